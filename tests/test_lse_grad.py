"""Gradients through the log-sum-exps ``usp_attention`` returns (Note [LSE gradient] in
``usp_dit.kernels.lse_grad``), against a float64 reference that autograd differentiates through
scores -> ``torch.logsumexp`` -> softmax (``tests.reference``).

Kernel level, one process: both ways of handing the kernels D' = D - dL (one augmented call, two
calls), with causal and key-mask calls, on the two CPU kernels; which way a backend's caps pick;
bfloat16 within twice the plain backward's error.

Grids: one spawned group per world size (1 in-process, 2 and 4 ranks), every 2-D grid of 1, 2 and
4 ranks, every ring schedule, batch 2, odd lengths, uneven heads (6 heads on 4 Ulysses ranks, GQA
6:2; 3 on 2), joint tokens, joint tokens under a key mask whose valid lengths differ per batch
element, causal and block-causal attention in each layout. The loss reads out and LSE (joint ones
too) with random weights; also the LSE alone, and the LSE on one rank only (the others' zero
gradients travel: no rank waits). One compiled call (fullgraph) on one rank and one on (2, 2).
A loss that reads only ``out`` keeps the plain backward (counted).

Tolerance: float64 1e-10 (max |err| / max |ref|): every part runs in float64, only its rounding
remains.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from tests.reference import frame_causal_mask, masked_attention_ref
from usp_dit import init_usp, shard_sequence, single_rank_mesh, usp_attention
from usp_dit.kernels import autograd as kernel_autograd
from usp_dit.kernels import get_backend
from usp_dit.kernels.lse_grad import augmented_width, backward_augmented, backward_two_calls
from usp_dit.kernels.protocol import BackendCaps
from usp_dit.sharding.partition import split_sizes
from usp_dit.testing import rel_err, run_spawned_worlds

TOL = 1e-10
GRIDS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1), (1, 4)]}
SCHEDULES = ("stream", "gather_merge", "gather_one_call")
BACKENDS = ("reference", "sdpa_cpu")
JOINT_MASK = [[1, 1, 1, 1, 1, 0, 0], [1, 1, 0, 0, 0, 0, 0]]  # valid lengths 5 and 2


# ---- kernels, one process ------------------------------------------------------------------------

def _kernel_case(dtype, causal: bool, masked: bool, seed: int):
    """Inputs of one kernel call (float64), its options, and the reference gradients of
    (out * w_out).sum() + (lse * w_lse).sum()."""
    g = torch.Generator().manual_seed(seed)
    b, sq, h, hk, d = 2, 7, 4, 2, 16
    sk = sq if causal else 9
    q, w_out = (torch.randn(b, sq, h, d, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(b, sk, hk, d, generator=g, dtype=torch.float64) for _ in range(2))
    w_lse = torch.randn(b, sq, h, generator=g, dtype=torch.float64)
    visible, opts = torch.ones(sq, sk, dtype=torch.bool), {}
    if causal:
        visible, opts["causal"] = visible.tril(), True
    if masked:
        key_mask = torch.ones(b, sk, dtype=torch.bool)
        key_mask[0, 2], key_mask[1, 5:] = False, False
        visible, opts["key_mask"] = visible & key_mask[:, None, None, :], key_mask
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = masked_attention_ref(*leaves, 0.3, visible)
    ref = torch.autograd.grad((out * w_out).sum() + (lse * w_lse).sum(), leaves, retain_graph=True)
    plain = torch.autograd.grad((out * w_out).sum(), leaves)
    return (q, k, v, w_out, w_lse), opts, ref, plain


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("causal, masked", [(False, False), (True, False), (False, True)])
def test_kernel_backward_with_lse_gradient(name, causal, masked):
    """Both ways (augmented, two calls) equal the reference in float64 (1e-10) and float32 (1e-5:
    float32 rounding of 16-long dot products)."""
    backend = get_backend(name)
    for dtype, tol in ((torch.float64, TOL), (torch.float32, 1e-5)):
        (q, k, v, w_out, w_lse), opts, ref, _ = _kernel_case(dtype, causal, masked, seed=1)
        qd, kd, vd = (t.to(dtype) for t in (q, k, v))
        out, lse = backend.forward(qd, kd, vd, 0.3, **opts)
        dlse = w_lse.to(lse.dtype)
        for grads in (backward_augmented(backend, w_out.to(dtype), qd, kd, vd, out, lse, dlse, 0.3, 19, opts),
                      backward_two_calls(backend, w_out.to(dtype), qd, kd, vd, out, lse, dlse, 0.3, opts)):
            errors = [rel_err(a, b) for a, b in zip(grads, ref)]
            assert max(errors) <= tol, (dtype, errors)


@pytest.mark.parametrize("name", BACKENDS)
def test_bfloat16_within_twice_the_plain_backward_error(name):
    """-dL travels in bfloat16 as hi + lo (Note [LSE gradient], precision): the gradient with an
    LSE term is within twice the plain bfloat16 backward's error (each against float64), plus
    1e-3 for the rounding of bfloat16 inputs differing between the two losses."""
    backend = get_backend(name)
    (q, k, v, w_out, w_lse), opts, ref, plain_ref = _kernel_case(torch.bfloat16, False, False, seed=2)
    qd, kd, vd = (t.to(torch.bfloat16) for t in (q, k, v))
    out, lse = backend.forward(qd, kd, vd, 0.3)
    plain = backend.backward(w_out.to(torch.bfloat16), qd, kd, vd, out, lse, 0.3)
    plain_err = max(rel_err(a, b) for a, b in zip(plain, plain_ref))
    args = (backend, w_out.to(torch.bfloat16), qd, kd, vd, out, lse, w_lse.float(), 0.3)
    for width in (24, None):  # augmented at 24 columns; two calls
        grads = backward_two_calls(*args, {}) if width is None else backward_augmented(*args, width, {})
        err = max(rel_err(a, b) for a, b in zip(grads, ref))
        assert err <= 2 * plain_err + 1e-3, (width, err, plain_err)


class _Stub:
    """A backend whose caps are all that ``augmented_width`` reads."""

    def __init__(self, **caps):
        self.caps = BackendCaps(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float32}), supports_backward=True,
                                **caps)


def test_augmented_width_follows_the_caps():
    """One column (float32) over head_dim, rounded to the caps' multiple; the next listed head dim;
    ``None`` (two calls) where the backward's largest head dim is reached."""
    q = torch.zeros(1, 1, 1, 64)
    assert augmented_width(_Stub(max_head_dim=1 << 16), q, 1) == 65
    assert augmented_width(_Stub(max_head_dim=256, head_dim_multiple=8), q, 1) == 72
    assert augmented_width(_Stub(max_head_dim=256, head_dims=frozenset({64, 128, 256})), q, 2) == 128
    assert augmented_width(_Stub(max_head_dim=256, max_head_dim_backward=64), q, 1) is None
    assert augmented_width(_Stub(max_head_dim=64), q, 1) is None


