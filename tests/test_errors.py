"""Bad input and impossible combinations raise clear errors (single process, no process group).

Kernel choice ("auto", the registry, install lines) is tested in tests/test_kernel_policy.py."""
from __future__ import annotations

import pytest
import torch

import usp_dit
from usp_dit import init_usp, usp_attention
from usp_dit.kernels import get_backend, registry
from usp_dit.kernels.protocol import BackendCaps


def _qkv(s=5, h=4, hk=4, d=16, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(0)
    make = lambda heads: torch.randn(1, s, heads, d, generator=g, dtype=dtype).requires_grad_(grad)  # noqa: E731
    return make(h), make(hk), make(hk)


def test_degrees_must_fit_world_size():
    with pytest.raises(ValueError, match="world_size=1 is not a multiple of .*=2"):
        init_usp(ulysses_degree=2)
    with pytest.raises(ValueError, match="ring_degree must be a positive int, got 0"):
        init_usp(ring_degree=0)
    mesh = init_usp()  # world size 1 needs no process group
    assert mesh.device_mesh is None and mesh.sequence_degree == 1
    assert not torch.distributed.is_initialized()


def test_shape_errors_name_the_argument():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="q must be"):
        usp_attention(q[0], k, v)
    with pytest.raises(ValueError, match="k and v must have the same shape"):
        usp_attention(q, k, v[:, :3])
    with pytest.raises(ValueError, match=r"q heads \(4\) must be a multiple of k/v heads \(3\)"):
        usp_attention(q, k[:, :, :3], v[:, :, :3])
    with pytest.raises(ValueError, match="share a dtype"):
        usp_attention(q, k.double(), v.double())
    with pytest.raises(ValueError, match="must be given together"):
        usp_attention(q, k, v, joint_q=q)
    with pytest.raises(ValueError, match="joint_k must be"):
        usp_attention(q, k, v, joint_q=q, joint_k=k[:, :, :2], joint_v=v)


class _ForwardOnly:
    name = "test_forward_only"
    caps = BackendCaps(frozenset({"cpu"}), frozenset({torch.float32}), 256, supports_backward=False)

    def available(self):
        return True

    def require(self):
        return None

    def forward(self, q, k, v, scale):
        return get_backend("reference").forward(q, k, v, scale)


class _Missing(_ForwardOnly):
    name = "test_missing"

    def available(self):
        return False

    def require(self):
        raise RuntimeError("test_missing needs a package: pip install test-missing-kernel")


def test_forward_only_backend_under_autograd_raises(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, _ForwardOnly.name, _ForwardOnly())
    q, k, v = _qkv()
    out = usp_attention(q, k, v, backend="test_forward_only").out  # fine without gradients
    assert out.shape == q.shape
    q, k, v = _qkv(grad=True)
    with pytest.raises(NotImplementedError, match="no backward.*backends with a backward here: .*reference"):
        usp_attention(q, k, v, backend="test_forward_only")


def test_missing_package_raises_runtime_error_with_install_line(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, _Missing.name, _Missing())
    q, k, v = _qkv()
    with pytest.raises(RuntimeError, match="pip install test-missing-kernel"):
        usp_attention(q, k, v, backend="test_missing")


def test_lse_gradient_is_exact_not_dropped():
    """Once refused, now exact (Note [LSE gradient]): a loss that reads the LSE gets its gradient,
    against float64 autograd through the scores (tests/test_lse_grad.py covers the grids)."""
    q, k, v = _qkv(dtype=torch.float64, grad=True)
    out, _, lse, _ = usp_attention(q, k, v, return_lse=True)
    got = torch.autograd.grad(out.sum() + 3.0 * lse.sum(), (q, k, v))
    scores = torch.einsum("bshd,bthd->bhst", q, k) * q.shape[-1] ** -0.5
    ref_out = torch.einsum("bhst,bthd->bshd", scores.softmax(-1), v)
    ref_lse = scores.logsumexp(-1).transpose(1, 2)  # (B, S, H)
    ref = torch.autograd.grad(ref_out.sum() + 3.0 * ref_lse.sum(), (q, k, v))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)  # float64: rounding only


def test_world_size_one_joint_and_empty_joint():
    q, k, v = _qkv(s=6)
    jq, jk, jv = _qkv(s=3)
    out, jout, _, _ = usp_attention(q, k, v, joint_q=jq, joint_k=jk, joint_v=jv, mesh=usp_dit.single_rank_mesh())
    assert out.shape == q.shape and jout.shape == jq.shape
    out0, jout0, _, _ = usp_attention(q, k, v, joint_q=jq[:, :0], joint_k=jk[:, :0], joint_v=jv[:, :0])
    torch.testing.assert_close(out0, usp_attention(q, k, v).out, rtol=0, atol=0)
    assert jout0.shape == (1, 0, 4, 16)


class _NoLSE(_ForwardOnly):
    name = "test_no_lse"
    caps = BackendCaps(frozenset({"cpu"}), frozenset({torch.float32}), 256, supports_backward=False, returns_lse=False)

    def forward(self, q, k, v, scale):
        return get_backend("reference").forward(q, k, v, scale)[0], None


def test_backend_without_lse_refused_where_lse_is_needed(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, _NoLSE.name, _NoLSE())
    q, k, v = _qkv()
    torch.testing.assert_close(usp_attention(q, k, v, backend="test_no_lse").out, usp_attention(q, k, v, backend="reference").out)
    with pytest.raises(NotImplementedError, match="returns no log-sum-exp, which return_lse=True needs"):
        usp_attention(q, k, v, backend="test_no_lse", return_lse=True)
    ring_mesh = usp_dit.USPMesh(usp_dit.USPConfig(ring_degree=2), dp_degree=1, device_type="cpu")
    with pytest.raises(NotImplementedError, match="ring_degree=2 .*backend that returns one: .*reference"):
        usp_attention(q, k, v, backend="test_no_lse", mesh=ring_mesh)


def test_ring_schedule_must_be_known():
    with pytest.raises(ValueError, match=r"ring_schedule must be one of \('auto', 'stream', 'gather_merge', 'gather_one_call'\) \(or an old name: \['allgather', 'gather'\]\), got 'ring'"):
        init_usp(ring_schedule="ring")
    assert usp_dit.USPConfig(ring_degree=2, ring_schedule="gather").ring_schedule == "gather_merge"  # 0.1 name
    assert usp_dit.USPConfig(ring_degree=2, ring_schedule="allgather").ring_schedule == "gather_one_call"
