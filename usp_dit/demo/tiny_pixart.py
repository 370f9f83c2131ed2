"""Tiny randomly initialised PixArt transformers and PixArt-Sigma / PixArt-Alpha pipelines, built in code.

Layout: latents (batch, LATENT_CHANNELS, height, width), 2 x 2 latent pixels a token: ``tokens =
(height / 2) * (width / 2)``, row-major; T5 embeddings (batch, text_len, TEXT_DIM) with a 0/1 mask
(batch, text_len); timesteps (batch,); PixArt-Alpha's ``added_cond_kwargs``: resolution (batch, 2)
and aspect ratio (batch, 1). The output has 2 x LATENT_CHANNELS channels (noise and learned sigma,
as the released models).

Nothing is downloaded: the T5 tokenizer is one over single characters (``tiny_chroma.tiny_t5``),
the T5 encoder, VAE and transformer are built from small configs and seeded. Every process that
calls a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import PixArtTransformer2DModel

from usp_dit.demo.tiny_chroma import TEXT_DIM
from usp_dit.demo.tiny_flux import LATENT_CHANNELS
from usp_dit.demo.tiny_video import _perturb

VARIANTS = ("sigma", "alpha")


def tiny_pixart(
    variant: str = "sigma", num_heads: int = 4, head_dim: int = 24, num_layers: int = 2, seed: int = 0,
) -> PixArtTransformer2DModel:
    """A small ``PixArtTransformer2DModel`` (``num_heads * head_dim`` wide, patch 2), float32, eval mode.

    ``"sigma"``: PixArt-Sigma-like (timestep only); ``"alpha"``: PixArt-Alpha 1024-like (the
    resolution and aspect-ratio embeddings of ``added_cond_kwargs``). Both: T5 caption projection,
    learned sigma (2 x LATENT_CHANNELS out), a sin-cos position table. The width must divide by 3
    (Alpha's size embeddings are a third of it each, as 1152 = 3 x 384 in the released models). Every parameter is perturbed
    (``tiny_video._perturb``: the zero-initialised ``scale_shift_table`` s too). Alpha's
    ``sample_size`` is 128 as the released 1024 one's: ``PixArtAlphaPipeline`` passes the size
    conditions only then (the position table is recomputed for the call's grid either way).

    Raises:
        ValueError: an unknown ``variant``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}; use one of {VARIANTS}")
    torch.manual_seed(seed)
    model = PixArtTransformer2DModel(
        num_attention_heads=num_heads, attention_head_dim=head_dim, in_channels=LATENT_CHANNELS,
        out_channels=2 * LATENT_CHANNELS, num_layers=num_layers, cross_attention_dim=num_heads * head_dim,
        sample_size=128 if variant == "alpha" else 8, patch_size=2, caption_channels=TEXT_DIM, interpolation_scale=1,
        use_additional_conditions=variant == "alpha",
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class PixArtInputs:
    """Keyword arguments of one ``PixArtTransformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, LATENT_CHANNELS, 2 H, 2 W)
    encoder_hidden_states: torch.Tensor  # (B, T, TEXT_DIM)
    timestep: torch.Tensor  # (B,)
    encoder_attention_mask: torch.Tensor | None  # (B, T) 0 / 1
    added_cond_kwargs: dict  # {"resolution": (B, 2) | None, "aspect_ratio": (B, 1) | None}

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def pixart_inputs(
    model: PixArtTransformer2DModel, height: int, width: int, prompt_lengths: list[int] | None, text_len: int = 6,
    batch: int = 2, seed: int = 0,
) -> PixArtInputs:
    """Seeded inputs for a ``height x width`` token grid: a different latent, prompt and timestep
    (and Alpha's resolution and aspect ratio) per batch element; ``prompt_lengths[b]``: element b's
    valid text tokens (a prefix mask, as the pipeline's right padding), ``None``: no mask."""
    g = torch.Generator().manual_seed(seed)
    mask = None
    if prompt_lengths is not None:
        mask = (torch.arange(text_len)[None, :] < torch.tensor(prompt_lengths)[:, None]).long()
    cond = {"resolution": None, "aspect_ratio": None}
    if model.config.use_additional_conditions:
        cond = {"resolution": torch.rand(batch, 2, generator=g) * 1024, "aspect_ratio": torch.rand(batch, 1, generator=g)}
    return PixArtInputs(
        hidden_states=torch.randn(batch, LATENT_CHANNELS, 2 * height, 2 * width, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TEXT_DIM, generator=g),
        timestep=torch.randint(0, 1000, (batch,), generator=g), encoder_attention_mask=mask,
        added_cond_kwargs=cond,
    )


def tiny_pixart_pipeline(variant: str = "sigma", max_text_len: int = 16, seed: int = 0):
    """A ``PixArtSigmaPipeline`` (``"sigma"``) or ``PixArtAlphaPipeline`` (``"alpha"``) of tiny random
    models (T5, a 3-level VAE, the transformer), float32 on CPU, with a DPM-Solver++ scheduler.

    VAE 4x compression and 2 x 2 patches: ``height x width`` gives ``(height / 8) * (width / 8)``
    image tokens (40 x 56 -> 5 x 7 = 35; the pipelines take sides in multiples of 8). Call it with ``max_sequence_length <= max_text_len`` (Sigma),
    ``clean_caption=False`` (it needs bs4 / ftfy) and ``use_resolution_binning=False`` (the bins are
    the real models' sizes).

    Raises:
        ValueError: an unknown ``variant``.
    """
    from diffusers import DPMSolverMultistepScheduler, PixArtAlphaPipeline, PixArtSigmaPipeline

    from usp_dit.demo.tiny_chroma import tiny_t5
    from usp_dit.demo.tiny_flux import tiny_vae

    transformer = tiny_pixart(variant, seed=seed + 30)  # raises on an unknown variant
    tokenizer, text_encoder = tiny_t5(max_text_len, seed + 10)
    cls = PixArtSigmaPipeline if variant == "sigma" else PixArtAlphaPipeline
    return cls(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=tiny_vae(3, seed + 20), transformer=transformer,
        scheduler=DPMSolverMultistepScheduler(),
    )
