"""Kernel choice without processes: the registry, what ``backend="auto"`` picks (its table, call
sizes, per-call costs), the optional kernels' flags and install lines, the kernels report."""
from __future__ import annotations

import pytest
import torch

import usp_dit
from usp_dit import usp_attention
from usp_dit.kernels import get_backend, list_backends, policy, registry, select_backend
from usp_dit.kernels.protocol import BackendCaps


def _qkv(s=5, h=4, hk=4, d=16, dtype=torch.float32, grad=False):
    g = torch.Generator().manual_seed(0)
    make = lambda heads: torch.randn(1, s, heads, d, generator=g, dtype=dtype).requires_grad_(grad)  # noqa: E731
    return make(h), make(hk), make(hk)


def test_registry_and_selection():
    names = list_backends()
    for name in ("reference", "sdpa_cpu", "sdpa_cudnn", "sdpa_flash", "sdpa_efficient"):
        assert name in names
        assert isinstance(get_backend(name).caps.supports_backward, bool)
    with pytest.raises(ValueError, match="backend='nope' is not registered"):
        get_backend("nope")
    assert select_backend("auto", "cpu", torch.float32, 64, True).name == "sdpa_cpu"
    assert select_backend("auto", "cpu", torch.float16, 64, True).name == "reference"
    with pytest.raises(NotImplementedError, match="backend='sdpa_cudnn' cannot run this case: device 'cpu'"):
        select_backend("sdpa_cudnn", "cpu", torch.bfloat16, 64, False)
    with pytest.raises(NotImplementedError, match="head_dim=264"):  # any head_dim up to 256 (padded to x 8)
        select_backend("sdpa_flash", "cuda", torch.bfloat16, 264, False)


def test_auto_choice_is_logged_once(caplog):
    policy._SELECTED.clear()
    q, k, v = _qkv(d=24)
    with caplog.at_level("INFO", logger="usp_dit"):
        usp_attention(q, k, v)
        usp_attention(q, k, v)
    chose = [r for r in caplog.records if "chose 'sdpa_cpu'" in r.getMessage()]
    assert len(chose) == 1 and "head_dim=24" in chose[0].getMessage()


def test_flash_attn_4_registered_with_flags_and_install_line():
    """FA4 is registered with a backward and an LSE; without the package (or a GPU) it says how to
    install it, and ``auto`` on CPU never picks it."""
    backend = get_backend("flash_attn_4")
    assert backend.caps.supports_backward and backend.caps.returns_lse
    assert backend.caps.why_not("cuda", torch.bfloat16, 128, True) is None
    assert "head_dim=264" in backend.caps.why_not("cuda", torch.bfloat16, 264, False)
    if not backend.available():
        with pytest.raises(RuntimeError, match=r"pip install --pre flash-attn-4"):
            select_backend("flash_attn_4", "cuda", torch.bfloat16, 128, False)
    assert select_backend("auto", "cpu", torch.float32, 128, False).name == "sdpa_cpu"


@pytest.mark.parametrize(
    "name, backward, install",
    [("flash_attn_2", True, r"pip install 'flash-attn>=2.7'"), ("flashinfer", False, r"pip install flashinfer-python")],
)
def test_optional_kernels_registered_with_flags_and_install_line(name, backward, install):
    """FlashAttention 2 (with a backward) and FlashInfer (forward only) both return an LSE; without
    their package (or a GPU) naming them says how to install it; ``auto`` on CPU never picks them."""
    backend = get_backend(name)
    assert backend.caps.returns_lse and backend.caps.supports_backward is backward
    assert backend.caps.why_not("cuda", torch.bfloat16, 128, backward) is None
    assert backend.caps.why_not("cuda", torch.float32, 128, False) is not None
    if not backend.available():
        with pytest.raises(RuntimeError, match=install):
            select_backend(name, "cuda", torch.bfloat16, 128, False)
    if not backward:
        with pytest.raises(NotImplementedError, match=f"backend='{name}' cannot run this case: it has no backward.*sdpa_cudnn"):
            select_backend(name, "cuda", torch.bfloat16, 128, True)
    assert select_backend("auto", "cpu", torch.float32, 128, False).name == "sdpa_cpu"


