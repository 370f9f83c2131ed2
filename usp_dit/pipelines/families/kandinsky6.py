"""Kandinsky 6 adapter: ``Kandinsky6Transformer3DModel`` (Kandinsky 6.0 text / image to video and audio) on a USP grid.

Layout: latents channels-last (batch, frames, height, width, channels); the patch embedding makes
(batch, frames/p_t, height/p_h, width/p_w, model_dim), flattened to the video tokens
(batch, seq, model_dim), frame-major, ``seq = frames/p_t * height/p_h * width/p_w``; audio tokens
(batch, audio_seq, model_dim_a), one per audio latent; text (batch, text_seq, model_dim) for each
stream, replicated, with the prompt's padding mask ``encoder_attention_mask`` (batch, text_seq),
True = real token; Q/K/V (batch, seq, heads, head_dim), ``head_dim = sum(axes_dims)``; the visual
RoPE table (seq, 1, head_dim/2, 2, 2) after the model's flatten: **the sequence on dim 0**, no batch
dim; the time embeddings (batch, time_dim): one per element, none per token.

The model (diffusers' ``Kandinsky6FusedTransformerDecoderBlock``): two text streams (video's and
audio's own text blocks over the same prompt, masked self-attention) run before the fused blocks;
each fused block runs seven attentions:

    attention                               queries  keys/values  here
    video_dec_block.self_attention          video    video        parallel: usp_attention
    video_dec_block.cross_attention         video    video text   local (text replicated, masked keys)
    audio_dec_block.self_attention          audio    audio        local (audio replicated)
    audio_dec_block.cross_attention         audio    audio text   local
    va_cross_attention                      video    audio        local (audio replicated)
    av_cross_attention                      audio    video        parallel: replicated queries (LTX-2's Note [v2a])
    *_text_transformer_blocks.*.attn        text     text         local (before the fused blocks)

Where the tokens are split: the embeddings, the text streams and the RoPE tables run on every rank;
``visual_transformer_blocks.0``'s video input is sharded; the *last fused block's* video output is
gathered (Note [Kandinsky 6's gather]). The video RoPE table reaches every block as an argument and
is cut like the tokens there (``VisualRopeHooks``, Kandinsky 5's, at Kandinsky 6's argument); in
the ``ca_rope`` configs (the releases') the same rows rotate the video side of the two cross-modal
attentions, so they stay aligned with this rank's video rows.

The audio stream is **replicated**, as LTX-2's (usp_dit.pipelines.families.ltx2): every rank holds
every audio token and runs the audio half of each block on all of them, the same computation on
every rank. Replicated, audio self-attention, audio-to-text and video-to-audio (``va_cross_attention``:
this rank's video queries against the whole audio K/V) need no communication; the audio queries
of ``av_cross_attention`` attend over the whole video, of which this rank holds a shard: each rank
attends them to its own video keys and the partial results are merged over the sequence group by
their log-sum-exp (LTX-2's ``attend_replicated_queries``: 2 small all-reduces a layer). Text
tokens: **replicated**, no communication. Per-rank token counts, Kandinsky 6.0 Pro 5 s at 768 x 512,
24 fps (121 frames: 31 latent frames x 32 x 48 patches = 47616 video tokens; ceil(121 / 24 *
44100 / 1024) = 218 audio tokens; up to 1024 prompt tokens): on 8 ranks each rank holds 5952 video
tokens and the 218 audio tokens (3.7 % of its video rows), and the whole prompt in the text streams
(once a forward) and the cross-attentions' K/V.

Note [Kandinsky 6's gather]
    After the last fused block the model reshapes the video tokens to the latent grid
    (batch, frames, height, width, model_dim) and runs ``out_layer`` (modulated norm, linear,
    unpatchify) on it: the reshape needs every token, so the sequence is gathered at the last
    block's output (``gather_at="visual_transformer_blocks.-1"``; the block returns (video, audio):
    the video entry is gathered, the replicated audio passes through), and ``out_layer`` runs
    whole on every rank (one norm and one linear per token). As Kandinsky 5 (Note [Kandinsky 5's
    gather] there).

Masks: the prompt mask is over text keys only (the text streams' self-attention, the two
text cross-attentions): local on every rank, the stock code. No mask touches video or audio keys.

Gradients (fine-tuning): each rank's parameter gradients, summed over the sequence group, are one
process's. The replicated streams (text, audio) carry per-rank partial gradients that add up over
the group, and ``av_cross_attention``'s backward all-reduces its output's gradient before this
rank's keys' part (LTX-2's Note [v2a]); float32 throughout (the stock RoPE casts back to the
input's dtype, unlike Kandinsky 5's bfloat16 round trip).

CFG: ``Kandinsky6TI2VAPipeline`` calls the transformer once per guidance branch (the prompt's
Qwen2.5-VL embeds, CLIP pooled embeds and padding mask, then the negative prompt's); with
``cfg_degree=2`` the two calls of a step run on the two cfg groups at once
(``usp_dit.pipelines.cfg_pair`` Note [two calls a step]). The distilled checkpoints run
``guidance_scale=1``: one call a step.

Refused (NotImplementedError): processors other than the stock ``Kandinsky6AttnProcessor``, an
attention module the plan does not name, a Diffusers cache that cannot run on a grid
(``usp_dit.pipelines.caches``), a model without fused blocks (``num_visual_blocks=0``), and any
attention mask in the parallel sites (the model passes none there). The model has no dropout.
``Kandinsky6SRTransformer3DModel`` (the super-resolution stage, NABLA block-sparse) has its own
adapter on grids without ring (usp_dit.pipelines.families.kandinsky6_sr).
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers import Kandinsky6Transformer3DModel
from diffusers.models.transformers.transformer_kandinsky6 import Kandinsky6Attention, Kandinsky6AttnProcessor

from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class, with_global
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.families.kandinsky5 import VisualRopeHooks
from usp_dit.pipelines.families.ltx2 import attend_replicated_queries
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed to usp_attention (video self-attention) or to the
# replicated-query merge (audio queries over the video). None if this diffusers' makes no such call.
_RoutedKandinsky6Processor = routed_processor_class(Kandinsky6AttnProcessor, "_RoutedKandinsky6Processor")
_audio_from_video_call = with_global(Kandinsky6AttnProcessor.__call__, ROUTED_NAME, attend_replicated_queries)


def _no_mask(attn_mask: torch.Tensor | None, site: str) -> None:
    if attn_mask is not None:
        raise NotImplementedError(
            f"usp_dit's Kandinsky6 adapter takes no attention mask in {site}: it would mask video tokens")


class USPKandinsky6SelfAttnProcessor(_RoutedKandinsky6Processor or RoutedProcessor):
    """``video_dec_block.self_attention``: this rank's video shard against the whole video.

    Inputs: ``hidden_states`` (B, S_local, C); ``rotary_emb`` this rank's rows of the video RoPE
    table (S_local, 1, head_dim/2, 2, 2) (cut by ``Kandinsky6RopeHooks``). Returns (B, S_local, C).
    """

    def __call__(
        self,
        attn: Kandinsky6Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        rotary_emb: torch.Tensor | None = None,
        rotary_emb_kv: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None:
            raise NotImplementedError("USPKandinsky6SelfAttnProcessor is for the video self-attention only")
        _no_mask(attn_mask, "the video self-attention")
        return super().__call__(attn, hidden_states, encoder_hidden_states, rotary_emb, rotary_emb_kv, attn_mask)


class USPKandinsky6AudioFromVideoProcessor(RoutedProcessor):
    """``av_cross_attention``: every audio query (replicated) against the whole video, of which
    this rank holds (B, S_local, C) (LTX-2's Note [v2a]).

    Inputs: ``hidden_states`` (B, S_a, C_a) the audio; ``encoder_hidden_states`` (B, S_local, C)
    this rank's video rows; ``rotary_emb`` the audio table (whole), ``rotary_emb_kv`` this rank's
    rows of the video table (``ca_rope`` configs; else both None). Returns (B, S_a, C_a), the same
    on every rank.
    """

    _stock_call = _audio_from_video_call

    def __call__(
        self,
        attn: Kandinsky6Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        rotary_emb: torch.Tensor | None = None,
        rotary_emb_kv: torch.Tensor | None = None,
        attn_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is None:
            raise NotImplementedError("USPKandinsky6AudioFromVideoProcessor is for av_cross_attention only")
        _no_mask(attn_mask, "av_cross_attention")
        return super().__call__(attn, hidden_states, encoder_hidden_states, rotary_emb, rotary_emb_kv, attn_mask)


class Kandinsky6RopeHooks(VisualRopeHooks):
    """Kandinsky 5's per-block RoPE cut at Kandinsky 6's argument: ``vis_rope``, the fused blocks'
    sixth, (S, 1, head_dim/2, 2, 2) with the sequence on dim 0."""

    rope_arg = ("vis_rope", 5)
    dim = 0


def _routed_call_missing(transformer: Kandinsky6Transformer3DModel) -> str | None:
    if _RoutedKandinsky6Processor is None or _audio_from_video_call is None:
        return f"this diffusers' Kandinsky6AttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


def _no_visual_blocks(transformer: Kandinsky6Transformer3DModel) -> str | None:
    if len(transformer.visual_transformer_blocks) == 0:
        return "num_visual_blocks=0: no fused block to split the video tokens at"
    return None


def _video_heads(model: Any) -> int:
    return model.config.model_dim // sum(model.config.axes_dims)


_STOCK = (Kandinsky6AttnProcessor,)
_FUSED = "visual_transformer_blocks.*."

PLAN = ModelPlan(
    name="Kandinsky6",
    model_class=Kandinsky6Transformer3DModel,
    split_at="visual_transformer_blocks.0",
    gather_at="visual_transformer_blocks.-1",  # Note [Kandinsky 6's gather]
    attention=(
        Parallel(_FUSED + "video_dec_block.self_attention", USPKandinsky6SelfAttnProcessor, stock=_STOCK),
        Parallel(_FUSED + "av_cross_attention", USPKandinsky6AudioFromVideoProcessor, stock=_STOCK),
        Local(_FUSED + "video_dec_block.cross_attention", stock=_STOCK),  # video -> replicated text
        Local(_FUSED + "audio_dec_block.*", stock=_STOCK),  # the audio's self- and text attention, replicated
        Local(_FUSED + "va_cross_attention", stock=_STOCK),  # video -> replicated audio
        Local("*_text_transformer_blocks.*.attn", stock=_STOCK),  # the text streams, whole on every rank
    ),
    block_lists=("video_text_transformer_blocks", "audio_text_transformer_blocks", "visual_transformer_blocks"),
    # Batched on dim 0, split over the "cfg" axis by enable_usp (a call cfg_branch_args does not run).
    cfg_batch_args=("hidden_states", "audio_hidden_states", "encoder_hidden_states", "pooled_projections",
                    "timestep", "encoder_attention_mask", "visual_token_type_ids"),
    cfg_branch_args=("encoder_hidden_states", "pooled_projections", "encoder_attention_mask"),
    hooks=(Kandinsky6RopeHooks,),
    refuse=(_routed_call_missing, _no_visual_blocks),
    heads=_video_heads,
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
