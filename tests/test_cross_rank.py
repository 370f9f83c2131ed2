"""Misuse across ranks (issue 13): a clear error on every rank, never garbage, a hang or a SIGABRT.

Two spawned gloo groups, of 2 and 4 ranks, each run every case on every grid that fits:
  * metadata handshake (Note [call handshake]): the last rank of the group differs from the others
    in one field (dtype bf16 vs fp16 -- same byte size, so without a check the bytes would silently
    mix -- batch, heads, K/V heads, head_dim, joint length, joint given or not, seq_len given or
    not, the ring schedule of the mesh or of the call, a gradient); every rank must raise ValueError naming the field and
    every rank's value, and a correct call afterwards still matches the float64 reference (the
    group survived). A rank whose own inputs are refused raises its own error; the others name it.
  * seq_len wrong on one rank, or wrong on all: every rank raises.
  * gather_sequence: dtype or shape differing, seq_len wrong on one rank: every rank raises.
  * joint_out read by the loss of some ranks only: the backward completes (no rank waits for
    another in a collective) and every gradient equals the float64 reference gradient of the
    sum of the ranks' losses.
  * outputs are contiguous: gather_sequence at batch 2, an enabled Flux transformer at batch 2;
    enabled CogVideoX and Mochi return the strides stock returns.
  * process groups have a lifecycle: 50 enable_usp / disable_usp cycles leave the number of open
    file descriptors and gloo threads where the first cycle left them, and equal degrees give the
    same mesh.

Tolerances: float64 everywhere the maths is compared (1e-10: only float64 rounding remains), the
enabled Flux output in float32 against one rank (1e-5, the pipelines' bar).
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import usp_dit
from tests.reference import joint_attention_ref
from usp_dit import gather_sequence, init_usp, shard_sequence, usp_attention
from usp_dit.demo.tiny_flux import flux_inputs, tiny_flux_transformer
from usp_dit.demo.tiny_video import cogvideox_inputs, mochi_inputs, tiny_cogvideox, tiny_mochi
from usp_dit.testing import _gloo_threads, rel_err, run_spawned_worlds

GRIDS = {2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1), (1, 4)]}
SEQ, HEADS, DIM, JOINT = 13, 4, 16, 5
F64_TOL = 1e-10

# name -> (what the other ranks pass, what the last rank passes, text naming the field)
MISMATCHES = {
    "dtype": ({"dtype": torch.bfloat16}, {"dtype": torch.float16}, ["dtype", "bfloat16", "float16"]),
    "batch": ({"batch": 1}, {"batch": 2}, ["batch", ": 1", ": 2"]),
    "heads": ({"heads": 4, "kv_heads": 2}, {"heads": 2, "kv_heads": 2}, ["heads", ": 4", ": 2"]),
    "kv_heads": ({"kv_heads": 4}, {"kv_heads": 2}, ["kv_heads", ": 4", ": 2"]),
    "head_dim": ({"dim": 16}, {"dim": 8}, ["head_dim", ": 16", ": 8"]),
    "joint_len": ({"joint": 5}, {"joint": 7}, ["joint tokens", ": 5", ": 7"]),
    "joint_given": ({"joint": 5}, {"joint": None}, ["joint tokens", ": 5", "not given"]),
    "seq_len_given": ({"seq_len": True}, {"seq_len": False}, ["seq_len", f": {SEQ}", "not given"]),
    "seq_len_wrong_one": ({"seq_len": True}, {"seq_len": SEQ + 1}, ["seq_len", f": {SEQ}", f": {SEQ + 1}"]),
    "grad": ({"grad": True}, {"grad": False}, ["needs grad", "True", "False"]),
    "schedule": ({"schedule": "stream"}, {"schedule": "gather_merge"}, ["ring_schedule", "'stream'", "'gather_merge'"]),
    "schedule_per_call": ({"per_call": "gather_one_call"}, {"per_call": "stream"},
                          ["ring_schedule", "'gather_one_call'", "'stream'"]),
}


def _tensors(batch=1, heads=HEADS, kv_heads=None, dim=DIM, joint=JOINT, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    kv = heads if kv_heads is None else kv_heads
    make = lambda s, h: torch.randn(batch, s, h, dim, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    x = {"q": make(SEQ, heads), "k": make(SEQ, kv), "v": make(SEQ, kv)}
    if joint is not None:
        x.update(jq=make(joint, heads), jk=make(joint, kv), jv=make(joint, kv))
    return x


def _call(mesh, *, grad=False, seq_len=None, per_call=None, **shape):
    """One usp_attention call on this rank's shard of seeded inputs described by ``shape``."""
    x = _tensors(**shape)
    local = {n: shard_sequence(x[n], mesh) for n in ("q", "k", "v")}
    joint = {f"joint_{n[1]}": x[n] for n in ("jq", "jk", "jv") if n in x}
    if grad:
        local["q"] = local["q"].clone().requires_grad_()
    if seq_len is True:
        seq_len = SEQ
    seq_len = seq_len or None
    return usp_attention(local["q"], local["k"], local["v"], mesh=mesh, backend="reference", seq_len=seq_len,
                         ring_schedule=per_call, **joint)


