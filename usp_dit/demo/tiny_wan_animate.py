"""Tiny randomly initialised Wan Animate transformers, for tests.

Layout: latents (batch, 2 * latent_channels + 4, frames, height, width), frame 0 the reference
image's; pose latents (batch, latent_channels, frames - 1, height, width); face video in pixels
(batch, 3, face_frames, FACE_SIZE, FACE_SIZE) in [-1, 1]; text embeddings (batch, 512, text_dim);
CLIP image embeddings (batch, image_seq, image_dim); timestep (batch,).

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import WanAnimateTransformer3DModel

from usp_dit.demo.tiny_video import TEXT_DIM, _perturb
from usp_dit.demo.tiny_wan import I2V_TEXT_LEN, LATENT_CHANNELS

FACE_SIZE = 16  # the motion encoder's input resolution (512 in the release)


def tiny_wan_animate(num_heads: int = 4, head_dim: int = 16, seed: int = 0) -> WanAnimateTransformer3DModel:
    """A 2-layer ``WanAnimateTransformer3DModel`` with a face adapter after each block
    (``inject_face_latents_blocks=1``; every 5th in the release), CLIP image tokens through the
    added K/V cross-attention, float32, eval mode; every parameter perturbed, the face encoder's
    zero padding tokens included (``tiny_video._perturb``)."""
    torch.manual_seed(seed)
    model = WanAnimateTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=num_heads, attention_head_dim=head_dim,
        latent_channels=LATENT_CHANNELS, in_channels=2 * LATENT_CHANNELS + 4, out_channels=LATENT_CHANNELS,
        text_dim=TEXT_DIM, freq_dim=16, ffn_dim=96, num_layers=2, cross_attn_norm=True, image_dim=24,
        added_kv_proj_dim=num_heads * head_dim, rope_max_seq_len=32,
        motion_encoder_channel_sizes={"16": 8, "8": 8, "4": 8}, motion_encoder_size=FACE_SIZE, motion_style_dim=16,
        motion_dim=4, motion_encoder_dim=16, face_encoder_hidden_dim=16, face_encoder_num_heads=2,
        inject_face_latents_blocks=1, motion_encoder_batch_size=4,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class WanAnimateInputs:
    """Keyword arguments of one ``WanAnimateTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, 2 * latent_channels + 4, F, H, W)
    timestep: torch.Tensor  # (B,)
    encoder_hidden_states: torch.Tensor  # (B, 512, text_dim)
    encoder_hidden_states_image: torch.Tensor  # (B, image_seq, image_dim)
    pose_hidden_states: torch.Tensor  # (B, latent_channels, F - 1, H, W)
    face_pixel_values: torch.Tensor  # (B, 3, face_frames, FACE_SIZE, FACE_SIZE)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def face_frames_for(frames: int) -> int:
    """Face video frames that give ``frames`` latent frames: the face encoder's two stride-2 causal
    convs take 4k + 1 frames to k + 1, and the model prepends one zero position: 4 (frames - 2) + 1."""
    if frames < 2:
        raise ValueError(f"frames must be at least 2 (the reference frame and one more), got {frames}")
    return 4 * (frames - 2) + 1


def wan_animate_inputs(
    model: WanAnimateTransformer3DModel, frames: int, height: int, width: int, batch: int = 2, image_len: int = 5,
    seed: int = 0,
) -> WanAnimateInputs:
    """Seeded inputs for ``model`` (latent sizes, ``frames`` including the reference frame); a
    different prompt, image, pose, face video and timestep per batch element."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg.in_channels, frames, height, width, generator=g)
    text = torch.randn(batch, I2V_TEXT_LEN, cfg.text_dim, generator=g)
    image = torch.randn(batch, image_len, cfg.image_dim, generator=g)
    pose = torch.randn(batch, cfg.latent_channels, frames - 1, height, width, generator=g)
    face = torch.rand(batch, 3, face_frames_for(frames), FACE_SIZE, FACE_SIZE, generator=g) * 2 - 1
    timestep = torch.randint(0, 1000, (batch,), generator=g)
    return WanAnimateInputs(x, timestep, text, image, pose, face)
