"""Tiny randomly initialised Kandinsky 6 SR transformers (video super-resolution), for tests.

Layout: latents channels-last (batch, frames, height, width, 2 * 4 + 1): the noisy latent, the
anchor latent and the anchor mask on channels; timestep (batch,). The token grid's height and
width (after the patch size) must be multiples of 8 (the model's 8 x 8 NABLA blocks), so a
sequence is a multiple of 64 tokens.

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import Kandinsky6SRTransformer3DModel

from usp_dit.demo.tiny_video import _perturb

LATENT_CHANNELS = 4  # the tiny stand-in for the K-VAE's 64


def tiny_kandinsky6_sr(
    num_heads: int = 4, head_dim: int = 16, num_visual_blocks: int = 2, threshold: float = 0.5,
    window: tuple[int, int, int] = (1, 1, 1), seed: int = 0,
) -> Kandinsky6SRTransformer3DModel:
    """A ``Kandinsky6SRTransformer3DModel`` (``num_visual_blocks`` blocks, ``num_heads * head_dim``
    wide, patch (1, 1, 1) as the release), float32, eval mode.

    ``threshold`` (the release's 0.8) and ``window`` (its (11, 7, 7)) are small so that the NABLA
    mask drops blocks at a tiny grid (the release's window covers every block of a few-block grid).
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
        nabla_threshold=threshold, nabla_window=window,
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
