"""JoyImage-Edit adapter: ``JoyImageEditTransformer3DModel`` (``JoyImageEditPipeline``) on a USP grid.

Layout: latents (batch, channels, frames, height, width), or with reference images
(batch, items, channels, frames, height, width), the target last; tokens (batch, seq, channels);
text (batch, text_seq, text_dim), no mask (the pipeline pads with zeros and passes none); Q/K/V
(batch, seq, heads, head_dim); the image RoPE table ``(cos, sin)``, each (seq, head_dim): **the
sequence on dim 0**, rows in the token order; the text table (``rope_type="mrope"``) likewise, over
the text tokens.

Note [JoyImage's reference frames]
    An edit call stacks the reference latents and the noisy target as items of one 6-D tensor. The
    forward rolls the target to the front, folds the items into frames
    ((b, n, c, t, h, w) -> (b, c, n * t, h, w)), and embeds them with the one ``img_in``: the
    reference images are extra frames of the same image stream, through the same blocks at the same
    timestep. So they are split with the target tokens, not replicated: block 0
    (``double_blocks.0``) gets this rank's S / P of the n * t * h * w tokens, whichever item they
    belong to. After the blocks the model applies ``norm_out`` / ``proj_out`` (per token), then
    unpatchifies and rolls the items back: both index the whole sequence, so the gather is at
    ``proj_out``'s output, before them, and they run as in one process on every rank.

Note [JoyImage's RoPE table]
    The table is made by a method (``get_rotary_pos_embed``), a local of the forward, not a
    submodule's output: no ``Table`` can cut it. A forward pre-hook on every block cuts the image
    table (the first entry of the blocks' ``image_rotary_emb`` pair) to this rank's rows, the same
    ``shard_sequence`` as the tokens, after checking it has a row per token; the text table (second
    entry; ``None`` under ``rope_type="rope"``) passes whole, as the text does. Each token is
    rotated by its own row, as in one process.

Text tokens: **replicated** (the double-stream blocks keep a text stream of their own; it is padded
to the batch's longest prompt, up to 2048 tokens, beside 4096 image tokens a frame at 1024 x 1024).
The processor's single ``dispatch_attention_fn`` call over ``[image; text]`` (text last) is routed as
HunyuanVideo's (``usp_dit.pipelines._routing``): the text is joint tokens, attended once, with no
mask. Per-rank tokens at 1024 x 1024 editing (a reference and the target: 8192 image tokens) on 8
ranks: 1024 image tokens + the prompt's.

Refused (NotImplementedError, at enable unless noted): a processor other than the stock
``JoyImageAttnProcessor``, an attention module the plan does not name, a Diffusers cache, a
processor that no longer calls ``dispatch_attention_fn``, ``num_layers=0``; at the call, an image
RoPE argument that is not a (cos, sin) pair with one row per token (ValueError when its length
differs). Tensor parallelism (``tensor_degree > 1``) cuts the blocks' heads and MLP widths (``_TENSOR``).
The pipeline's CFG calls the transformer once per branch (the prompt's embeds, then the
negative prompt's): with ``cfg_degree=2`` the two calls run on the two cfg groups at once
(``cfg_branch_args``).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from diffusers import JoyImageEditTransformer3DModel
from diffusers.models.transformers.transformer_joyimage import JoyImageAttention, JoyImageAttnProcessor
from torch.utils.hooks import RemovableHandle

from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter
from usp_dit.pipelines.tensor import BlockCuts, Split, TensorPlan
from usp_dit.sharding.shard import shard_sequence

# Note [routing a stock processor's attention call]: the stock code, its one call routed; None if
# this diffusers' processor makes no such call (refused at enable).
_RoutedJoyImageProcessor = routed_processor_class(JoyImageAttnProcessor, "_RoutedJoyImageProcessor")

# JoyImageTransformerBlock.forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb):
# the model passes it by keyword, gradient checkpointing positionally (fourth).
_ROPE_ARG = ("image_rotary_emb", 3)


class USPJoyImageAttnProcessor(_RoutedJoyImageProcessor or RoutedProcessor):
    """JoyImage joint attention of this rank's image shard and the replicated text tokens.

    Inputs: ``hidden_states`` (B, S_local, C) this rank's image tokens (target and reference frames);
    ``encoder_hidden_states`` (B, T, C) every text token; ``image_rotary_emb`` (image table: this
    rank's rows, each (S_local, head_dim); text table (T, head_dim) or None).
    Returns ``(image_out (B, S_local, C), text_out (B, T, C))``, ``text_out`` equal on every rank.

    The signature is spelled out: ``JoyImageAttention.forward`` passes a processor only the keyword
    arguments its ``__call__`` names.
    """

    def __call__(
        self,
        attn: JoyImageAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        image_rotary_emb: tuple | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None:
            raise NotImplementedError(
                "USPJoyImageAttnProcessor routes the blocks' joint [image; text] attention; it got no text")
        return super().__call__(attn, hidden_states, encoder_hidden_states, image_rotary_emb)


@dataclass(eq=False)
class ImageRopeHooks:
    """Note [JoyImage's RoPE table]: a pre-hook on every block cuts the image (cos, sin), each
    (S, head_dim), to this rank's (S_local, head_dim) rows (block 0's token hook, installed before,
    has recorded the call's token count S); the text table passes whole."""

    transformer: JoyImageEditTransformer3DModel
    state: ShardState
    handles: list[RemovableHandle] = field(default_factory=list)

    def install(self) -> None:
        for block in self.transformer.double_blocks:
            # A bound method, not a closure: a deep copy of the enabled model copies it (base Note [deep copies]).
            self.handles.append(block.register_forward_pre_hook(self._cut, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _cut(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """``image_rotary_emb``'s image (cos, sin), (S, head_dim) each -> (S_local, head_dim).

        Raises:
            NotImplementedError: the argument is not an (image, text) pair with an image (cos, sin) pair.
            ValueError: the image table's length is not the token count (its rows would not line up).
        """
        name, index = _ROPE_ARG
        rope = _get_arg(args, kwargs, name, index)
        if rope is None:
            return None
        image = rope[0] if isinstance(rope, (tuple, list)) and len(rope) == 2 else None
        if not (isinstance(image, (tuple, list)) and len(image) == 2 and all(torch.is_tensor(t) for t in image)):
            raise NotImplementedError(
                f"usp_dit's JoyImage adapter: {name} must be ((cos, sin) of the image, text table or None), each "
                f"(seq, head_dim); got {type(rope).__name__}")
        rows = [t.shape[0] for t in image]
        if rows != [self.state.seq_len] * 2:
            raise ValueError(
                f"{name}'s image table has {rows} rows but the image sequence has {self.state.seq_len} tokens: "
                f"they must match for the table to be cut like the tokens")
        local = tuple(shard_sequence(t, self.state.mesh, dim=0, layout=self.state.layout) for t in image)
        return _set_arg(args, kwargs, name, index, (local, rope[1]))


def _routed_call_missing(transformer: JoyImageEditTransformer3DModel) -> str | None:
    if _RoutedJoyImageProcessor is None:
        return f"this diffusers' JoyImageAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


# Tensor parallelism (usp_dit.pipelines.tensor Note [tensor plans]): the joint attention's heads
# (each stream's fused QKV, [q; k; v] packed: three packs; both output projections) and the two
# MLPs' hidden widths. The QK norms are per head (RMSNorm over head_dim): exact on a rank's heads;
# the modulation tables and the norms stay whole.
_TENSOR = TensorPlan((BlockCuts("double_blocks", splits=(
    Split(columns=("attn.img_attn_qkv", "attn.txt_attn_qkv"), rows=("attn.img_attn_proj", "attn.txt_attn_proj"),
          heads="attn", packs=3),
    Split(columns=("img_mlp.net.0.proj",), rows=("img_mlp.net.2",)),
    Split(columns=("txt_mlp.net.0.proj",), rows=("txt_mlp.net.2",)),
)),))

PLAN = ModelPlan(
    name="JoyImageEdit",
    model_class=JoyImageEditTransformer3DModel,
    split_at="double_blocks.0",
    # Note [JoyImage's reference frames]: gathered before the unpatchify and the roll of the items.
    gather_at="proj_out",
    attention=(
        # joint [image shard (target and reference frames); text] attention, text last, no mask
        Parallel("double_blocks.*.attn", USPJoyImageAttnProcessor, stock=(JoyImageAttnProcessor,), text="last"),
    ),
    block_lists=("double_blocks",),
    # Batched on dim 0, split over the "cfg" axis by enable_usp (a call cfg_branch_args does not run).
    cfg_batch_args=("hidden_states", "timestep", "encoder_hidden_states"),
    # JoyImageEditPipeline's CFG (guidance_scale > 1): the prompt's embeds, then the negative
    # prompt's; latents and timestep are the same (usp_dit.pipelines.cfg_pair Note [two calls a step]).
    cfg_branch_args=("encoder_hidden_states",),
    hooks=(ImageRopeHooks,),
    refuse=(_routed_call_missing,),
    tensor=_TENSOR,
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
