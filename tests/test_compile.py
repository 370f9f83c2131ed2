"""torch.compile traces through usp_attention (world size 1) without graph breaks, forward and backward.

Uses the "aot_eager" compiler backend: it traces forward and backward graphs exactly as inductor
would see them (a graph break fails ``fullgraph=True``) without spending minutes compiling C++ on
two cores. The result must equal eager to float32 rounding (1e-5): the traced graph may decompose
the projections and their gradient sums in another order; the attention kernels are the same.
"""
from __future__ import annotations

import pytest
import torch

from usp_dit import usp_attention


class _Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int, backend: str):
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.heads, self.backend = heads, backend

    def forward(self, x, text):
        b, s, c = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, c // self.heads).unbind(2)
        tq, tk, tv = self.qkv(text).view(b, text.shape[1], 3, self.heads, c // self.heads).unbind(2)
        out, jout, _, _ = usp_attention(q, k, v, joint_q=tq, joint_k=tk, joint_v=tv, backend=self.backend)
        return out.sum() + jout.square().sum()


@pytest.mark.parametrize("backend", ["sdpa_cpu", "reference"])
def test_compiled_equals_eager_without_graph_breaks(backend):
    torch.manual_seed(0)
    block = _Block(64, 4, backend)
    x, text = torch.randn(2, 9, 64), torch.randn(2, 5, 64)
    torch._dynamo.reset()
    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    loss_c = compiled(x, text)
    grads_c = torch.autograd.grad(loss_c, list(block.parameters()))
    loss_e = block(x, text)
    grads_e = torch.autograd.grad(loss_e, list(block.parameters()))
    torch.testing.assert_close(loss_c, loss_e, rtol=1e-6, atol=1e-6)
    for gc, ge in zip(grads_c, grads_e):
        torch.testing.assert_close(gc, ge, rtol=1e-5, atol=1e-6)
