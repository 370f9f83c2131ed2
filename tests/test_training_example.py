"""examples/finetune_video.py end to end on 2 CPU ranks: losses, bad items, checkpoints, resume.

One spawned gloo group of 2 ranks runs the example's ``train()`` (what torchrun would run) on a
folder holding one latent clip (64 tokens), one GIF video (encoded by the tiny VAE: 12 tokens) and
one broken ``.pt`` file:
  * A: Ring 2, plain ``sync_grads``, 3 steps;
  * B: the same run stopped after 2 steps (checkpoint-2), then C: resumed from it to step 3;
  * D: Ulysses 2 with FSDP2 "full" and gradient checkpointing, 3 steps.
Checked: the broken file is reported and skipped on every rank; C's step-3 loss equals A's (resume
is exact: weights, AdamW state and the per-step noise all come back); D's losses equal A's (both
are the one-process losses); Diffusers' ``from_pretrained`` loads checkpoint-2 and its weights
equal the live model's at that step.

Tolerance: resume 1e-6 relative (the same computation replayed: only the file round trip could
differ, and it is exact for float32). D vs A: 1e-6 at step 0 (same weights; sums reordered by
sharding), 1e-4 after AdamW updates (Adam's step g / (sqrt(v) + eps) is about ±lr for every entry
whatever its size, so an entry whose gradient is rounding noise moves by up to 2·lr = 2e-4 with
the opposite sign under a different sharding; the loss moves by far less).

Apart from the spawned group: the documented default (no ``--data``: synthetic clips) under real
torchrun on 2 ranks, which used to crash (each rank made its own temporary folder and only rank 0
wrote into it).
"""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch.distributed as dist

from usp_dit.testing import assert_no_crash, run_spawned

WORLD = 2
EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "finetune_video.py"


def _example():
    spec = importlib.util.spec_from_file_location("finetune_video", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def _write_data(root: Path) -> None:
    from PIL import Image

    from usp_dit.training.data import write_synthetic_latents

    write_synthetic_latents(root, 1, (4, 4, 8, 8), text_shape=(7, 32), seed=3)
    rng = np.random.default_rng(0)
    frames = [Image.fromarray((rng.random((32, 32, 3)) * 255).astype("uint8")) for _ in range(9)]
    frames[0].save(root / "clip.gif", save_all=True, append_images=frames[1:])
    (root / "broken.pt").write_bytes(b"not a tensor")


def _run(ex, data: Path, output: Path, *extra: str) -> dict:
    args = ex.parse_args(["--data", str(data), "--output", str(output), "--no-progress", "--height", "32",
                          "--width", "32", "--lr", "1e-3", *extra])
    return ex.train(args)


def _spawned() -> dict:
    ex = _example()
    root = Path(os.environ.get("TMPDIR", "/tmp")) / f"usp_dit_finetune_{os.environ['MASTER_PORT']}"
    data = root / "data"
    if dist.get_rank() == 0:
        data.mkdir(parents=True, exist_ok=True)
        _write_data(data)
    dist.barrier()
    a = _run(ex, data, root / "a", "--ring", "2", "--steps", "3")
    _run(ex, data, root / "b", "--ring", "2", "--steps", "2")
    live = {n: p.detach().clone() for n, p in _run(ex, data, root / "b2", "--ring", "2", "--steps", "2")["model"].named_parameters()}
    c = _run(ex, data, root / "b", "--ring", "2", "--steps", "3", "--resume", "latest")
    d = _run(ex, data, root / "d", "--ulysses", "2", "--steps", "3", "--fsdp", "full", "--grad-ckpt")
    from diffusers import CogVideoXTransformer3DModel

    loaded = CogVideoXTransformer3DModel.from_pretrained(root / "b" / "checkpoint-2" / "transformer")
    load_err = max((loaded.state_dict()[n] - p).abs().max().item() for n, p in live.items())
    checkpoints = sorted(p.name for p in (root / "b").iterdir())
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(root, ignore_errors=True)
    return {"a": a["losses"], "c": c["losses"], "d": d["losses"], "skipped": a["skipped"], "load_err": load_err,
            "checkpoints": checkpoints}


@pytest.fixture(scope="module")
def per_rank() -> list[dict]:
    results = run_spawned(_spawned, WORLD)
    assert_no_crash(results)
    return results


def test_bad_item_is_reported_and_skipped(per_rank):
    for r in per_rank:
        assert [Path(p).name for p in r["skipped"]] == ["broken.pt"]
        assert set(r["a"]) == {0, 1, 2} and all(np.isfinite(list(r["a"].values())))


def test_resume_gives_the_same_next_step_loss(per_rank):
    for r in per_rank:
        assert set(r["c"]) == {2}, "the resumed run must start at step 2"
        assert r["c"][2] == pytest.approx(r["a"][2], rel=1e-6)
        assert r["checkpoints"] == ["checkpoint-2", "checkpoint-3"]


def test_fsdp_ulysses_run_matches_ring_run(per_rank):
    for r in per_rank:
        assert r["d"][0] == pytest.approx(r["a"][0], rel=1e-6)
        for step in (1, 2):
            assert r["d"][step] == pytest.approx(r["a"][step], rel=1e-4)


def test_diffusers_loads_the_checkpoint(per_rank):
    for r in per_rank:
        assert r["load_err"] == 0.0


def test_default_synthetic_run_under_torchrun(tmp_path):
    """No --data, 2 ranks, real torchrun: trains, checkpoints, and leaves no synthetic folder behind."""
    scratch = tmp_path / "tmp"  # the ranks' TMPDIR: where their synthetic clips go
    scratch.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
           str(EXAMPLE), "--steps", "2", "--ring", "2", "--no-progress", "--output", str(tmp_path / "out")]
    env = dict(os.environ, TMPDIR=str(scratch), OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert re.search(r"done: 2 steps, last loss \d", proc.stdout), proc.stdout
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["checkpoint-2"]
    assert not [p.name for p in scratch.iterdir() if p.name.startswith("usp_synthetic_")]
