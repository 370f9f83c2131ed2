"""Tiny randomly initialised Allegro transformers and an ``AllegroPipeline``, built in code.

Layout: latents (batch, LATENT_CHANNELS, frames, height, width), 2 x 2 latent pixels a token, one
frame a token in time: ``tokens = frames * (height / 2) * (width / 2)``, frame-major; T5 embeddings
(batch, 1, text_len, TEXT_DIM) (the pipeline's layout) with a 0/1 mask (batch, text_len);
timesteps (batch,); the RoPE argument ``((freqs_t, freqs_h, freqs_w), (pos_t, pos_h, pos_w))``: three
(cos, sin) tables over each axis's positions and three (1, tokens) position indices.

Nothing is downloaded: the T5 tokenizer is one over single characters (``tiny_chroma.tiny_t5``),
the T5 encoder, the 3D VAE and the transformer are built from small configs and seeded. Every
process that calls a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from diffusers import AllegroTransformer3DModel

from usp_dit.demo.tiny_chroma import TEXT_DIM
from usp_dit.demo.tiny_flux import LATENT_CHANNELS
from usp_dit.demo.tiny_video import _perturb

SPATIAL, TEMPORAL = 8, 4  # the tiny VAE's compression, as the release's


def tiny_allegro(num_heads: int = 4, head_dim: int = 24, num_layers: int = 2, seed: int = 0) -> AllegroTransformer3DModel:
    """A small ``AllegroTransformer3DModel`` (``num_heads * head_dim`` wide, patch 1 x 2 x 2), float32, eval.

    As the release's config: biased Q/K/V, tanh-GELU, no affine norms, adaLN-single, T5 caption
    projection, 3D RoPE over thirds of each head (``head_dim`` divisible by 6) with the release's
    interpolation scales. Every parameter is perturbed (``tiny_video._perturb``).
    """
    torch.manual_seed(seed)
    model = AllegroTransformer3DModel(
        patch_size=2, patch_size_t=1, num_attention_heads=num_heads, attention_head_dim=head_dim,
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=num_layers,
        cross_attention_dim=num_heads * head_dim, sample_height=8, sample_width=8, sample_frames=4,
        caption_channels=TEXT_DIM,
    )
    _perturb(model, seed + 1)
    return model.eval()


def allegro_rope(model: AllegroTransformer3DModel, frames: int, height: int, width: int) -> tuple:
    """``image_rotary_emb`` for ``frames x height x width`` tokens, as ``AllegroPipeline`` builds it."""
    from diffusers.models.embeddings import get_3d_rotary_pos_embed_allegro

    cfg = model.config
    freqs_t, freqs_h, freqs_w, grid_t, grid_h, grid_w = get_3d_rotary_pos_embed_allegro(
        embed_dim=cfg.attention_head_dim, crops_coords=((0, 0), (height, width)), grid_size=(height, width),
        temporal_size=frames,
        interpolation_scale=(cfg.interpolation_scale_t, cfg.interpolation_scale_h, cfg.interpolation_scale_w),
    )
    pos = torch.cartesian_prod(grid_t.long(), grid_h.long(), grid_w.long())  # (tokens, 3), frame-major
    pos = pos.reshape(-1, 3).transpose(0, 1).reshape(3, 1, -1).contiguous()
    return (freqs_t, freqs_h, freqs_w), tuple(pos)


@dataclass
class AllegroInputs:
    """Keyword arguments of one ``AllegroTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, LATENT_CHANNELS, F, 2 H, 2 W)
    encoder_hidden_states: torch.Tensor  # (B, 1, T, TEXT_DIM)
    timestep: torch.Tensor  # (B,)
    encoder_attention_mask: torch.Tensor | None  # (B, T) 0 / 1
    image_rotary_emb: tuple | None

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def allegro_inputs(
    model: AllegroTransformer3DModel, frames: int, height: int, width: int, prompt_lengths: list[int] | None,
    text_len: int = 6, batch: int = 2, seed: int = 0,
) -> AllegroInputs:
    """Seeded inputs for ``frames x height x width`` tokens: a different latent, prompt and timestep per
    batch element; ``prompt_lengths[b]``: element b's valid text tokens (a prefix mask, as the
    pipeline's right padding), ``None``: no mask; the pipeline's RoPE positions."""
    g = torch.Generator().manual_seed(seed)
    mask = None
    if prompt_lengths is not None:
        mask = (torch.arange(text_len)[None, :] < torch.tensor(prompt_lengths)[:, None]).long()
    return AllegroInputs(
        hidden_states=torch.randn(batch, LATENT_CHANNELS, frames, 2 * height, 2 * width, generator=g),
        encoder_hidden_states=torch.randn(batch, 1, text_len, TEXT_DIM, generator=g),
        timestep=torch.randint(0, 1000, (batch,), generator=g), encoder_attention_mask=mask,
        image_rotary_emb=allegro_rope(model, frames, height, width),
    )