def test_a_gpu_takes_the_augmented_call_within_the_tile_class():
    """Note [LSE gradient], which: off the CPU (here the meta device stands for a GPU) the augmented
    width must stay in the head dim's tile class (64, 128, 256): head_dim 72 -> 80 and 120 -> 128
    augmented; 64 -> 72 and 128 -> 136 cross a class (measured 2-5x on an H100) and take two calls."""
    stub = _Stub(max_head_dim=256)
    stub.caps = BackendCaps(devices=frozenset({"meta"}), dtypes=frozenset({torch.bfloat16}), supports_backward=True,
                            max_head_dim=256)
    width = {d: augmented_width(stub, torch.zeros(1, 1, 1, d, dtype=torch.bfloat16, device="meta"), 2)
             for d in (64, 72, 120, 128, 200)}
    assert width == {64: None, 72: 80, 120: 128, 128: None, 200: 208}


def test_two_calls_where_no_width_fits():
    """A backend with no wider head dim (cuDNN's backward stops at 128) takes two calls through
    ``kernel_backward``, exactly (float64, 1e-10)."""
    reference, calls = get_backend("reference"), []

    class Narrow:  # the reference kernel, declared for head_dim 16 only; counts its backwards
        name = "narrow"
        caps = BackendCaps(devices=frozenset({"cpu"}), dtypes=frozenset({torch.float64}), max_head_dim=16,
                           supports_backward=True, causal=True)

        def backward(self, *args, **kwargs):
            calls.append(1)
            return reference.backward(*args, **kwargs)

    (q, k, v, w_out, w_lse), opts, ref, _ = _kernel_case(torch.float64, True, False, seed=3)
    out, lse = reference.forward(q, k, v, 0.3, causal=True)
    grads = kernel_autograd.kernel_backward(Narrow(), w_out, q, k, v, out, lse, 0.3, True, dlse=w_lse)
    assert len(calls) == 2
    assert max(rel_err(a, b) for a, b in zip(grads, ref)) <= TOL


