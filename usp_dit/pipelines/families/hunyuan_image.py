"""HunyuanImage 2.1 adapter: ``HunyuanImageTransformer2DModel`` (base, distilled, refiner) on a USP grid.

Layout: latents (batch, channels, height, width), or (batch, channels, frames, height, width) for
the refiner (its ``[noise; condition latents]`` on channels, one frame); image tokens (batch, seq,
channels), ``seq = height/p * width/p`` (times frames/p_t for the refiner), row-major as
``x_embedder`` flattens them; the Qwen2.5-VL prompt (batch, text_seq, channels) with its mask
``encoder_attention_mask`` (batch, text_seq), nonzero = real token; the ByT5 glyph tokens
(batch, glyph_seq, channels) with theirs; Q/K/V (batch, seq, heads, head_dim); the RoPE table
``self.rope(latents)`` ``(cos, sin)``, each (seq, head_dim): **the sequence on dim 0**.

HunyuanImage 2.1 is HunyuanVideo's architecture (dual-stream then single-stream blocks, text
*last* in the joint sequence ``[image; text]``, a token refiner over the prompt, a key mask over the
text) for images, so this plan is HunyuanVideo's (``usp_dit.pipelines.families.hunyuan_video``):
block 0's input (``transformer_blocks.0``) sharded, ``proj_out``'s output gathered before
unpatchify, the RoPE table cut by a forward hook on ``rope`` (a ``Table``), the stock processor's
one ``dispatch_attention_fn`` call routed with the text last (``_routing`` Note [routing a stock
processor's attention call]).

Note [HunyuanImage's text tokens]
    Before the blocks, on every rank, the model refines the prompt (``context_embedder``: a
    token refiner whose self-attention takes a query-dependent (B, 1, T, T) mask: local, stock
    processor untouched) and, when the checkpoint has a glyph encoder and the call passes glyph
    tokens, joins them per element as ``[valid glyph; valid prompt; padded glyph; padded
    prompt]`` with the masks reordered alike. The blocks get the key mask
    ``[all image keys valid; that text mask]`` (B, 1, 1, S + T) over the *whole* joint sequence.
    The routed call reads its text part (the last T keys) and runs one ``usp_attention`` per
    element with that element's valid text tokens as joint tokens (``_routing`` Note [masked text
    tokens]); without glyph tokens the prompt mask may have holes: the same code handles them.
    Text: **replicated** (every rank holds all T tokens): padded and masked per element, and the
    token refiner needs the whole prompt. Padded text queries get zeros where stock gives them some
    output; nothing reads them (masked as keys in every later layer; the text stream is dropped
    after the last block). Per-rank token count at 2048 x 2048 (the VAE's 32x and patch 1: 64 x 64
    = 4096 image tokens; 1000 prompt + 128 glyph tokens): 512 image + 1128 text tokens on 8 ranks.

Refused (NotImplementedError, at enable unless noted): block processors other than the stock
``HunyuanImageAttnProcessor`` (custom ones, or Diffusers' context parallelism already enabled),
token refiner processors other than the stock ``AttnProcessor2_0`` / ``AttnProcessor``, an
attention module the plan does not name, a Diffusers cache that cannot run on a grid
(``usp_dit.pipelines.caches``), ``num_layers=0`` (no dual-stream block to split at; every release
has 20); at the call a mask the router cannot read as a text key mask, dropout or causal attention
(the stock processor passes none).

CFG: ``HunyuanImagePipeline`` and ``HunyuanImageRefinerPipeline`` guide through their
``AdaptiveProjectedMixGuidance`` guider, which calls the transformer once per branch (prompt, then
negative prompt; batch 1 each for one prompt): with ``cfg_degree=2`` the two calls of a step run on
the two cfg groups at once (``cfg_branch_args``, ``usp_dit.pipelines.cfg_pair`` Note [two calls a
step]). The distilled checkpoint and the refiner run without a guider (one call a step, the
guidance embedded): ``cfg_degree=2`` then splits a batch of prompts, or runs a batch of one whole
on both groups: correct, no faster. No dropout is configurable in this model, so no
replicated-dropout handling is needed for the replicated text.
"""
from __future__ import annotations

import torch
from diffusers import HunyuanImageTransformer2DModel
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0
from diffusers.models.transformers.transformer_hunyuanimage import HunyuanImageAttnProcessor

from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, Table

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_RoutedProcessor = routed_processor_class(HunyuanImageAttnProcessor, "_RoutedHunyuanImageProcessor")


class USPHunyuanImageAttnProcessor(_RoutedProcessor or RoutedProcessor):
    """Joint attention of this rank's image shard and the replicated text (Note [HunyuanImage's
    text tokens]).

    Inputs: ``hidden_states`` (B, S_local, C) this rank's image tokens; ``encoder_hidden_states``
    (B, T, C) every text token; ``attention_mask`` the model's (B, 1, 1, S + T) key mask over the
    whole joint sequence; ``image_rotary_emb`` this rank's rows of the RoPE table, each
    (S_local, head_dim) (cut by the ``rope`` table hook).
    Returns ``(image_out (B, S_local, C), text_out (B, T, C))``, ``text_out`` equal on every rank.

    The signature is spelled out: ``Attention.forward`` passes a processor only the keyword
    arguments its ``__call__`` names.
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
                "USPHunyuanImageAttnProcessor routes the blocks' joint [image; text] attention; it got no text"
            )
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


def _routed_call_missing(transformer: HunyuanImageTransformer2DModel) -> str | None:
    if _RoutedProcessor is None:
        return f"this diffusers' HunyuanImageAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


def _no_dual_stream_blocks(transformer: HunyuanImageTransformer2DModel) -> str | None:
    if len(transformer.transformer_blocks) == 0:
        return ("num_layers=0 (single-stream blocks only) is not supported: the tokens are split at "
                "transformer_blocks.0 (every released HunyuanImage has dual-stream blocks)")
    return None


_STOCK = (HunyuanImageAttnProcessor,)

PLAN = ModelPlan(
    name="HunyuanImage",
    model_class=HunyuanImageTransformer2DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    attention=(
        # joint [image shard; text] attention, text last (Note [HunyuanImage's text tokens])
        Parallel("transformer_blocks.*.attn", USPHunyuanImageAttnProcessor, stock=_STOCK, text="last"),
        Parallel("single_transformer_blocks.*.attn", USPHunyuanImageAttnProcessor, stock=_STOCK, text="last"),
        # the token refiner's self-attention over the whole (replicated) prompt, before the blocks
        Local("context_embedder.token_refiner.refiner_blocks.*.attn", stock=(AttnProcessor2_0, AttnProcessor)),
    ),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # rope(latents) -> (cos, sin), each (seq, head_dim): the sequence on dim 0.
    tables=(Table("rope", dim=0, items=(0, 1)),),
    # Batched on dim 0, split over the "cfg" axis by enable_usp (a call cfg_branch_args does not run).
    cfg_batch_args=(
        "hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask", "timestep_r",
        "encoder_hidden_states_2", "encoder_attention_mask_2", "guidance",
    ),
    # The guider's two calls a step differ in the text conditioning alone: the prompt's Qwen embeds
    # and mask and its ByT5 glyph embeds and mask, then the negative prompt's (the refiner passes the
    # first two only); latents, timesteps and the embedded guidance are the same.
    cfg_branch_args=("encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2",
                     "encoder_attention_mask_2"),
    refuse=(_routed_call_missing, _no_dual_stream_blocks),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
