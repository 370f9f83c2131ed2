"""HunyuanVideo adapter: ``HunyuanVideoTransformer3DModel`` (T2V; I2V latent_concat, token_replace) on a USP grid.

Layout: latents (batch, channels, frames, height, width); video tokens (batch, seq, channels),
``seq = frames/p_t * height/p * width/p``, frame-major as ``x_embedder`` flattens them; text
(batch, text_seq, channels) with the prompt mask ``encoder_attention_mask`` (batch, text_seq),
nonzero = real token; Q/K/V (batch, seq, heads, head_dim); the RoPE table ``self.rope(latents)``
``(cos, sin)``, each (seq, head_dim): **the sequence on dim 0**, frame-major like the tokens.

Where the tokens are split (``_token_sharding`` Note [where the sequence is split]): the patch
embedding, the condition embedding and the text token refiner run on every rank; block 0's input
(``transformer_blocks.0``, the first dual-stream block) is sharded; ``proj_out``'s output is
gathered before unpatchify. The RoPE table is cut like the tokens by a forward hook on ``rope``
(Diffusers' own ``_cp_plan`` splits the same output on the same dim).

Text tokens: **replicated**. HunyuanVideo attends over ``[video; text]`` jointly (text *last*):
the dual-stream blocks keep the text as a second stream with its own weights, the single-stream
blocks concatenate ``[video shard; text]`` for their per-token work, and both hand their attention
processor the video and text separately. Every rank holds all T text tokens; the routed call
(``Route(state, text="last")``) gives them to ``usp_attention`` as joint tokens. Replicated, not
split, because the prompt is padded and masked (below) and because the token refiner's
self-attention over the text (a query-dependent (B, 1, T, T) mask) runs before the blocks on the
full text: it runs locally on every rank, its stock processor untouched, no communication. Per-rank
token count, HunyuanVideo 720p x 129 frames (33 latent frames x 45 x 80 patches = 118800 video
tokens, 256 prompt tokens): 14850 video tokens + 256 text tokens on 8 ranks.

Note [HunyuanVideo's prompt mask]
    The model's forward builds one key mask over the *whole* joint sequence, (B, 1, 1, S + T): all
    video keys valid, then the first ``encoder_attention_mask[b].sum()`` text keys (a prefix of that
    length, whatever the holes of the prompt mask: stock's own choice, kept). The routed call gets
    that mask unchanged; ``_routing.route_attention`` reads its text part (the last T keys) and runs
    one ``usp_attention`` per batch element with that element's valid text tokens as joint tokens
    (``_routing`` Note [masked text tokens]). Padded text queries get zeros there where stock gives
    them some output; nothing reads them: they are masked as keys in every later layer, per-token
    ops keep them to their own rows, and the text stream is dropped after the last block.

Note [HunyuanVideo's first-frame tokens]
    The ``token_replace`` I2V variant (HunyuanVideo-I2V) modulates the first latent frame's tokens,
    the first ``first_frame_num_tokens = height/p * width/p`` of the sequence, with their own
    shift/scale/gate (from ``token_replace_emb``), by slicing ``x[:, :num_tokens]`` inside every
    block. On a shard that global count would be wrong: a forward pre-hook on every block replaces
    it with this rank's count of first-frame tokens, ``clamp(num_tokens - shard_start, 0,
    shard_len)`` (the first frame is a prefix of the sequence, so it is a prefix of every shard that
    meets it). Exact: each token gets the modulation it gets in one process. (The single-stream
    blocks slice ``[video shard; text]`` and the local count never exceeds the shard, so the text
    keeps its ordinary modulation, as in stock.)

Attention keeps Diffusers' maths: ``USPHunyuanVideoAttnProcessor`` runs the stock
``HunyuanVideoAttnProcessor2_0.__call__``'s own code (projections, QK norms, RoPE on this rank's
rows of the video part, added text projections, output projections) with its one
``dispatch_attention_fn`` call routed to ``usp_attention`` (``_routing`` Note [routing a stock
processor's attention call]).

The adapter is a ``ModelPlan`` (``usp_dit.pipelines.plan`` Note [a model is a plan]): split at
``transformer_blocks.0``, gather at ``proj_out``, the dual- and single-stream blocks' attention
parallel (text last), the token refiner's attention local, the RoPE table a ``Table``, the
first-frame count a hook.

Refused (NotImplementedError, at enable unless noted): block processors other than the stock
``HunyuanVideoAttnProcessor2_0`` (custom ones, or Diffusers' context parallelism already enabled),
token refiner processors other than the stock ``AttnProcessor2_0`` / ``AttnProcessor``, an
attention module the plan does not name, a Diffusers cache (``enable_cache``: its decisions would
be taken per rank on a shard), ``num_layers=0`` (no dual-stream block to split at; no released
checkpoint has none), and at the call a mask other than a text
key-padding mask, dropout or causal attention (the stock processor passes none).
``HunyuanVideoPipeline`` with true CFG (``true_cfg_scale > 1`` and a negative prompt) calls the
transformer once per guidance branch, batch 1 each with one prompt: with ``cfg_degree=2`` the two
calls of a step run on the two cfg groups at once (``cfg_branch_args``, ``usp_dit.pipelines.cfg_pair``
Note [two calls a step]); a call not run so (the first step) splits a batch of prompts over the cfg
groups, or runs whole on both. Without true CFG (the distilled guidance alone: one call a step)
``cfg_degree=2`` runs every call whole on both groups: correct, no faster.
``HunyuanVideoFramepackTransformer3DModel`` is a different class (not a subclass), run by its own adapter
(``usp_dit.pipelines.families.hunyuan_video_framepack``). No dropout is configurable in this model, so no replicated-dropout
handling is needed for the replicated text stream.
"""
from __future__ import annotations

