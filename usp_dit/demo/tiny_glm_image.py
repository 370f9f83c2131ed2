"""Tiny randomly initialised GLM-Image decoder transformers, built in code for tests and benchmarks.

Layout: latents (batch, LATENT_CHANNELS, 2 * height, 2 * width) for ``height x width`` image
tokens (2x2 patches); ``prior_token_id`` (batch, height * width) long, one AR prior per image token
(``prior_token_drop`` (batch, height * width) bool: priors zeroed); glyph text
(batch, T, TEXT_DIM); ``attention_mask`` (batch, T) 0/1 or ``None``; timestep (batch,);
``target_size``, ``crop_coords`` (batch, 2) in pixels.

Nothing is downloaded. Every process that calls a builder with the same arguments gets
bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import GlmImageTransformer2DModel

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # text_embed_dim (GLM-Image: its ByT5 glyph encoder's 1472)
LATENT_CHANNELS = 4  # in_channels (GLM-Image: 16)
CODEBOOK = 64  # prior_vq_quantizer_codebook_size (GLM-Image: 16384)


def tiny_glm_image(num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, seed: int = 0) -> GlmImageTransformer2DModel:
    """A small ``GlmImageTransformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode,
    every parameter perturbed (``tiny_video._perturb``)."""
    torch.manual_seed(seed)
    model = GlmImageTransformer2DModel(
        patch_size=2, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=num_layers,
        attention_head_dim=head_dim, num_attention_heads=num_heads, text_embed_dim=TEXT_DIM, time_embed_dim=32,
        condition_dim=16, prior_vq_quantizer_codebook_size=CODEBOOK,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class GlmImageInputs:
    """Keyword arguments of one ``GlmImageTransformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, LATENT_CHANNELS, 2H, 2W)
    encoder_hidden_states: torch.Tensor  # (B, T, TEXT_DIM)
    prior_token_id: torch.Tensor  # (B, H * W) long
    prior_token_drop: torch.Tensor  # (B, H * W) bool
    timestep: torch.Tensor  # (B,)
    target_size: torch.Tensor  # (B, 2)
    crop_coords: torch.Tensor  # (B, 2)
    attention_mask: torch.Tensor | None = None  # (B, T) 0/1

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def glm_image_inputs(height: int, width: int, text_lens: tuple[int, ...], masked: bool = True,
                     seed: int = 0) -> GlmImageInputs:
    """Seeded inputs for ``height x width`` image tokens, one element per entry of ``text_lens``
    (each its own glyph text, latent, priors (the last element's partly dropped) and timestep);
    ``masked``: an ``attention_mask`` of each element's valid length (else ``None``)."""
    g = torch.Generator().manual_seed(seed)
    batch, longest, tokens = len(text_lens), max(text_lens), height * width
    drop = torch.zeros(batch, tokens, dtype=torch.bool)
    drop[-1, ::2] = True
    mask = (torch.arange(longest)[None, :] < torch.tensor(text_lens)[:, None]).long()
    return GlmImageInputs(
        hidden_states=torch.randn(batch, LATENT_CHANNELS, 2 * height, 2 * width, generator=g),
        encoder_hidden_states=torch.randn(batch, longest, TEXT_DIM, generator=g),
        prior_token_id=torch.randint(0, CODEBOOK, (batch, tokens), generator=g), prior_token_drop=drop,
        timestep=torch.rand(batch, generator=g) * 1000,
        target_size=torch.tensor([[16.0 * height, 16.0 * width]]).repeat(batch, 1),
        crop_coords=torch.randint(0, 64, (batch, 2), generator=g).float(),
        attention_mask=mask if masked else None,
    )


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_glm_image_pipeline(seed: int = 0):
    """A ``GlmImagePipeline`` of a tiny VAE (2x, its latent statistics set away from 0 / 1) and
    transformer, float32 on CPU, **without** its AR model, glyph encoder or tokenizers: call it
    with ``prior_token_ids`` (batch, tokens), ``prompt_embeds`` and ``negative_prompt_embeds``
    (batch, T, TEXT_DIM) (the pipeline's own path for precomputed conditioning). ``height x width``
    gives ``(height / 4) * (width / 4)`` image tokens (24 x 28 -> 42: the pipeline takes heights in multiples
    of 8 here, so the token rows are even).
    """
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, GlmImagePipeline

    torch.manual_seed(seed + 20)
    g = torch.Generator().manual_seed(seed + 21)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2,
        block_out_channels=(8, 16), norm_num_groups=4, sample_size=32,
        latents_mean=(0.1 * torch.randn(LATENT_CHANNELS, generator=g)).tolist(),
        latents_std=(1.0 + 0.1 * torch.rand(LATENT_CHANNELS, generator=g)).tolist(),
    ).eval()
    return GlmImagePipeline(
        tokenizer=None, processor=None, text_encoder=None, vision_language_encoder=None, vae=vae,
        transformer=tiny_glm_image(seed=seed + 30), scheduler=FlowMatchEulerDiscreteScheduler(),
    )
