"""Tiny randomly initialised Helios transformers and pipelines, for tests and the video example.

Layout: latents (batch, channels, frames, height, width): the current chunk's and the short /
mid / long history's (the same channels and spatial size); frame indices (batch | 1, frames),
one per latent frame, for the RoPE; text embeddings (batch, text_seq, text_dim); timestep (batch,).

Built from a seed, in code, with no download: every rank gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import HeliosTransformer3DModel

from usp_dit.demo.tiny_video import TEXT_DIM, _perturb, tiny_t5
from usp_dit.demo.tiny_wan import LATENT_CHANNELS, tiny_wan_vae

# Variants: the release's switches (guidance_cross_attn, zero_history_timestep) and their opposites
# with the history's key amplification, so that every branch of the model's forward runs.
HELIOS_VARIANTS = {
    "base": dict(guidance_cross_attn=True, zero_history_timestep=True, is_amplify_history=False),
    "amplify": dict(guidance_cross_attn=False, zero_history_timestep=False, is_amplify_history=True,
                    history_scale_mode="per_head"),
}


def tiny_helios(variant: str = "base", num_heads: int = 4, head_dim: int = 16, seed: int = 0) -> HeliosTransformer3DModel:
    """A 2-layer ``HeliosTransformer3DModel`` (with the multi-term memory patches), float32, eval
    mode, every parameter perturbed (``tiny_video._perturb``: the history key scales too).

    Raises:
        ValueError: ``variant`` is not one of ``HELIOS_VARIANTS``.
    """
    if variant not in HELIOS_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(HELIOS_VARIANTS)}, got {variant!r}")
    t_dim = head_dim - 2 * (2 * (head_dim // 6))  # RoPE dims (t, y, x), even, summing to head_dim
    torch.manual_seed(seed)
    model = HeliosTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=num_heads, attention_head_dim=head_dim,
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, text_dim=TEXT_DIM, freq_dim=16, ffn_dim=96,
        num_layers=2, cross_attn_norm=True, rope_dim=(t_dim, 2 * (head_dim // 6), 2 * (head_dim // 6)),
        has_multi_term_memory_patch=True, **HELIOS_VARIANTS[variant],
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class HeliosInputs:
    """Keyword arguments of one ``HeliosTransformer3DModel.forward`` call (history ``None``: none)."""

    hidden_states: torch.Tensor  # (B, C, F, H, W), the current chunk
    timestep: torch.Tensor  # (B,)
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    indices_hidden_states: torch.Tensor | None = None  # (B, F)
    indices_latents_history_short: torch.Tensor | None = None
    indices_latents_history_mid: torch.Tensor | None = None
    indices_latents_history_long: torch.Tensor | None = None
    latents_history_short: torch.Tensor | None = None  # (B, C, F_short, H, W)
    latents_history_mid: torch.Tensor | None = None
    latents_history_long: torch.Tensor | None = None

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def helios_inputs(model: HeliosTransformer3DModel, frames: int, height: int, width: int,
                  history: tuple[int, int, int] | None = (4, 2, 2), batch: int = 2, text_len: int = 9,
                  seed: int = 0) -> HeliosInputs:
    """Seeded inputs; ``history`` = (long, mid, short) latent frames, or ``None`` for a call
    without history. A different prompt, timestep and set of frame indices per batch element
    (random, increasing: the RoPE positions of a later chunk)."""
    g = torch.Generator().manual_seed(seed)
    channels = model.config.in_channels

    def latent(f: int) -> torch.Tensor:
        return torch.randn(batch, channels, f, height, width, generator=g)

    def indices(f: int) -> torch.Tensor:
        return torch.sort(torch.randperm(64, generator=g)[:f]).values.expand(batch, -1) + torch.arange(batch)[:, None]

    inputs = HeliosInputs(latent(frames), torch.randint(0, 1000, (batch,), generator=g),
                          torch.randn(batch, text_len, model.config.text_dim, generator=g), indices(frames))
    if history is not None:
        long, mid, short = history
        inputs.latents_history_long, inputs.indices_latents_history_long = latent(long), indices(long)
        inputs.latents_history_mid, inputs.indices_latents_history_mid = latent(mid), indices(mid)
        inputs.latents_history_short, inputs.indices_latents_history_short = latent(short), indices(short)
    return inputs


def helios_tokens(frames: int, height: int, width: int, history: tuple[int, int, int] | None = (4, 2, 2)) -> int:
    """Tokens of the whole sequence for patch (1, 2, 2): the current chunk's, plus the short
    history's at 1x, the mid's at 2x coarser (padded to (2, 4, 4)) and the long's at 4x (padded to (4, 8, 8))."""
    def ceil(a: int, b: int) -> int:
        return -(-a // b)

    tokens = frames * (height // 2) * (width // 2)
    if history is not None:
        long, mid, short = history
        tokens += short * (height // 2) * (width // 2)
        tokens += ceil(mid, 2) * ceil(height, 4) * ceil(width, 4) + ceil(long, 4) * ceil(height, 8) * ceil(width, 8)
    return tokens


def tiny_helios_pipeline(max_text_len: int = 16, seed: int = 0, pyramid: bool = False):
    """A ``HeliosPipeline`` (or, with ``pyramid``, a ``HeliosPyramidPipeline``) of tiny random
    models, float32: T5 text encoder, the "base" transformer, Wan's VAE (8x spatial, 4x temporal
    compression), ``HeliosScheduler``. Call it with small ``history_sizes`` (e.g. [4, 2, 1]) and
    ``num_latent_frames_per_chunk`` (e.g. 3: 9 frames a chunk) and ``max_sequence_length <= max_text_len``.
    """
    from diffusers import HeliosPipeline, HeliosPyramidPipeline, HeliosScheduler

    tokenizer, text_encoder = tiny_t5(max_text_len, seed + 10)
    cls = HeliosPyramidPipeline if pyramid else HeliosPipeline
    # Stage 1 (Helios-Base) denoises in one stage; the pyramid pipeline in one stage per resolution
    # (two here: call it with two entries in pyramid_num_inference_steps_list).
    # gamma 0.3, not the release's 1/3: the pyramid's block noise factors the covariance
    # (1 + gamma) I - gamma 1 1^T of a 2 x 2 patch, whose least eigenvalue 1 - 3 gamma is 0 at 1/3
    # (stock adds 1e-8), and its float32 Cholesky then fails in stock itself on some CPUs (AVX2 MKL).
    scheduler = (HeliosScheduler(stages=2, stage_range=[0, 1 / 2, 1], gamma=0.3) if pyramid
                 else HeliosScheduler(stages=1))
    return cls(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=tiny_wan_vae(LATENT_CHANNELS, seed=seed + 20),
        scheduler=scheduler, transformer=tiny_helios(seed=seed + 30),
    )
