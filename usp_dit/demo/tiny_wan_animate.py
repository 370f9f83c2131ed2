"""Tiny randomly initialised Wan Animate transformers and pipelines, for tests and the video example.

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


# ---- whole pipeline ------------------------------------------------------------------------------


def tiny_wan_animate_pipeline(max_text_len: int = I2V_TEXT_LEN, seed: int = 0):
    """A ``WanAnimatePipeline`` of tiny random models, float32: a T5 encoder (character tokenizer),
    the tiny CLIP vision tower (``tiny_chronoedit.tiny_clip_vision``: 17 image tokens of width 24,
    the transformer's ``image_dim``), the tiny Wan VAE (8x spatial, 4x temporal compression, 4
    latent channels) and a ``tiny_wan_animate`` transformer (face video of ``FACE_SIZE`` pixels).

    Call it with ``max_sequence_length=512`` (the stock processor's fixed text length). Without ftfy
    (the pipeline's prompt cleaning calls it unconditionally) pass ``prompt_embeds`` made by
    ``tiny_wan_vace.wan_prompt_embeds``. One segment of ``segment_frame_length = 4k + 1`` frames
    at ``height x width`` gives ``(k + 2) * (height / 16) * (width / 16)`` video tokens (the
    reference image's latent frame first), e.g. 5 frames of 48 x 80: 3 * 3 * 5 = 45.
    """
    from diffusers import UniPCMultistepScheduler, WanAnimatePipeline

    from usp_dit.demo.tiny_chronoedit import tiny_clip_vision
    from usp_dit.demo.tiny_video import tiny_t5
    from usp_dit.demo.tiny_wan import tiny_wan_vae

    tokenizer, text_encoder = tiny_t5(max_text_len, seed + 10)
    image_encoder, image_processor = tiny_clip_vision(seed + 50)
    return WanAnimatePipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=tiny_wan_vae(LATENT_CHANNELS, seed=seed + 20),
        # The release's scheduler class (UniPC on flow sigmas).
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0),
        image_processor=image_processor, image_encoder=image_encoder, transformer=tiny_wan_animate(seed=seed + 30),
    )


def wan_animate_videos(frames: int, height: int, width: int, replace: bool = False, seed: int = 0,
                       face_size: int = FACE_SIZE) -> dict:
    """Seeded ``WanAnimatePipeline`` conditioning in PIL (RGB noise; no preprocessing models):
    ``image`` (the character, ``height x width``), ``pose_video`` (``frames`` of ``height x width``),
    ``face_video`` (``frames`` of ``face_size`` squared: the motion encoder's size, which the
    pipeline resizes to) and, with ``replace``, ``background_video`` and a binary ``mask_video``
    (white: generate, black: keep)."""
    import numpy as np
    from PIL import Image

    rng = np.random.RandomState(seed)

    def noise(h: int, w: int) -> Image.Image:
        return Image.fromarray((rng.rand(h, w, 3) * 255).astype("uint8"))

    videos = {"image": noise(height, width), "pose_video": [noise(height, width) for _ in range(frames)],
              "face_video": [noise(face_size, face_size) for _ in range(frames)]}
    if replace:
        videos["background_video"] = [noise(height, width) for _ in range(frames)]
        videos["mask_video"] = [Image.fromarray(((rng.rand(height, width) > 0.5) * 255).astype("uint8")).convert("RGB")
                                for _ in range(frames)]
    return videos
