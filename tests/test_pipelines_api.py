"""``enable_usp`` / ``disable_usp`` in one process, CFG batch splitting, a failing rank, the image example.

One-process tests check the API's contracts (errors, restore, method on every pipeline). The
failing-rank test starts 4 plain processes (no torchrun agent, so nothing else can stop them) in
which rank 1 raises at step 1 of a tiny FluxPipeline run on a 2x2 grid: every rank must exit,
non-zero, within seconds of the failure. The example test runs examples/generate_image.py under
torchrun on 2 ranks and asserts it prints MATCH and writes the PNG.
"""
from __future__ import annotations

import gc
import os
import re
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
from diffusers import DiffusionPipeline, PriorTransformer

import usp_dit
from usp_dit import USPConfig, USPMesh, disable_usp, enable_usp
from usp_dit.demo.tiny_flux import flux_inputs, tiny_flux_pipeline, tiny_flux_transformer
from usp_dit.demo.tiny_video import tiny_cogvideox, tiny_mochi
from usp_dit.pipelines import is_usp_enabled
from usp_dit.pipelines.api import split_cfg_batch
from usp_dit.testing.pool import free_port

ROOT = Path(__file__).resolve().parents[1]


def _flux_out(model, args) -> torch.Tensor:
    with torch.no_grad():
        return model(**args, guidance=torch.full((1,), 3.5), return_dict=False)[0]


def test_enable_disable_one_process_is_bit_identical():
    model = tiny_flux_transformer()
    args = flux_inputs(1, 5, 7, 6)
    before = model.attn_processors
    ref = _flux_out(model, args)
    mesh = enable_usp(model)
    assert is_usp_enabled(model) and mesh.sequence_degree == 1
    assert _flux_out(model, args).shape == ref.shape
    disable_usp(model)
    assert not is_usp_enabled(model)
    assert torch.equal(_flux_out(model, args), ref)
    assert all(before[k] is v for k, v in model.attn_processors.items())
    assert "forward" not in model.__dict__
    disable_usp(model)  # a second disable leaves the model as it is
    assert torch.equal(_flux_out(model, args), ref)


def test_pipeline_methods_on_every_diffusion_pipeline():
    assert callable(DiffusionPipeline.enable_usp) and callable(DiffusionPipeline.disable_usp)
    pipe = tiny_flux_pipeline()
    pipe.enable_usp()
    assert is_usp_enabled(pipe) and is_usp_enabled(pipe.transformer)
    with pytest.raises(ValueError, match="already enabled"):
        usp_dit.enable_usp(pipe.transformer)
    pipe.disable_usp()
    assert not is_usp_enabled(pipe)


def test_unsupported_model_names_class_and_supported_ones():
    """A Diffusers transformer usp_dit has no plan for (the unCLIP prior) is refused, naming its
    class, the reason (docs/COVERAGE.md) and the supported families."""
    prior = PriorTransformer(num_attention_heads=2, attention_head_dim=4, num_layers=1, embedding_dim=8,
                             num_embeddings=3, additional_embeddings=1)
    with pytest.raises(NotImplementedError, match=r"PriorTransformer.*nothing to split.*Flux"):
        enable_usp(prior)
    with pytest.raises(NotImplementedError, match="Linear"):
        enable_usp(torch.nn.Linear(2, 2))
    assert not is_usp_enabled(prior)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"ulysses_degree": 0}, "ulysses_degree"),
        ({"ring_degree": 2}, "world_size"),
        ({"backend": "nope"}, "backend='nope'"),
    ],
)
def test_bad_arguments_raise_value_error_and_leave_model_untouched(kwargs, match):
    model = tiny_flux_transformer()
    with pytest.raises(ValueError, match=match):
        enable_usp(model, **kwargs)
    assert not is_usp_enabled(model) and "forward" not in model.__dict__
    assert all(type(p).__name__ == "FluxAttnProcessor" for p in model.attn_processors.values())


def test_not_a_pipeline_or_module():
    with pytest.raises(ValueError, match="pipe_or_transformer"):
        enable_usp("flux")


def _cfg_mesh(cfg_rank: int) -> USPMesh:
    """A cfg=2 mesh object whose cfg coordinate is ``cfg_rank`` (no process group: index maths only)."""
    mesh = USPMesh(USPConfig(cfg_degree=2), dp_degree=1, device_type="cpu")
    mesh._local_rank = lambda axis: cfg_rank if axis == "cfg" else 0
    return mesh


def test_cfg_split_takes_this_ranks_half_of_declared_args():
    x = torch.arange(4 * 3).view(4, 3)
    for cfg_rank, rows in ((0, x[:2]), (1, x[2:])):
        args = {"hidden_states": x, "timestep": torch.tensor([7]), "ids": torch.zeros(4, 3), "scale": 1.0}
        batch = split_cfg_batch(args, _cfg_mesh(cfg_rank), ("hidden_states", "timestep"))
        assert batch == 4 and torch.equal(args["hidden_states"], rows)
        assert torch.equal(args["timestep"], torch.tensor([7]))  # size 1: broadcasts, stays whole
        assert args["ids"].shape == (4, 3)  # not declared: untouched although its dim 0 is 4