def _healthy(mesh) -> float:
    """A correct call after a refused one: the group still works and matches the reference."""
    x = _tensors(seed=7)
    out, jout, _, _ = _call(mesh, seed=7)
    ref, jref, _, _ = joint_attention_ref(x["q"], x["k"], x["v"], x["jq"], x["jk"], x["jv"], DIM ** -0.5)
    return max(rel_err(out, shard_sequence(ref, mesh)), rel_err(jout, jref))


def _mismatch(mesh, mine: dict) -> str:
    schedule = mine.pop("schedule", None)
    if schedule is not None:  # a mesh of the same degrees and another ring schedule: same groups
        mesh = init_usp(ulysses_degree=mesh.ulysses_degree, ring_degree=mesh.ring_degree, ring_schedule=schedule)
    try:
        _call(mesh, **mine)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _handshake_cases(mesh, world: int) -> dict[str, object]:
    last = dist.get_rank() == world - 1
    out: dict[str, object] = {}
    for name, (others, lasts, _) in MISMATCHES.items():
        if name.startswith("schedule") and mesh.ring_degree == 1:
            continue
        out[name] = _mismatch(mesh, dict(lasts if last else others))
        out[f"{name}/healthy"] = _healthy(mesh)
    bad_q = {"q_3d": True} if last else {}
    try:
        q = torch.zeros(1, 3, HEADS) if bad_q else shard_sequence(_tensors()["q"], mesh)
        k = shard_sequence(_tensors()["k"], mesh)
        usp_attention(q, k, k, mesh=mesh, backend="reference")
        out["own_error"] = "no error"
    except ValueError as exc:
        out["own_error"] = str(exc)
    out["own_error/healthy"] = _healthy(mesh)
    try:
        _call(mesh, seq_len=SEQ + 1)  # the same wrong length everywhere
        out["seq_len_wrong_all"] = "no error"
    except ValueError as exc:
        out["seq_len_wrong_all"] = str(exc)
    return out


