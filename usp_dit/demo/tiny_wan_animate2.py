"""Tiny randomly initialised Wan-Animate-2 transformers and one segment's inputs, for tests.

Layout: per-sample latents in Python lists, each (channels, frames, height, width) (latent sizes;
patches of 1 x 2 x 2): the reference pass's driving-video latents (LATENT_CHANNELS, F_r, H, W)
beside their conditioning (COND_CHANNELS, F_r, H, W); the generation pass's noisy latents
(LATENT_CHANNELS, F, H, W) beside theirs; text embeddings per sample (text_seq, text_dim), padded
to ``text_len`` by the model; CLIP image tokens (batch, image_seq, 1280); timestep (batch,).

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from unittest import mock

import torch
from diffusers import WanAnimate2Transformer3DModel
from diffusers.models.transformers import transformer_wan_animate_2 as stock
from diffusers.models.transformers.transformer_wan_animate_2 import WanAnimate2KVCache

from usp_dit.demo.tiny_video import _perturb

LATENT_CHANNELS = 4
COND_CHANNELS = 8  # the release: a 4-channel mask and 16 latent channels beside 16 noisy ones
TEXT_DIM = 32
TEXT_LEN = 16  # 512 in the release
CLIP_DIM = 1280  # fixed by the model's image projection (MLPProj(1280, dim))


def tiny_wan_animate2(num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, seed: int = 0,
                      refer_offset_w: int = -1, refer_stride: int = 1) -> WanAnimate2Transformer3DModel:
    """A ``num_layers``-layer ``WanAnimate2Transformer3DModel`` (``num_heads * head_dim`` wide) with
    CLIP image tokens, float32, eval mode, every parameter perturbed (``tiny_video._perturb``).
    ``refer_offset_w`` -1 (the release's): the reference's width offset is its grid width."""
    torch.manual_seed(seed)
    model = WanAnimate2Transformer3DModel(
        patch_size=(1, 2, 2), text_len=TEXT_LEN, in_dim=LATENT_CHANNELS + COND_CHANNELS, dim=num_heads * head_dim,
        ffn_dim=96, freq_dim=16, text_dim=TEXT_DIM, out_dim=LATENT_CHANNELS, num_heads=num_heads,
        num_layers=num_layers, use_img_emb=True, refer_offset_w=refer_offset_w, refer_stride=refer_stride,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass(frozen=True)
class SegmentShape:
    """One segment's grids, in patches (latent height and width are twice these)."""

    ref_frames: int  # F_r, reference (driving-video) latent frames
    frames: int  # F, generation latent frames (F_r + 1 in the pipeline: the reference image's slot first)
    height: int  # h = h_r, patches
    width: int
    origin_frames: int  # F0, the video geometry the block mask is built for (origin_len // 4 + 1)
    origin_hw: int  # HW0, patches per frame of that geometry (origin_area[0] * origin_area[1] // 256)

    @property
    def tokens(self) -> int:
        return self.frames * self.height * self.width

    @property
    def ref_tokens(self) -> int:
        return self.ref_frames * self.height * self.width

    def __str__(self) -> str:
        return f"r{self.ref_frames}f{self.frames}h{self.height}w{self.width}o{self.origin_frames}x{self.origin_hw}"


@dataclass
class SegmentInputs:
    """The two passes' arguments (``WanAnimate2Transformer3DModel.forward``), less the cache."""

    ref_latents: list[torch.Tensor]  # each (LATENT_CHANNELS, F_r, 2h, 2w)
    ref_condition: list[torch.Tensor]  # each (COND_CHANNELS, F_r, 2h, 2w)
    ref_text: list[torch.Tensor]  # each (text_seq, TEXT_DIM)
    latents: list[torch.Tensor]  # each (LATENT_CHANNELS, F, 2h, 2w)
    condition: list[torch.Tensor]  # each (COND_CHANNELS, F, 2h, 2w)
    text: list[torch.Tensor]
    negative_text: list[torch.Tensor]  # the unconditional calls' prompt embeds
    image: torch.Tensor  # (B, image_seq, CLIP_DIM)
    timestep: torch.Tensor  # (B,)
    shape: SegmentShape

    def extract(self, cache: WanAnimate2KVCache) -> dict:
        """Keyword arguments of the reference pass."""
        s = self.shape
        grid = torch.tensor([[s.ref_frames, s.height, s.width]] * len(self.ref_latents))
        return {"hidden_states": self.ref_latents, "timestep": self.timestep, "encoder_hidden_states": self.ref_text,
                    "condition_latents": self.ref_condition, "kv_cache": cache, "kv_cache_mode": "extract",
                    "seq_len": s.ref_tokens, "encoder_hidden_states_image": self.image, "offset_grid_sizes": grid}

    def cached(self, cache: WanAnimate2KVCache, is_uncondtion: bool = False) -> dict:
        """Keyword arguments of one generation call (``origin_len`` and ``origin_area`` give F0, HW0)."""
        s = self.shape
        grid = torch.tensor([[s.ref_frames, s.height, s.width]] * len(self.latents))
        return {"hidden_states": self.latents, "timestep": self.timestep, "encoder_hidden_states": self.negative_text if is_uncondtion else self.text,
                    "condition_latents": self.condition, "kv_cache": cache, "kv_cache_mode": "cached", "seq_len": s.tokens,
                    "encoder_hidden_states_image": self.image, "reference_grid_sizes": grid,
                    "origin_len": 4 * (s.origin_frames - 1), "origin_area": [16, 16 * s.origin_hw],
                    "is_uncondtion": is_uncondtion}


def segment_inputs(model: WanAnimate2Transformer3DModel, shape: SegmentShape, batch: int = 2,
                   seed: int = 0) -> SegmentInputs:
    """Seeded inputs of one segment: a different driving video, prompt and negative prompt (of
    different lengths), image and timestep per sample."""
    g = torch.Generator().manual_seed(seed)
    h, w = 2 * shape.height, 2 * shape.width

    def latents(channels: int, frames: int) -> list[torch.Tensor]:
        return [torch.randn(channels, frames, h, w, generator=g) for _ in range(batch)]

    def text() -> list[torch.Tensor]:
        return [torch.randn(7 + 3 * i, TEXT_DIM, generator=g) for i in range(batch)]

    return SegmentInputs(
        latents(LATENT_CHANNELS, shape.ref_frames), latents(COND_CHANNELS, shape.ref_frames), text(),
        latents(LATENT_CHANNELS, shape.frames), latents(COND_CHANNELS, shape.frames), text(), text(),
        torch.randn(batch, 5, CLIP_DIM, generator=g), torch.randint(0, 1000, (batch,), generator=g), shape)


@contextmanager
def eager_block_masks() -> Iterator[None]:
    """Stock's ``create_mask`` builds its BlockMask with ``create_block_mask(_compile=True)``: an
    inductor build of half a minute on CPU. Inside this, the same mask is built uncompiled (the same
    ``mask_mod`` evaluated directly: the same BlockMask), so a one-process reference stays cheap."""
    with mock.patch.object(stock, "create_block_mask", functools.partial(stock.create_block_mask, _compile=False)):
        yield


def run_segment(model: WanAnimate2Transformer3DModel, inputs: SegmentInputs, calls: int = 2) -> torch.Tensor:
    """The reference pass, then ``calls`` generation calls (alternately conditional and
    unconditional), under ``torch.no_grad``: every output's samples flattened into one vector."""
    cache = WanAnimate2KVCache(model.config.num_layers)
    outs = []
    with torch.no_grad(), eager_block_masks():
        outs += model(**inputs.extract(cache)).sample
        for i in range(calls):
            outs += model(**inputs.cached(cache, is_uncondtion=bool(i % 2))).sample
    return torch.cat([o.flatten() for o in outs])