# ---- grids ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    batch: int
    seq: int
    heads: int
    kv_heads: int
    head_dim: int
    joint: int
    joint_mask: bool = False

    @property
    def id(self) -> str:
        mask = "m" if self.joint_mask else ""
        return f"b{self.batch}s{self.seq}h{self.heads}kv{self.kv_heads}j{self.joint}{mask}"


SHAPES = [
    Shape(2, 13, 6, 2, 16, 5),  # joint tokens; 6 heads, GQA 6:2: uneven on 4 Ulysses ranks
    Shape(2, 11, 3, 3, 8, 0),  # no joint tokens; 3 heads: uneven on 2
    Shape(2, 13, 4, 2, 16, 7, True),  # masked joint tokens, valid lengths 5 and 2
]


@dataclass(frozen=True)
class Case:
    """``reads``: "both" (every rank's loss reads out and LSE), "lse" (the LSEs only), "rank0"
    (every rank reads out; sequence rank 0 alone reads the LSEs). ``frame``: None dense, 1 causal,
    3 block-causal (no joint tokens then)."""

    world: int
    ulysses: int
    ring: int
    schedule: str
    backend: str
    shape: Shape
    reads: str = "both"
    frame: int | None = None
    layout: str = "contiguous"

    @property
    def id(self) -> str:
        mask = "" if self.frame is None else f"-f{self.frame}-{self.layout}"
        grid = f"w{self.world}-u{self.ulysses}r{self.ring}-{self.schedule}"
        return f"{grid}-{self.backend}-{self.shape.id}-{self.reads}{mask}"


CAUSAL_SHAPE = Shape(2, 13, 4, 2, 8, 0)
CAUSAL_RUNS = (("contiguous", 1), ("zigzag", 3), ("stripe", 1))


def cases(world: int) -> list[Case]:
    """Dense: every grid x schedule x shape, the two kernels in turn; the LSE alone and on one rank
    on the last grid. Masked: every grid x masked schedule x (layout, frame) run."""
    out: list[Case] = []
    for u, r in GRIDS[world]:
        for schedule in (SCHEDULES if r > 1 else ("auto",)):
            for shape in SHAPES:
                if u <= shape.heads:
                    out.append(Case(world, u, r, schedule, BACKENDS[len(out) % 2], shape))
            for layout, frame in CAUSAL_RUNS if schedule != "gather_one_call" else ():
                backend = BACKENDS[len(out) % 2]
                out.append(Case(world, u, r, schedule, backend, CAUSAL_SHAPE, frame=frame, layout=layout))
    u, r = GRIDS[world][-1]
    schedule = "stream" if r > 1 else "auto"
    out += [Case(world, u, r, schedule, "sdpa_cpu", SHAPES[0], "lse"),
            Case(world, u, r, schedule, "sdpa_cpu", SHAPES[2], "rank0")]
    return out