def test_flash_attn_2_refuses_releases_before_2_7():
    """2.7 changed the private call signatures the adapter uses; older releases read as absent."""
    from usp_dit.kernels.flash2 import _version_tuple

    assert _version_tuple("2.8.3.post2") == (2, 8) and _version_tuple("2.6.3") < (2, 7)
    assert _version_tuple("3.0.0b1") >= (2, 7) and _version_tuple("dev") == (0, 0)


class _BigCallsOnly:
    """A kernel with a high per-call cost: "auto" should use it for big calls only."""

    name = "test_big_calls_only"
    caps = BackendCaps(frozenset({"cpu"}), frozenset({torch.float32}), 256, supports_backward=False, min_call_flops=1e6)
    calls = 0

    def available(self):
        return True

    def require(self):
        return None

    def forward(self, q, k, v, scale):
        type(self).calls += 1
        return get_backend("reference").forward(q, k, v, scale)


def test_auto_passes_over_a_backend_for_calls_below_its_min_flops(monkeypatch):
    monkeypatch.setitem(registry._REGISTRY, _BigCallsOnly.name, _BigCallsOnly())
    monkeypatch.setitem(policy.AUTO_TABLE, "cpu", tuple(map(policy.AutoRule, (_BigCallsOnly.name, "sdpa_cpu", "reference"))))
    monkeypatch.setattr(policy, "_SELECTED", {})
    small = _qkv(s=8, h=2, hk=2, d=16)  # 4 * 8 * 8 * 2 * 16 = 8e3 flops
    big = _qkv(s=128, h=4, hk=4, d=16)  # 4 * 128 * 128 * 4 * 16 = 4.2e6 flops
    usp_attention(*small)
    assert _BigCallsOnly.calls == 0
    usp_attention(*big)
    assert _BigCallsOnly.calls == 1
    assert select_backend("auto", "cpu", torch.float32, 16, False, 10.0).name == "sdpa_cpu"
    assert select_backend("auto", "cpu", torch.float32, 16, False, None).name == _BigCallsOnly.name
    assert select_backend(_BigCallsOnly.name, "cpu", torch.float32, 16, False, 10.0).name == _BigCallsOnly.name


def test_call_flops_estimate_follows_the_grid():
    """Ulysses: all keys, heads / U; stream ring: one block; gather ring: the remote blocks in one
    call; allgather: all keys; in training a ring counts its backward's one-block calls."""
    from usp_dit.attention.usp import _call_flops

    q, k, _ = _qkv(s=100, h=8, hk=8, d=16)  # a 100-token shard
    mesh = lambda u, r, sched="auto": usp_dit.USPMesh(  # noqa: E731
        usp_dit.USPConfig(ulysses_degree=u, ring_degree=r, ring_schedule=sched), dp_degree=1, device_type="cpu")
    assert _call_flops(q, k, None, mesh(1, 1)) == 4 * 100 * 100 * 8 * 16
    assert _call_flops(q, k, None, mesh(4, 1)) == 4 * 400 * 400 * 2 * 16
    assert _call_flops(q, k, None, mesh(1, 4, "stream")) == 4 * 100 * 100 * 8 * 16
    assert _call_flops(q, k, None, mesh(1, 4, "gather_merge")) == 4 * 100 * 300 * 8 * 16
    assert _call_flops(q, k, None, mesh(1, 4, "gather_one_call")) == 4 * 100 * 400 * 8 * 16
    # training: the ring's backward streams one block per call, whatever the forward schedule
    assert _call_flops(q, k, None, mesh(1, 4, "gather_one_call"), needs_grad=True) == 4 * 100 * 100 * 8 * 16
    assert _call_flops(q, k, None, mesh(4, 1), needs_grad=True) == 4 * 400 * 400 * 2 * 16


