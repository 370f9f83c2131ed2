"""Imports run one way (docs/DESIGN.md, "Where things live"): the folders are the layers.

Every module of the package is parsed (no import is executed) and each ``import`` / ``from ...
import`` statement, at any depth (function-level and ``TYPE_CHECKING`` ones included: a type-only
import is still a dependency), is checked:
  * the layer order: a module imports only its own layer and those below it,
        distributed < kernels < sharding < attention < planner < pipelines (machinery, vae)
        < pipelines.families < pipelines (package, coverage) < training < llm < cli
        < demo, testing < serve < usp_dit (the public names);
  * no import circle anywhere in usp_dit, within a layer too;
  * kernels (``usp_dit.kernels.*``) import nothing of usp_dit outside ``usp_dit.kernels``: no
    ring, no mesh, no communication;
  * the attention core (distributed, sharding, attention) imports only torch, the standard library,
    itself and the kernels: no Diffusers, transformers or PEFT, and no integration.
"""
from __future__ import annotations

import ast
import functools
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "usp_dit"
CORE_PACKAGES = ("usp_dit.distributed", "usp_dit.sharding", "usp_dit.attention")
THIRD_PARTY_INTEGRATIONS = ("diffusers", "transformers", "peft", "accelerate")
# The layers, lowest first: a module's layer is that of the longest prefix naming it.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("usp_dit.distributed",),
    ("usp_dit.kernels",),
    ("usp_dit.sharding",),
    ("usp_dit.attention",),
    ("usp_dit.planner",),
    ("usp_dit.pipelines.",),  # the machinery (api, base, plan, routing, caches, ...) and vae/
    ("usp_dit.pipelines.families",),
    ("usp_dit.pipelines", "usp_dit.pipelines.coverage"),  # the package: registers the families
    ("usp_dit.training",),
    ("usp_dit.llm",),
    ("usp_dit.cli",),
    ("usp_dit.demo", "usp_dit.testing"),
    ("usp_dit.serve",),  # the server: FastAPI, uvicorn, prometheus-client are imported here only
    ("usp_dit",),
)


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of every module ``path`` imports (relative imports resolved)."""
    package = _module_name(path) if path.name == "__init__.py" else _module_name(path).rpartition(".")[0]
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names)  # "from pkg import module"
    return names


def _modules(prefix: str) -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if _module_name(p).startswith(prefix))


def _top(name: str) -> str:
    return name.split(".")[0]


@pytest.mark.parametrize("path", _modules("usp_dit.kernels"), ids=lambda p: _module_name(p))
def test_kernels_know_nothing_of_distribution(path):
    outside = sorted(n for n in _imports(path)
                     if _top(n) == "usp_dit" and n != "usp_dit" and not n.startswith("usp_dit.kernels"))
    assert not outside, f"{_module_name(path)} imports {outside}"


def _core_modules() -> list[Path]:
    return [p for prefix in CORE_PACKAGES for p in _modules(prefix)]


@pytest.mark.parametrize("path", _core_modules(), ids=lambda p: _module_name(p))
def test_the_core_needs_only_torch_and_the_kernels(path):
    imports = _imports(path)
    integrations = sorted(n for n in imports if _top(n) in THIRD_PARTY_INTEGRATIONS)
    assert not integrations, f"{_module_name(path)} imports {integrations}"
    upward = sorted(n for n in imports if _top(n) == "usp_dit" and n != "usp_dit"
                    and not n.startswith(("usp_dit.kernels", *CORE_PACKAGES)))
    assert not upward, f"{_module_name(path)} imports {upward}"


def test_the_rules_see_imports():
    """The parser finds what a rule must catch: a function-level import and a relative one."""
    ring = _imports(PACKAGE / "attention" / "ring.py")
    assert "usp_dit.kernels.protocol" in ring and "usp_dit.distributed.comm" in ring
    blockwise = _imports(PACKAGE / "testing" / "blockwise.py")
    assert "usp_dit.attention.ring" in blockwise  # the simulator moved out of kernels because of this import


def _fresh(code: str) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_usp_dit_loads_no_integration():
    """A fresh interpreter's ``import usp_dit`` leaves Diffusers, transformers and PEFT unloaded (so
    it patches no class); ``usp_dit.enable_usp`` loads the integration, which gives every
    DiffusionPipeline its ``enable_usp`` method. (One interpreter: the first line is printed
    before anything else is touched.)"""
    out = _fresh(
        "import sys, usp_dit; print(sorted(m for m in ('diffusers', 'transformers', 'peft') if m in sys.modules)); "
        "f = usp_dit.enable_usp; from diffusers import DiffusionPipeline; "
        "print(f.__module__, DiffusionPipeline.enable_usp.__name__)"
    )
    assert out.splitlines() == ["[]", "usp_dit.pipelines.api _pipe_enable_usp"], out


_ENABLE_TWICE = (
    "pipe = tiny_flux_pipeline(); mesh = pipe.enable_usp(); "
    "from usp_dit.pipelines import is_usp_enabled; on = is_usp_enabled(pipe.transformer); pipe.disable_usp(); "
    "print(type(mesh).__name__, on, is_usp_enabled(pipe.transformer), type(pipe).enable_usp.__name__)"
)


def test_pipe_enable_usp_after_import_usp_dit_with_diffusers_imported_first():
    """Issue 27, item 5: Diffusers first, then ``import usp_dit``: the pipeline has the methods at
    once (the integration itself loads on their first call) and they run enable and disable."""
    out = _fresh(
        "import sys; from diffusers import DiffusionPipeline; import usp_dit; "
        "print(DiffusionPipeline.enable_usp.__module__, 'usp_dit.pipelines' in sys.modules); "
        "from usp_dit.demo.tiny_flux import tiny_flux_pipeline; " + _ENABLE_TWICE
    )
    assert out.splitlines() == ["usp_dit._pipeline_methods False", "USPMesh True False _pipe_enable_usp"], out


def test_pipe_enable_usp_after_import_usp_dit_with_diffusers_imported_after():
    """``import usp_dit`` first (no Diffusers loaded by it), then Diffusers: the one-shot import hook
    gives ``DiffusionPipeline`` and ``ModularPipeline`` the methods as Diffusers defines each, and
    then leaves ``sys.meta_path``."""
    out = _fresh(
        "import sys, usp_dit; print('diffusers' in sys.modules); from diffusers import FluxPipeline; "
        "from diffusers.modular_pipelines import Flux3ModularPipeline; "
        "print(FluxPipeline.enable_usp.__module__, Flux3ModularPipeline.enable_usp.__module__, "
        "any('PipelineUtilsFinder' in type(f).__name__ for f in sys.meta_path)); "
        "from usp_dit.demo.tiny_flux import tiny_flux_pipeline; " + _ENABLE_TWICE
    )
    assert out.splitlines() == ["False", "usp_dit._pipeline_methods usp_dit._pipeline_methods False",
                                "USPMesh True False _pipe_enable_usp"], out


@pytest.mark.parametrize("path", _modules("usp_dit.pipelines"), ids=lambda p: _module_name(p))
def test_the_integration_does_not_import_the_demo_models(path):
    """The tiny models (``usp_dit.demo``) are the examples' defaults and the tests' fixtures; the
    Diffusers integration works without them."""
    demo = sorted(n for n in _imports(path) if n.startswith("usp_dit.demo"))
    assert not demo, f"{_module_name(path)} imports {demo}"


# ---------------------------------------------------------------------------------------------
# The layer order and import circles


def _layer(name: str) -> int:
    """The index in ``LAYERS`` of the longest prefix naming ``name``."""
    best, layer = -1, None
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            hit = name.startswith(prefix) if prefix.endswith(".") else (name == prefix or name.startswith(prefix + "."))
            if hit and len(prefix) > best:
                best, layer = len(prefix), index
    assert layer is not None, f"{name} is in no layer: add its folder to LAYERS"
    return layer


@functools.cache
def _graph() -> dict[str, set[str]]:
    """Module -> the package's modules it imports (a name ``pkg.mod.attr`` counts as ``pkg.mod``)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}

    def owner(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    return {m: {o for n in _imports(p) if _top(n) == "usp_dit" and (o := owner(n)) not in (None, m)}
            for m, p in modules.items()}


@pytest.mark.parametrize("module", sorted(_graph()))
def test_imports_follow_the_layer_order(module):
    mine = _layer(module)
    upward = sorted(n for n in _graph()[module] if _layer(n) > mine)
    assert not upward, f"{module} (layer {LAYERS[mine]}) imports {upward}, above it"


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle():
    assert _circles(_graph()) == []


def test_the_circle_finder_finds_circles():
    """The check can fail: a three-module circle and a two-module one are found, a chain is not."""
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"e"}, "e": {"d"}, "f": {"a"}, "g": set()}
    assert sorted(_circles(graph)) == [["a", "b", "c"], ["d", "e"]]
    assert _layer("usp_dit.pipelines.api") < _layer("usp_dit.pipelines.families.flux") < _layer("usp_dit.pipelines")
    assert _layer("usp_dit.pipelines.coverage") == _layer("usp_dit.pipelines")


SERVER_STACK = ("fastapi", "uvicorn", "starlette", "prometheus_client", "openai")


@pytest.mark.parametrize("path", [p for p in PACKAGE.rglob("*.py") if not _module_name(p).startswith("usp_dit.serve")],
                         ids=lambda p: _module_name(p))
def test_only_the_server_imports_the_http_stack(path):
    """FastAPI, uvicorn and prometheus-client are the ``[serve]`` extra: nothing below the server needs them."""
    stack = sorted(n for n in _imports(path) if _top(n) in SERVER_STACK)
    assert not stack, f"{_module_name(path)} imports {stack}"
