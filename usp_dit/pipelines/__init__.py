"""Diffusers integration: ``enable_usp`` / ``disable_usp`` and one adapter per model family.

Layout: each adapter module documents its own (tokens, RoPE tables, text handling).

Importing this package registers the adapters (Flux, Flux.2, Chroma, CogVideoX, Mochi, Wan, HunyuanVideo,
LTX-Video, Qwen-Image, SD3, SkyReels-V2: each module calls ``register_adapter`` on import; docs/COVERAGE.md
lists every Diffusers transformer class) and gives every ``DiffusionPipeline`` the methods
``enable_usp(...)`` and ``disable_usp()``.
"""
from __future__ import annotations

from usp_dit.pipelines import families  # noqa: F401  (registers every family's adapter)
from usp_dit.pipelines.api import attach_pipeline_methods, disable_usp, enable_usp, is_usp_enabled
from usp_dit.pipelines.base import find_adapter, register_adapter
from usp_dit.pipelines.failure import install_failure_handler

attach_pipeline_methods()

__all__ = ["disable_usp", "enable_usp", "find_adapter", "install_failure_handler", "is_usp_enabled", "register_adapter"]
