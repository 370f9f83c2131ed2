"""``pipe.enable_usp(...)`` after ``import usp_dit``, whichever of usp_dit and Diffusers is imported first.

Layout: no tensors.

Note [pipeline methods on import]
    ``import usp_dit`` loads the attention core alone: it must not import Diffusers (a user of
    ``usp_attention`` or the LLM drop-in may not have it, and importing it costs seconds). But a
    user who writes ``import usp_dit`` and then ``pipe.enable_usp(...)`` must not get Diffusers'
    bare "object has no attribute enable_usp". So ``import usp_dit`` gives ``DiffusionPipeline``
    (and ``ModularPipeline``, the same way) two thin methods, ``enable_usp`` and ``disable_usp``, that import the integration
    (``usp_dit.pipelines``) on their first call and then run its own methods, which replace them:
      * Diffusers' ``pipeline_utils`` (where ``DiffusionPipeline`` lives) already imported: the
        methods are set at once;
      * not yet imported: a one-shot import hook (a ``sys.meta_path`` finder for those modules)
        sets them right after Diffusers executes each, and removes itself after the last. Nothing else of
        Diffusers is imported early; ``import usp_dit`` alone still loads no Diffusers.
    ``import usp_dit.pipelines`` (what the quick start shows) attaches the full methods directly.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

# The modules that define the pipeline classes, and the class each defines: a ``DiffusionPipeline``
# and a modular one (``ModularPipeline``: FLUX.3, Wan-Animate-2, ...; Note [modular pipelines]).
_TARGETS = {
    "diffusers.pipelines.pipeline_utils": "DiffusionPipeline",
    "diffusers.modular_pipelines.modular_pipeline": "ModularPipeline",
}


def _enable_usp(self, *args: Any, **kwargs: Any) -> Any:
    """``usp_dit.enable_usp(pipe, ...)`` as a pipeline method (the integration loads on this first call)."""
    import usp_dit.pipelines  # attaches the full methods, replacing these

    return usp_dit.pipelines.enable_usp(self, *args, **kwargs)


def _disable_usp(self) -> None:
    """``usp_dit.disable_usp(pipe)`` as a pipeline method (the integration loads on this first call)."""
    import usp_dit.pipelines

    usp_dit.pipelines.disable_usp(self)


def _attach(module: ModuleType) -> None:
    """Give the module's pipeline class (``_TARGETS``) the thin methods, unless the integration
    already gave it its own."""
    cls = getattr(module, _TARGETS.get(module.__name__, ""), None)
    if cls is None:
        return
    for name, method in (("enable_usp", _enable_usp), ("disable_usp", _disable_usp)):
        if name not in vars(cls):
            setattr(cls, name, method)


class _AttachAfterExec(importlib.abc.Loader):
    """Wraps Diffusers' own loader of a ``_TARGETS`` module: runs it, then attaches the methods."""

    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        _attach(module)


class _PipelineUtilsFinder(importlib.abc.MetaPathFinder):
    """Finds the ``_TARGETS`` modules as the path finder would, with their loaders wrapped."""

    def __init__(self) -> None:
        self.pending = set(_TARGETS)

    def find_spec(self, fullname: str, path: Any, target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in self.pending:
            return None
        self.pending.discard(fullname)
        if not self.pending:
            _remove_finder()  # one shot per module: later imports (a reload) go the usual way
        spec = importlib.machinery.PathFinder.find_spec(fullname, path, target)
        if spec is not None and spec.loader is not None:
            spec.loader = _AttachAfterExec(spec.loader)
        return spec


def _remove_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _PipelineUtilsFinder)]


def install() -> None:
    """Note [pipeline methods on import]: attach now, or once Diffusers loads each pipeline class."""
    loaded = [sys.modules[name] for name in _TARGETS if name in sys.modules]
    for module in loaded:
        _attach(module)
    if len(loaded) < len(_TARGETS) and not any(isinstance(f, _PipelineUtilsFinder) for f in sys.meta_path):
        finder = _PipelineUtilsFinder()
        finder.pending -= {module.__name__ for module in loaded}
        sys.meta_path.insert(0, finder)
