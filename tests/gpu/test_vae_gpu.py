"""The parallel VAE's CUDA GroupNorm (SyncBatchNorm's kernels; skipped without CUDA, run on the lent
H200) against ``nn.GroupNorm`` on the whole tensor.

The tensor's rows are cut into 3 uneven pieces; each piece is normalised as its rank would be, the
other ranks' statistics standing in for the gather (``norm._gather_stats`` returns every piece's
``local_stats``), and the pieces are put back together. float32: <= 1e-5 relative to the stock
output (only the order of the float32 sums differs). bf16: the error against a float64 reference
at most 2x the stock kernel's own plus 1e-5 (the rule of tests/gpu/test_backends_gpu.py).
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from usp_dit.pipelines.vae import norm as vae_norm
from usp_dit.pipelines.vae.halo import RowGroup, decoding
from usp_dit.testing import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 64, 37, 29), (1, 32, 5, 41, 23)])
def test_cuda_group_norm_over_pieces_equals_group_norm(dtype, shape):
    g = torch.Generator("cuda").manual_seed(0)
    gn = torch.nn.GroupNorm(8, shape[1], eps=1e-6).cuda()
    with torch.no_grad():
        gn.weight.copy_(torch.randn(shape[1], generator=g, device="cuda"))
        gn.bias.copy_(torch.randn(shape[1], generator=g, device="cuda"))
    x64 = torch.randn(shape, generator=g, device="cuda", dtype=torch.float64) * 3 + 1.5
    x = x64.to(dtype)
    ref64 = torch.nn.functional.group_norm(x.double(), 8, gn.weight.double(), gn.bias.double(), gn.eps)
    stock = gn.to(dtype)(x) if dtype == torch.float32 else torch.nn.functional.group_norm(
        x, 8, gn.weight.to(dtype), gn.bias.to(dtype), gn.eps)
    sizes = (shape[-2] // 3 + 2, shape[-2] // 3, shape[-2] - 2 * (shape[-2] // 3) - 2)
    pieces = list(x.split(sizes, dim=-2))
    gn = gn.to(dtype)
    every = torch.stack([vae_norm.local_stats(gn, p.contiguous()) for p in pieces])
    out = []
    with torch.no_grad(), mock.patch.object(vae_norm, "_gather_stats", lambda t, group: every):
        for rank, piece in enumerate(pieces):
            with decoding(RowGroup(None, rank, sizes)):
                out.append(vae_norm.group_norm_forward(gn, piece))
    out = torch.cat(out, dim=-2)
    assert out.dtype == dtype and out.shape == x.shape
    if dtype == torch.float32:
        assert rel_err(out, stock) <= 1e-5
    else:
        assert rel_err(out.double(), ref64) <= 2 * rel_err(stock.double(), ref64) + 1e-5
