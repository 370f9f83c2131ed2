"""Tiny randomly initialised Motif-Video transformers and pipelines, for tests and the video example.

Layout: latents (batch, channels, frames, height, width), channels = 2 * LATENT_CHANNELS + 1
(noise, first-frame condition, its mask, as the pipelines concatenate them); text embeddings
(batch, text_seq, TEXT_DIM) with a mask (batch, text_seq); SigLIP-like image embeddings
(batch, image_seq, IMAGE_DIM) for the I2V variant; timestep (batch,).

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import MotifVideoTransformer3DModel

from usp_dit.demo.tiny_video import TEXT_DIM, _perturb, tiny_t5

LATENT_CHANNELS = 4  # the tiny stand-in for the Wan VAE's 16
IMAGE_DIM = 24

# Variants, each exercising every block type the config can build (widths /32 of the release's).
MOTIF_VARIANTS = {
    # dual-stream blocks with text cross-attention, single-stream encoder blocks with it, and a
    # single-stream decoder block (no text; both streams video).
    "t2v": dict(num_layers=1, num_single_layers=2, num_decoder_layers=1,
                enable_text_cross_attention_dual=True, enable_text_cross_attention_single=True),
    # first-frame conditioning: image tokens in front of the text; no decoder, no cross-attention.
    "i2v": dict(num_layers=1, num_single_layers=1, num_decoder_layers=0, image_embed_dim=IMAGE_DIM),
}


def tiny_motif_video(variant: str = "t2v", num_heads: int = 4, head_dim: int = 16, seed: int = 0
                     ) -> MotifVideoTransformer3DModel:
    """A tiny ``MotifVideoTransformer3DModel`` (``num_heads * head_dim`` wide), float32, eval mode,
    every parameter perturbed with seeded noise (``tiny_video._perturb``).

    Raises:
        ValueError: ``variant`` is not one of ``MOTIF_VARIANTS``; ``head_dim`` not 16 (the RoPE axes).
    """
    if variant not in MOTIF_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(MOTIF_VARIANTS)}, got {variant!r}")
    if head_dim != 16:
        raise ValueError(f"head_dim must be 16 (rope_axes_dim (4, 6, 6) sums to it), got {head_dim}")
    config = dict(
        in_channels=2 * LATENT_CHANNELS + 1, out_channels=LATENT_CHANNELS, num_attention_heads=num_heads,
        attention_head_dim=head_dim, mlp_ratio=2.0, patch_size=2, patch_size_t=1, text_embed_dim=TEXT_DIM,
        rope_axes_dim=(4, 6, 6),
    )
    config.update(MOTIF_VARIANTS[variant])
    torch.manual_seed(seed)
    model = MotifVideoTransformer3DModel(**config)
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class MotifVideoInputs:
    """Keyword arguments of one ``MotifVideoTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, C, F, H, W)
    timestep: torch.Tensor  # (B,)
    encoder_hidden_states: torch.Tensor  # (B, T, TEXT_DIM)
    encoder_attention_mask: torch.Tensor  # (B, T), 1 = real token
    image_embeds: torch.Tensor | None = None  # (B, image_seq, IMAGE_DIM), I2V only

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def motif_video_tokens(model: MotifVideoTransformer3DModel, frames: int, height: int, width: int) -> int:
    """Video tokens of a latent of this size: frames/p_t * height/p * width/p."""
    p, p_t = model.config.patch_size, model.config.patch_size_t
    return (frames // p_t) * (height // p) * (width // p)


def motif_video_inputs(
    model: MotifVideoTransformer3DModel, frames: int, height: int, width: int, text_len: int = 9,
    image_len: int = 5, seed: int = 0,
) -> MotifVideoInputs:
    """Seeded inputs of batch 2: a different prompt, timestep and prompt mask per element (element 0:
    6 valid tokens with a hole, element 1: 7, a prefix); I2V models get ``image_len`` image tokens."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, cfg.in_channels, frames, height, width, generator=g)
    text = torch.randn(2, text_len, cfg.text_embed_dim, generator=g)
    mask = torch.zeros(2, text_len, dtype=torch.long)
    mask[0, [0, 1, 3, 4, 5, 6]] = 1
    mask[1, :7] = 1
    image = torch.randn(2, image_len, cfg.image_embed_dim, generator=g) if cfg.image_embed_dim else None
    timestep = torch.tensor([931, 207])
    return MotifVideoInputs(x, timestep, text, mask, image)


# ---- whole pipeline ----------------------------------------------------------------------------------


def tiny_motif_video_vae(seed: int = 0):
    """An ``AutoencoderKLWan`` of ``LATENT_CHANNELS``: 8x spatial, 4x temporal compression."""
    from usp_dit.demo.tiny_wan import tiny_wan_vae

    return tiny_wan_vae(LATENT_CHANNELS, seed=seed)


def tiny_motif_video_pipeline(max_text_len: int = 16, seed: int = 0, guidance_scale: float = 5.0):
    """A ``MotifVideoPipeline`` of tiny random models, float32: the "t2v" transformer (decoder block
    included), a character-level T5 encoder standing in for T5Gemma2 (the pipeline reads only its
    first output), the Wan VAE, and ``ClassifierFreeGuidance`` (two transformer calls a step).

    ``height x width x num_frames`` gives ``((num_frames - 1) / 4 + 1) * (height / 16) *
    (width / 16)`` video tokens; e.g. 48 x 80 x 9 frames -> 3 * 3 * 5 = 45. Call it with
    ``max_sequence_length <= max_text_len``.
    """
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, MotifVideoPipeline

    tokenizer, text_encoder = tiny_t5(max_text_len, seed + 10)
    return MotifVideoPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=tiny_motif_video_vae(seed + 20),
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=tiny_motif_video("t2v", seed=seed + 30),
        guider=ClassifierFreeGuidance(guidance_scale=guidance_scale),
    )
