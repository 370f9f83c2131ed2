"""Tiny randomly initialised SkyReels-V2 transformers (the Wan-based family), for tests.

Layout: latents (batch, channels, frames, height, width); text embeddings (batch, text_seq,
text_dim); timestep (batch,) or, in diffusion forcing, one per latent frame (batch, frames).

Built from a seed, in code, with no download: every rank gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import SkyReelsV2Transformer3DModel

from usp_dit.demo.tiny_video import TEXT_DIM, _perturb

LATENT_CHANNELS = 4


def tiny_skyreels_v2(num_frame_per_block: int = 1, num_heads: int = 4, head_dim: int = 16, seed: int = 0,
                     inject_sample_info: bool = True) -> SkyReelsV2Transformer3DModel:
    """A 2-layer ``SkyReelsV2Transformer3DModel``, float32, eval mode, every parameter perturbed.

    ``num_frame_per_block`` > 1 is the diffusion-forcing models' block-causal attention (the model
    builds a frame-causal mask over its tokens); ``inject_sample_info`` adds the fps conditioning
    of the DF checkpoints.
    """
    torch.manual_seed(seed)
    model = SkyReelsV2Transformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=num_heads, attention_head_dim=head_dim,
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, text_dim=TEXT_DIM, freq_dim=16,
        ffn_dim=96, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32,
        inject_sample_info=inject_sample_info, num_frame_per_block=num_frame_per_block,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class SkyReelsInputs:
    """Keyword arguments of one ``SkyReelsV2Transformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, C, F, H, W)
    timestep: torch.Tensor  # (B,), or (B, F) with diffusion forcing
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    enable_diffusion_forcing: bool = False
    fps: list[int] | None = None

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def skyreels_inputs(model: SkyReelsV2Transformer3DModel, frames: int, height: int, width: int,
                    diffusion_forcing: bool, batch: int = 2, text_len: int = 9, seed: int = 0) -> SkyReelsInputs:
    """Random inputs; with ``diffusion_forcing`` one timestep per latent frame per element (each
    frame at its own noise level, as the DF pipelines schedule them)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, model.config.in_channels, frames, height, width, generator=g)
    text = torch.randn(batch, text_len, model.config.text_dim, generator=g)
    shape = (batch, frames) if diffusion_forcing else (batch,)
    timestep = torch.randint(0, 1000, shape, generator=g)
    fps = [0] * batch if model.config.inject_sample_info else None  # the pipelines pass 0 for 16 fps, 1 otherwise
    return SkyReelsInputs(x, timestep, text, diffusion_forcing, fps)


def skyreels_tokens(model: SkyReelsV2Transformer3DModel, frames: int, height: int, width: int) -> int:
    p_t, p_h, p_w = model.config.patch_size
    return (frames // p_t) * (height // p_h) * (width // p_w)