import torch
from diffusers import HunyuanVideoTransformer3DModel
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0
from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoAttnProcessor2_0
from torch.utils.hooks import RemovableHandle

from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, Table
from usp_dit.sharding.partition import offsets, split_sizes

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_RoutedHunyuanProcessor = routed_processor_class(HunyuanVideoAttnProcessor2_0, "_RoutedHunyuanVideoProcessor")

# The blocks' positional argument that carries the first frame's token count (``first_frame_num_tokens``
# in the model's forward; ``num_tokens`` in the token_replace blocks): see HunyuanVideo's block calls.
_NUM_TOKENS_ARG = ("num_tokens", 6)


class USPHunyuanVideoAttnProcessor(_RoutedHunyuanProcessor or RoutedProcessor):
    """HunyuanVideo joint attention of this rank's video shard and the replicated text tokens.

    Inputs: ``hidden_states`` (B, S_local, C) this rank's video tokens; ``encoder_hidden_states``
    (B, T, C) every text token; ``attention_mask`` the model's (B, 1, 1, S + T) key mask over the
    whole joint sequence (Note [HunyuanVideo's prompt mask]); ``image_rotary_emb`` this rank's rows
    of the RoPE table, each (S_local, head_dim) (cut by the hook on ``rope``).
    Returns ``(video_out (B, S_local, C), text_out (B, T, C))``, ``text_out`` equal on every rank.

    The signature is spelled out: ``Attention.forward`` passes a processor only the keyword
    arguments its ``__call__`` names (``image_rotary_emb`` would be dropped silently otherwise).
    """

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None:
            raise NotImplementedError(
                "USPHunyuanVideoAttnProcessor routes the blocks' joint [video; text] attention; it got no text"
            )
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class FirstFrameHooks:
    """Note [HunyuanVideo's first-frame tokens]: every block gets this rank's count of first-frame
    tokens (the RoPE table is the plan's ``Table``; its hook runs first and sets this call's ``seq_len``)."""

    def __init__(self, transformer: HunyuanVideoTransformer3DModel, state: ShardState) -> None:
        self.state = state
        self.blocks = list(transformer.transformer_blocks) + list(transformer.single_transformer_blocks)
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        for block in self.blocks:
            self.handles.append(block.register_forward_pre_hook(self._local_first_frame, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _local_first_frame(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """The global first-frame count -> this rank's, ``clamp(count - shard_start, 0, shard_len)``.

        Raises:
            ValueError: the count exceeds the video token count.
        """
        name, index = _NUM_TOKENS_ARG
        num_tokens = _get_arg(args, kwargs, name, index)
        if num_tokens is None:
            return None
        seq_len, mesh = self.state.seq_len, self.state.mesh
        if not 0 <= num_tokens <= seq_len:
            raise ValueError(f"first_frame_num_tokens={num_tokens} is not within the {seq_len} video tokens")
        sizes = split_sizes(seq_len, mesh.sequence_degree)
        start = offsets(sizes)[mesh.seq_rank]
        local = min(max(num_tokens - start, 0), sizes[mesh.seq_rank])
        return _set_arg(args, kwargs, name, index, local)


def _routed_call_missing(transformer: HunyuanVideoTransformer3DModel) -> str | None:
    if _RoutedHunyuanProcessor is None:
        return f"this diffusers' HunyuanVideoAttnProcessor2_0 does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


def _no_dual_stream_blocks(transformer: HunyuanVideoTransformer3DModel) -> str | None:
    if len(transformer.transformer_blocks) == 0:
        return ("num_layers=0 (single-stream blocks only) is not supported: the tokens are split at "
                "transformer_blocks.0 (every released HunyuanVideo has dual-stream blocks)")
    return None


_STOCK = (HunyuanVideoAttnProcessor2_0,)

PLAN = ModelPlan(
    name="HunyuanVideo",
    model_class=HunyuanVideoTransformer3DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    attention=(
        # joint [video shard; text] attention, text last (Note [HunyuanVideo's prompt mask])
        Parallel("transformer_blocks.*.attn", USPHunyuanVideoAttnProcessor, stock=_STOCK, text="last"),
        Parallel("single_transformer_blocks.*.attn", USPHunyuanVideoAttnProcessor, stock=_STOCK, text="last"),
        # the token refiner's self-attention over the whole (replicated) text, before the blocks
        Local("context_embedder.token_refiner.refiner_blocks.*.attn", stock=(AttnProcessor2_0, AttnProcessor)),
    ),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # rope(latents) -> (cos, sin), each (seq, head_dim): the sequence on dim 0.
    tables=(Table("rope", dim=0, items=(0, 1)),),
    # Batched on dim 0, split over the "cfg" axis by enable_usp (a call cfg_branch_args does not run).
    cfg_batch_args=(
        "hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask", "pooled_projections",
        "guidance",
    ),
    # HunyuanVideoPipeline's true CFG (true_cfg_scale > 1 and a negative prompt; the I2V and SkyReels
    # pipelines alike) calls the transformer once per branch: the prompt's Llama embeds, their mask
    # and the CLIP pooled embeds, then the negative prompt's; latents, timestep and the embedded
    # guidance are the same (usp_dit.pipelines.cfg_pair Note [two calls a step]).
    cfg_branch_args=("encoder_hidden_states", "encoder_attention_mask", "pooled_projections"),
    hooks=(FirstFrameHooks,),
    refuse=(_routed_call_missing, _no_dual_stream_blocks),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
