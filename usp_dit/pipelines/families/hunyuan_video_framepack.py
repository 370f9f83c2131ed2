"""FramePack adapter: ``HunyuanVideoFramepackTransformer3DModel`` (``HunyuanVideoFramepackPipeline``) on a USP grid.

Layout: latents (batch, channels, frames, height, width), the noisy window and three history
latents of the same layout (``latents_clean`` at 1x, ``latents_history_2x`` / ``_4x`` embedded by
their own strided convs at 2x and 4x compression); tokens (batch, seq, channels); text (batch,
text_seq, channels) with the prompt mask ``encoder_attention_mask`` (batch, text_seq), nonzero =
real token; the SigLIP image tokens ``image_embeds`` (batch, image_seq, image_proj_dim); Q/K/V
(batch, seq, heads, head_dim); the RoPE table ``(cos, sin)``, each (seq, head_dim): **the sequence
on dim 0**, rows in the token order.

Note [FramePack's packed sequence]
    The model embeds the noisy latents (``x_embedder``) and each history latent (``clean_x_embedder``:
    ``proj``, ``proj_2x``, ``proj_4x``), and ``rope`` makes one table per part from that part's own
    frame indices (a 2x / 4x table is the 1x grid's table, padded and average-pooled like its
    latent: "clean-latent RoPE"). ``_pack_history_states`` then concatenates tokens and tables in
    the same order, history first, noisy last::

        tokens  [ 4x | 2x | clean | noisy ]   (B, S, C),  S = S_4x + S_2x + S_clean + S_noisy
        table   [ 4x | 2x | clean | noisy ]   (S, head_dim) each of cos, sin

    Every token of the packed sequence attends every other one (and the text, joint), so the whole
    packed sequence is what is split: block 0's ``hidden_states`` (``transformer_blocks.0``) is
    sharded, S / P tokens a rank whatever part they come from. The packed table reaches every block
    whole (a local of the forward, not a submodule's output: no ``Table`` can cut it where it is
    made, ``rope`` being called once per part), so a forward pre-hook on every block cuts its RoPE
    argument (``freqs_cis`` of the dual-stream blocks, ``image_rotary_emb`` of the single-stream
    ones, the fifth positional argument of both) to this rank's rows, the same ``shard_sequence``
    as the tokens, after checking its length is the packed token count. Each token is rotated by
    its own row, as in one process.

Note [FramePack's noisy-token crop]
    After the last block the model keeps only the noisy tokens, ``hidden_states[:, -S_noisy:]``,
    before ``norm_out`` and ``proj_out``. On a shard that slice would take the wrong rows (the
    last S_noisy of each rank's piece), so the sequence is gathered at the **output of the last
    single-stream block** (``single_transformer_blocks.-1``; its text stream passes through
    whole): the crop then runs on the full packed sequence, exactly as stock, and ``norm_out`` /
    ``proj_out`` (per-token, small) run on the S_noisy noisy tokens on every rank. The gather moves
    S x C (the hidden width) instead of HunyuanVideo's S_noisy x patch-volume; at the released
    640 x 640 window (9 latent frames) that is 14400 noisy + 3200 clean + 400 + 400 history tokens.

Text tokens: **replicated**, as HunyuanVideo (``usp_dit.pipelines.families.hunyuan_video``): the
image tokens (``image_projection(image_embeds)``) are put in front of the prompt's and the model's
mask, over ``[packed video; image; text]``, has all video keys and a prefix of the conditioning
keys valid (Note [HunyuanVideo's prompt mask]); the routed call (text last) takes them as joint
tokens, one ``usp_attention`` per element where the valid lengths differ. With batch 1 the model
crops the text to its valid length and passes no mask. The token refiner's self-attention over the
text runs locally. Per-rank tokens at the released 640 x 640 window on 8 ranks: 2300 video tokens +
729 image + up to 256 prompt tokens.

The processors are HunyuanVideo's (``USPHunyuanVideoAttnProcessor``: the stock
``HunyuanVideoAttnProcessor2_0`` with its dispatch call routed); the blocks are HunyuanVideo's.

Refused (NotImplementedError, at enable unless noted): block processors other than the stock
``HunyuanVideoAttnProcessor2_0``, refiner processors other than ``AttnProcessor2_0`` /
``AttnProcessor``, an attention module the plan does not name, a Diffusers cache, ``num_layers=0``
(no dual-stream block to split at) and ``num_single_layers=0`` (no single-stream block to gather
after, Note [FramePack's noisy-token crop]; the released checkpoints have 20 and 40), and at the
call a RoPE argument that is not a (cos, sin) pair with one row per packed token, a mask other than
the text key-padding mask. The pipeline's true CFG (``true_cfg_scale > 1`` with a negative prompt)
calls the transformer once per branch: with ``cfg_degree=2`` the two calls run on the two cfg
groups at once (``cfg_branch_args``); without it (the distilled guidance alone) ``cfg_degree=2``
runs every call whole on both groups: correct, no faster.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from diffusers import HunyuanVideoFramepackTransformer3DModel
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
from torch.utils.hooks import RemovableHandle

import usp_dit.pipelines.families.hunyuan_video as hunyuan_video  # noqa: PLR0402  (the module: no import circle)
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter
from usp_dit.sharding.shard import shard_sequence

# The blocks' RoPE argument: HunyuanVideoTransformerBlock names it ``freqs_cis``,
# HunyuanVideoSingleTransformerBlock ``image_rotary_emb``; the model passes it fifth, positionally.
_ROPE_INDEX = 4
_ROPE_NAMES = {"HunyuanVideoTransformerBlock": "freqs_cis", "HunyuanVideoSingleTransformerBlock": "image_rotary_emb"}


@dataclass(eq=False)
class PackedRopeHooks:
    """Note [FramePack's packed sequence]: a pre-hook on every block cuts the packed (S, head_dim)
    RoPE tables to this rank's (S_local, head_dim) rows (block 0's token hook, installed before,
    has recorded the call's packed token count S)."""

    transformer: HunyuanVideoFramepackTransformer3DModel
    state: ShardState
    handles: list[RemovableHandle] = field(default_factory=list)

    def install(self) -> None:
        for block in [*self.transformer.transformer_blocks, *self.transformer.single_transformer_blocks]:
            name = _ROPE_NAMES[type(block).__name__]
            # A partial of a bound method, not a closure: a deep copy of the enabled model copies it
            # with these hooks (base Note [deep copies]).
            hook = functools.partial(self._cut, name)
            self.handles.append(block.register_forward_pre_hook(hook, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _cut(self, name: str, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """``name``'s (cos, sin), each (S, head_dim) -> (S_local, head_dim), cut like the tokens.

        Raises:
            NotImplementedError: the argument is not a (cos, sin) pair of tables.
            ValueError: its length is not the packed token count (its rows would not line up).
        """
        table = _get_arg(args, kwargs, name, _ROPE_INDEX)
        if table is None:
            return None
        if not (isinstance(table, (tuple, list)) and len(table) == 2 and all(torch.is_tensor(t) for t in table)):
            raise NotImplementedError(
                f"usp_dit's HunyuanVideoFramepack adapter: {name} must be a (cos, sin) pair of (seq, head_dim) "
                f"tables, got {type(table).__name__}")
        rows = [t.shape[0] for t in table]
        if rows != [self.state.seq_len] * 2:
            raise ValueError(
                f"{name} has {rows} rows but the packed sequence has {self.state.seq_len} tokens: they must match "
                f"for the table to be cut like the tokens")
        local = tuple(shard_sequence(t, self.state.mesh, dim=0, layout=self.state.layout) for t in table)
        return _set_arg(args, kwargs, name, _ROPE_INDEX, local)


def _missing_blocks(transformer: HunyuanVideoFramepackTransformer3DModel) -> str | None:
    if len(transformer.transformer_blocks) == 0:
        return ("num_layers=0 (single-stream blocks only) is not supported: the packed tokens are split at "
                "transformer_blocks.0 (the released FramePack checkpoints have 20 dual-stream blocks)")
    if len(transformer.single_transformer_blocks) == 0:
        return ("num_single_layers=0 is not supported: the packed tokens are gathered after the last single-stream "
                "block, before the model crops the noisy tokens (the released checkpoints have 40)")
    return None


_STOCK = (HunyuanVideoAttnProcessor2_0,)
_PROCESSOR = hunyuan_video.USPHunyuanVideoAttnProcessor

PLAN = ModelPlan(
    name="HunyuanVideoFramepack",
    model_class=HunyuanVideoFramepackTransformer3DModel,
    split_at="transformer_blocks.0",
    # Note [FramePack's noisy-token crop]: gathered before the crop, not at proj_out.
    gather_at="single_transformer_blocks.-1",
    attention=(
        # joint [packed video shard; image; text] attention, conditioning last (Note [HunyuanVideo's prompt mask])
        Parallel("transformer_blocks.*.attn", _PROCESSOR, stock=_STOCK, text="last"),
        Parallel("single_transformer_blocks.*.attn", _PROCESSOR, stock=_STOCK, text="last"),
        Local("context_embedder.token_refiner.refiner_blocks.*.attn", stock=(AttnProcessor2_0, AttnProcessor)),
    ),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # Batched on dim 0, split over the "cfg" axis by enable_usp (a call cfg_branch_args does not run);
    # the frame indices are (frames,) vectors shared by the batch: passed whole.
    cfg_batch_args=(
        "hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask", "pooled_projections",
        "image_embeds", "guidance", "latents_clean", "latents_history_2x", "latents_history_4x",
    ),
    # HunyuanVideoFramepackPipeline's true CFG: the prompt's Llama embeds, their mask and the CLIP
    # pooled embeds differ between the two calls of a step; latents, history, image and guidance do not.
    cfg_branch_args=("encoder_hidden_states", "encoder_attention_mask", "pooled_projections"),
    hooks=(PackedRopeHooks,),
    refuse=(hunyuan_video._routed_call_missing, _missing_blocks),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
