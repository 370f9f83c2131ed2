"""Diffusers integration: ``enable_usp`` / ``disable_usp`` and one adapter per model family.

Layout: each adapter module documents its own (tokens, RoPE tables, text handling).

Importing this package registers every adapter module present (``_ADAPTER_MODULES``) and gives every
``DiffusionPipeline`` the methods ``enable_usp(...)`` and ``disable_usp()``.
"""
from __future__ import annotations

import importlib

from usp_dit.pipelines.api import attach_pipeline_methods, disable_usp, enable_usp, install_failure_handler, is_usp_enabled
from usp_dit.pipelines.base import find_adapter, register_adapter

# Adapter modules register themselves on import. A family whose module is not in this checkout
# (adapters land one at a time) is skipped; any other import error is raised.
_ADAPTER_MODULES = ("flux", "cogvideox", "mochi")


def _import_adapters() -> None:
    for name in _ADAPTER_MODULES:
        module = f"{__name__}.{name}"
        try:
            importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name != module:
                raise


_import_adapters()
attach_pipeline_methods()

__all__ = ["disable_usp", "enable_usp", "find_adapter", "install_failure_handler", "is_usp_enabled", "register_adapter"]