def test_cfg_split_takes_this_ranks_entries_of_list_args():
    """Z-Image's call: latents and prompt embeddings are lists of one tensor per row (prompts of
    different lengths), the timestep a tensor; a list of the wrong length is refused."""
    xs, caps = [torch.full((2, 3), float(i)) for i in range(4)], [torch.zeros(i + 1, 2) for i in range(4)]
    for cfg_rank, lo in ((0, 0), (1, 2)):
        args = {"x": list(xs), "t": torch.arange(4.0), "cap_feats": list(caps)}
        assert split_cfg_batch(args, _cfg_mesh(cfg_rank), ("t",), ("x", "cap_feats")) == 4
        assert [a is b for a, b in zip(args["x"], xs[lo:lo + 2])] == [True, True]
        assert [c.shape[0] for c in args["cap_feats"]] == [lo + 1, lo + 2]
        assert torch.equal(args["t"], torch.arange(4.0)[lo:lo + 2])
    with pytest.raises(ValueError, match="'x' lists 3 rows but the batch is 4"):
        split_cfg_batch({"t": torch.zeros(4), "x": xs[:3]}, _cfg_mesh(0), ("t",), ("x",))


def test_cfg_split_errors():
    with pytest.raises(NotImplementedError, match="batch is 3"):
        split_cfg_batch({"hidden_states": torch.zeros(3, 2)}, _cfg_mesh(0), None)
    with pytest.raises(ValueError, match="'timestep' has 3 rows"):
        split_cfg_batch({"hidden_states": torch.zeros(4, 2), "timestep": torch.zeros(3)}, _cfg_mesh(0),
                        ("hidden_states", "timestep"))



def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ, TRANSFORMERS_VERBOSITY="error", OMP_NUM_THREADS="1")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def test_failing_rank_ends_every_rank_within_seconds():
    world, fail_rank, port = 4, 1, free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "_failing_rank_job.py")],
            env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
                     LOCAL_RANK=str(r), FAIL_RANK=str(fail_rank)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )
        for r in range(world)
    ]
    ended: dict[int, float] = {}
    deadline = time.time() + 240  # start-up of 4 processes on 2 busy cores; the failure itself is fast
    while len(ended) < world and time.time() < deadline:
        for r, p in enumerate(procs):
            if r not in ended and p.poll() is not None:
                ended[r] = time.time()
        time.sleep(0.05)
    for p in procs:
        if p.poll() is None:
            p.kill()
    outputs = [p.communicate() for p in procs]
    assert len(ended) == world, f"ranks still running after the deadline: {sorted(set(range(world)) - set(ended))}"
    failed_at = re.search(r"FAILING AT ([0-9.]+)", outputs[fail_rank][0])
    assert failed_at, f"rank {fail_rank} did not reach the failure:\n{outputs[fail_rank][1][-2000:]}"
    assert "[usp_dit] rank 1: uncaught RuntimeError" in outputs[fail_rank][1]
    assert "injected failure on rank 1 at step 1" in outputs[fail_rank][1]
    for r, p in enumerate(procs):
        assert p.returncode != 0, f"rank {r} exited 0:\n{outputs[r][0][-500:]}"
        # Seconds, not a collective timeout (the job's is 300 s).
        assert ended[r] - float(failed_at.group(1)) < 20, f"rank {r} took {ended[r] - float(failed_at.group(1)):.1f} s"


def test_image_example_matches_one_rank(tmp_path):
    out_png = tmp_path / "flux.png"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(ROOT / "examples" / "generate_image.py"), "--height", "80", "--width", "96", "--steps", "2",
           "--ring", "2", "--ulysses", "1", "--output", str(out_png)]
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "30 image tokens" in proc.stdout, proc.stdout  # 5 x 6 tokens: odd, does not divide 2 ranks
    assert re.search(r"max\|diff\|/max\|one rank\| = \S+ \(tolerance \S+\): MATCH", proc.stdout), proc.stdout
    from PIL import Image

    with Image.open(out_png) as image:
        assert image.size == (96, 80)


def test_ring_schedule_reaches_the_mesh_and_is_checked():
    """enable_usp passes ring_schedule to the mesh it builds; a wrong value fails before patching."""
    model = tiny_flux_transformer()
    mesh = enable_usp(model, ring_schedule="stream")
    assert mesh.ring_schedule == "stream"
    disable_usp(model)
    with pytest.raises(ValueError, match="ring_schedule must be one of"):
        enable_usp(model, ring_schedule="fast")
    assert not is_usp_enabled(model)


@pytest.mark.parametrize("build", [tiny_flux_transformer, tiny_cogvideox, tiny_mochi], ids=["flux", "cogvideox", "mochi"])
def test_an_enabled_transformer_is_freed_once_the_user_drops_it(build):
    """enable_usp keeps its state on the transformer, never in a table of its own: a dropped
    model (and its memory) must go, enabled or not."""
    model = build()
    enable_usp(model)
    ref = weakref.ref(model)
    del model
    gc.collect()
    assert ref() is None


def test_a_job_leaves_no_process_group_for_interpreter_teardown():
    """init_usp's groups outlive destroy_process_group while the default mesh holds them; usp_dit's
    exit hook lets go of them, so no gloo thread meets interpreter teardown (where it can abort
    the process after the work is done). Without the hook this job left 18 threads per rank."""
    world, port = 2, free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, str(ROOT / "tests" / "_exit_hook_job.py")],
            env=_env(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r), WORLD_SIZE=str(world),
                     LOCAL_RANK=str(r)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
        )
        for r in range(world)
    ]
    outputs = [p.communicate(timeout=240) for p in procs]
    for r, (p, (out, err)) in enumerate(zip(procs, outputs)):
        assert p.returncode == 0, f"rank {r} exited {p.returncode}:\n{err[-2000:]}"
        assert f"RANKS {r}" in out
        assert "GLOO THREADS AT TEARDOWN 0" in out, out
