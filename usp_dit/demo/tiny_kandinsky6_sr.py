"""Tiny randomly initialised Kandinsky 6 SR transformers and pipelines (video super-resolution), for tests.

Layout: latents channels-last (batch, frames, height, width, 2 * 4 + 1): the noisy latent, the
anchor latent and the anchor mask on channels; timestep (batch,); the pipeline's input video
(batch, frames, 3, height, width) in [0, 1], ``1 + 4k`` frames. The token grid's height and
width (after the patch size) must be multiples of 8 (the model's 8 x 8 NABLA blocks), so a
sequence is a multiple of 64 tokens.

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import (
    FlowMatchEulerDiscreteScheduler,
    Kandinsky6SRPipeline,
    Kandinsky6SRTransformer3DModel,
    Kandinsky6SRVAE,
)

from usp_dit.demo.tiny_video import _perturb

LATENT_CHANNELS = 4  # the tiny stand-in for the K-VAE's 64


def tiny_kandinsky6_sr(
    num_heads: int = 4, head_dim: int = 16, num_visual_blocks: int = 2, threshold: float = 0.5,
    window: tuple[int, int, int] = (1, 1, 1), tile_sizes: tuple[tuple[int, int], ...] = ((128, 256),), seed: int = 0,
) -> Kandinsky6SRTransformer3DModel:
    """A ``Kandinsky6SRTransformer3DModel`` (``num_visual_blocks`` blocks, ``num_heads * head_dim``
    wide, patch (1, 1, 1) as the release), float32, eval mode.

    ``threshold`` (the release's 0.8) and ``window`` (its (11, 7, 7)) are small so that the NABLA
    mask drops blocks at a tiny grid (the release's window covers every block of a few-block grid).
    ``tile_sizes``: the pipeline's refined tile in pixels (the release's 512 x 512 and up); 128 x 256
    is 8 x 16 tokens a latent frame with the 16x VAE, two 64-token NABLA blocks.
    RoPE axes (frame, height, width) split ``head_dim`` 1:1.5:1.5 as the release's (16, 24, 24).
    Every parameter is perturbed with seeded noise (``tiny_video._perturb``): ``pooled_bias`` and
    the modulations too.

    Raises:
        ValueError: ``head_dim`` is not a multiple of 8.
    """
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 (three even RoPE axes, 2:3:3), got {head_dim}")
    frame_axis, spatial_axis = head_dim // 4, head_dim * 3 // 8
    torch.manual_seed(seed)
    model = Kandinsky6SRTransformer3DModel(
        in_visual_dim=LATENT_CHANNELS, out_visual_dim=LATENT_CHANNELS, time_dim=32, patch_size=(1, 1, 1),
        model_dim=num_heads * head_dim, ff_dim=96, num_visual_blocks=num_visual_blocks,
        axes_dims=(frame_axis, spatial_axis, spatial_axis), scale_factor=(1.0, 2.0, 2.0),
        nabla_threshold=threshold, nabla_window=window, tile_sizes=tile_sizes,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class Kandinsky6SRInputs:
    """Keyword arguments of one ``Kandinsky6SRTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, F, H, W, 2C + 1)
    timestep: torch.Tensor  # (B,)

    def kwargs(self) -> dict:
        return {"hidden_states": self.hidden_states, "timestep": self.timestep}


def kandinsky6_sr_inputs(frames: int, height: int, width: int, batch: int = 2, seed: int = 0) -> Kandinsky6SRInputs:
    """Seeded inputs: a different latent and timestep per element; the anchor mask channel 0 / 1.

    Raises:
        ValueError: ``height`` or ``width`` is not a multiple of 8 (the model's NABLA blocks).
    """
    if height % 8 or width % 8:
        raise ValueError(f"height and width must be multiples of 8 (NABLA's 8 x 8 blocks), got {height} x {width}")
    g = torch.Generator().manual_seed(seed)
    latents = torch.randn(batch, frames, height, width, 2 * LATENT_CHANNELS, generator=g)
    mask = (torch.rand(batch, frames, height, width, 1, generator=g) > 0.5).float()
    timestep = torch.rand(batch, generator=g) * 1000
    return Kandinsky6SRInputs(torch.cat([latents, mask], dim=-1), timestep)


def tiny_kandinsky6_sr_pipeline(seed: int = 0) -> Kandinsky6SRPipeline:
    """The stock ``Kandinsky6SRPipeline`` with ``tiny_kandinsky6_sr`` (one 128 x 256 tile size), a
    tiny ``Kandinsky6SRVAE`` (five levels of 8 channels: 16x spatial, 4x temporal, 4 latent
    channels; perturbed by 0.01 so its decode stays in range) and a flow-matching Euler scheduler;
    no latent upscaler (the 2x path resizes pixels). A 64 x 128 video at ``resolution_scale=2``
    is one tile: 8 x 16 tokens a latent frame."""
    vae = tiny_kandinsky6_sr_vae(seed)
    return Kandinsky6SRPipeline(transformer=tiny_kandinsky6_sr(seed=seed), vae=vae,
                                scheduler=FlowMatchEulerDiscreteScheduler())


def tiny_kandinsky6_sr_vae(seed: int = 0, std: float = 0.01) -> Kandinsky6SRVAE:
    """A tiny K-VAE (``Kandinsky6SRVAE``): five levels of 8 channels (16x spatial, 4x temporal, as
    released), ``LATENT_CHANNELS`` latent channels, built from ``seed``, every parameter perturbed by
    seeded noise of ``std`` (the norms' gains too); float32, eval mode."""
    torch.manual_seed(seed)
    vae = Kandinsky6SRVAE(latent_channels=LATENT_CHANNELS, encoder_block_out_channels=(8,) * 5,
                          decoder_block_out_channels=(8,) * 5, layers_per_block=1)
    _perturb(vae, seed + 2, std=std)
    return vae.eval()


def kandinsky6_sr_video(frames: int = 5, height: int = 64, width: int = 128, seed: int = 0) -> torch.Tensor:
    """A seeded low-resolution video (1, frames, 3, height, width) in [0, 1] for the pipeline.

    Raises:
        ValueError: ``frames`` is not 1 + 4k (the VAE's temporal factor).
    """
    if (frames - 1) % 4:
        raise ValueError(f"frames must be 1 + 4k, got {frames}")
    return torch.rand(1, frames, 3, height, width, generator=torch.Generator().manual_seed(seed))
