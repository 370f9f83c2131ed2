"""The model families the server serves: what it must know of each before anything loads, and how it
calls the pipeline for a batch.

Layout: a batch's output is float32 in [0, 1], images (batch, height, width, 3) and videos
(batch, frames, height, width, 3).

The tiny pipelines are the examples' (``usp_dit.demo.tiny_<family>``, built in code, seeded: every
rank and every test process builds bit-identical weights). A video family serves images too: an
image is a one-frame video (Wan's VAE encodes the first frame on its own, so one frame is its
text-to-image mode).

Every family is called alike (``run_batch``): its differences are data in its ``ServedFamily`` row
(the guidance argument, the count argument, the tiny pipeline's text arguments), and
``load_pipeline`` checks, before the first request, that the pipeline's ``__call__`` names every
argument the server passes (``check_call``). tests/test_serve_families.py runs each family's
served call against its pipeline called directly.
"""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

TINY_TEXT_LEN = 64  # the tiny tokenizers spend one token per character: a prompt of at most 64 characters
# The tiny pipelines' fixed prompt text: HunyuanVideo's template without the real model's chat
# template (usp_dit.demo.tiny_hunyuan_video.TINY_PROMPT_TEMPLATE); Flux.2's stacked Mistral layers
# (usp_dit.demo.tiny_flux2.MISTRAL_LAYERS; FLUX.2-dev's are 10, 20, 30). Written here, not imported:
# this module loads before Diffusers (rank 0 checks requests with it).
TINY_HUNYUAN_PROMPT_TEMPLATE = {"template": "{}", "crop_start": 0}
TINY_FLUX2_LAYERS = (1, 2, 3)


@dataclass(frozen=True)
class ServedFamily:
    """What the server needs to know of a model family before anything loads."""

    pipeline: str  # the Diffusers pipeline class that --model loads
    videos: bool  # generates videos (and images as one-frame videos) rather than images alone
    tiny_pixels_per_token: int  # the tiny VAE's pixels per latent pixel x the patch side
    tiny_size: tuple[int, int]  # (width, height) of a request that gives no size, tiny pipeline
    guidance_arg: str = "guidance_scale"
    negative_prompt: bool = False  # the pipeline takes a negative prompt (CFG)
    frames_step: int = 1  # videos: num_frames must be frames_step * k + 1 (the VAE's temporal compression)
    tiny_max_side: int = 512  # the tiny transformer's position table (or a bound on CPU time), pixels
    tiny_kwargs: dict[str, Any] = field(default_factory=dict)  # the tiny builder's arguments
    real_size: tuple[int, int] = (1024, 1024)  # (width, height): the pipeline's own default
    count_arg: str = "num_images_per_prompt"
    real_pixels_per_token: int = 16  # 8 pixels per latent pixel (VAE) x a 2x2 patch, but LTX-Video's 32 x 1
    # "module:function" of the tiny builder in usp_dit.demo (default tiny_<family>:tiny_<family>_pipeline)
    tiny_builder: str | None = None
    # The tiny pipeline's extra call arguments: its text length (one token a character), or what
    # replaces the real model's prompt template.
    tiny_call: dict[str, Any] = field(default_factory=lambda: {"max_sequence_length": TINY_TEXT_LEN})


