"""Tiny randomly initialised FramePack transformers and a ``HunyuanVideoFramepackPipeline``, for tests and examples.

Layout: latents (batch, channels, frames, height, width), the noisy window and the three history
latents (1x, 2x, 4x) alike; their frame indices (frames,), shared by the batch; text embeddings
(batch, text_seq, text_dim) with their prompt mask (batch, text_seq), 1 = real token; SigLIP image
tokens (batch, image_seq, image_dim); pooled CLIP embeddings (batch, pooled_dim); timestep and
guidance (batch,).

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import HunyuanVideoFramepackTransformer3DModel

from usp_dit.demo.tiny_hunyuan_video import (
    LATENT_CHANNELS,
    TINY_PROMPT_TEMPLATE,
    _text_encoders,
    _tokenizers,
    tiny_hunyuan_video_vae,
)
from usp_dit.demo.tiny_video import TEXT_DIM, _perturb

IMAGE_DIM = 24  # the tiny SigLIP's width = image_proj_dim (the real model's 1152)
IMAGE_TOKENS = 4  # the tiny SigLIP's patches (16 x 16 pixels, patch 8; the real 729)

__all__ = ["TINY_PROMPT_TEMPLATE", "FramepackInputs", "framepack_inputs", "framepack_tokens",
           "tiny_framepack", "tiny_framepack_pipeline"]


def tiny_framepack(num_heads: int = 4, head_dim: int = 16, seed: int = 0) -> HunyuanVideoFramepackTransformer3DModel:
    """A ``HunyuanVideoFramepackTransformer3DModel`` as the released FramePack (history embedders,
    image projection, guidance embedding) with one dual-stream, one single-stream and one token
    refiner block, ``num_heads * head_dim`` wide, float32, eval mode; every parameter perturbed.

    Raises:
        ValueError: ``head_dim`` is not a multiple of 8 (three even RoPE axes).
    """
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 (three even RoPE axes), got {head_dim}")
    torch.manual_seed(seed)
    model = HunyuanVideoFramepackTransformer3DModel(
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_attention_heads=num_heads,
        attention_head_dim=head_dim, num_layers=1, num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0,
        text_embed_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM,
        rope_axes_dim=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8),
        has_image_proj=True, image_proj_dim=IMAGE_DIM, has_clean_x_embedder=True, guidance_embeds=True,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class FramepackInputs:
    """Keyword arguments of one ``HunyuanVideoFramepackTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, C, F, H, W), the noisy window
    timestep: torch.Tensor  # (B,)
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    encoder_attention_mask: torch.Tensor  # (B, T), 1 = real prompt token
    pooled_projections: torch.Tensor  # (B, pooled_dim)
    image_embeds: torch.Tensor  # (B, image_seq, image_dim)
    indices_latents: torch.Tensor  # (F,)
    guidance: torch.Tensor  # (B,)
    latents_clean: torch.Tensor  # (B, C, F_clean, H, W)
    indices_latents_clean: torch.Tensor  # (F_clean,)
    latents_history_2x: torch.Tensor  # (B, C, F_2x, H, W)
    indices_latents_history_2x: torch.Tensor  # (F_2x,)
    latents_history_4x: torch.Tensor  # (B, C, F_4x, H, W)
    indices_latents_history_4x: torch.Tensor  # (F_4x,)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def _ceil(n: int, k: int) -> int:
    return -(-n // k)


def framepack_tokens(model: HunyuanVideoFramepackTransformer3DModel, frames: tuple[int, int, int, int],
                     height: int, width: int) -> tuple[int, int]:
    """(packed tokens, noisy tokens) for ``frames`` = (noisy, clean, 2x, 4x) latent frames of
    ``height x width``: the history embedders pad each latent up to their kernels (1,2,2), (2,4,4), (4,8,8)."""
    p = model.config.patch_size
    noisy, clean, f2, f4 = frames
    per_frame = (height // p) * (width // p)
    two = _ceil(f2, 2) * _ceil(height, 4) * _ceil(width, 4)
    four = _ceil(f4, 4) * _ceil(height, 8) * _ceil(width, 8)
    return noisy * per_frame + clean * per_frame + two + four, noisy * per_frame


def framepack_inputs(
    model: HunyuanVideoFramepackTransformer3DModel, frames: tuple[int, int, int, int], height: int, width: int,
    valid: list[list[int]] | None = None, text_len: int = 9, seed: int = 0,
) -> FramepackInputs:
    """Seeded inputs for ``frames`` = (noisy, clean, 2x, 4x) latent frames; a different prompt,
    prompt mask, image, history, timestep and guidance per batch element; frame indices drawn at
    random (distinct, increasing per part: the RoPE positions are not a plain range).

    ``valid[b]``: the positions of element b's real prompt tokens (default: a hole for element 0,
    a prefix of 4 for element 1); the batch size is ``len(valid)``.
    """
    cfg = model.config
    valid = valid if valid is not None else [[0, 1, 3, 4, 5, 6], [0, 1, 2, 3]]
    batch = len(valid)
    g = torch.Generator().manual_seed(seed)

    def latent(f: int) -> torch.Tensor:
        return torch.randn(batch, cfg.in_channels, f, height, width, generator=g)

    def indices(f: int) -> torch.Tensor:
        return torch.randperm(4 * f + 4, generator=g)[:f].sort().values

    mask = torch.zeros(batch, text_len)
    for b, positions in enumerate(valid):
        mask[b, positions] = 1.0
    noisy, clean, f2, f4 = frames
    return FramepackInputs(
        hidden_states=latent(noisy),
        timestep=torch.randint(1, 1000, (batch,), generator=g).float(),
        encoder_hidden_states=torch.randn(batch, text_len, cfg.text_embed_dim, generator=g),
        encoder_attention_mask=mask,
        pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=g),
        image_embeds=torch.randn(batch, IMAGE_TOKENS, cfg.image_proj_dim, generator=g),
        indices_latents=indices(noisy),
        guidance=(torch.rand(batch, generator=g) * 6 + 1) * 1000,
        latents_clean=latent(clean), indices_latents_clean=indices(clean),
        latents_history_2x=latent(f2), indices_latents_history_2x=indices(f2),
        latents_history_4x=latent(f4), indices_latents_history_4x=indices(f4),
    )


# ---- the whole pipeline ----------------------------------------------------------------------------


def _image_encoder(seed: int):
    """A one-layer ``SiglipVisionModel`` over 16 x 16 images (patch 8: ``IMAGE_TOKENS`` tokens,
    ``IMAGE_DIM`` wide) and its ``SiglipImageProcessor``; returns ``(encoder, processor)``."""
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(seed)
    encoder = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=IMAGE_DIM, intermediate_size=48, num_hidden_layers=1, num_attention_heads=2, image_size=16,
        patch_size=8,
    ))
    _perturb(encoder, seed + 1, std=0.02)
    return encoder.eval(), SiglipImageProcessor(size={"height": 16, "width": 16})


def tiny_framepack_pipeline(max_text_len: int = 16, seed: int = 0):
    """A ``HunyuanVideoFramepackPipeline`` of tiny random models, float32.

    Call it with ``prompt_template=TINY_PROMPT_TEMPLATE``, ``max_sequence_length <= max_text_len``
    and an ``image``. VAE: HunyuanVideo's tiny one (8x spatial, 4x temporal); e.g. 48 x 80 pixels
    and ``latent_window_size=3``: a packed sequence of 3 x 15 noisy, 2 x 15 clean, 6 (2x) and 8
    (4x) tokens, 89 in all.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoFramepackPipeline

    llama_tok, clip_tok = _tokenizers(max_text_len)
    llama, clip = _text_encoders(len(llama_tok), len(clip_tok), seed + 10)
    image_encoder, feature_extractor = _image_encoder(seed + 40)
    return HunyuanVideoFramepackPipeline(
        text_encoder=llama, tokenizer=llama_tok, transformer=tiny_framepack(seed=seed + 30),
        vae=tiny_hunyuan_video_vae(seed + 20), scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=clip, tokenizer_2=clip_tok, image_encoder=image_encoder, feature_extractor=feature_extractor,
    )
