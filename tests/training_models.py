"""Tiny Flux, CogVideoX, Mochi, Wan and Qwen-Image transformers with training inputs, for the tests/test_training_*.py.

Layout: each model's own forward arguments (``kwargs``), its output ``out`` (batch, ...) and a
regression ``target`` of the same shape; loss = mean((out - target)^2).

A family whose adapter module is not in this checkout (adapters land one at a time) is listed in
``MISSING`` and its cases are skipped, not failed. Everything is seeded: every rank that builds a
case gets bit-identical weights and inputs.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any

import torch

FAMILIES = ("cogvideox", "flux", "mochi", "wan", "qwen_image")
_BUILDER_MODULES = {
    "cogvideox": ("usp_dit.pipelines.families.cogvideox", "usp_dit.demo.tiny_video"),
    "flux": ("usp_dit.pipelines.families.flux", "usp_dit.demo.tiny_flux"),
    "mochi": ("usp_dit.pipelines.families.mochi", "usp_dit.demo.tiny_video"),
    "wan": ("usp_dit.pipelines.families.wan", "usp_dit.demo.tiny_wan"),
    "qwen_image": ("usp_dit.pipelines.families.qwen_image", "usp_dit.demo.tiny_qwen_image"),
}


def _present(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


AVAILABLE = tuple(f for f in FAMILIES if all(_present(m) for m in _BUILDER_MODULES[f]))
MISSING = tuple(f for f in FAMILIES if f not in AVAILABLE)


@dataclass
class TrainingCase:
    """One model and one batch: ``model(**kwargs, return_dict=False)[0]`` is compared with ``target``."""

    model: torch.nn.Module
    kwargs: dict[str, Any]
    target: torch.Tensor
    num_tokens: int  # sequence tokens sharded over the ranks (video/image tokens, plus text for Flux)


def _target(out_shape: torch.Size, seed: int) -> torch.Tensor:
    return torch.randn(out_shape, generator=torch.Generator().manual_seed(1000 + seed))


def _cogvideox(seed: int) -> TrainingCase:
    from usp_dit.demo.tiny_video import cogvideox_inputs, tiny_cogvideox

    model = tiny_cogvideox("5b").train()  # RoPE table passed in: sliced like the tokens
    inputs = cogvideox_inputs(model, frames=3, height=6, width=6, batch=2, seed=seed)  # 27 tokens
    return TrainingCase(model, inputs.kwargs(), _target(inputs.hidden_states.shape, seed), 27)


def _flux(seed: int) -> TrainingCase:
    from usp_dit.demo.tiny_flux import flux_inputs, tiny_flux_transformer

    model = tiny_flux_transformer().train()
    kwargs = flux_inputs(batch=2, height=6, width=5, text_len=7, seed=seed)  # 30 image + 7 text = 37 tokens
    kwargs["guidance"] = torch.full((2,), 3.5)
    return TrainingCase(model, kwargs, _target(kwargs["hidden_states"].shape, seed), 37)


def _mochi(seed: int) -> TrainingCase:
    from usp_dit.demo.tiny_video import mochi_inputs, tiny_mochi

    model = tiny_mochi().train()
    inputs = mochi_inputs(model, frames=3, height=6, width=6, valid=[6, 2], seed=seed)  # 27 tokens, padded prompts
    return TrainingCase(model, inputs.kwargs(), _target(inputs.hidden_states.shape, seed), 27)


def _wan(seed: int) -> TrainingCase:
    from usp_dit.demo.tiny_wan import tiny_wan, wan_inputs

    model = tiny_wan("t2v").train()  # FSDP2's units: its plan's block list, "blocks"
    inputs = wan_inputs(model, frames=3, height=6, width=10, seed=seed)  # 45 tokens, batch 2
    return TrainingCase(model, inputs.kwargs(), _target(inputs.hidden_states.shape, seed), 45)


def _qwen_image(seed: int) -> TrainingCase:
    from usp_dit.demo.tiny_qwen_image import qwen_image_inputs, tiny_qwen_image

    model = tiny_qwen_image().train()
    # 5 x 7 = 35 image tokens; two prompts, one with a hole and padding (masked text keys)
    inputs = qwen_image_inputs(model, [(1, 5, 7)], masks=[[1, 1, 0, 1, 1, 1, 0], [1] * 7], seed=seed)
    out_shape = (*inputs.hidden_states.shape[:2], model.config.out_channels * 4)
    return TrainingCase(model, inputs.kwargs(), _target(torch.Size(out_shape), seed), 35)


_BUILDERS = {"cogvideox": _cogvideox, "flux": _flux, "mochi": _mochi, "wan": _wan, "qwen_image": _qwen_image}


def build(family: str, seed: int = 0) -> TrainingCase:
    """The tiny ``family`` model in train mode and a batch drawn from ``seed`` (same on every rank)."""
    return _BUILDERS[family](seed)


def loss_of(case: TrainingCase) -> torch.Tensor:
    """mean((out - target)^2) over the full (gathered) output: the same scalar on every rank."""
    out = case.model(**case.kwargs, return_dict=False)[0]
    return (out - case.target).pow(2).mean()


def param_grads(case: TrainingCase) -> dict[str, torch.Tensor]:
    """``{name: grad}`` of ``loss_of(case)`` for every trainable parameter (zeros where unused); grads cleared."""
    case.model.zero_grad(set_to_none=True)
    loss_of(case).backward()
    grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
             for n, p in case.model.named_parameters() if p.requires_grad}
    case.model.zero_grad(set_to_none=True)
    return grads
