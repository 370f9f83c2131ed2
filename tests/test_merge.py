"""LSEMerger (usp_dit.attention.merge) without processes: partial (out, lse) results merged exactly.

Tolerance: float64 1e-12 against a merge written out from the definition (only float64 rounding).
"""
from __future__ import annotations

import pytest
import torch

from usp_dit.attention.merge import LSEMerger
from usp_dit.testing import rel_err


def test_merge_with_empty_side_is_exact():
    """A block with no keys (lse = -inf) leaves the running result unchanged."""
    out = torch.randn(1, 3, 2, 4)
    lse = torch.randn(1, 3, 2)
    m = LSEMerger()
    m.add(out, lse)
    m.add(torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    merged_out, merged_lse = m.result(torch.float32)
    assert torch.equal(merged_out, out) and torch.equal(merged_lse, lse)


def _partials(g: torch.Generator, blocks: int, shape=(2, 5, 3, 8)):
    """``blocks`` partial results (out, lse) of the same queries, lse of varied scale, float64."""
    outs = torch.randn(blocks, *shape, generator=g, dtype=torch.float64)
    lses = 10 * torch.randn(blocks, *shape[:3], generator=g, dtype=torch.float64)
    return outs, lses


def _merged_ref(outs: torch.Tensor, lses: torch.Tensor):
    """The exact merge: softmax weights over the blocks' LSEs."""
    lse = torch.logsumexp(lses, dim=0)
    return (torch.exp(lses - lse).unsqueeze(-1) * outs).sum(0), lse


@pytest.mark.parametrize("plan", [[1], [1, 1, 1], [3], [1, 4], [2, 1, 3], [1, 1, 2, 4]])
def test_merger_stacks_match_exact_merge(plan):
    """Blocks merged one by one, as stacks, or finished straight into float32: all equal the
    exact merge to float64 rounding (1e-12); the float32 finish to float32 rounding (1e-6)."""
    g = torch.Generator().manual_seed(len(plan))
    outs, lses = _partials(g, sum(plan))
    ref_out, ref_lse = _merged_ref(outs, lses)
    for finish in (False, True):
        m, i = LSEMerger(), 0
        for j, size in enumerate(plan):
            part = (outs[i:i + size], lses[i:i + size])
            i += size
            if finish and j == len(plan) - 1:
                out, lse = m.finish(torch.float32, *part)
            else:
                m.add_stack(*part)
        if not finish:
            out, lse = m.result(torch.float64)
        tol = 1e-6 if finish else 1e-12
        assert out.dtype == (torch.float32 if finish else torch.float64)
        assert rel_err(out, ref_out) <= tol and rel_err(lse, ref_lse) <= 1e-12


def test_merger_all_empty_blocks_give_zero_and_minus_inf():
    outs = torch.randn(3, 1, 2, 2, 4, dtype=torch.float64)
    lses = torch.full((3, 1, 2, 2), float("-inf"), dtype=torch.float64)
    m = LSEMerger()
    out, lse = m.finish(torch.float64, outs, lses)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_merger_does_not_modify_its_first_block():
    """The first block is held without a copy; merging must not write into it."""
    outs, lses = _partials(torch.Generator().manual_seed(3), 3)
    first = outs[0].clone(), lses[0].clone()
    m = LSEMerger()
    m.add(outs[0], lses[0])
    m.add_stack(outs[1:], lses[1:])
    assert torch.equal(outs[0], first[0]) and torch.equal(lses[0], first[1])
