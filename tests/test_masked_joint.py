"""Masked joint tokens (``usp_attention(joint_mask=...)``, Note [masked joint tokens]) against a
float64 reference that drops the masked keys, on one process and on CPU gloo grids of 2 and 4 ranks.

The masks of a batch of 2 differ per element: a prefix, holes, every joint key masked (element 1 of
one mask: the queries then see the video keys only) and none masked. Every case checks out, LSE,
joint out / LSE (every row: a masked token's own row attends over the keys that are) and the
gradients of q, k, v and the joint inputs (joint gradients summed over the sequence group), on
every grid with every ring schedule forced, float32 and float64, the CPU kernel and the reference.

Tolerances (max |err| / max |ref|): float64 1e-10 (only float64 rounding remains); float32 1e-5,
the suite's bar (float32 rounding of 64-long dot products and a few LSE merges stays near 1e-6).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

from tests.reference import masked_attention_ref
from usp_dit import init_usp, shard_sequence, single_rank_mesh, usp_attention
from usp_dit.kernels import get_backend
from usp_dit.testing import rel_err, run_spawned_worlds

TOL = {torch.float32: 1e-5, torch.float64: 1e-10}
MASKS = {
    "prefix_none": [[1, 1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1]],
    "holes_all": [[0, 1, 1, 0, 1, 0, 1], [0, 0, 0, 0, 0, 0, 0]],
}
GRIDS = {1: [(1, 1)], 2: [(2, 1), (1, 2)], 4: [(2, 2), (4, 1), (1, 4)]}
SCHEDULES = ("stream", "gather_merge", "gather_one_call")


@dataclass(frozen=True)
class Case:
    world: int
    ulysses: int
    ring: int
    dtype: torch.dtype
    backend: str
    mask: str
    seq: int
    kv_heads: int
    schedule: str = "auto"

    @property
    def id(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        grid = f"w{self.world}-u{self.ulysses}r{self.ring}-{self.schedule}"
        return f"{grid}-{dt}-{self.backend}-{self.mask}-s{self.seq}kv{self.kv_heads}"


def cases(world: int) -> list[Case]:
    return [
        Case(world, u, r, dtype, backend, mask, seq, kv, schedule)
        for (u, r) in GRIDS[world]
        for schedule in (SCHEDULES if r > 1 else ("auto",))
        for dtype in (torch.float32, torch.float64)
        for backend in ("auto", "reference")
        for mask, seq, kv in (("prefix_none", 13, 4), ("holes_all", 11, 2))
    ]


def _inputs(case: Case, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t, h, d = 2, 7, 4, 64
    shapes = {"q": (b, case.seq, h, d), "k": (b, case.seq, case.kv_heads, d), "v": (b, case.seq, case.kv_heads, d),
              "jq": (b, t, h, d), "jk": (b, t, case.kv_heads, d), "jv": (b, t, case.kv_heads, d),
              "g_out": (b, case.seq, h, d), "g_joint": (b, t, h, d)}
    x = {n: torch.randn(s, generator=g, dtype=torch.float64) for n, s in shapes.items()}
    x["mask"] = torch.tensor(MASKS[case.mask], dtype=torch.bool)
    return x


def _reference(x: dict[str, torch.Tensor], scale: float):
    """Attention over [sequence; joint] for both query sets, masked joint keys dropped (float64)."""
    names = ("q", "k", "v", "jq", "jk", "jv")
    leaves = {n: x[n].clone().requires_grad_() for n in names}
    n = x["q"].shape[1]
    keys = torch.cat([torch.ones(x["q"].shape[0], n, dtype=torch.bool), x["mask"]], 1)
    cat = [torch.cat([leaves[a], leaves[b]], 1) for a, b in (("q", "jq"), ("k", "jk"), ("v", "jv"))]
    out, lse = masked_attention_ref(*cat, scale, keys[:, None, None, :])
    loss = (out[:, :n] * x["g_out"]).sum() + (out[:, n:] * x["g_joint"]).sum()
    grads = dict(zip(names, torch.autograd.grad(loss, [leaves[m] for m in names])))
    return {"out": out[:, :n], "lse": lse[:, :n], "joint_out": out[:, n:], "joint_lse": lse[:, n:]}, grads


def run_case(case: Case, mesh, seed: int) -> dict[str, float]:
    """Relative errors of every output and gradient of one case on this rank."""
    x = _inputs(case, seed)
    ref, ref_grads = _reference(x, 64 ** -0.5)
    dt, p = case.dtype, mesh.sequence_degree
    leaves = {n: shard_sequence(x[n], mesh).to(dt).clone().requires_grad_() for n in ("q", "k", "v")}
    leaves.update({n: x[n].to(dt).clone().requires_grad_() for n in ("jq", "jk", "jv")})
    out, jout, lse, jlse = usp_attention(
        leaves["q"], leaves["k"], leaves["v"], joint_q=leaves["jq"], joint_k=leaves["jk"], joint_v=leaves["jv"],
        joint_mask=x["mask"], mesh=mesh, backend=case.backend, return_lse=True, ring_schedule=case.schedule,
    )
    loss = (out * shard_sequence(x["g_out"], mesh).to(dt)).sum() + (jout * (x["g_joint"] / p).to(dt)).sum()
    grads = dict(zip(leaves, torch.autograd.grad(loss, list(leaves.values()))))
    errors = {"out": rel_err(out, shard_sequence(ref["out"], mesh)),
              "lse": rel_err(lse, shard_sequence(ref["lse"], mesh)),
              "joint_out": rel_err(jout, ref["joint_out"]), "joint_lse": rel_err(jlse, ref["joint_lse"])}
    for n in ("q", "k", "v"):
        errors[f"d{n}"] = rel_err(grads[n], shard_sequence(ref_grads[n], mesh))
    for n in ("jq", "jk", "jv"):
        g = grads[n].contiguous()
        if mesh.seq_group is not None:
            dist.all_reduce(g, group=mesh.seq_group)  # per-rank partials sum to the full gradient
        errors[f"d{n}"] = rel_err(g, ref_grads[n])
    return errors


def run_grid(world: int) -> dict[str, dict[str, float] | str]:
    results, meshes = {}, {}
    for i, case in enumerate(cases(world)):
        key = (case.ulysses, case.ring)
        if key not in meshes:
            meshes[key] = init_usp(ulysses_degree=case.ulysses, ring_degree=case.ring) if world > 1 else single_rank_mesh()
        try:
            results[case.id] = run_case(case, meshes[key], seed=i)
        except Exception as exc:  # recorded, asserted by the parent
            results[case.id] = f"{type(exc).__name__}: {exc}"
    return results


@pytest.fixture(scope="module")
def grid_results():
    return {1: [run_grid(1)], **run_spawned_worlds(run_grid, (2, 4))}


ALL_CASES = cases(1) + cases(2) + cases(4)


@pytest.mark.parametrize("case", ALL_CASES, ids=[c.id for c in ALL_CASES])
def test_matches_float64_reference(grid_results, case: Case):
    tol = TOL[case.dtype]
    for rank, res in enumerate(grid_results[case.world]):
        errors = res[case.id]
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        worst = {k: v for k, v in errors.items() if not v <= tol}
        assert not worst, f"rank {rank}: errors above {tol}: {worst}"


@pytest.mark.parametrize("name", ["reference", "sdpa_cpu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_kernel_key_mask(name: str, dtype: torch.dtype):
    """The protocol's ``key_mask`` on each CPU kernel: out, LSE and (given the final out / LSE) the
    gradients equal the masked reference; a batch element with every key masked gets out 0 and
    lse -inf (what an LSE merge needs)."""
    backend = get_backend(name)
    g = torch.Generator().manual_seed(3)
    q, dout = (torch.randn(2, 5, 4, 32, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(2, 9, 2, 32, generator=g, dtype=torch.float64) for _ in range(2))
    mask = torch.tensor([[1, 0, 1, 1, 0, 0, 1, 1, 0], [0] * 9], dtype=torch.bool)
    out, lse = backend.forward(q.to(dtype), k.to(dtype), v.to(dtype), 0.3, key_mask=mask)
    assert torch.isneginf(lse[1]).all() and (out[1] == 0).all()
    leaves = [t[:1].clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = masked_attention_ref(*leaves, 0.3, mask[:1, None, None, :])
    tol = TOL[dtype]
    assert rel_err(out[:1], ref_out) <= tol and rel_err(lse[:1], ref_lse) <= tol
    ref_grads = torch.autograd.grad((ref_out * dout[:1]).sum(), leaves)
    grads = backend.backward(dout[:1].to(dtype), *(t[:1].to(dtype) for t in (q, k, v)), out[:1], lse[:1],
                             0.3, key_mask=mask[:1])
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) <= tol


def test_joint_mask_refusals():
    q = torch.randn(2, 5, 4, 16)
    jq = torch.randn(2, 3, 4, 16)
    with pytest.raises(ValueError, match="joint_mask was given without"):
        usp_attention(q, q, q, joint_mask=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match=r"joint_mask must be \(batch, seq_joint\) = \(2, 3\)"):
        usp_attention(q, q, q, joint_q=jq, joint_k=jq, joint_v=jq, joint_mask=torch.ones(2, 4, dtype=torch.bool))
