"""Motif-Video adapter: ``MotifVideoTransformer3DModel`` (T2V, I2V) on a USP grid.

Layout: latents (batch, channels, frames, height, width), channels = noise + first-frame condition
+ its mask (16 + 16 + 1 in the release); video tokens (batch, seq, channels), ``seq = frames/p_t *
height/p * width/p``, frame-major as ``x_embedder`` flattens them; text (batch, text_seq, channels)
with the prompt mask ``encoder_attention_mask`` (batch, text_seq), nonzero = real token (I2V puts
its SigLIP image tokens in front of the text, always valid); Q/K/V (batch, seq, heads, head_dim);
the RoPE table ``self.rope(latents)`` ``(cos, sin)``, each (seq, sum(rope_axes_dim)): **the
sequence on dim 0**.

Where the tokens are split: at ``x_embedder``'s output (``split="output"``), not at block 0's
input: with decoder layers the forward keeps a clone of the embedded tokens
(``decoder_hidden_states``) beside the blocks, which block 0's pre-hook would never see. Every
later per-token op runs on the shard; ``proj_out``'s output is gathered before unpatchify. The
RoPE table is cut like the tokens by a forward hook on ``rope``. The forward builds its key mask
after the split, ``F.pad(text_mask, (S_local, 0), True)``: (B, 1, 1, S_local + T), over this
rank's shard and the text, as the routed call sees them.

What each block does with the two streams (Diffusers 0.42, ``transformer_motif_video.py``):

* **dual-stream blocks** (``transformer_blocks``): video and text keep their own norms, MLPs and
  projections (``add_q_proj`` ...); one joint attention over ``[video; text]`` (text *last*), text
  key mask, RoPE on the video part. Optional text cross-attention (``cross_attn``,
  ``enable_text_cross_attention_dual``): queries are the video attention output, keys the text
  (after the image tokens), the same text key mask, RoPE on the queries.
* **single-stream encoder blocks** (the first ``num_single_layers - num_decoder_layers`` of
  ``single_transformer_blocks``): ``[video; text]`` through one set of per-token weights (norm,
  MLP, output projection), one joint attention over ``[video; text]`` (text last, the text key
  mask, RoPE on the video part); optional cross-attention as above.
* **single-stream decoder blocks** (the last ``num_decoder_layers``): the same block class with
  *no text at all*. Its two streams are both video: ``hidden_states`` is the patch embedding's
  output (the clone), ``encoder_hidden_states`` the encoder blocks' video output; the text stream
  is dropped and the mask is ``None``. The block concatenates ``[dec; enc]`` (2 S tokens) for
  its per-token work and attends over all 2 S of them, RoPE on the ``dec`` part only, no mask; the
  ``enc`` part it returns is the next decoder block's second stream. No cross-attention there
  (the model forces it off).

The split. Video tokens are sharded everywhere. Text is **replicated** (as HunyuanVideo, which
this model follows): it is a separate, padded and masked stream whose dual-stream weights are its
own; the routed joint calls (``Route(state, text="last")``) give it to ``usp_attention`` as joint
tokens (``_routing`` Note [masked text tokens]). The cross-attention is local: queries are this
rank's video rows, keys the replicated text: the stock processor stays, no communication. In a
decoder block **both streams are sharded** the same way (both are video, cut by the same split):
Note [Motif-Video's decoder blocks]. Per-rank token count at the release's 736 x 1280 x 121 frames
(31 latent frames x 46 x 80 patches = 114080 video tokens, 512 prompt tokens): 14260 video
tokens + 512 text tokens on 8 ranks; in a decoder block 2 x 14260.

Note [Motif-Video's decoder blocks]
    A decoder block's attention is dense, unmasked attention over ``[dec; enc]``, 2 S tokens
    (RoPE applied per token before it, on ``dec`` only). Rank s holds rows ``I_s`` of both streams
    (``split_sizes(S, P)``, the same rows, since both come from the same split), and its local
    call is over ``[dec[I_s]; enc[I_s]]``, 2 |I_s| tokens. Dense attention without a mask is
    invariant under any permutation of the keys and equivariant under one of the queries, so the
    2 S tokens may be taken in the order ``[dec[I_0]; enc[I_0]; dec[I_1]; enc[I_1]; ...]``: that
    is a plain contiguous split of one sequence of 2 S tokens, rank s holding piece s, of
    2 |I_s| tokens. ``usp_attention`` with ``seq_len=None`` takes any contiguous split of dense
    attention (the ranks exchange their lengths in the call's handshake), so the routed call is
    exact, forward and backward. The pieces equal ``split_sizes(2 S, P)`` exactly when P divides
    S; then the call passes ``seq_len = 2 S`` (no handshake, and the shape torch.compile needs);
    otherwise a compiled call is refused (the handshake that learns the lengths cannot be traced).

Attention keeps Diffusers' maths: ``USPMotifVideoAttnProcessor`` runs the stock
``MotifVideoAttnProcessor2_0.__call__``'s own code (projections, QK norms, RoPE on this rank's rows
of the video part, added text projections, the split of the output) with its one
``dispatch_attention_fn`` call routed (``_routing`` Note [routing a stock processor's attention
call]): to the joint router in dual-stream and encoder blocks, to ``_decoder_attention`` in the
decoder blocks (marked at enable by ``DecoderMarks``).

Refused (NotImplementedError, at enable unless noted): attention processors other than the stock
``MotifVideoAttnProcessor2_0`` / ``MotifVideoCrossAttnProcessor2_0`` (custom ones, or Diffusers'
context parallelism already enabled), an attention module the plan does not name, a Diffusers
cache (its decisions would be taken per rank on a shard), a model with no blocks at all; at the
call a mask other than a text key-padding mask (the model builds none other), a mask in a decoder block (the model passes none), and under
torch.compile a decoder block whose video token count the sequence degree does not divide
(Note [Motif-Video's decoder blocks]). ``MotifVideoPipeline`` and
``MotifVideoImage2VideoPipeline`` run classifier-free guidance through their guider, one
transformer call per branch (prompt, then negative prompt): with ``cfg_degree=2`` the two calls
of a step run on the two cfg groups at once (``cfg_branch_args``, ``usp_dit.pipelines.cfg_pair``
Note [two calls a step]). No dropout is configurable in the blocks, so the replicated text stream
needs no replicated-dropout handling.
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers.transformer_motif_video import (
    MotifVideoAttention,
    MotifVideoAttnProcessor2_0,
    MotifVideoCrossAttnProcessor2_0,
    MotifVideoTransformer3DModel,
)

from usp_dit.attention.usp import usp_attention
from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class, with_global
from usp_dit.pipelines._token_sharding import ShardState
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, Table

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_RoutedMotifProcessor = routed_processor_class(MotifVideoAttnProcessor2_0, "_RoutedMotifVideoProcessor")

# The attribute DecoderMarks sets on a decoder block's attention module while the adapter is enabled.
DECODER_MARK = "_usp_dit_motif_decoder"


def _decoder_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
    attention_kwargs: dict[str, Any] | None = None, *, backend: Any = None, parallel_config: Any = None,
) -> torch.Tensor:
    """A decoder block's attention (``dispatch_attention_fn``'s signature): Note [Motif-Video's decoder blocks].

    Args:
        query, key, value: (B, 2 S_local, H, D): ``[dec shard; enc shard]`` of this rank.
        parallel_config: the processor's ``Route`` (its state's ``seq_len`` is S, the video tokens).

    Returns:
        (B, 2 S_local, H, D), each token attended over all 2 S tokens of both streams.

    Raises:
        NotImplementedError: a mask, dropout, causal attention or attention kwargs; under
            torch.compile, a video token count the sequence degree does not divide.
        ValueError: the call is not two shards of this rank's length.
    """
    route = parallel_config
    if attn_mask is not None or dropout_p or is_causal or attention_kwargs:
        raise NotImplementedError(
            "usp_dit's Motif-Video decoder blocks route dense unmasked attention only (the model passes no mask "
            f"there), got attn_mask={None if attn_mask is None else tuple(attn_mask.shape)}, dropout_p={dropout_p}, "
            f"is_causal={is_causal}, attention_kwargs={attention_kwargs}"
        )
    state, shard = route.state, route.shard_len()
    if query.shape[1] != 2 * shard:
        raise ValueError(
            f"a Motif-Video decoder block's attention got {query.shape[1]} tokens, not twice this rank's {shard} "
            f"video tokens ([decoder stream; encoder stream])"
        )
    degree = state.mesh.sequence_degree
    # the same on every rank (they must agree on seq_len): then 2 * shard == split_sizes(2 S, P)[rank]
    even = state.seq_len % degree == 0
    if not even and torch.compiler.is_compiling():
        raise NotImplementedError(
            f"usp_dit's Motif-Video decoder blocks under torch.compile need the {state.seq_len} video tokens to divide "
            f"over the {degree} sequence ranks: the two streams' shards are not the pieces of one split, and the "
            f"handshake that learns them cannot be traced (Note [Motif-Video's decoder blocks]); run eagerly"
        )
    return usp_attention(query, key, value, scale=scale, mesh=state.mesh, backend=state.backend,
                         seq_len=2 * state.seq_len if even else None).out


_decoder_call = with_global(MotifVideoAttnProcessor2_0.__call__, ROUTED_NAME, _decoder_attention)


class USPMotifVideoAttnProcessor(_RoutedMotifProcessor or RoutedProcessor):
    """Motif-Video's self-attention on this rank's video shard (module docstring).

    Inputs: ``hidden_states`` (B, S_local, C) this rank's video tokens; ``encoder_hidden_states``
    (B, T, C) every text token (dual-stream and encoder blocks) or, in a decoder block, this
    rank's (B, S_local, C) rows of the encoder's video output; ``attention_mask`` the model's
    (B, 1, 1, S_local + T) text key mask or ``None``; ``image_rotary_emb`` this rank's rows of
    the RoPE table, each (S_local, D). Returns ``(video_out, second_stream_out)`` laid out like
    the inputs (the text's equal on every rank).

    The signature is spelled out: ``MotifVideoAttention.forward`` passes a processor only the
    keyword arguments its ``__call__`` names.
    """

    def __call__(
        self,
        attn: MotifVideoAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None:
            raise NotImplementedError(
                "USPMotifVideoAttnProcessor routes the blocks' two-stream attention; it got no second stream"
            )
        if getattr(attn, DECODER_MARK, False):
            return _decoder_call(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class DecoderMarks:
    """Marks the decoder blocks' attention modules (the last ``num_decoder_layers`` single-stream
    blocks) for ``USPMotifVideoAttnProcessor`` while enabled (Note [Motif-Video's decoder blocks]):
    the plan's sites are path patterns, and which blocks decode depends on the config."""

    def __init__(self, transformer: MotifVideoTransformer3DModel, state: ShardState) -> None:
        blocks = transformer.single_transformer_blocks
        count = transformer.num_decoder_layers
        self.modules = [block.attn for block in blocks[len(blocks) - count:]] if count > 0 else []

    def install(self) -> None:
        for attn in self.modules:
            setattr(attn, DECODER_MARK, True)

    def remove(self) -> None:
        for attn in self.modules:
            attn.__dict__.pop(DECODER_MARK, None)


def _routed_call_missing(transformer: MotifVideoTransformer3DModel) -> str | None:
    if _RoutedMotifProcessor is None or _decoder_call is None:
        return f"this diffusers' MotifVideoAttnProcessor2_0 does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


_STOCK = (MotifVideoAttnProcessor2_0,)
_CROSS = (MotifVideoCrossAttnProcessor2_0,)

PLAN = ModelPlan(
    name="MotifVideo",
    model_class=MotifVideoTransformer3DModel,
    # the patch embedding's output: the decoder's clone of the tokens is taken after it
    split_at="x_embedder",
    split="output",
    gather_at="proj_out",
    attention=(
        # joint [video shard; text] attention, text last; in decoder blocks [dec shard; enc shard]
        Parallel("transformer_blocks.*.attn", USPMotifVideoAttnProcessor, stock=_STOCK, text="last"),
        Parallel("single_transformer_blocks.*.attn", USPMotifVideoAttnProcessor, stock=_STOCK, text="last"),
        # cross-attention from this rank's video rows to the replicated text
        Local("transformer_blocks.*.cross_attn", stock=_CROSS),
        Local("single_transformer_blocks.*.cross_attn", stock=_CROSS),
    ),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # rope(latents) -> (cos, sin), each (seq, sum(rope_axes_dim)): the sequence on dim 0.
    tables=(Table("rope", dim=0, items=(0, 1)),),
    # Batched on dim 0, split over the "cfg" axis by enable_usp (a call cfg_branch_args does not run).
    cfg_batch_args=("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask", "image_embeds"),
    # The pipelines' guider calls the transformer once per branch: the prompt's embeds and mask, then
    # the negative prompt's; latents, timestep and image embeds are the same
    # (usp_dit.pipelines.cfg_pair Note [two calls a step]).
    cfg_branch_args=("encoder_hidden_states", "encoder_attention_mask"),
    hooks=(DecoderMarks,),
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
