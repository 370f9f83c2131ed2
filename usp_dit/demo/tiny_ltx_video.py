"""Tiny randomly initialised LTX-Video transformers and an ``LTXPipeline``, for tests and examples.

Layout: the transformer takes packed latents, video tokens (batch, seq, channels) with
``seq = frames * height * width`` of the latent (patch 1, frame-major as ``LTXPipeline._pack_latents``
orders them); text embeddings (batch, text_seq, text_dim) with their prompt mask (batch, text_seq),
1 = real token; timestep (batch,) or, as the image-to-video and condition pipelines pass it, one
per token (batch, seq); ``video_coords`` (batch, 3, seq) (frame, row, column of each token) for
the condition pipeline's RoPE.

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import LTXVideoTransformer3DModel

from usp_dit.demo.tiny_video import TEXT_DIM, _perturb, tiny_t5

LATENT_CHANNELS = 4  # the tiny stand-in for the real VAE's 128
# LTXPipeline's micro-condition at 25 fps with the real VAE's compression (8x in time, 32x in
# space): the RoPE coordinates' scale, (temporal_compression / frame_rate, spatial, spatial).
ROPE_INTERPOLATION_SCALE = (8 / 25, 32, 32)


def tiny_ltx_video(num_heads: int = 4, head_dim: int = 16, seed: int = 0) -> LTXVideoTransformer3DModel:
    """A 2-layer ``LTXVideoTransformer3DModel`` (``num_heads * head_dim`` wide; the cross-attention
    width equals it, as in the real model), float32, eval mode.

    Every parameter is perturbed with seeded noise (``tiny_video._perturb``): no weight or bias
    keeps a default constant that could hide a token on the wrong rank.
    """
    torch.manual_seed(seed)
    model = LTXVideoTransformer3DModel(
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, patch_size=1, patch_size_t=1,
        num_attention_heads=num_heads, attention_head_dim=head_dim, cross_attention_dim=num_heads * head_dim,
        num_layers=2, caption_channels=TEXT_DIM,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class LTXVideoInputs:
    """Keyword arguments of one ``LTXVideoTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, S, C)
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    timestep: torch.Tensor  # (B,) or (B, S)
    encoder_attention_mask: torch.Tensor  # (B, T), 1 = real prompt token
    num_frames: int  # latent sizes, for the RoPE grid
    height: int
    width: int
    rope_interpolation_scale: tuple[float, float, float] | None = ROPE_INTERPOLATION_SCALE
    video_coords: torch.Tensor | None = None  # (B, 3, S), replaces the grid above when given

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def ltx_video_inputs(
    model: LTXVideoTransformer3DModel, frames: int, height: int, width: int,
    valid: list[list[int]] | None = None, text_len: int = 9, per_token_timestep: bool = False,
    video_coords: bool = False, seed: int = 0,
) -> LTXVideoInputs:
    """Seeded inputs for a latent of ``frames x height x width`` (= tokens, patch 1); a different
    prompt, prompt mask and timestep per batch element.

    ``valid[b]``: positions of element b's real prompt tokens (default: element 0 with a hole,
    ``[0, 1, 3, 4, 5, 6]``, element 1 a prefix of 4); the batch size is ``len(valid)``.
    ``per_token_timestep``: (B, S) random per token with the first latent frame at 0, as the
    image-to-video pipeline conditions it. ``video_coords``: the condition pipeline's (B, 3, S)
    pixel coordinates of each token (latent grid x compression, frames / fps), element 1 shifted
    in time, as a conditioning video placed later would be.
    """
    cfg = model.config
    valid = valid if valid is not None else [[0, 1, 3, 4, 5, 6], [0, 1, 2, 3]]
    batch = len(valid)
    seq = frames * height * width
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, seq, cfg.in_channels, generator=g)
    text = torch.randn(batch, text_len, cfg.caption_channels, generator=g)
    mask = torch.zeros(batch, text_len)
    for b, positions in enumerate(valid):
        mask[b, positions] = 1.0
    if per_token_timestep:
        timestep = torch.rand(batch, seq, generator=g) * 1000
        timestep[:, : height * width] = 0.0  # the conditioning first frame
    else:
        timestep = torch.rand(batch, generator=g) * 1000
    coords = None
    if video_coords:
        grid = torch.stack(torch.meshgrid(
            torch.arange(frames), torch.arange(height), torch.arange(width), indexing="ij")).flatten(1).float()
        coords = (grid * torch.tensor([8.0, 32.0, 32.0])[:, None]).expand(batch, 3, seq).clone()
        coords[:, 0] = coords[:, 0] / 25.0
        coords[1:, 0] += 0.5
    return LTXVideoInputs(x, text, timestep, mask, frames, height, width, ROPE_INTERPOLATION_SCALE, coords)


# ---- whole pipelines -----------------------------------------------------------------------------


def tiny_ltx_video_vae(seed: int = 0):
    """An ``AutoencoderKLLTXVideo`` of ``LATENT_CHANNELS``: 32x spatial, 8x temporal compression, as
    the real one (patch 4, three down blocks that scale time and space), 8 channels wide."""
    from diffusers import AutoencoderKLLTXVideo

    torch.manual_seed(seed)
    return AutoencoderKLLTXVideo(
        latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8, 8), decoder_block_out_channels=(8, 8, 8),
        down_block_types=("LTXVideoDownBlock3D",) * 3, layers_per_block=(1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1), spatio_temporal_scaling=(True, True, True),
        decoder_spatio_temporal_scaling=(True, True, True), decoder_inject_noise=(False,) * 4,
        upsample_residual=(False,) * 3, upsample_factor=(1,) * 3, patch_size=4, patch_size_t=1,
    ).eval()


def tiny_ltx_video_pipeline(max_text_len: int = 16, seed: int = 0):
    """An ``LTXPipeline`` of tiny random models (T5 encoder, LTX VAE, transformer), float32.

    The pipeline batches classifier-free guidance: one transformer call per step of batch 2
    ([negative; positive]). VAE: 32x spatial, 8x temporal compression and patch 1, so
    ``height x width x num_frames`` (height and width multiples of 32, as the pipeline requires)
    gives ``((num_frames - 1) / 8 + 1) * (height / 32) * (width / 32)`` video tokens; e.g.
    96 x 160 x 17 frames -> 3 * 3 * 5 = 45 tokens. Call it with ``max_sequence_length <= max_text_len``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, LTXPipeline

    tokenizer, text_encoder = tiny_t5(max_text_len, seed + 10)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_image_seq_len=16, max_image_seq_len=256, base_shift=0.95, max_shift=2.05,
    )
    return LTXPipeline(
        scheduler=scheduler, vae=tiny_ltx_video_vae(seed + 20), text_encoder=text_encoder, tokenizer=tokenizer,
        transformer=tiny_ltx_video(seed=seed + 30),
    )
