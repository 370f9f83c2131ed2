"""The model families the server serves: what it must know of each before anything loads, and how it
calls the pipeline for a batch.

Layout: a batch's output is float32 in [0, 1], images (batch, height, width, 3) and videos
(batch, frames, height, width, 3).

The tiny pipelines are the examples' (``usp_dit.demo.tiny_<family>``, built in code, seeded: every
rank and every test process builds bit-identical weights). A video family serves images too: an
image is a one-frame video (Wan's VAE encodes the first frame on its own, so one frame is its
text-to-image mode).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

REAL_PIXELS_PER_TOKEN = 16  # every real family here: 8 pixels per latent pixel (VAE), 2 x 2 latent pixels per token
TINY_TEXT_LEN = 64  # the tiny tokenizers spend one token per character: a prompt of at most 64 characters


@dataclass(frozen=True)
class ServedFamily:
    """What the server needs to know of a model family before anything loads."""

    pipeline: str  # the Diffusers pipeline class that --model loads
    videos: bool  # generates videos (and images as one-frame videos) rather than images alone
    tiny_pixels_per_token: int  # the tiny VAE's pixels per latent pixel x 2 (2x2 latent pixels a token)
    tiny_size: tuple[int, int]  # (width, height) of a request that gives no size, tiny pipeline
    guidance_arg: str = "guidance_scale"
    negative_prompt: bool = False  # the pipeline takes a negative prompt (CFG)
    frames_step: int = 1  # videos: num_frames must be frames_step * k + 1 (the VAE's temporal compression)
    tiny_max_side: int = 512  # the tiny transformer's position table (or a bound on CPU time), pixels
    tiny_kwargs: dict[str, Any] = field(default_factory=dict)  # the tiny builder's arguments
    real_size: tuple[int, int] = (1024, 1024)
    count_arg: str = "num_images_per_prompt"


FAMILIES: dict[str, ServedFamily] = {
    "flux": ServedFamily("FluxPipeline", False, 16, (64, 64), tiny_kwargs={"vae_blocks": 4, "max_text_len": TINY_TEXT_LEN}),
    "sd3": ServedFamily("StableDiffusion3Pipeline", False, 4, (44, 60), negative_prompt=True, tiny_max_side=64,
                        tiny_kwargs={"clip_len": TINY_TEXT_LEN}),
    "wan": ServedFamily("WanPipeline", True, 16, (80, 48), negative_prompt=True, frames_step=4,
                        tiny_kwargs={"max_text_len": TINY_TEXT_LEN}, real_size=(832, 480),
                        count_arg="num_videos_per_prompt"),
}


def pixels_per_token(family: str, tiny: bool) -> int:
    """Widths and heights must be multiples of this: the VAE's compression x the 2x2 patch."""
    return FAMILIES[family].tiny_pixels_per_token if tiny else REAL_PIXELS_PER_TOKEN


def load_pipeline(family: str, model: str | None, device: torch.device):
    """``model`` from disk (bf16 on GPUs), or the family's tiny random pipeline in float32."""
    spec = FAMILIES[family]
    if model is None:
        module = importlib.import_module(f"usp_dit.demo.tiny_{family}")
        return getattr(module, f"tiny_{family}_pipeline")(**spec.tiny_kwargs).to(device)
    import diffusers

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(diffusers, spec.pipeline).from_pretrained(model, torch_dtype=dtype).to(device)


@dataclass(frozen=True)
class CallShape:
    """What every request of a batch shares: the batching key (``usp_dit.serve.jobs``)."""

    width: int
    height: int
    num_frames: int  # 1 for an image
    steps: int
    guidance: float | None  # None: the pipeline's default
    negative_prompt: str | None
    lora: tuple[tuple[str, float], ...] = ()  # (adapter name, scale), sorted (Note [served LoRA])


def run_batch(pipe, family: str, tiny: bool, shape: CallShape, prompts: list[str], seeds: list[int],
              on_step: Callable[[int], None]) -> np.ndarray:
    """Run one batch: prompt i with ``torch.Generator().manual_seed(seeds[i])``.

    With a list of generators the pipeline draws element i's noise from generator i alone, so each
    element equals a call of that prompt alone with that seed (up to float rounding of the batched
    matmuls). ``on_step(i)`` is called at the end of denoising step i on every rank.

    Returns (batch, height, width, 3), or (batch, frames, height, width, 3) for a video family.
    """
    spec = FAMILIES[family]
    kwargs: dict[str, Any] = {}
    if tiny:
        kwargs["max_sequence_length"] = TINY_TEXT_LEN
    if shape.guidance is not None:
        kwargs[spec.guidance_arg] = shape.guidance
    if shape.negative_prompt is not None:
        kwargs["negative_prompt"] = shape.negative_prompt
    if spec.videos:
        kwargs["num_frames"] = shape.num_frames

    def callback(pipe_, step: int, timestep, callback_kwargs: dict) -> dict:
        on_step(step)
        return {}

    out = pipe(prompt=list(prompts), height=shape.height, width=shape.width, num_inference_steps=shape.steps,
               generator=[torch.Generator("cpu").manual_seed(s) for s in seeds], output_type="np",
               callback_on_step_end=callback, callback_on_step_end_tensor_inputs=[], **{spec.count_arg: 1},
               **kwargs)
    return np.asarray(out.frames if spec.videos else out.images, dtype=np.float32)