def _inputs(case: Case, seed: int) -> dict[str, torch.Tensor]:
    s = case.shape
    g = torch.Generator().manual_seed(seed)
    shapes = {"q": (s.batch, s.seq, s.heads, s.head_dim), "k": (s.batch, s.seq, s.kv_heads, s.head_dim),
              "v": (s.batch, s.seq, s.kv_heads, s.head_dim), "w_out": (s.batch, s.seq, s.heads, s.head_dim),
              "w_lse": (s.batch, s.seq, s.heads)}
    if s.joint:
        shapes.update(jq=(s.batch, s.joint, s.heads, s.head_dim), jk=(s.batch, s.joint, s.kv_heads, s.head_dim),
                      jv=(s.batch, s.joint, s.kv_heads, s.head_dim), w_jout=(s.batch, s.joint, s.heads, s.head_dim),
                      w_jlse=(s.batch, s.joint, s.heads))
    return {n: torch.randn(shape, generator=g, dtype=torch.float64) for n, shape in shapes.items()}


def _weights(case: Case, x: dict, p: int) -> dict[str, torch.Tensor]:
    """The reference loss's weights: the sum of every rank's loss (``_loss``)."""
    w = {n: x[n] for n in ("w_out", "w_lse", "w_jout", "w_jlse") if n in x}
    if case.reads == "lse":
        w["w_out"] = torch.zeros_like(x["w_out"])
        w.pop("w_jout", None)
    if case.reads == "rank0":  # rank 0 holds the first split_sizes rows (contiguous layout)
        rows = torch.zeros(case.shape.seq, dtype=torch.float64)
        rows[:split_sizes(case.shape.seq, p)[0]] = 1
        w["w_lse"] = x["w_lse"] * rows[None, :, None]
    return w


def _reference(case: Case, x: dict, p: int):
    """Reference out/LSE over [sequence; joint] (masked joint keys and staircase masks applied) and
    the gradients of the weighted loss."""
    s = case.shape
    names = ["q", "k", "v"] + (["jq", "jk", "jv"] if s.joint else [])
    leaves = {n: x[n].clone().requires_grad_() for n in names}
    n = s.seq
    pairs = (("q", "jq"), ("k", "jk"), ("v", "jv"))
    cat = [torch.cat([leaves[a], leaves[b]], 1) if s.joint else leaves[a] for a, b in pairs]
    if case.frame is not None:
        visible = frame_causal_mask(n, case.frame)
    else:
        keys = torch.ones(s.batch, n + s.joint, dtype=torch.bool)
        if s.joint_mask:
            keys[:, n:] = torch.tensor(JOINT_MASK, dtype=torch.bool)[:, :s.joint]
        visible = keys[:, None, None, :]
    out, lse = masked_attention_ref(*cat, s.head_dim ** -0.5, visible)
    w = _weights(case, x, p)
    loss = (out[:, :n] * w["w_out"]).sum() + (lse[:, :n] * w["w_lse"]).sum()
    if s.joint:
        loss = loss + (lse[:, n:] * w["w_jlse"]).sum()
        if "w_jout" in w:
            loss = loss + (out[:, n:] * w["w_jout"]).sum()
    return dict(zip(names, torch.autograd.grad(loss, [leaves[m] for m in names])))


def _loss(case: Case, res, x: dict, mesh) -> torch.Tensor:
    """This rank's loss: its own rows of out / LSE; the replicated joint ones divided by P (every
    rank reads them), or read by rank 0 alone ("rank0")."""
    p, local = mesh.sequence_degree, (lambda t: shard_sequence(t, mesh, layout=case.layout))
    lse_here = case.reads != "rank0" or mesh.seq_rank == 0
    loss = (res.lse * local(x["w_lse"])).sum() if lse_here else res.out.new_zeros(())
    if case.reads != "lse":
        loss = loss + (res.out * local(x["w_out"])).sum()
    if case.shape.joint:
        if case.reads != "lse":
            loss = loss + (res.joint_out * x["w_jout"] / p).sum()
        if lse_here:
            loss = loss + (res.joint_lse * (x["w_jlse"] if case.reads == "rank0" else x["w_jlse"] / p)).sum()
    return loss