def test_kernels_report_lists_every_backend_and_the_auto_pick(capsys):
    """``python -m usp_dit.kernels``: one row per backend (an uninstalled one with its install
    line) and what "auto" picks for inference and training."""
    from usp_dit.kernels.__main__ import main

    assert main(["--device", "cpu", "--dtype", "float32", "--head-dim", "64"]) == 0
    out = capsys.readouterr().out
    for name in list_backends():
        assert f"| {name} | " in out
    assert "auto, inference: sdpa_cpu" in out and "auto, training:  sdpa_cpu" in out
    if not get_backend("flashinfer").available():
        assert "pip install flashinfer-python" in out


def test_auto_table_on_an_h200_with_every_kernel(monkeypatch):
    """The measured CUDA table (``policy.AUTO_TABLE``), as if FA3, FA4, FlashInfer and cuDNN were
    all installed: FA4 for training and head_dim 64 inference where calls are big enough for its
    per-call cost, FA3 otherwise; without FA3, FA4 then FlashInfer (inference) then cuDNN."""
    from usp_dit.kernels import get_backend

    have = {"flash_attn_3", "flash_attn_4", "flashinfer", "sdpa_cudnn"}
    for name in ("flash_attn_3", "flash_attn_4", "flashinfer", "sdpa_cudnn", "flash_attn_2", "sdpa_flash", "sdpa_efficient"):
        monkeypatch.setattr(get_backend(name), "available", lambda name=name: name in have)
    monkeypatch.setattr(policy, "_SELECTED", {})
    pick = lambda head_dim, grad, flops: select_backend("auto", "cuda", torch.bfloat16, head_dim, grad, flops).name  # noqa: E731
    big, small = 1e12, 1e10  # FA4's min_call_flops is 1.5e11
    assert (pick(128, True, big), pick(128, True, small)) == ("flash_attn_4", "flash_attn_3")
    assert (pick(128, False, big), pick(128, False, small)) == ("flash_attn_3", "flash_attn_3")
    assert (pick(64, False, big), pick(64, False, small)) == ("flash_attn_4", "flash_attn_3")
    have.discard("flash_attn_3")
    monkeypatch.setattr(policy, "_SELECTED", {})
    assert (pick(128, False, big), pick(128, False, small)) == ("flash_attn_4", "flashinfer")
    assert (pick(128, True, big), pick(128, True, small)) == ("flash_attn_4", "sdpa_cudnn")


def test_auto_rules_name_training_and_head_dims():
    rule = policy.AutoRule("x", training=False, max_head_dim=64)
    assert rule.applies(64, False) and not rule.applies(128, False) and not rule.applies(64, True)
    assert policy.AutoRule("x").applies(256, True)


def test_auto_on_torch_alone_takes_cudnn_for_a_head_dim_256_forward_and_flash_for_its_backward(monkeypatch):
    """With PyTorch's kernels alone (no FA3/FA4/FlashInfer), head_dim 256 inference goes to cuDNN,
    as PyTorch's own SDPA does (AuraFlow's 12 x 256: flash took 1.9x cuDNN's time on the H100,
    docs/PERFORMANCE.md); cuDNN's backward is kept to head_dim 128, so training takes flash, and
    naming cuDNN for a head_dim 256 backward says why not."""
    from usp_dit.kernels import get_backend

    have = {"sdpa_cudnn", "sdpa_flash", "sdpa_efficient"}
    for name in ("flash_attn_3", "flash_attn_4", "flashinfer", "flash_attn_2", *have):
        monkeypatch.setattr(get_backend(name), "available", lambda name=name: name in have)
    monkeypatch.setattr(policy, "_SELECTED", {})
    pick = lambda head_dim, grad: select_backend("auto", "cuda", torch.bfloat16, head_dim, grad, 1e12).name  # noqa: E731
    assert (pick(256, False), pick(256, True)) == ("sdpa_cudnn", "sdpa_flash")
    assert (pick(128, False), pick(128, True)) == ("sdpa_cudnn", "sdpa_cudnn")
    assert pick(264, False) == "sdpa_efficient"
    with pytest.raises(NotImplementedError, match="head_dim=256 has a forward only"):
        select_backend("sdpa_cudnn", "cuda", torch.bfloat16, 256, True)
