"""Misuse across ranks and the fine-tuning patterns around an enabled transformer (issue 13).

One spawned group of 2 CPU gloo ranks runs every distributed check, one of 4 ranks the cfg x ring
handshake; the rest needs no process group.

* Model handshake (item 1): rank 1 passes hidden_states of another dtype, token count or batch,
  omits ``guidance`` or runs with grad enabled where rank 0 does not. Each call must raise the same
  ValueError on every rank, naming the field and both ranks' values, and the next correct call
  must match the one-rank output (the group survived).
* ``copy.deepcopy`` of an enabled Flux, CogVideoX and Mochi transformer (item 5): the copy
  matches the one-rank output, runs ITS OWN weights (doubling its ``proj_out`` changes its output
  and not the original's, and the copy then matches its own one-rank output), trains (gradients
  = one-process gradients) and is disabled independently of the original.
* Dropout on the replicated text stream (item 6): CogVideoX with dropout 0.2 and Mochi with its
  text feed-forward dropout set to 0.2, in train mode: the text stream after every block is the
  same on both ranks; the sharded rows' masks are each rank's own draw; backward is finite; a
  gradient-checkpointed copy has the same gradients (the recompute draws the same masks).
* ``ulysses_degree`` above the model's heads fails at ``enable_usp`` (item 8), for each family.
* A model on another rank's GPU fails at ``enable_usp`` (item 10): a pure check on fake devices.

Tolerances (max|err| / max|ref|, ``usp_dit.testing.rel_err``): 1e-5 against one rank, float32 (the
repository's bar: sharding only reorders float32 sums, a few 1e-7 on these sizes). The text stream
across ranks: 1e-6; each rank computes it with the same ops, but the feed-forward's matrix
products also hold the rank's video rows, whose count differs between ranks (27 tokens: 14 and
13), which may change the kernel's blocking and so the last bits; a mask per rank differs by O(1).
"""
from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from usp_dit import disable_usp, enable_usp
from usp_dit.pipelines import api, is_usp_enabled
from usp_dit.pipelines._replicated_dropout import ReplicaDropout
from usp_dit.pipelines.base import MISSING, check_model_device
from usp_dit.demo.tiny_flux import flux_inputs, tiny_flux_transformer
from usp_dit.demo.tiny_video import cogvideox_inputs, mochi_inputs, tiny_cogvideox, tiny_mochi
from usp_dit.testing import assert_no_crash, rel_err, run_spawned

TOL = 1e-5
TEXT_TOL = 1e-6
FAMILIES = ("flux", "cogvideox", "mochi")


# ---- shared helpers --------------------------------------------------------------------------


def _record(results: dict, key: str, fn: Callable[[], Any]) -> None:
    try:
        results[key] = fn()
    except Exception as exc:  # recorded, asserted by the parent
        results[key] = f"{type(exc).__name__}: {exc}"


def _flux_args(batch: int = 1, height: int = 8, width: int = 8, seed: int = 0) -> dict:
    args = flux_inputs(batch, height, width, 7, seed=seed)  # 64 image + 7 text tokens: odd over 2 ranks
    args["guidance"] = torch.full((batch,), 3.5)
    return args


def _build(family: str, num_heads: int = 6) -> tuple[torch.nn.Module, dict]:
    """A tiny transformer of ``family`` and its keyword arguments (same on every rank)."""
    if family == "flux":
        return tiny_flux_transformer(num_heads=min(num_heads, 4)), _flux_args()
    if family == "cogvideox":
        model = tiny_cogvideox("5b", num_heads=num_heads)
        return model, cogvideox_inputs(model, 3, 6, 6).kwargs()  # 27 video tokens
    model = tiny_mochi(num_heads=num_heads)
    return model, mochi_inputs(model, 3, 6, 6, valid=[6, 2]).kwargs()  # 27 tokens, padded prompts


def _out(model, kwargs: dict, grad: bool = False) -> torch.Tensor:
    with torch.set_grad_enabled(grad):
        return model(**kwargs, return_dict=False)[0]