_TEXT = {"max_text_len": TINY_TEXT_LEN}
FAMILIES: dict[str, ServedFamily] = {
    "flux": ServedFamily("FluxPipeline", False, 16, (64, 64), tiny_kwargs={"vae_blocks": 4, **_TEXT}),
    # Flux.2 [dev]: guidance-distilled (the scale embedded); its chat template's system message is ~170 tokens.
    "flux2": ServedFamily("Flux2Pipeline", False, 4, (20, 12),
                          tiny_call={"max_sequence_length": 256, "text_encoder_out_layers": TINY_FLUX2_LAYERS}),
    # True CFG: two transformer calls a step when a negative prompt is given; the tiny prompt keeps
    # every token after the chat template's first 34 (~130 for 64 characters): no text length set.
    "qwen_image": ServedFamily("QwenImagePipeline", False, 16, (80, 48), guidance_arg="true_cfg_scale",
                               negative_prompt=True, tiny_call={}),
    "sd3": ServedFamily("StableDiffusion3Pipeline", False, 4, (44, 60), negative_prompt=True, tiny_max_side=64,
                        tiny_kwargs={"clip_len": TINY_TEXT_LEN}),
    # Z-Image: its Qwen3 chat template (~20 tokens) and the prompt.
    "zimage": ServedFamily("ZImagePipeline", False, 4, (20, 12), negative_prompt=True,
                           tiny_call={"max_sequence_length": 2 * TINY_TEXT_LEN}),
    "chroma": ServedFamily("ChromaPipeline", False, 4, (20, 12), negative_prompt=True, tiny_kwargs=_TEXT),
    "cogview4": ServedFamily("CogView4Pipeline", False, 16, (80, 48), negative_prompt=True, tiny_kwargs=_TEXT),
    # Lumina2's default system prompt (~150 characters) would fill the tiny tokenizer: a short one.
    "lumina2": ServedFamily("Lumina2Pipeline", False, 16, (80, 48), negative_prompt=True,
                            tiny_kwargs={"max_text_len": 2 * TINY_TEXT_LEN},
                            tiny_call={"max_sequence_length": 2 * TINY_TEXT_LEN, "system_prompt": "draw"}),
    # Sana's DC-AE: 32 pixels per latent pixel, patch 1. The tiny one drops the real model's ~1000-character
    # chat instruction and its size bins.
    "sana": ServedFamily("SanaPipeline", False, 32, (96, 64), negative_prompt=True, tiny_kwargs=_TEXT,
                         real_pixels_per_token=32,
                         tiny_call={"max_sequence_length": TINY_TEXT_LEN, "complex_human_instruction": None,
                                    "use_resolution_binning": False}),
    # The tiny AuraFlow's learned position table covers 16 x 16 tokens.
    "auraflow": ServedFamily("AuraFlowPipeline", False, 4, (20, 12), negative_prompt=True, tiny_max_side=64,
                             tiny_kwargs=_TEXT),
    # Bria: the tiny VAE is 2x, but the pipeline resizes sides that are not multiples of 8 pixels.
    "bria": ServedFamily("BriaPipeline", False, 8, (24, 16), negative_prompt=True, tiny_kwargs=_TEXT),
    "krea2": ServedFamily("Krea2Pipeline", False, 16, (80, 48), negative_prompt=True),
    # Ovis-Image: its system prompt is ~150 characters; 256 is the pipeline's most.
    "ovis_image": ServedFamily("OvisImagePipeline", False, 4, (20, 12), negative_prompt=True,
                               tiny_call={"max_sequence_length": 256}),
    "wan": ServedFamily("WanPipeline", True, 16, (80, 48), negative_prompt=True, frames_step=4, tiny_kwargs=_TEXT,
                        real_size=(832, 480), count_arg="num_videos_per_prompt"),
    # Kandinsky 5 T2V: HunyuanVideo's VAE class; two calls a step (the prompt's, the negative prompt's).
    "kandinsky5": ServedFamily("Kandinsky5T2VPipeline", True, 16, (80, 48), negative_prompt=True, frames_step=4,
                               real_size=(768, 512), count_arg="num_videos_per_prompt"),
    # AnyFlow: CFG fused into the released weights (its default guidance 1); a guidance above 1 batches CFG.
    "anyflow": ServedFamily("AnyFlowPipeline", True, 16, (80, 48), negative_prompt=True, frames_step=4,
                            tiny_kwargs=_TEXT, real_size=(832, 480), count_arg="num_videos_per_prompt"),
    # HunyuanVideo T2V: guidance-distilled (the embedded scale); true CFG is not served.
    "hunyuan_video": ServedFamily("HunyuanVideoPipeline", True, 16, (80, 48), frames_step=4, tiny_kwargs=_TEXT,
                                  real_size=(1280, 720), count_arg="num_videos_per_prompt",
                                  tiny_call={"max_sequence_length": TINY_TEXT_LEN,
                                             "prompt_template": TINY_HUNYUAN_PROMPT_TEMPLATE}),
    # LTX-Video: a 32x VAE (the tiny one too), patch 1, 8 frames a latent frame; batched CFG.
    "ltx_video": ServedFamily("LTXPipeline", True, 32, (96, 64), negative_prompt=True, frames_step=8,
                              tiny_kwargs=_TEXT, real_size=(704, 512), count_arg="num_videos_per_prompt",
                              real_pixels_per_token=32),
    # CogVideoX: its VAE decodes latent frames of 4 in pairs, so only 8k + 1 frames come back as asked.
    "cogvideox": ServedFamily("CogVideoXPipeline", True, 16, (80, 48), negative_prompt=True, frames_step=8,
                              tiny_kwargs=_TEXT, real_size=(720, 480), count_arg="num_videos_per_prompt",
                              tiny_builder="tiny_video:tiny_cogvideox_pipeline"),
}


