"""The built wheel, installed without extras, runs the examples (issue 13, item 11).

One wheel is built from a copy of the package (``pip wheel --no-deps --no-build-isolation``: no
download, and no ``build/`` folder left in the shared working tree), then installed into a fresh
virtual environment that sees this interpreter's packages (``--system-site-packages``: torch,
diffusers and transformers are reused, nothing is downloaded). Checked:
  * the wheel's metadata: version from ``usp_dit.__version__``, the Apache-2.0 license and its
    file, a project URL, and base dependencies that cover every third-party module that usp_dit and
    the examples import (an optional one must sit in an extra);
  * ``pip install --no-index`` of the wheel is satisfied by what is installed here;
  * from a folder outside the repository, the venv imports the wheel's usp_dit (not the editable
    checkout) and examples/generate_image.py prints MATCH on 2 ranks under torchrun.
"""
from __future__ import annotations

import ast
import email.parser
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

import usp_dit

ROOT = Path(__file__).resolve().parents[1]
BUILD_INPUTS = ("pyproject.toml", "README.md", "LICENSE", "usp_dit")
# Third-party modules imported only on optional paths: where each is declared instead of the base.
OPTIONAL_MODULES = {
    "imageio": "video",  # video files in fine-tuning data, MP4 output
    "triton": None,  # ships with CUDA builds of torch; the fused ring merge runs on CUDA only
    "fastapi": "serve", "uvicorn": "serve", "prometheus_client": "serve", "pydantic": "serve",  # usp_dit.serve
    "torchao": "fp8",  # usp_dit.quantize_fp8_linears (the FP8 step recipe)
    "cudnn": ("fp8-cudnn", "nvidia-cudnn-frontend"),  # backend "fp8_cudnn" (module, distribution differ)
}
# Base dependencies; accelerate is imported by no one here, but without it from_pretrained loads slowly.
EXPECTED_BASE = ("torch", "diffusers", "transformers", "accelerate", "numpy", "safetensors", "pillow", "tqdm")


def _pip(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from a copy of the package files."""
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    src.mkdir()
    for name in BUILD_INPUTS:
        path = ROOT / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    proc = _pip("wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(tmp / "dist"), str(src))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    (built,) = (tmp / "dist").glob("usp_dit-*.whl")
    return built


@pytest.fixture(scope="module")
def metadata(wheel):
    with zipfile.ZipFile(wheel) as zf:
        name = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        return email.parser.Parser().parsestr(zf.read(name).decode())


@pytest.fixture(scope="module")
def venv_python(wheel, tmp_path_factory) -> Path:
    """A fresh venv over this interpreter's packages, with the wheel installed into it."""
    venv = tmp_path_factory.mktemp("venv") / "env"
    # --without-pip: the venv's own pip would bring an old setuptools that shadows the one torch needs.
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)], check=True,
                   timeout=120)
    python = venv / "bin" / "python"
    proc = _pip("--python", str(python), "install", "-q", "--no-index", "--no-deps", "--force-reinstall", str(wheel))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return python


def _base_requirements(metadata) -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in metadata.get_all("Requires-Dist")]
    return {r.name.lower(): r for r in reqs if r.marker is None}


def _extra_requirements(metadata, extra: str) -> dict[str, Requirement]:
    reqs = [Requirement(r) for r in metadata.get_all("Requires-Dist")]
    return {r.name.lower(): r for r in reqs if r.marker is not None and r.marker.evaluate({"extra": extra})}


def _imported_modules() -> set[str]:
    """Top-level third-party modules imported anywhere in usp_dit/ and examples/ (lazy imports too)."""
    files = list((ROOT / "usp_dit").rglob("*.py")) + list((ROOT / "examples").glob("*.py"))
    found = set()
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {m for m in found if m not in sys.stdlib_module_names and m not in ("usp_dit", "__future__")}


def test_wheel_version_license_and_urls(wheel, metadata):
    assert metadata["Version"] == usp_dit.__version__
    assert metadata["License-Expression"] == "Apache-2.0"
    assert metadata["License-File"] == "LICENSE"
    with zipfile.ZipFile(wheel) as zf:
        license_text = zf.read(next(n for n in zf.namelist() if n.endswith("licenses/LICENSE"))).decode()
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert all(url.split(", ", 1)[1].startswith("https://") for url in metadata.get_all("Project-URL"))


def test_wheel_declares_what_usp_dit_and_the_examples_import(metadata):
    base = _base_requirements(metadata)
    missing = [name for name in EXPECTED_BASE if name not in base]
    assert not missing, f"not base dependencies: {missing} (declared: {sorted(base)})"
    # FSDP2's public fully_shard arrived in torch 2.6.
    assert base["torch"].specifier.contains("2.6.0") and not base["torch"].specifier.contains("2.5.1"), base["torch"]
    distributions = importlib.metadata.packages_distributions()
    for module in sorted(_imported_modules()):
        if module in OPTIONAL_MODULES:
            extra = OPTIONAL_MODULES[module]
            extra, dist = extra if isinstance(extra, tuple) else (extra, module.replace("_", "-"))
            assert extra is None or dist in _extra_requirements(metadata, extra), (module, extra)
            continue
        names = {d.lower() for d in distributions.get(module, [module])}
        assert names & set(base), f"usp_dit or an example imports {module} ({names}); not a base dependency"
    assert str(_extra_requirements(metadata, "flash")["flash-attn"].specifier) == ">=2.7"


def test_wheel_dependencies_are_met_here_without_downloading(wheel, venv_python):
    proc = _pip("--python", str(venv_python), "install", "--no-index", str(wheel))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_image_example_runs_from_the_installed_wheel(venv_python, tmp_path):
    run_dir = tmp_path / "elsewhere"  # no usp_dit/ folder beside the script or in the working directory
    run_dir.mkdir()
    script = run_dir / "generate_image.py"
    shutil.copy2(ROOT / "examples" / "generate_image.py", script)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error")
    where = subprocess.run([str(venv_python), "-c", "import usp_dit; print(usp_dit.__file__)"], cwd=run_dir, env=env,
                           capture_output=True, text=True, timeout=120)
    assert Path(where.stdout.strip()).is_relative_to(venv_python.parents[1]), where.stdout + where.stderr
    cmd = [str(venv_python), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script),
           "--height", "64", "--width", "64", "--steps", "1", "--output", "out.png"]
    proc = subprocess.run(cmd, cwd=run_dir, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert re.search(r"\(tolerance \S+\): MATCH", proc.stdout), proc.stdout
    assert (run_dir / "out.png").is_file()