def _spread(x: torch.Tensor) -> float:
    """max over ranks of max|x_rank - x_rank0| / max|x_rank0| (the same number on every rank)."""
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(pieces, x.detach().contiguous())
    return max(rel_err(p, pieces[0]) for p in pieces)


# ---- item 1: model handshake -----------------------------------------------------------------

# Rank 1's call in each case (rank 0 always makes the good call), and what the error must say.
HANDSHAKE_CASES = {
    "dtype": "hidden_states.dtype (rank 0: float32, rank 1: float64)",
    "tokens": "hidden_states.shape (rank 0: (1, 64, 16), rank 1: (1, 56, 16))",
    "batch": "hidden_states.shape (rank 0: (1, 64, 16), rank 1: (2, 64, 16))",
    "guidance": "guidance (rank 0: 'tensor', rank 1: not given)",
    "grad": "grad enabled (rank 0: False, rank 1: True)",
}


def _rank1_call(case: str, good: dict) -> tuple[dict, bool]:
    """(kwargs, grad enabled) of rank 1's bad call."""
    if case == "dtype":
        return {**good, "hidden_states": good["hidden_states"].double()}, False
    if case == "tokens":
        return _flux_args(height=8, width=7), False
    if case == "batch":
        return _flux_args(batch=2), False
    if case == "guidance":
        return {k: v for k, v in good.items() if k != "guidance"}, False
    return good, True