def _gather_cases(mesh, world: int) -> dict[str, object]:
    last = dist.get_rank() == world - 1
    x = torch.randn(2, SEQ, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    out: dict[str, object] = {}
    full = gather_sequence(shard_sequence(x, mesh), mesh)
    out["gather_contiguous"] = full.is_contiguous() and torch.equal(full.view(2, -1), x.view(2, -1))
    variants = {
        "gather_dtype": lambda: shard_sequence(x.float() if last else x, mesh),
        "gather_shape": lambda: shard_sequence(x[..., :2] if last else x, mesh),
    }
    for name, piece in variants.items():
        try:
            gather_sequence(piece(), mesh)
            out[name] = "no error"
        except ValueError as exc:
            out[name] = str(exc)
    try:
        gather_sequence(shard_sequence(x, mesh), mesh, seq_len=SEQ + 1 if last else SEQ)
        out["gather_seq_len"] = "no error"
    except ValueError as exc:
        out["gather_seq_len"] = str(exc)
    return out


# Whose loss reads what ("out", "joint" or "both"), by sequence rank.
JOINT_USE = {
    "first_rank_both": lambda rank: "both" if rank == 0 else "out",
    "first_joint_others_out": lambda rank: "joint" if rank == 0 else "out",
    "alternate": lambda rank: "out" if rank % 2 == 0 else "joint",
}


def _partial_joint_loss(mesh, world: int, pattern: str) -> float:
    """Backward when joint_out is in some ranks' losses only; worst relative error of all grads."""
    uses = [JOINT_USE[pattern](r) for r in range(world)]
    x = _tensors(batch=2, heads=4, kv_heads=2, seed=11)
    g = torch.Generator().manual_seed(12)
    g_out = [torch.randn_like(x["q"]).normal_(generator=g) for _ in range(world)]
    g_joint = [torch.randn_like(x["jq"]).normal_(generator=g) for _ in range(world)]
    names = ("q", "k", "v", "jq", "jk", "jv")
    ref_leaves = {n: x[n].clone().requires_grad_() for n in names}
    ref_out, ref_jout, _, _ = joint_attention_ref(*(ref_leaves[n] for n in names), DIM ** -0.5)
    ref_loss = 0
    for r, use in enumerate(uses):
        if use in ("out", "both"):  # rank r's loss reads its own rows of out
            ref_loss = ref_loss + (shard_sequence_of(ref_out, mesh, r) * shard_sequence_of(g_out[r], mesh, r)).sum()
        if use in ("joint", "both"):
            ref_loss = ref_loss + (ref_jout * g_joint[r]).sum()
    ref_grads = dict(zip(names, torch.autograd.grad(ref_loss, [ref_leaves[n] for n in names])))
    rank = dist.get_rank(mesh.seq_group)
    leaves = {n: shard_sequence(x[n], mesh).clone().requires_grad_() for n in ("q", "k", "v")}
    leaves.update({n: x[n].clone().requires_grad_() for n in ("jq", "jk", "jv")})
    out, jout, _, _ = usp_attention(leaves["q"], leaves["k"], leaves["v"], joint_q=leaves["jq"], joint_k=leaves["jk"],
                              joint_v=leaves["jv"], mesh=mesh, backend="reference")
    loss = 0
    if uses[rank] in ("out", "both"):
        loss = loss + (out * shard_sequence(g_out[rank], mesh)).sum()
    if uses[rank] in ("joint", "both"):
        loss = loss + (jout * g_joint[rank]).sum()
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)))
    errors = []
    for n in ("q", "k", "v"):
        errors.append(rel_err(grads[n], shard_sequence(ref_grads[n], mesh)))
    for n in ("jq", "jk", "jv"):
        part = grads[n].contiguous()
        dist.all_reduce(part, group=mesh.seq_group)  # per-rank partials sum to the full gradient
        errors.append(rel_err(part, ref_grads[n]))
    return max(errors)


