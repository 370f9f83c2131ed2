"""Tiny randomly initialised SANA-WM refiners (``SanaWMLTX2RefinerTransformer3DModel``), their
inputs and a ``SanaWMLTX2Refiner`` pipeline, built in code for tests and examples.

Layout: video tokens (batch, S, LATENT_CHANNELS) with ``S = frames * height * width`` of the latent
(patch 1, frame-major as the refiner's ``_pack_latents``); text embeddings (batch, text_len,
TEXT_DIM) with a 0/1 prompt mask (batch, text_len); the timestep (batch, S), one per token, as the
pipeline passes it; the video RoPE ``(cos, sin)`` of the window's absolute frame positions,
(batch, S, dim) ("interleaved") or (batch, heads, S, dim // heads // 2) ("split"); the KV cache's
per-layer K/V (batch, tokens, inner_dim).

Every process that calls a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import SanaWMLTX2RefinerTransformer3DModel
from diffusers.models.transformers.transformer_sana_wm_refiner import SanaWMRefinerKVCache

from usp_dit.demo.tiny_ltx2 import LATENT_CHANNELS, tiny_gemma3, tiny_ltx2_connectors
from usp_dit.demo.tiny_video import TEXT_DIM, _perturb

# "2.0": LTX-2.0 as released (interleaved RoPE); "2.3": split RoPE, per-head gated attention and
# perturbed-attention processors (LTX-2.3-like; its prompt modulation is left out: the refiner's
# block unpacks six modulation parameters, so ``cross_attn_mod`` does not run even on one process).
VARIANTS = {
    "2.0": {"rope_type": "interleaved"},
    "2.3": {"rope_type": "split", "gated_attn": True, "audio_gated_attn": True, "perturbed_attn": True},
}
CALLS = (None, "capture_pre_rope", "inject", "inject_and_capture_post_rope")  # kv_cache_mode


def tiny_sana_wm_refiner(variant: str = "2.0", num_heads: int = 4, head_dim: int = 16, num_layers: int = 2,
                         seed: int = 0) -> SanaWMLTX2RefinerTransformer3DModel:
    """A ``num_layers``-layer refiner, ``num_heads * head_dim`` wide (its unused audio stream 4 x 8),
    float32, eval mode; every parameter perturbed with seeded noise (``tiny_video._perturb``).

    Raises:
        ValueError: an unknown ``variant``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}; choose one of {sorted(VARIANTS)}")
    torch.manual_seed(seed)
    model = SanaWMLTX2RefinerTransformer3DModel(
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_attention_heads=num_heads,
        attention_head_dim=head_dim, cross_attention_dim=num_heads * head_dim, audio_in_channels=8,
        audio_out_channels=8, audio_num_attention_heads=4, audio_attention_head_dim=8, audio_cross_attention_dim=32,
        num_layers=num_layers, caption_channels=TEXT_DIM, **VARIANTS[variant],
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class RefinerInputs:
    """Keyword arguments of one refiner call; ``kwargs()`` builds a fresh KV cache from the seeded
    tensors below each time (a forward writes its captures into it): the last one is ``cache``."""

    hidden_states: torch.Tensor  # (B, S, C)
    encoder_hidden_states: torch.Tensor  # (B, T, TEXT_DIM)
    timestep: torch.Tensor  # (B, S)
    video_rotary_emb: tuple[torch.Tensor, torch.Tensor]
    encoder_attention_mask: torch.Tensor  # (B, T), 1 = real prompt token
    kv_cache_mode: str | None = None
    num_layers: int = 0  # of the cache
    sink: tuple[torch.Tensor, torch.Tensor] | None = None  # per layer stacked: (L, B, N_sink, inner) pre-RoPE K, V
    history: tuple[torch.Tensor, torch.Tensor] | None = None  # (L, B, N_hist, inner) post-RoPE K, V
    sink_pe: tuple[torch.Tensor, torch.Tensor] | None = None
    cache: SanaWMRefinerKVCache | None = None

    def new_cache(self) -> SanaWMRefinerKVCache | None:
        if self.kv_cache_mode is None:
            return None
        cache = SanaWMRefinerKVCache(self.num_layers)
        cache.sink_pe = self.sink_pe
        for i in range(self.num_layers):
            if self.sink is not None:
                cache.get(i).store_sink(self.sink[0][i], self.sink[1][i])
            if self.history is not None:
                cache.get(i).store_history(self.history[0][i], self.history[1][i])
        return cache

    def kwargs(self) -> dict:
        self.cache = self.new_cache()
        names = ("hidden_states", "encoder_hidden_states", "timestep", "video_rotary_emb", "encoder_attention_mask",
                 "kv_cache_mode")
        return {**{n: getattr(self, n) for n in names}, "kv_cache": self.cache}


def _rope(model, positions: list[list[int]], height: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The video RoPE of each element's absolute frame positions, stacked on the batch."""
    tables = [model.build_rotary_emb_for_absolute_positions(1, p, height, width, torch.device("cpu"), fps=24.0)
              for p in positions]
    return torch.cat([t[0] for t in tables]), torch.cat([t[1] for t in tables])


def refiner_inputs(model: SanaWMLTX2RefinerTransformer3DModel, frames: int, height: int, width: int,
                   kv_cache_mode: str | None = None, sink_frames: int = 1, history_frames: int = 2,
                   text_len: int = 9, seed: int = 0) -> RefinerInputs:
    """Seeded inputs of batch 2 for a window of ``frames x height x width`` tokens: a different
    prompt, prompt mask (element 0's with a hole) and per-token timestep per element, element 1's
    frames later in time (its RoPE positions shifted). With an injecting ``kv_cache_mode``, a cache
    of ``sink_frames`` random sink frames (rotated at their own shifted positions by ``sink_pe``)
    and ``history_frames`` random history frames per layer.
    """
    if kv_cache_mode not in CALLS:
        raise ValueError(f"kv_cache_mode={kv_cache_mode!r}; choose one of {CALLS}")
    cfg = model.config
    seq, per_frame = frames * height * width, height * width
    inner = cfg.num_attention_heads * cfg.attention_head_dim
    layers = len(model.transformer_blocks)
    g = torch.Generator().manual_seed(seed)
    start = sink_frames + history_frames
    inputs = RefinerInputs(
        hidden_states=torch.randn(2, seq, cfg.in_channels, generator=g),
        encoder_hidden_states=torch.randn(2, text_len, cfg.caption_channels, generator=g),
        timestep=torch.rand(2, seq, generator=g) * 1000,
        video_rotary_emb=_rope(model, [list(range(start, start + frames)), list(range(start + 2, start + 2 + frames))],
                               height, width),
        encoder_attention_mask=torch.zeros(2, text_len),
        kv_cache_mode=kv_cache_mode,
        num_layers=layers,
    )
    inputs.encoder_attention_mask[0, [0, 1, 3, 4, 5, 6]] = 1.0
    inputs.encoder_attention_mask[1, :4] = 1.0
    if kv_cache_mode in ("inject", "inject_and_capture_post_rope"):
        def kv(tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
            return (torch.randn(layers, 2, tokens, inner, generator=g), torch.randn(layers, 2, tokens, inner, generator=g))

        inputs.sink, inputs.history = kv(sink_frames * per_frame), kv(history_frames * per_frame)
        inputs.sink_pe = _rope(model, [list(range(sink_frames)), list(range(1, 1 + sink_frames))], height, width)
    return inputs


# ---- the pipeline ---------------------------------------------------------------------------------


def tiny_sana_wm_refiner_pipeline(variant: str = "2.0", max_text_len: int = 16, seed: int = 0):
    """A ``SanaWMLTX2Refiner`` of tiny random models (Gemma 3 encoder, LTX-2 text connectors, refiner
    transformer; no VAE: it returns refined latents), float32. Its stage-1 latent is
    (batch, LATENT_CHANNELS, frames, height, width); the pipeline refines ``block_size`` frames at a
    time over ``[sink; history; block]`` (``frames * height * width`` tokens per frame group)."""
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.sana_wm.refiner import SanaWMLTX2Refiner

    tokenizer, text_encoder = tiny_gemma3(max_text_len, seed + 10)
    return SanaWMLTX2Refiner(
        transformer=tiny_sana_wm_refiner(variant, seed=seed + 30), connectors=tiny_ltx2_connectors(seed + 50),
        tokenizer=tokenizer, text_encoder=text_encoder, scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0),
        text_max_sequence_length=max_text_len,
    )