def _error_of(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _handshake_cases() -> dict[str, dict]:
    """Flux on ulysses 2: each bad call's error on this rank, then a good call's error vs one rank."""
    model, good = tiny_flux_transformer(), _flux_args()
    ref = _out(model, good)
    enable_usp(model, ulysses_degree=2)
    results = {}
    try:
        for case in HANDSHAKE_CASES:
            kwargs, grad = _rank1_call(case, good) if dist.get_rank() == 1 else (good, False)
            error = _error_of(lambda: _out(model, kwargs, grad))
            results[case] = {"error": error, "after": rel_err(_out(model, good), ref)}
    finally:
        disable_usp(model)
    return results


def _cfg_ring_handshake() -> dict:
    """Flux on cfg 2 x ring 2 (4 ranks): rank 3 alone passes float64. Its cfg group {1, 3} sees it;
    ranks 0 and 2 must raise too (through the sequence group's check)."""
    model, good = tiny_flux_transformer(), _flux_args(batch=2)
    ref = _out(model, good)
    enable_usp(model, ring_degree=2, cfg_degree=2)
    try:
        bad = {**good, "hidden_states": good["hidden_states"].double()} if dist.get_rank() == 3 else good
        error = _error_of(lambda: _out(model, bad))
        return {"error": error, "after": rel_err(_out(model, good), ref)}
    finally:
        disable_usp(model)


# ---- item 5: deep copies ----------------------------------------------------------------------


def _train_twin(twin, kwargs: dict) -> dict:
    """One train-mode backward of a weighted sum of the enabled ``twin``'s prediction: the loss
    weights and this rank's parameter gradients (then cleared, for the stock run to compare)."""
    weight = torch.randn(_out(twin, kwargs).shape, generator=torch.Generator().manual_seed(5))
    twin.train()
    (_out(twin, kwargs, grad=True) * weight).sum().backward()
    grads = {n: p.grad.clone() for n, p in twin.named_parameters() if p.grad is not None}
    twin.zero_grad(set_to_none=True)
    return {"weight": weight, "grads": grads}


def _deepcopy_case(family: str) -> dict[str, float]:
    model, kwargs = _build(family)
    ref = _out(model, kwargs)
    grid = {"ring_degree": 2} if family == "cogvideox" else {"ulysses_degree": 2}
    enable_usp(model, **grid)
    try:
        twin = copy.deepcopy(model)
        out, out_twin = _out(model, kwargs), _out(twin, kwargs)
        with torch.no_grad():
            twin.proj_out.weight.mul_(2.0)  # the copy's own weights now differ from the original's
        out_after, twin_after = _out(model, kwargs), _out(twin, kwargs)
        trained = _train_twin(twin, kwargs)
        original_untouched = all(p.grad is None for p in model.parameters())
        disable_usp(twin)
        twin.eval()
        ref_twin = _out(twin, kwargs)  # stock copy: its own (doubled) weights on one process
        twin.train()
        (_out(twin, kwargs, grad=True) * trained["weight"]).sum().backward()
        # docs/TRAINING.md: the mean of a parameter's gradient over the replica is the one-process one.
        stock_grads, worst_grad = dict(twin.named_parameters()), 0.0
        for name, grad in trained["grads"].items():
            dist.all_reduce(grad)
            worst_grad = max(worst_grad, rel_err(grad / dist.get_world_size(), stock_grads[name].grad))
        still = _out(model, kwargs)
        return {
            "copy_vs_one_rank": rel_err(out_twin, ref),
            "copy_equals_original": float(torch.equal(out_twin, out)),
            "original_unchanged": float(torch.equal(out_after, out)),
            "copy_changed": float(not torch.equal(twin_after, out_twin)),
            "copy_own_weights_vs_one_rank": rel_err(twin_after, ref_twin),
            "copy_grads_vs_one_process": worst_grad,
            "copy_has_grads": float(len(trained["grads"]) > 0),
            "original_got_no_grads": float(original_untouched),
            "copy_disabled_is_stock": float(not is_usp_enabled(twin) and "forward" not in twin.__dict__),
            "original_still_enabled": float(is_usp_enabled(model) and torch.equal(still, out)),
        }
    finally:
        disable_usp(model)


# ---- item 6: dropout on replicated tokens -----------------------------------------------------


def _text_streams(model, kwargs: dict, seed: int) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Every block's text-stream output (the second output of each block) and the prediction, in
    a grad-enabled forward with this rank's global RNG seeded with ``seed``."""
    streams: list[torch.Tensor] = []
    hooks = [b.register_forward_hook(lambda m, a, out: streams.append(out[1])) for b in model.transformer_blocks]
    torch.manual_seed(seed)
    try:
        out = _out(model, kwargs, grad=True)
    finally:
        for h in hooks:
            h.remove()
    return streams, out


def _set_text_dropout(model, family: str, p: float) -> None:
    """Mochi's config has no dropout: set it on the text feed-forward (and the video dropouts)."""
    if family == "mochi":
        for m in model.modules():
            if isinstance(m, torch.nn.Dropout):
                m.p = p


def _dropout_case(family: str) -> dict[str, float]:
    if family == "cogvideox":
        model = tiny_cogvideox("5b", dropout=0.2)
        kwargs = cogvideox_inputs(model, 3, 6, 6).kwargs()
    else:
        model, kwargs = _build("mochi")
        _set_text_dropout(model, family, 0.2)
    enable_usp(model, ulysses_degree=2)
    try:
        model.eval()
        eval_streams, _ = _text_streams(model, kwargs, seed=0)
        model.train()
        rank = dist.get_rank()
        streams, out = _text_streams(model, kwargs, seed=1000 + rank)  # each rank its own RNG, as in a run
        out.square().mean().backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        return {
            "text_spread_train": max(_spread(s) for s in streams),
            "text_spread_eval": max(_spread(s) for s in eval_streams),
            "dropout_active": float(not torch.equal(streams[0], eval_streams[0])),
            "grads_finite": float(bool(grads) and all(torch.isfinite(g).all() for g in grads)),
        }
    finally:
        disable_usp(model)


def _sharded_rows_own_mask() -> dict[str, float]:
    """CogVideoX's feed-forward dropout over [text (7); video shard]: the text rows' mask is the
    group's, the video rows' mask is the rank's own global-RNG draw (as stock dropout's)."""
    model = tiny_cogvideox("5b", dropout=0.5)
    kwargs = cogvideox_inputs(model, 3, 6, 6).kwargs()
    enable_usp(model, ulysses_degree=2)
    try:
        _out(model, kwargs)  # sets the call's text length
        dropout = model.transformer_blocks[0].ff.net[1]
        dropout.train()
        text_len = kwargs["encoder_hidden_states"].shape[1]
        x = torch.ones(1, text_len + 14, 64)  # 14 video rows on both ranks: equal shapes to compare
        torch.manual_seed(77 + dist.get_rank())
        y = dropout(x)
        torch.manual_seed(77 + dist.get_rank())
        own = F.dropout(x[:, text_len:], 0.5, True)
        return {
            "is_replica_dropout": float(isinstance(dropout, ReplicaDropout)),
            "text_mask_spread": _spread(y[:, :text_len]),
            "video_masks_differ": float(_spread(y[:, text_len:]) > 0),
            "video_mask_is_own_rng": float(torch.equal(y[:, text_len:], own)),
        }
    finally:
        disable_usp(model)


def _checkpointed_copy_same_grads() -> dict[str, float]:
    """Gradient checkpointing with dropout: the recompute must draw the forward's masks again.
    A deep copy starts from the same dropout state; with checkpointing its gradients must equal
    the original's without (same per-rank RNG seed for both runs)."""
    model = tiny_cogvideox("5b", dropout=0.2)
    kwargs = cogvideox_inputs(model, 3, 6, 6).kwargs()
    enable_usp(model, ring_degree=2)
    try:
        model.train()
        twin = copy.deepcopy(model)
        twin.enable_gradient_checkpointing()
        runs = [0]
        twin.transformer_blocks[0].register_forward_pre_hook(lambda m, a: runs.__setitem__(0, runs[0] + 1))
        grads = []
        for m in (model, twin):
            torch.manual_seed(31 + dist.get_rank())
            out = _out(m, kwargs, grad=True)
            params = [p for p in m.parameters() if p.requires_grad]
            grads.append(torch.autograd.grad(out.square().mean(), params, allow_unused=True))
        worst = max(rel_err(b, a) for a, b in zip(*grads) if a is not None)
        return {"checkpointed_vs_plain": worst, "block0_ran_twice": float(runs[0] == 2)}
    finally:
        disable_usp(model)


# ---- item 8: degrees the model cannot take ---------------------------------------------------


def _heads_case(family: str) -> dict:
    model, kwargs = _build(family, num_heads=1)
    ref = _out(model, kwargs)
    error = _error_of(lambda: enable_usp(model, ulysses_degree=2))
    untouched = not is_usp_enabled(model) and "forward" not in model.__dict__
    enable_usp(model, ring_degree=2)  # the ranks go on the ring instead: fine with one head
    try:
        ring = rel_err(_out(model, kwargs), ref)
    finally:
        disable_usp(model)
    return {"error": error, "untouched": untouched, "ring_vs_one_rank": ring}


# ---- the spawned groups ----------------------------------------------------------------------


def _two_ranks() -> dict[str, Any]:
    torch.manual_seed(0)
    results: dict[str, Any] = {}
    _record(results, "handshake", _handshake_cases)
    for family in FAMILIES:
        _record(results, f"deepcopy-{family}", lambda: _deepcopy_case(family))
        _record(results, f"heads-{family}", lambda: _heads_case(family))
    for family in ("cogvideox", "mochi"):
        _record(results, f"dropout-{family}", lambda: _dropout_case(family))
    _record(results, "dropout-own-rows", _sharded_rows_own_mask)
    _record(results, "dropout-checkpointing", _checkpointed_copy_same_grads)
    return results


def _four_ranks() -> dict[str, Any]:
    results: dict[str, Any] = {}
    _record(results, "cfg-ring-handshake", _cfg_ring_handshake)
    return results


@pytest.fixture(scope="module")
def two():
    per_rank = run_spawned(_two_ranks, 2)
    assert_no_crash(per_rank)
    return per_rank


@pytest.fixture(scope="module")
def four():
    per_rank = run_spawned(_four_ranks, 4)
    assert_no_crash(per_rank)
    return per_rank


def _values(per_rank: list[dict], key: str) -> list:
    out = []
    for rank, res in enumerate(per_rank):
        assert not isinstance(res[key], str), f"rank {rank}: {res[key]}"
        out.append(res[key])
    return out


# ---- item 1 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("case", list(HANDSHAKE_CASES))
def test_ranks_that_disagree_on_a_call_all_raise_and_the_group_survives(two, case):
    per_rank = [res[case] for res in _values(two, "handshake")]
    for rank, res in enumerate(per_rank):
        assert res["error"].startswith("ValueError: ranks of one USP group disagree"), f"rank {rank}: {res['error']}"
        assert HANDSHAKE_CASES[case] in res["error"], f"rank {rank}: {res['error']}"
        assert res["after"] <= TOL, f"rank {rank}: the next correct call is off by {res['after']:.2e}"
    assert per_rank[0]["error"] == per_rank[1]["error"], "the ranks raised different errors"


def test_cfg_ring_disagreement_raises_on_every_rank(four):
    for rank, res in enumerate(_values(four, "cfg-ring-handshake")):
        assert res["error"].startswith("ValueError:") and "hidden_states.dtype" in res["error"], f"rank {rank}: {res}"
        assert "rank 3: float64" in res["error"], f"rank {rank}: {res['error']}"
        assert res["after"] <= TOL, f"rank {rank}: {res}"


def test_call_fields_describe_containers_and_mode():
    fields: dict = {}
    api.describe_value("joint_attention_kwargs", {"scale": 0.5, "mask": torch.zeros(2, 3, dtype=torch.bool)}, fields)
    api.describe_value("samples", [torch.zeros(1, 4)], fields)
    assert fields == {
        "joint_attention_kwargs": "dict with keys ['mask', 'scale']",
        "joint_attention_kwargs['scale']": 0.5,
        "joint_attention_kwargs['mask']": "tensor",
        "joint_attention_kwargs['mask'].shape": (2, 3),
        "joint_attention_kwargs['mask'].dtype": torch.bool,
        "joint_attention_kwargs['mask'].requires_grad": False,
        "samples": "list of 1",
        "samples[0]": "tensor",
        "samples[0].shape": (1, 4),
        "samples[0].dtype": torch.float32,
        "samples[0].requires_grad": False,
    }


# ---- item 5 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_deepcopy_of_an_enabled_transformer_runs_its_own_weights(two, family):
    for rank, res in enumerate(_values(two, f"deepcopy-{family}")):
        for key in ("copy_vs_one_rank", "copy_own_weights_vs_one_rank", "copy_grads_vs_one_process"):
            assert res[key] <= TOL, f"rank {rank}: {key} = {res[key]:.2e}"
        flags = {k: v for k, v in res.items() if k not in ("copy_vs_one_rank", "copy_own_weights_vs_one_rank",
                                                           "copy_grads_vs_one_process")}
        assert all(v == 1.0 for v in flags.values()), f"rank {rank}: {flags}"


def test_missing_marker_survives_deepcopy():
    assert copy.deepcopy(MISSING) is MISSING and copy.copy(MISSING) is MISSING


def test_deepcopy_at_one_rank_runs_its_own_weights():
    model, kwargs = _build("flux")
    enable_usp(model)
    twin = copy.deepcopy(model)
    out = _out(model, kwargs)
    with torch.no_grad():
        twin.proj_out.weight.mul_(2.0)
    assert torch.equal(_out(model, kwargs), out) and not torch.equal(_out(twin, kwargs), out)
    disable_usp(twin)
    assert is_usp_enabled(model) and not is_usp_enabled(twin)
    disable_usp(model)


# ---- item 6 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["cogvideox", "mochi"])
def test_dropout_on_the_replicated_text_stream_is_the_same_on_every_rank(two, family):
    for rank, res in enumerate(_values(two, f"dropout-{family}")):
        assert res["dropout_active"] == 1.0, f"rank {rank}: train-mode text equals eval-mode text: {res}"
        assert res["text_spread_train"] <= TEXT_TOL, f"rank {rank}: text streams differ across ranks: {res}"
        assert res["text_spread_eval"] <= TEXT_TOL, f"rank {rank}: {res}"
        assert res["grads_finite"] == 1.0, f"rank {rank}: {res}"


def test_dropout_on_sharded_rows_stays_each_ranks_own(two):
    for rank, res in enumerate(_values(two, "dropout-own-rows")):
        assert res["is_replica_dropout"] == 1.0, f"rank {rank}: {res}"
        assert res["text_mask_spread"] == 0.0, f"rank {rank}: {res}"
        assert res["video_masks_differ"] == 1.0 and res["video_mask_is_own_rng"] == 1.0, f"rank {rank}: {res}"


def test_checkpoint_recompute_draws_the_same_masks(two):
    for rank, res in enumerate(_values(two, "dropout-checkpointing")):
        assert res["block0_ran_twice"] == 1.0, f"rank {rank}: checkpointing did not recompute: {res}"
        # Same ops on the same numbers, recomputed: float32 equal up to rounding of the backward's order.
        assert res["checkpointed_vs_plain"] <= TOL, f"rank {rank}: {res}"


# ---- item 8 ----------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_ulysses_degree_above_the_heads_fails_at_enable(two, family):
    for rank, res in enumerate(_values(two, f"heads-{family}")):
        assert res["error"].startswith("ValueError: ulysses_degree=2 exceeds the 1 attention heads"), f"rank {rank}: {res}"
        assert "at most 1" in res["error"], f"rank {rank}: {res}"
        assert res["untouched"], f"rank {rank}: enable_usp left the model patched"
        assert res["ring_vs_one_rank"] <= TOL, f"rank {rank}: {res}"


# ---- item 10 ---------------------------------------------------------------------------------

CUDA = torch.device


@pytest.mark.parametrize(
    "devices, local_rank, num_gpus, current",
    [
        ([CUDA("cuda", 1)], 1, 8, 1),  # torchrun + set_device + .to(f"cuda:{LOCAL_RANK}")
        ([CUDA("cpu")], 3, 8, 0),  # a CPU model: not ours to place
        ([CUDA("cuda", 0)], None, 8, 0),  # not under torchrun
        ([CUDA("cuda", 0)], 3, 1, 0),  # one visible GPU per process (CUDA_VISIBLE_DEVICES per rank)
    ],
)
def test_model_on_this_ranks_gpu_passes(devices, local_rank, num_gpus, current):
    check_model_device(devices, local_rank, num_gpus, current)


def test_model_on_another_ranks_gpu_raises():
    # The README's old order: pipe.to("cuda") (GPU 0) on every rank, LOCAL_RANK 1.
    with pytest.raises(ValueError, match=r"parameters on cuda:0, but this rank's LOCAL_RANK is 1") as info:
        check_model_device([CUDA("cuda", 0), CUDA("cpu")], 1, 8, 1)
    assert "torch.cuda.set_device(1)" in str(info.value) and 'f"cuda:{LOCAL_RANK}"' in str(info.value)
    with pytest.raises(ValueError, match=r"parameters on cuda:0, but"):
        check_model_device([CUDA("cuda")], 2, 8, 0)  # bare "cuda": the current device, GPU 0
    with pytest.raises(ValueError, match=r"current CUDA device is cuda:0, but this rank's LOCAL_RANK is 2"):
        check_model_device([CUDA("cuda", 2)], 2, 8, 0)  # right GPU, but set_device was not called


def test_enable_usp_checks_the_device_before_patching(monkeypatch):
    """enable_usp passes the model's devices and LOCAL_RANK to the check, and a refusal leaves the
    model as it was (no GPU here: CUDA is faked, the check answers as it would for cuda:0)."""
    seen = []

    def refuse(devices, local_rank, num_gpus, current):
        seen.append((set(devices), local_rank, num_gpus, current))
        raise ValueError("wrong GPU")

    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    monkeypatch.setattr(api, "check_model_device", refuse)
    model = tiny_flux_transformer()
    with pytest.raises(ValueError, match="wrong GPU"):
        enable_usp(model)
    assert seen == [({torch.device("cpu")}, 1, 2, 1)]
    assert not is_usp_enabled(model)
    assert all(type(p).__name__ == "FluxAttnProcessor" for p in model.attn_processors.values())