def shard_sequence_of(x: torch.Tensor, mesh, seq_rank: int) -> torch.Tensor:
    """Sequence rank ``seq_rank``'s piece of ``x`` (shard_sequence as that rank would cut it)."""
    from usp_dit.sharding.partition import offsets, split_sizes
    sizes = split_sizes(x.shape[1], mesh.sequence_degree)
    return x.narrow(1, offsets(sizes)[seq_rank], sizes[seq_rank])


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _lifecycle(world: int) -> dict[str, object]:
    """50 enable/disable cycles on a tiny Flux transformer: fds and gloo threads stay bounded."""
    model = tiny_flux_transformer(guidance_embeds=False)
    counts = []
    for _ in range(50):
        usp_dit.enable_usp(model, ulysses_degree=2, ring_degree=world // 2)
        usp_dit.disable_usp(model)
        counts.append((_open_fds(), _gloo_threads()))
    same = init_usp(ulysses_degree=2, ring_degree=world // 2) is init_usp(ulysses_degree=2, ring_degree=world // 2)
    other_schedule = init_usp(ulysses_degree=2, ring_degree=world // 2, ring_schedule="stream")
    shares = other_schedule.ulysses_group is init_usp(ulysses_degree=2, ring_degree=world // 2).ulysses_group
    return {"counts": counts, "same_mesh": same, "schedule_shares_groups": shares}


def _flux_contiguous(world: int) -> dict[str, object]:
    model = tiny_flux_transformer(guidance_embeds=False)
    inputs = flux_inputs(batch=2, height=3, width=5, text_len=7, seed=1)
    with torch.no_grad():
        ref = model(**inputs).sample
        usp_dit.enable_usp(model, ulysses_degree=2, ring_degree=world // 2)
        out = model(**inputs).sample
        usp_dit.disable_usp(model)
    return {"flux_contiguous": out.is_contiguous() and out.view(2, -1).shape == ref.view(2, -1).shape,
            "flux_err": rel_err(out, ref)}


def _video_contiguous(world: int) -> dict[str, object]:
    """CogVideoX and Mochi enabled: the sample is laid out like stock's (contiguous iff stock's is)."""
    out = {}
    for name, model, inputs in (
        ("cogvideox", tiny_cogvideox(), lambda m: cogvideox_inputs(m, frames=3, height=6, width=10)),
        ("mochi", tiny_mochi(), lambda m: mochi_inputs(m, frames=3, height=6, width=10, valid=[9, 5])),
    ):
        kwargs = inputs(model).kwargs()
        with torch.no_grad():
            ref = model(**kwargs).sample
            usp_dit.enable_usp(model, ulysses_degree=2, ring_degree=world // 2)
            got = model(**kwargs).sample
            usp_dit.disable_usp(model)
        out[name] = (got.is_contiguous() == ref.is_contiguous(), got.stride() == ref.stride(), rel_err(got, ref))
    return out


def _kernel_fails_in_a_ring(mesh, grad: bool) -> dict[str, object]:
    """Every rank's kernel raises at its first block call of a "stream" ring (the forward's, or the
    backward's), after the next block's transfer was posted: the error reaches the caller, and the
    next call on the same group matches the reference (the posted transfer was drained, not
    dropped: Note [draining a posted transfer] in usp_dit.distributed.comm)."""
    from usp_dit.kernels import get_backend

    backend, name = get_backend("reference"), "backward" if grad else "forward"

    def failing(*args, **kwargs):
        raise RuntimeError(f"kernel {name} failed")

    x = _tensors(joint=None, seed=3)
    local = {n: shard_sequence(x[n], mesh).clone().requires_grad_(grad) for n in ("q", "k", "v")}
    error = "no error"
    try:
        if not grad:
            setattr(backend, name, failing)
        res = usp_attention(local["q"], local["k"], local["v"], mesh=mesh, backend="reference", ring_schedule="stream")
        if grad:
            setattr(backend, name, failing)
            res.out.sum().backward()
    except RuntimeError as exc:
        error = str(exc)
    finally:
        vars(backend).pop(name, None)  # the class's method again
    return {"error": error, "healthy": _healthy(mesh)}


def run_world(world: int) -> dict[str, object]:
    results: dict[str, object] = {}
    for u, r in GRIDS[world]:
        mesh = init_usp(ulysses_degree=u, ring_degree=r)
        for name, value in {**_handshake_cases(mesh, world), **_gather_cases(mesh, world)}.items():
            results[f"u{u}r{r}/{name}"] = value
        if r > 1:
            for grad in (False, True):
                for key, value in _kernel_fails_in_a_ring(mesh, grad).items():
                    results[f"u{u}r{r}/kernel_fails/{'backward' if grad else 'forward'}/{key}"] = value
        for pattern in JOINT_USE:
            try:
                results[f"u{u}r{r}/joint_use/{pattern}"] = _partial_joint_loss(mesh, world, pattern)
            except Exception as exc:  # recorded, asserted by the parent
                results[f"u{u}r{r}/joint_use/{pattern}"] = f"{type(exc).__name__}: {exc}"
    results.update(_flux_contiguous(world))
    results["video"] = _video_contiguous(world)
    results.update(_lifecycle(world))
    return results


@pytest.fixture(scope="module")
def results():
    return run_spawned_worlds(run_world, (2, 4))


def _grid_keys(world: int, name: str) -> list[str]:
    return [f"u{u}r{r}/{name}" for u, r in GRIDS[world]]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", list(MISMATCHES))
def test_ranks_that_disagree_all_raise_naming_the_field(results, world, name):
    expected = MISMATCHES[name][2]
    for rank, res in enumerate(results[world]):
        for key in _grid_keys(world, name):
            if key not in res:  # the ring schedule on a grid without a ring
                continue
            msg = res[key]
            assert all(text in msg for text in expected), f"rank {rank} {key}: {msg}"
            assert f"rank {world - 1}:" in msg, f"rank {rank} {key}: every rank's value is named: {msg}"
            assert res[f"{key}/healthy"] <= F64_TOL, f"rank {rank} {key}: group unusable afterwards"


@pytest.mark.parametrize("world", [2, 4])
def test_a_kernel_failing_mid_ring_raises_and_leaves_the_group_exact(results, world):
    checked = 0
    for rank, res in enumerate(results[world]):
        for key in _grid_keys(world, "kernel_fails"):
            for part in ("forward", "backward"):
                if f"{key}/{part}/error" not in res:  # a grid without a ring
                    continue
                assert res[f"{key}/{part}/error"] == f"kernel {part} failed", (rank, key, res[f"{key}/{part}/error"])
                assert res[f"{key}/{part}/healthy"] <= F64_TOL, (rank, key, part, res[f"{key}/{part}/healthy"])
                checked += 1
    assert checked >= 2 * world


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_refusing_its_inputs_makes_every_rank_raise(results, world):
    for rank, res in enumerate(results[world]):
        for key in _grid_keys(world, "own_error"):
            if rank == world - 1:
                assert "q must be (batch, seq, heads, head_dim)" in res[key], res[key]
            else:
                assert "input check" in res[key] and "q must be" in res[key], res[key]
            assert res[f"{key}/healthy"] <= F64_TOL


@pytest.mark.parametrize("world", [2, 4])
def test_a_wrong_seq_len_raises_on_every_rank(results, world):
    for res in results[world]:
        for key in _grid_keys(world, "seq_len_wrong_all"):
            assert f"seq_len={SEQ + 1}" in res[key] and "expected" in res[key], res[key]


@pytest.mark.parametrize("world", [2, 4])
def test_gather_sequence_checks_every_rank_and_is_contiguous(results, world):
    for rank, res in enumerate(results[world]):
        for u, r in GRIDS[world]:
            p = f"u{u}r{r}/"
            assert res[p + "gather_contiguous"] is True
            assert "dtype" in res[p + "gather_dtype"] and "float32" in res[p + "gather_dtype"], res[p + "gather_dtype"]
            assert "other dims" in res[p + "gather_shape"], res[p + "gather_shape"]
            assert "seq_len" in res[p + "gather_seq_len"] and f"rank {world - 1}" in res[p + "gather_seq_len"]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("pattern", list(JOINT_USE))
def test_joint_out_in_some_losses_only_completes_with_exact_gradients(results, world, pattern):
    for rank, res in enumerate(results[world]):
        for key in _grid_keys(world, f"joint_use/{pattern}"):
            err = res[key]
            assert not isinstance(err, str), f"rank {rank} {key}: {err}"
            assert err <= F64_TOL, f"rank {rank} {key}: {err}"


@pytest.mark.parametrize("world", [2, 4])
def test_enabled_flux_output_is_contiguous(results, world):
    for res in results[world]:
        assert res["flux_contiguous"] is True
        assert res["flux_err"] <= 1e-5


@pytest.mark.parametrize("world", [2, 4])
def test_enabled_video_outputs_are_laid_out_like_stock(results, world):
    for res in results[world]:
        for name, (contiguous_alike, strides_alike, err) in res["video"].items():
            assert contiguous_alike and strides_alike, name
            assert err <= 1e-5, (name, err)


@pytest.mark.parametrize("world", [2, 4])
def test_enable_disable_cycles_open_no_new_groups(results, world):
    for rank, res in enumerate(results[world]):
        counts = res["counts"]
        # Sockets of finished transfers close at their own pace, so the fd count may dip; it must
        # never grow past what the first cycle left (each new mesh used to add ~20 per rank).
        fds, threads = zip(*counts)
        assert max(fds) <= fds[0], f"rank {rank}: open fds over 50 cycles {fds}"
        assert set(threads) == {threads[0]}, f"rank {rank}: gloo threads over 50 cycles {threads}"
        assert res["same_mesh"] is True and res["schedule_shares_groups"] is True
