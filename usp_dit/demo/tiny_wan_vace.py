"""Tiny randomly initialised Wan VACE transformers and pipelines, for tests and the video example.

Layout: latents (batch, channels, frames, height, width); control latents (batch,
vace_in_channels, control_frames, height, width); text embeddings (batch, text_seq, text_dim);
timestep (batch,); control scales (len(vace_layers),).

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import WanVACETransformer3DModel

from usp_dit.demo.tiny_video import TEXT_DIM, _perturb, tiny_t5
from usp_dit.demo.tiny_wan import LATENT_CHANNELS, tiny_wan_vae

# The pipeline's control latents: the masked video's inactive and reactive latents (2 x the VAE's
# channels) and the mask folded 8 x 8 onto channels (64): 2 * 16 + 64 = 96 for the real VAE.
PIPELINE_CONTROL_CHANNELS = 2 * LATENT_CHANNELS + 64


def tiny_wan_vace(
    num_heads: int = 4, head_dim: int = 16, seed: int = 0, vace_in_channels: int = 6,
) -> WanVACETransformer3DModel:
    """A 3-layer ``WanVACETransformer3DModel`` with control blocks at layers 0 and 2 (layer 1 gets
    no hint), ``num_heads * head_dim`` wide, float32, eval mode; every parameter perturbed
    (``tiny_video._perturb``), so no hint projection keeps the zeros of a fresh checkpoint."""
    torch.manual_seed(seed)
    model = WanVACETransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=num_heads, attention_head_dim=head_dim,
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, text_dim=TEXT_DIM, freq_dim=16, ffn_dim=96,
        num_layers=3, cross_attn_norm=True, rope_max_seq_len=32, vace_layers=[0, 2], vace_in_channels=vace_in_channels,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class WanVACEInputs:
    """Keyword arguments of one ``WanVACETransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, C, F, H, W)
    timestep: torch.Tensor  # (B,)
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    control_hidden_states: torch.Tensor  # (B, vace_in_channels, F_c <= F, H, W)
    control_hidden_states_scale: torch.Tensor | None = None  # (len(vace_layers),)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def wan_vace_inputs(
    model: WanVACETransformer3DModel, frames: int, height: int, width: int, control_frames: int | None = None,
    batch: int = 2, text_len: int = 9, scales: bool = True, seed: int = 0,
) -> WanVACEInputs:
    """Seeded inputs for ``model`` (latent sizes); a different prompt, timestep and control per
    batch element. ``control_frames`` below ``frames``: the model pads the control tokens with
    zeros to the video's count. ``scales``: a random scale per hint (else the model's ones)."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg.in_channels, frames, height, width, generator=g)
    control = torch.randn(batch, cfg.vace_in_channels, control_frames or frames, height, width, generator=g)
    text = torch.randn(batch, text_len, cfg.text_dim, generator=g)
    timestep = torch.randint(0, 1000, (batch,), generator=g)
    scale = torch.rand(len(cfg.vace_layers), generator=g) + 0.5 if scales else None
    return WanVACEInputs(x, timestep, text, control, scale)


def tiny_wan_vace_pipeline(max_text_len: int = 16, seed: int = 0):
    """A ``WanVACEPipeline`` (Wan 2.1 VACE-like) of tiny random models, float32: a T5 encoder, the
    tiny Wan VAE (8x spatial, 4x temporal compression) and a ``tiny_wan_vace`` transformer taking
    the pipeline's control latents (``PIPELINE_CONTROL_CHANNELS``). ``height x width x num_frames``
    with ``r`` reference images gives ``((num_frames - 1) / 4 + 1 + r) * (height / 16) * (width / 16)``
    video tokens, e.g. 48 x 80 x 13 frames and one reference image: 5 * 3 * 5 = 75."""
    from diffusers import FlowMatchEulerDiscreteScheduler, WanVACEPipeline

    tokenizer, text_encoder = tiny_t5(max_text_len, seed + 10)
    return WanVACEPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=tiny_wan_vae(LATENT_CHANNELS, seed=seed + 20),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        transformer=tiny_wan_vace(seed=seed + 30, vace_in_channels=PIPELINE_CONTROL_CHANNELS),
    )


def wan_prompt_embeds(pipe, prompt: str | list[str], max_sequence_length: int) -> torch.Tensor:
    """(batch, max_sequence_length, text_dim) T5 embeds of ``prompt`` through ``pipe``'s tokenizer
    and encoder, by ``WanPipeline``'s own encoding (the same as the VACE and Animate pipelines',
    whose prompt cleaning calls ftfy unconditionally in diffusers 0.42, where Wan's uses it only
    when installed): pass them as ``prompt_embeds`` / ``negative_prompt_embeds`` without ftfy."""
    from diffusers import WanPipeline

    return WanPipeline._get_t5_prompt_embeds(pipe, prompt, max_sequence_length=max_sequence_length)