def tiny_allegro_vae(num_frames: int, height: int, width: int, seed: int = 0):
    """A 4-level ``AutoencoderKLAllegro`` (8x in space, 4x in time, as released), its decode tile fitted to one
    ``num_frames x height x width`` video.

    The release decodes in overlapping tiles of 24 frames x 320 x 320 pixels (overlaps hard-coded
    for that size); a tiny video is smaller than one tile, so the tile is set to the whole video
    (no overlap), and slicing is on (the tiled decode takes one element at a time).
    """
    from diffusers import AutoencoderKLAllegro

    torch.manual_seed(seed)
    vae = AutoencoderKLAllegro(
        block_out_channels=(8, 16, 16, 16), down_block_types=("AllegroDownBlock3D",) * 4,
        up_block_types=("AllegroUpBlock3D",) * 4, temporal_downsample_blocks=(True, True, False, False),
        temporal_upsample_blocks=(False, True, True, False), latent_channels=LATENT_CHANNELS, layers_per_block=1,
        norm_num_groups=4, temporal_compression_ratio=TEMPORAL, scaling_factor=1.0,
    )
    latent_frames = math.ceil((num_frames - 1) / TEMPORAL) + 1 if num_frames % 2 else math.ceil(num_frames / TEMPORAL)
    vae.enable_tiling()
    vae.enable_slicing()
    vae.tile_overlap_t = vae.tile_overlap_h = vae.tile_overlap_w = 0
    vae.kernel = vae.stride = (latent_frames * TEMPORAL, height, width)
    return vae.eval()


def tiny_allegro_pipeline(num_frames: int = 9, height: int = 48, width: int = 80, max_text_len: int = 16,
                          seed: int = 0):
    """An ``AllegroPipeline`` of tiny random models (T5, the 3D VAE fitted to ``num_frames x height x
    width``, the transformer), float32 on CPU, with a DPM-Solver++ scheduler.

    8x VAE and 2 x 2 patches: ``height x width`` gives ``(height / 16) * (width / 16)`` tokens a
    latent frame (48 x 80 -> 3 x 5 = 15), ``num_frames`` (odd) ``(num_frames - 1) / 4 + 1`` latent
    frames (9 -> 3: 45 tokens). Call it with ``max_sequence_length <= max_text_len`` and
    ``clean_caption=False`` (it needs bs4 / ftfy), at that size and frame count (the pipeline
    checks sizes in multiples of 8).
    """
    from diffusers import AllegroPipeline, DPMSolverMultistepScheduler

    from usp_dit.demo.tiny_chroma import tiny_t5

    tokenizer, text_encoder = tiny_t5(max_text_len, seed + 10)
    return AllegroPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=tiny_allegro_vae(num_frames, height, width, seed + 20),
        transformer=tiny_allegro(seed=seed + 30), scheduler=DPMSolverMultistepScheduler(),
    )