def run_case(case: Case, mesh, seed: int) -> dict[str, float]:
    """Relative errors of this rank's gradients (joint ones summed over the sequence group)."""
    x = _inputs(case, seed)
    ref = _reference(case, x, mesh.sequence_degree)
    s = case.shape
    leaves = {n: shard_sequence(x[n], mesh, layout=case.layout).clone().requires_grad_() for n in ("q", "k", "v")}
    kwargs = {}
    if s.joint:
        leaves.update({n: x[n].clone().requires_grad_() for n in ("jq", "jk", "jv")})
        kwargs = dict(joint_q=leaves["jq"], joint_k=leaves["jk"], joint_v=leaves["jv"])
        if s.joint_mask:
            kwargs["joint_mask"] = torch.tensor(JOINT_MASK, dtype=torch.bool)[:, :s.joint]
    if case.frame is not None:
        kwargs.update({"causal": True} if case.frame == 1 else {"block_causal": case.frame})
    res = usp_attention(leaves["q"], leaves["k"], leaves["v"], mesh=mesh, backend=case.backend, return_lse=True,
                        ring_schedule=case.schedule, layout=case.layout, seq_len=s.seq, **kwargs)
    grads = dict(zip(leaves, torch.autograd.grad(_loss(case, res, x, mesh), list(leaves.values()))))
    errors = {}
    for n, g in grads.items():
        if n.startswith("j"):
            g = g.contiguous()
            if mesh.seq_group is not None:
                dist.all_reduce(g, group=mesh.seq_group)  # per-rank partials sum to the full gradient
            errors[f"d{n}"] = rel_err(g, ref[n])
        else:
            errors[f"d{n}"] = rel_err(g, shard_sequence(ref[n], mesh, layout=case.layout))
    return errors


def _joint_call(q, k, v, jq, jk, jv, mesh):
    res = usp_attention(q, k, v, joint_q=jq, joint_k=jk, joint_v=jv, mesh=mesh, seq_len=13, backend="sdpa_cpu",
                        return_lse=True, ring_schedule="stream")
    return res.out, res.joint_out, res.lse, res.joint_lse


def compiled_case(mesh) -> dict[str, float]:
    """One fullgraph compiled call (aot_eager: forward and backward traced as inductor sees them)
    with joint tokens, its loss reading out and LSE: gradients vs float64 (1e-10), one graph."""
    from torch._dynamo.testing import CompileCounterWithBackend

    case = Case(0, mesh.ulysses_degree, mesh.ring_degree, "stream", "sdpa_cpu", SHAPES[0])
    x = _inputs(case, seed=99)
    ref = _reference(case, x, mesh.sequence_degree)
    leaves = [shard_sequence(x[n], mesh).clone().requires_grad_() for n in ("q", "k", "v")]
    leaves += [x[n].clone().requires_grad_() for n in ("jq", "jk", "jv")]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    out, jout, lse, jlse = torch.compile(_joint_call, backend=counter, fullgraph=True)(*leaves, mesh)
    p = mesh.sequence_degree
    loss = ((out * shard_sequence(x["w_out"], mesh)).sum() + (lse * shard_sequence(x["w_lse"], mesh)).sum()
            + (jout * x["w_jout"] / p).sum() + (jlse * x["w_jlse"] / p).sum())
    grads = torch.autograd.grad(loss, leaves)
    errors = {"graphs_not_1": float(counter.frame_count != 1)}
    for n, g in zip(("q", "k", "v"), grads[:3]):
        errors[f"d{n}"] = rel_err(g, shard_sequence(ref[n], mesh))
    for n, g in zip(("jq", "jk", "jv"), grads[3:]):
        g = g.contiguous()
        if mesh.seq_group is not None:
            dist.all_reduce(g, group=mesh.seq_group)
        errors[f"d{n}"] = rel_err(g, ref[n])
    return errors


