"""Tiny randomly initialised Latte transformers and a ``LattePipeline``, built in code.

Layout: latents (batch, LATENT_CHANNELS, frames, height, width), 2 x 2 latent pixels a token per
frame: ``positions = (height / 2) * (width / 2)`` row-major, ``frames * positions`` tokens; T5
embeddings (batch, text_len, TEXT_DIM); timesteps (batch,); an optional key bias over the text
(batch * frames, 1, text_len), 0 = keep, -10000 = drop, as Latte's forward takes it. The output has
2 x LATENT_CHANNELS channels (noise and learned sigma, as the released Latte-1).

Nothing is downloaded: the T5 tokenizer is one over single characters (``tiny_chroma.tiny_t5``),
the T5 encoder, VAE and transformer are built from small configs and seeded. Every process that
calls a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import LatteTransformer3DModel

from usp_dit.demo.tiny_chroma import TEXT_DIM
from usp_dit.demo.tiny_flux import LATENT_CHANNELS
from usp_dit.demo.tiny_video import _perturb

LATTE_TEXT_LEN = 120  # LattePipeline pads every prompt to 120 T5 tokens (fixed in its encode_prompt)


def tiny_latte(
    video_length: int = 3, num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, seed: int = 0,
) -> LatteTransformer3DModel:
    """A small ``LatteTransformer3DModel`` (``num_heads * head_dim`` wide, patch 2), float32, eval mode.

    As Latte-1's config: adaLN-single blocks, biased Q/K/V, tanh-GELU, no affine norms, T5
    caption projection, learned sigma (2 x LATENT_CHANNELS out), a sin-cos position table per frame
    and a temporal one over ``video_length`` frames (a call must have exactly that many frames, as
    stock). ``sample_size`` 8: the position table is recomputed for another grid. Every parameter
    is perturbed (``tiny_video._perturb``: the zero-initialised ``scale_shift_table`` s too).
    """
    torch.manual_seed(seed)
    model = LatteTransformer3DModel(
        num_attention_heads=num_heads, attention_head_dim=head_dim, in_channels=LATENT_CHANNELS,
        out_channels=2 * LATENT_CHANNELS, num_layers=num_layers, cross_attention_dim=num_heads * head_dim,
        sample_size=8, patch_size=2, norm_type="ada_norm_single", caption_channels=TEXT_DIM,
        video_length=video_length, activation_fn="gelu-approximate", attention_bias=True,
        norm_elementwise_affine=False, norm_eps=1e-6, num_embeds_ada_norm=1000,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class LatteInputs:
    """Keyword arguments of one ``LatteTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, LATENT_CHANNELS, F, 2 H, 2 W)
    encoder_hidden_states: torch.Tensor  # (B, T, TEXT_DIM)
    timestep: torch.Tensor  # (B,)
    encoder_attention_mask: torch.Tensor | None  # (B * F, 1, T) 0 / -10000

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def latte_inputs(
    model: LatteTransformer3DModel, height: int, width: int, prompt_lengths: list[int] | None, text_len: int = 6,
    batch: int = 2, seed: int = 0,
) -> LatteInputs:
    """Seeded inputs for ``model``'s ``video_length`` frames of ``height x width`` positions: a different
    latent, prompt and timestep per batch element; ``prompt_lengths[b]``: element b's valid text
    tokens (a prefix, as the pipeline's right padding) as a key bias repeated over its frames,
    ``None``: no mask."""
    g = torch.Generator().manual_seed(seed)
    frames = model.config.video_length
    mask = None
    if prompt_lengths is not None:
        keep = torch.arange(text_len)[None, :] < torch.tensor(prompt_lengths)[:, None]  # (B, T)
        mask = ((~keep).float() * -10000.0).repeat_interleave(frames, dim=0)[:, None, :]  # (B * F, 1, T)
    return LatteInputs(
        hidden_states=torch.randn(batch, LATENT_CHANNELS, frames, 2 * height, 2 * width, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TEXT_DIM, generator=g),
        timestep=torch.randint(0, 1000, (batch,), generator=g), encoder_attention_mask=mask,
    )


def tiny_latte_pipeline(video_length: int = 3, max_text_len: int = LATTE_TEXT_LEN, seed: int = 0):
    """A ``LattePipeline`` of tiny random models (T5, a 4-level 8x VAE as the release's, the
    transformer), float32 on CPU, with a DDIM scheduler (the release's kind) without ``clip_sample``: the
    clip of an untrained model's x0 prediction leaves latents so small that stock's own rounding
    (a batch of 2 against two of 1) reaches 2e-5 of them.

    8x VAE and 2 x 2 patches: ``height x width`` gives ``(height / 16) * (width / 16)`` positions a
    frame (48 x 80 -> 3 x 5 = 15), ``video_length`` frames (the pipeline's ``video_length`` must be it:
    the VAE is an image VAE, one latent frame a frame). Call it with ``clean_caption=False`` (it needs
    bs4 / ftfy). ``max_text_len``: the tokenizer's length (the pipeline pads to 120 whatever it is).
    """
    from diffusers import DDIMScheduler, LattePipeline

    from usp_dit.demo.tiny_chroma import tiny_t5
    from usp_dit.demo.tiny_flux import tiny_vae

    transformer = tiny_latte(video_length, seed=seed + 30)
    tokenizer, text_encoder = tiny_t5(max(max_text_len, LATTE_TEXT_LEN), seed + 10)
    return LattePipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=tiny_vae(4, seed + 20), transformer=transformer,
        scheduler=DDIMScheduler(clip_sample=False),
    )
