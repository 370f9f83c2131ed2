"""The HTTP API's request bodies and their checks: a bad request is answered 400 here, on rank 0,
before any rank sees it.

Layout: no tensors. Bodies are JSON; a checked request becomes a ``Params`` (plain values).

Image requests follow OpenAI's ``POST /v1/images/generations`` (prompt, n, size "WIDTHxHEIGHT",
response_format ``b64_json``); the fields OpenAI defines that a diffusion pipeline has no use for
(quality, style, user, ...) are accepted and ignored. Extensions: seed, steps, guidance,
negative_prompt, lora (adapter name -> scale, Note [served LoRA]), and output_format "npy" (the
float32 array itself, for exact comparisons). Any
other field is refused (a misspelt "stpes" must not silently use the default).
"""
from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from usp_dit.serve.families import FAMILIES, CallShape, pixels_per_token

MAX_SEED = 2**63 - 1


class BadRequest(ValueError):
    """A request the server refuses (HTTP 400); the message names the field, its value and what is allowed."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=False)

    prompt: str = Field(min_length=1)
    model: str | None = None
    size: str | None = None
    seed: int | None = Field(default=None, ge=0, le=MAX_SEED)
    steps: int | None = None
    guidance: float | None = None
    negative_prompt: str | None = None
    lora: dict[str, float] | None = None  # adapter name -> scale (Note [served LoRA])
    user: str | None = None

    @field_validator("prompt")
    @classmethod
    def _not_blank(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("must not be blank")
        return value


class ImageBody(_Body):
    """``POST /v1/images/generations``."""

    n: int = 1
    response_format: Literal["b64_json"] = "b64_json"
    output_format: Literal["png", "npy"] = "png"
    # OpenAI's fields that change nothing here, accepted so that its clients' defaults pass.
    quality: str | None = None
    style: str | None = None
    background: str | None = None
    moderation: str | None = None
    output_compression: int | None = None


class VideoBody(_Body):
    """``POST /v1/videos`` (OpenAI's video API: prompt, model, seconds, size) and num_frames, fps."""

    seconds: float | str | None = None
    num_frames: int | None = None
    fps: int = Field(default=8, ge=1, le=60)


@dataclass(frozen=True)
class Limits:
    """What the server accepts; from its command line."""

    family: str
    tiny: bool
    max_batch: int
    max_side: int
    max_prompt_chars: int
    max_steps: int = 200
    max_frames: int = 129
    default_steps: int = 4
    model_id: str = "usp-dit"


@dataclass(frozen=True)
class Params:
    """One checked request: a ``CallShape`` (shared by the requests of a batch) and its own values."""

    shape: CallShape
    prompt: str
    seed: int
    n: int
    output_format: str = "png"
    fps: int = 8


def _validated(cls: type[BaseModel], body: object) -> BaseModel:
    if not isinstance(body, dict):
        raise BadRequest(f"the body must be a JSON object, got {type(body).__name__}")
    try:
        return cls.model_validate(body)
    except ValidationError as err:
        first = err.errors()[0]
        field = ".".join(str(p) for p in first["loc"]) or "body"
        value = first.get("input")
        shown = repr(value) if not isinstance(value, dict) else "the object"
        raise BadRequest(f"{field}: {first['msg']} (got {shown[:80]})", param=field) from None


def _size(text: str | None, limits: Limits) -> tuple[int, int]:
    """(width, height) from "WIDTHxHEIGHT"."""
    spec = FAMILIES[limits.family]
    if text is None or text == "auto":
        return spec.tiny_size if limits.tiny else spec.real_size
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise BadRequest(f"size {text!r} must be 'WIDTHxHEIGHT', e.g. '1024x1024'", param="size")
    width, height = int(parts[0]), int(parts[1])
    unit = pixels_per_token(limits.family, limits.tiny)
    for name, value in (("width", width), ("height", height)):
        if value < unit or value % unit or value > limits.max_side:
            raise BadRequest(f"size {text!r}: {name} {value} must be a multiple of {unit} (the model's pixels "
                             f"per token) between {unit} and {limits.max_side}", param="size")
    return width, height


def _common(body: _Body, limits: Limits) -> tuple[int, int, int, str]:
    """(width, height, steps, prompt) checked against ``limits``."""
    if body.model is not None and body.model != limits.model_id:
        raise BadRequest(f"model {body.model!r} is not served here; this server serves {limits.model_id!r}",
                         param="model")
    if len(body.prompt) > limits.max_prompt_chars:
        raise BadRequest(f"prompt: {len(body.prompt)} characters, at most {limits.max_prompt_chars} allowed",
                         param="prompt")
    if body.negative_prompt is not None and not FAMILIES[limits.family].negative_prompt:
        raise BadRequest(f"negative_prompt: the {limits.family} pipeline takes none (guidance-distilled)",
                         param="negative_prompt")
    if body.negative_prompt is not None and len(body.negative_prompt) > limits.max_prompt_chars:
        raise BadRequest(f"negative_prompt: {len(body.negative_prompt)} characters, at most "
                         f"{limits.max_prompt_chars} allowed", param="negative_prompt")
    steps = limits.default_steps if body.steps is None else body.steps
    if not 1 <= steps <= limits.max_steps:
        raise BadRequest(f"steps {steps} must be between 1 and {limits.max_steps}", param="steps")
    if body.guidance is not None and not 0 <= body.guidance <= 100:
        raise BadRequest(f"guidance {body.guidance} must be between 0 and 100", param="guidance")
    width, height = _size(body.size, limits)
    return width, height, steps, body.prompt


def _seed(body: _Body) -> int:
    # Chosen here, on rank 0, and sent to every rank: all ranks draw the same noise.
    return body.seed if body.seed is not None else random.randrange(2**31)


Resolve = Callable[[dict[str, float] | None], tuple[tuple[str, float], ...]]


def _no_lora(lora: dict[str, float] | None) -> tuple[tuple[str, float], ...]:
    if lora:
        raise BadRequest("lora: this server has no LoRA registry", param="lora")
    return ()


def check_image_request(body: object, limits: Limits, resolve_lora: Resolve = _no_lora) -> Params:
    """A ``POST /v1/images/generations`` body -> ``Params``; ``BadRequest`` (400) otherwise.
    ``resolve_lora`` checks the ``lora`` field against the server's adapters (``loras.Registry``)."""
    req = _validated(ImageBody, body)
    width, height, steps, prompt = _common(req, limits)
    if not 1 <= req.n <= limits.max_batch:
        raise BadRequest(f"n {req.n} must be between 1 and {limits.max_batch} (--max-batch)", param="n")
    shape = CallShape(width, height, 1, steps, req.guidance, req.negative_prompt, resolve_lora(req.lora))
    return Params(shape, prompt, _seed(req), req.n, req.output_format)


def check_video_request(body: object, limits: Limits, resolve_lora: Resolve = _no_lora) -> Params:
    """A ``POST /v1/videos`` body -> ``Params``; ``BadRequest`` (400) otherwise (and for an image family)."""
    spec = FAMILIES[limits.family]
    if not spec.videos:
        raise BadRequest(f"this server's model ({limits.family}) generates images, not videos", param="model")
    req = _validated(VideoBody, body)
    width, height, steps, prompt = _common(req, limits)
    step = spec.frames_step
    frames = req.num_frames
    if frames is None and req.seconds is not None:
        try:
            seconds = float(req.seconds)
        except ValueError:
            raise BadRequest(f"seconds {req.seconds!r} must be a number", param="seconds") from None
        frames = int(seconds * req.fps) // step * step + 1  # the longest k*step + 1 that fits
    frames = frames if frames is not None else 2 * step + 1
    if frames < 1 or (frames - 1) % step or frames > limits.max_frames:
        raise BadRequest(f"num_frames {frames} must be {step}k + 1 (the VAE's temporal compression) and at most "
                         f"{limits.max_frames}", param="num_frames")
    shape = CallShape(width, height, frames, steps, req.guidance, req.negative_prompt, resolve_lora(req.lora))
    return Params(shape, prompt, _seed(req), 1, "mp4", req.fps)
