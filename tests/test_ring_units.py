"""The ring's schedule maths without processes (usp_dit.attention.ring) and the one-device ring simulator
(usp_dit.testing.blockwise) against float64 maths.

Tolerances: float64 1e-12 (only float64 rounding); float32 1e-5, the project's bar: float32
rounding of D-long dot products, the fused CPU kernel's blocked softmax and a few merges reach
~2.5e-6 in gradients at D = 128.
"""
from __future__ import annotations

import pytest
import torch

from tests.reference import attention_ref
from usp_dit.attention.ring import choose_schedule, gathered_sequence, remote_runs
from usp_dit.kernels import get_backend
from usp_dit.testing import rel_err
from usp_dit.testing.blockwise import blockwise_backward, blockwise_forward

TOL = {torch.float64: 1e-12, torch.float32: 1e-5}


def _case(b, s, h, hk, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s, hk, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, hk, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, s, h, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


@pytest.mark.parametrize("schedule", ["stream", "gather_merge", "gather_one_call"])
@pytest.mark.parametrize("name", ["reference", "sdpa_cpu"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n", [1, 2, 3, 5])
@pytest.mark.parametrize("shape", [(1, 29, 4, 4, 64), (2, 17, 8, 2, 128), (1, 6, 3, 1, 64)])
def test_blockwise_matches_reference(name, dtype, n, shape, schedule):
    backend = get_backend(name)
    q, k, v, dout = _case(*shape, dtype=dtype)
    scale = shape[-1] ** -0.5
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out, ref_lse = attention_ref(*leaves, scale)
    ref_grads = torch.autograd.grad(ref_out, leaves, dout)
    qc, kc, vc, doc = (t.to(dtype) for t in (q, k, v, dout))
    out, lse = blockwise_forward(qc, kc, vc, backend, scale, n, schedule)
    grads = blockwise_backward(doc, qc, kc, vc, out, lse, backend, scale, n)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    errors = [rel_err(out, ref_out), rel_err(lse, ref_lse)] + [rel_err(a, b) for a, b in zip(grads, ref_grads)]
    assert max(errors) <= TOL[dtype], errors


@pytest.mark.parametrize(
    "sizes, rank, runs",
    [
        ((4, 4, 4, 4), 0, [(1, 4, 4)]),
        ((4, 4, 4, 4), 2, [(0, 2, 4), (3, 4, 4)]),
        ((5, 5, 4, 4), 1, [(0, 1, 5), (2, 4, 4)]),
        ((5, 4, 0, 0), 0, [(1, 2, 4)]),  # empty blocks are skipped
        ((3, 3), 1, [(0, 1, 3)]),
        ((7,), 0, []),
    ],
)
def test_remote_runs(sizes, rank, runs):
    assert remote_runs(sizes, rank) == runs


@pytest.mark.parametrize(
    "block, ring, heads, kv_heads, expected",
    [
        (1152, 4, 24, 24, "gather_one_call"),  # Flux R=4: blocks shorter than one transfer's worth of compute
        (4444, 4, 48, 48, "gather_merge"),  # CogVideoX R=4: the local block hides most of the gather
        (11194, 4, 24, 24, "gather_merge"),  # Mochi R=4
        (5597, 8, 24, 24, "stream"),  # Mochi R=8: the stream ring hides every transfer, gather would not
        (5597, 8, 24, 6, "gather_merge"),  # the same with 4:1 grouped K/V: a quarter of the bytes travel
    ],
)
def test_auto_schedule_rule(block, ring, heads, kv_heads, expected):
    assert choose_schedule("auto", (block,) * ring, heads, kv_heads).name == expected
    assert choose_schedule("stream", (block,) * ring, heads, kv_heads).name == "stream"
    # the names of 0.1 still resolve
    assert choose_schedule("gather", (block,) * ring, heads, kv_heads).name == "gather_merge"
    assert choose_schedule("allgather", (block,) * ring, heads, kv_heads).name == "gather_one_call"


def test_gathered_sequence_drops_padding_and_appends_joint():
    """The "gather_one_call" schedule's fallback layout (batch > 1 or uneven blocks): each block's real
    tokens in rank order, then the joint tokens."""
    blocks = torch.arange(3 * 2 * 4 * 2 * 1, dtype=torch.float32).view(3, 2, 4, 2, 1)  # (R, B, L, Hk, D)
    joint = torch.full((2, 2, 2, 1), -1.0)
    uneven = gathered_sequence(blocks, (4, 3, 0), joint)
    expected = torch.cat([blocks[0], blocks[1][:, :3], joint], dim=1)
    torch.testing.assert_close(uneven, expected, rtol=0, atol=0)
    torch.testing.assert_close(gathered_sequence(blocks, (4, 4, 4), None), torch.cat(list(blocks), dim=1), rtol=0, atol=0)
