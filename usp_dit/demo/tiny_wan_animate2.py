"""Tiny randomly initialised Wan-Animate-2 transformers and one segment's inputs, for tests; and
Diffusers' stock modular core denoise step around them (``tiny_wan_animate2_denoise``) with the
inputs of its call (``wan_animate2_denoise_inputs``: pixels (1, 3, frames, height, width)).

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


# ---- the stock modular core denoise step ----------------------------------------------------------

SEGMENT_FRAMES = 5  # frames of a segment (81 in the release): (5 - 1) / 4 + 1 = 2 latent frames
PIPELINE_SIZE = (48, 80)  # pixels: latents 6 x 10, patches 3 x 5 = 15 a frame


def tiny_wan_animate2_denoise(seed: int = 0, guidance_scale: float = 3.0):
    """The stock modular ``WanAnimate2CoreDenoiseStep`` as a pipeline (``WanAnimate2ModularPipeline``:
    the segment loop of VAE-encoding the driving slice and the previous segment's tail, noise,
    reference pass, guided denoising, decode) around tiny random models, float32: the transformer
    of ``tiny_wan_animate2``, the ``AutoencoderKLWan`` of ``tiny_wan.tiny_wan_vae`` (8x spatial,
    4x temporal, ``LATENT_CHANNELS`` latents: 4 + 4 mask channels make ``COND_CHANNELS``), a
    flow-matching Euler scheduler (the blocks pass ``generator=`` to ``scheduler.step``, which
    Wan's UniPC does not take; Euler takes it and, without stochastic sampling, draws nothing) and
    a ``ClassifierFreeGuidance`` guider (``guidance_scale`` > 1: two transformer calls a step, the
    unconditional one with ``is_uncondtion=True``). Call it with ``wan_animate2_denoise_inputs()``."""
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler
    from diffusers.modular_pipelines.wan_animate_2.modular_blocks_wan_animate_2 import WanAnimate2CoreDenoiseStep

    from usp_dit.demo.tiny_video import quiet_diffusers_log
    from usp_dit.demo.tiny_wan import tiny_wan_vae

    with quiet_diffusers_log():
        pipe = WanAnimate2CoreDenoiseStep().init_pipeline()
        pipe.update_components(
            transformer=tiny_wan_animate2(seed=seed), vae=tiny_wan_vae(LATENT_CHANNELS, seed=seed + 20),
            scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
            guider=ClassifierFreeGuidance(guidance_scale=guidance_scale),
        )
    return pipe


def wan_animate2_denoise_inputs(num_segments: int = 2, seed: int = 0,
                                size: tuple[int, int] = PIPELINE_SIZE) -> dict:
    """Seeded keyword arguments of ``tiny_wan_animate2_denoise()``'s call, as the stock encoder
    steps would hand them over, at ``size`` (height, width: multiples of 16; the shapes below are
    the default's) with ``SEGMENT_FRAMES``-frame segments that
    carry one frame over (so ``num_segments`` segments span 4 * num_segments + 1 driving frames, and
    each segment after the first conditions on the previous one's decoded last frame):

      reference_image_latents   (4 + LATENT_CHANNELS, 1, 6, 10): the i2v mask of one frame over
                                random reference-image latents;
      driving_video_pixels      (1, 3, 4 * num_segments + 1, 48, 80) in [-1, 1];
      condition_clip_context    (1, 5, CLIP_DIM): the reference pass's CLIP tokens (the driving
                                video's first frame); ``denoiser_input_fields`` carries the
                                generation calls' (the reference image's, 7 tokens);
      prompt_ref_embeds, prompt_embeds, negative_prompt_embeds: (1, 6 | 9 | 4, TEXT_DIM).

    Generation grid 3 x 3 x 5 = 45 tokens, reference grid 2 x 3 x 5 = 30 (the video geometry of
    the block mask equal to both: F0 = 2, HW0 = 15)."""
    from diffusers.modular_pipelines.wan_animate_2.encoders import get_i2v_mask

    g = torch.Generator().manual_seed(seed)
    height, width = size
    latent_h, latent_w = height // 8, width // 8
    carried = 1
    effective = SEGMENT_FRAMES - carried
    mask = get_i2v_mask(1, latent_h, latent_w, 1, device="cpu")  # (4, 1, h, w)
    return dict(
        reference_image_latents=torch.cat([mask, torch.randn(LATENT_CHANNELS, 1, latent_h, latent_w, generator=g)]),
        driving_video_pixels=torch.rand(1, 3, effective * num_segments + carried, height, width, generator=g) * 2 - 1,
        num_segments=num_segments, effective_segment=effective, prev_segment_conditioning_frames=carried,
        segment_frame_length=SEGMENT_FRAMES, height=height, width=width,
        condition_clip_context=torch.randn(1, 5, CLIP_DIM, generator=g),
        denoiser_input_fields={"encoder_hidden_states_image": torch.randn(1, 7, CLIP_DIM, generator=g)},
        prompt_ref_embeds=torch.randn(1, 6, TEXT_DIM, generator=g),
        prompt_embeds=torch.randn(1, 9, TEXT_DIM, generator=g),
        negative_prompt_embeds=torch.randn(1, 4, TEXT_DIM, generator=g),
    )