def pixels_per_token(family: str, tiny: bool) -> int:
    """Widths and heights must be multiples of this: the VAE's compression x the patch."""
    spec = FAMILIES[family]
    return spec.tiny_pixels_per_token if tiny else spec.real_pixels_per_token


def load_pipeline(family: str, model: str | None, device: torch.device):
    """``model`` from disk (bf16 on GPUs), or the family's tiny random pipeline in float32.

    Raises ``NotImplementedError`` when the pipeline's ``__call__`` lacks an argument the server
    passes (``check_call``): before the first request, not at it.
    """
    spec = FAMILIES[family]
    if model is None:
        module, function = (spec.tiny_builder or f"tiny_{family}:tiny_{family}_pipeline").split(":")
        pipe = getattr(importlib.import_module(f"usp_dit.demo.{module}"), function)(**spec.tiny_kwargs).to(device)
    else:
        import diffusers

        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        pipe = getattr(diffusers, spec.pipeline).from_pretrained(model, torch_dtype=dtype).to(device)
    check_call(pipe, family, model is None)
    return pipe


def served_arguments(family: str, tiny: bool) -> set[str]:
    """Every argument ``run_batch`` may pass to the family's pipeline."""
    spec = FAMILIES[family]
    names = {"prompt", "height", "width", "num_inference_steps", "generator", "output_type", "callback_on_step_end",
             "callback_on_step_end_tensor_inputs", spec.count_arg, spec.guidance_arg}
    names |= {"negative_prompt"} if spec.negative_prompt else set()
    names |= {"num_frames"} if spec.videos else set()
    return names | (set(spec.tiny_call) if tiny else set())


def check_call(pipe, family: str, tiny: bool) -> None:
    """Raise ``NotImplementedError`` naming the arguments the server would pass that ``pipe`` lacks."""
    # Named parameters only: a pipeline that swallows unknown keywords (``**kwargs``, PixArt's) would
    # drop callback_on_step_end, and with it the step ends every rank agrees at.
    params = inspect.signature(type(pipe).__call__).parameters
    missing = sorted(served_arguments(family, tiny) - set(params))
    if missing:
        raise NotImplementedError(f"--family {family}: {type(pipe).__name__}.__call__ takes no {', '.join(missing)}, "
                                  f"which the server passes (usp_dit/serve/families.py FAMILIES)")


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
    kwargs: dict[str, Any] = dict(spec.tiny_call) if tiny else {}
    if shape.guidance is not None:
        kwargs[spec.guidance_arg] = shape.guidance
    if shape.negative_prompt is not None:
        # One a prompt: the pipelines take a list of the prompts' length (Z-Image's takes nothing else).
        kwargs["negative_prompt"] = [shape.negative_prompt] * len(prompts)
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
