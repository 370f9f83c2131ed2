"""Kernels on CPU: each backend and the blockwise (simulated ring) schedule against float64 maths.

Tolerances: float64 1e-12 (only float64 rounding); float32 1e-5, the project's bar: float32
rounding of D-long dot products, the fused CPU kernel's blocked softmax and a few merges reach
~2.5e-6 in gradients at D = 128.
"""
from __future__ import annotations

import pytest
import torch

from tests.reference import attention_ref
from usp_dit.kernels import get_backend
from usp_dit.kernels.blockwise import blockwise_backward, blockwise_forward
from usp_dit.merge import LSEMerger
from usp_dit.testing import rel_err

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _case(b, s, h, hk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, hk, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


@pytest.mark.parametrize("name", ["reference", "sdpa_cpu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("shape", [(1, 29, 4, 4, 64), (2, 17, 8, 2, 128), (1, 6, 3, 1, 64)])
def test_blockwise_matches_reference(name, dtype, n, shape):
    backend = get_backend(name)
    q, k, v, dout = _case(*shape, dtype=dtype)
    scale = shape[-1] ** -0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_ref(*leaves, scale)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout)
    qc, kc, vc, doc = (t.to(dtype) for t in (q, k, v, dout))
    out, lse = blockwise_forward(qc, kc, vc, backend, scale, n)
    grads = blockwise_backward(doc, qc, kc, vc, out, lse, backend, scale, n)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    errors = [rel_err(out, ref_out), rel_err(lse, ref_lse)] + [rel_err(a, b) for a, b in zip(grads, ref_grads)]
    assert max(errors) <= TOL[dtype], errors


def test_merge_with_empty_side_is_exact():
    """A block with no keys (lse = -inf) leaves the running result unchanged."""
    out = torch.randn(1, 3, 2, 4)
    lse = torch.randn(1, 3, 2)
    m = LSEMerger()
    m.add(out, lse)
    m.add(torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    merged_out, merged_lse = m.result(torch.float32)
    assert torch.equal(merged_out, out) and torch.equal(merged_lse, lse)
