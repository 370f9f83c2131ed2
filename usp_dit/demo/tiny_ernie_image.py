"""Tiny randomly initialised ERNIE-Image transformers and an ``ErnieImagePipeline``, built in code for tests and examples.

Layout: latents (batch, 4 * LATENT_CHANNELS, height, width), the pipeline's 2x2-patchified latent,
one token per position (patch size 1, as released): ``height * width`` image tokens; text
``text_bth`` (batch, T, TEXT_DIM), element b's ``text_lens[b]`` rows first, zero rows after (as
``ErnieImagePipeline._pad_text`` pads); timestep (batch,) in [0, 1000).

Nothing is downloaded: the pipeline's text encoder is the tiny ``Mistral3Model`` and character
tokenizer of ``usp_dit.demo.tiny_flux2``, the VAE its tiny ``AutoencoderKLFlux2``. Every process
that calls a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import ErnieImageTransformer2DModel

from usp_dit.demo.tiny_flux2 import LATENT_CHANNELS, MISTRAL_DIM
from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = MISTRAL_DIM  # text_in_dim (ERNIE-Image: its Mistral-3's 2560)


def tiny_ernie_image(num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, seed: int = 0) -> ErnieImageTransformer2DModel:
    """A small ``ErnieImageTransformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    RoPE axes (text index, h, w) split ``head_dim`` 1/4, 3/8, 3/8 as the released (32, 48, 48) of
    128. Every parameter is perturbed (``tiny_video._perturb``; the stock zero-initialised
    modulation and output layers too).

    Raises:
        ValueError: ``head_dim`` is not a multiple of 16.
    """
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (three even RoPE axes), got {head_dim}")
    torch.manual_seed(seed)
    model = ErnieImageTransformer2DModel(
        hidden_size=num_heads * head_dim, num_attention_heads=num_heads, num_layers=num_layers,
        ffn_hidden_size=2 * num_heads * head_dim, in_channels=4 * LATENT_CHANNELS, out_channels=4 * LATENT_CHANNELS,
        patch_size=1, text_in_dim=TEXT_DIM, rope_axes_dim=(head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8),
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class ErnieImageInputs:
    """Keyword arguments of one ``ErnieImageTransformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, 4 * LATENT_CHANNELS, H, W)
    timestep: torch.Tensor  # (B,)
    text_bth: torch.Tensor  # (B, T, TEXT_DIM), zero rows past text_lens[b]
    text_lens: torch.Tensor  # (B,) long

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def ernie_image_inputs(height: int, width: int, text_lens: tuple[int, ...], seed: int = 0) -> ErnieImageInputs:
    """Seeded inputs for a ``height x width`` latent grid: one element per entry of ``text_lens``,
    each its own prompt (padded as the pipeline pads), latent and timestep."""
    g = torch.Generator().manual_seed(seed)
    batch, longest = len(text_lens), max(text_lens)
    text = torch.randn(batch, longest, TEXT_DIM, generator=g)
    valid = torch.arange(longest)[None, :] < torch.tensor(text_lens)[:, None]
    return ErnieImageInputs(
        hidden_states=torch.randn(batch, 4 * LATENT_CHANNELS, height, width, generator=g),
        timestep=torch.rand(batch, generator=g) * 1000, text_bth=text * valid[:, :, None],
        text_lens=torch.tensor(text_lens, dtype=torch.long),
    )


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_ernie_image_pipeline(seed: int = 0):
    """An ``ErnieImagePipeline`` of tiny random models (a 3-layer Mistral-3 text model, character
    tokenizer, Flux.2 VAE, transformer), float32 on CPU, no prompt enhancer.

    The VAE has 2 blocks: ``vae_scale_factor`` 4 (its 2x compression times the 2x2 patchify), so
    ``height x width`` gives ``(height / 4) * (width / 4)`` image tokens (20 x 28 -> 35).
    """
    from diffusers import ErnieImagePipeline, FlowMatchEulerDiscreteScheduler

    from usp_dit.demo.tiny_flux2 import tiny_flux2_vae, tiny_mistral3_text_encoder, tiny_mistral_tokenizer

    tokenizer = tiny_mistral_tokenizer()
    # The pipeline calls a Mistral3Model (hidden states, no LM head): the tiny model's own.
    text_encoder = tiny_mistral3_text_encoder(len(tokenizer), seed + 10).model
    return ErnieImagePipeline(
        transformer=tiny_ernie_image(seed=seed + 30), vae=tiny_flux2_vae(seed + 20), text_encoder=text_encoder,
        tokenizer=tokenizer, scheduler=FlowMatchEulerDiscreteScheduler(),
    )