def plain_path_calls(mesh) -> dict[str, int]:
    """How many kernel backwards took an LSE gradient for losses that read only ``out``: none, at
    one rank and on a ring of Ulysses degree 1 with ``return_lse=True`` (nothing moves the LSE), and
    with ``return_lse=False`` anywhere. Reading the LSE takes them (a check that the count counts)."""
    seen = []
    original = kernel_autograd.backward_with_lse_grad
    kernel_autograd.backward_with_lse_grad = lambda *a, **kw: seen.append(1) or original(*a, **kw)
    counts = {}
    try:
        x = _inputs(Case(0, 1, 1, "auto", "sdpa_cpu", SHAPES[1]), seed=7)
        leaves = [shard_sequence(x[n], mesh).clone().requires_grad_() for n in ("q", "k", "v")]
        runs = (("out_only", True, False), ("no_lse", False, False), ("reads_lse", True, True))
        for name, want_lse, read_lse in runs:
            seen.clear()
            res = usp_attention(*leaves, mesh=mesh, backend="sdpa_cpu", return_lse=want_lse, seq_len=11)
            loss = res.out.square().sum() + (res.lse.sum() if read_lse else 0)
            torch.autograd.grad(loss, leaves)
            counts[name] = len(seen)
    finally:
        kernel_autograd.backward_with_lse_grad = original
    return counts


def run_grid(world: int) -> dict[str, object]:
    results, meshes = {}, {}
    for i, case in enumerate(cases(world)):
        key = (case.ulysses, case.ring)
        if key not in meshes:
            meshes[key] = single_rank_mesh() if world == 1 else init_usp(ulysses_degree=case.ulysses,
                                                                         ring_degree=case.ring)
        try:
            results[case.id] = run_case(case, meshes[key], seed=i)
        except Exception as exc:  # recorded, asserted by the parent
            results[case.id] = f"{type(exc).__name__}: {exc}"
    checks = {1: [("compiled", compiled_case, (1, 1)), ("plain_path", plain_path_calls, (1, 1))],
              2: [("plain_path", plain_path_calls, (1, 2))],
              4: [("compiled", compiled_case, (2, 2)), ("plain_path", plain_path_calls, (1, 4))]}[world]
    for name, fn, grid in checks:
        try:
            results[name] = fn(meshes[grid])
        except Exception as exc:  # recorded, asserted by the parent
            results[name] = f"{type(exc).__name__}: {exc}"
    return results


@pytest.fixture(scope="module")
def grid_results():
    return {1: [run_grid(1)], **run_spawned_worlds(run_grid, (2, 4))}


ALL_CASES = cases(1) + cases(2) + cases(4)


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id for c in ALL_CASES])
def test_gradients_match_float64_reference(grid_results, case: Case):
    for rank, res in enumerate(grid_results[case.world]):
        errors = res[case.id]
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        worst = {k: v for k, v in errors.items() if not v <= TOL}
        assert not worst, f"rank {rank}: errors above {TOL}: {worst}"


@pytest.mark.parametrize("world", [1, 4])
def test_compiled_call_with_lse_gradient(grid_results, world):
    for rank, res in enumerate(grid_results[world]):
        errors = res["compiled"]
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        assert max(errors.values()) <= TOL, f"rank {rank}: {errors}"


@pytest.mark.parametrize("world", [1, 2, 4])
def test_loss_reading_only_out_keeps_the_plain_backward(grid_results, world):
    for rank, res in enumerate(grid_results[world]):
        counts = res["plain_path"]
        assert not isinstance(counts, str), f"rank {rank}: {counts}"
        assert counts["out_only"] == 0 and counts["no_lse"] == 0 and counts["reads_lse"] > 0, f"rank {rank}: {counts}"
