"""Imports run one way (docs/DESIGN.md, "Layers"): kernels <- core <- integrations.

Every module of the package is parsed (no import is executed) and each ``import`` / ``from ...
import`` statement, at any depth, is checked against its layer's rules:
  * kernels (``usp_dit.kernels.*``) import nothing of usp_dit outside ``usp_dit.kernels``: no
    ring, no mesh, no communication;
  * the attention core (config, groups, mesh, replica, partition, layouts, masks, masked, comm,
    handshake, ulysses, ring, merge, usp, sharding, traffic) imports only torch, the standard library, itself and the kernels: no
    Diffusers, transformers or PEFT, and no integration (``usp_dit.pipelines``, ``usp_dit.training``).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "usp_dit"
CORE = ("config", "groups", "mesh", "replica", "partition", "layouts", "masks", "masked", "masked_joint", "comm",
        "handshake", "ulysses", "ring", "merge", "usp", "sharding", "traffic")
THIRD_PARTY_INTEGRATIONS = ("diffusers", "transformers", "peft", "accelerate")


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


@pytest.mark.parametrize("name", CORE)
def test_the_core_needs_only_torch_and_the_kernels(name):
    path = PACKAGE / f"{name}.py"
    imports = _imports(path)
    integrations = sorted(n for n in imports if _top(n) in THIRD_PARTY_INTEGRATIONS)
    assert not integrations, f"usp_dit.{name} imports {integrations}"
    allowed = {f"usp_dit.{m}" for m in CORE}
    upward = sorted(n for n in imports if _top(n) == "usp_dit" and n != "usp_dit"
                    and not n.startswith("usp_dit.kernels") and n.rsplit(".", 1)[0] not in allowed
                    and n not in allowed)
    assert not upward, f"usp_dit.{name} imports {upward}"


def test_the_rules_see_imports():
    """The parser finds what a rule must catch: a function-level import and a relative one."""
    ring = _imports(PACKAGE / "ring.py")
    assert "usp_dit.kernels.protocol" in ring and "usp_dit.comm" in ring
    blockwise = _imports(PACKAGE / "testing" / "blockwise.py")
    assert "usp_dit.ring" in blockwise  # the simulator moved out of kernels because of this import


def _fresh(code: str) -> str:
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_import_usp_dit_loads_no_integration():
    """A fresh interpreter's ``import usp_dit`` leaves Diffusers, transformers and PEFT unloaded (so
    it patches no class); ``usp_dit.enable_usp`` loads the integration, which gives every
    DiffusionPipeline its ``enable_usp`` method."""
    loaded = _fresh(
        "import sys, usp_dit; print(sorted(m for m in ('diffusers', 'transformers', 'peft') if m in sys.modules))"
    )
    assert loaded == "[]", loaded
    attached = _fresh(
        "import usp_dit; f = usp_dit.enable_usp; from diffusers import DiffusionPipeline; "
        "print(f.__module__, DiffusionPipeline.enable_usp.__name__)"
    )
    assert attached == "usp_dit.pipelines.api _pipe_enable_usp", attached


@pytest.mark.parametrize("path", _modules("usp_dit.pipelines"), ids=lambda p: _module_name(p))
def test_the_integration_does_not_import_the_demo_models(path):
    """The tiny models (``usp_dit.demo``) are the examples' defaults and the tests' fixtures; the
    Diffusers integration works without them."""
    demo = sorted(n for n in _imports(path) if n.startswith("usp_dit.demo"))
    assert not demo, f"{_module_name(path)} imports {demo}"
