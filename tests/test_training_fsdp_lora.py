"""FSDP2 and PEFT LoRA under USP: gradients and a two-step optimizer run equal one process's.

One spawned gloo group of 4 ranks runs every case on the tiny CogVideoX-5B (27 tokens: uneven on 2
and 4 ranks) in train mode; where the dp degree is 2, each dp index draws its own batch and the
expected gradient is the mean of the two one-process gradients.
  * FSDP2 "full" (one axis over all 4 ranks) on grids (U, R) = (2,1) (dp 2) and (2,2) with
    gradient checkpointing; FSDP2 "hybrid" (dp x replica) on (1,2) (dp 2); and the Flux
    transformer (FSDP2 "full", (1,2)) when its adapter is in this checkout; Wan (FSDP2 "full", (2,2),
    gradient checkpointing: its units are its plan's block list) and Qwen-Image (FSDP2 "hybrid",
    (1,2), dp 2, a prompt mask with a hole). FSDP2 averages over its
    mesh: its gathered gradients (``full_grads``) must equal the expected ones with no rescaling.
  * LoRA (``transformer.add_adapter``, rank 4, random A and B) with ``sync_grads`` on (2,1) and
    with FSDP2 on (2,2): only LoRA parameters get gradients, and they match.
  * Two optimizer steps (SGD with momentum), with ``sync_grads`` on (2,2) and with FSDP2 on (2,1):
    the losses of both steps and the parameters after them match the one-process run.

Tolerance: max|err| / max|ref| <= 1e-5 per parameter (float32, the issue's bar; reordered float32
sums give a few 1e-6 at worst). The optimizer is SGD because its update is linear in the gradient:
Adam divides by sqrt(v) + eps and turns a gradient that is rounding noise into a full step of
either sign, which would compare the noise, not the sharding.
"""
from __future__ import annotations

import pytest
import torch

from tests.training_models import AVAILABLE, build, loss_of, param_grads
from usp_dit import init_usp
from usp_dit.testing import assert_no_crash, rel_err, run_spawned
from usp_dit import disable_usp, enable_usp
from usp_dit.training import sync_grads
from usp_dit.training.fsdp import full_grads, shard_transformer

TOL = 1e-5
WORLD = 4
LR, MOMENTUM = 0.05, 0.9


def _lora(model: torch.nn.Module) -> torch.nn.Module:
    from peft import LoraConfig

    torch.manual_seed(7)  # LoRA weights drawn from the global RNG: the same on every rank and in the reference
    config = LoraConfig(r=4, lora_alpha=4, init_lora_weights=False, target_modules=["to_q", "to_k", "to_v", "to_out.0"])
    model.add_adapter(config)  # B random too (init_lora_weights=False): A's gradient is not zero
    return model


def _build(family: str, seed: int, lora: bool, ckpt: bool):
    case = build(family, seed)
    if lora:
        _lora(case.model)
    if ckpt:
        case.model.enable_gradient_checkpointing()
    return case


def _expected_grads(family: str, dp: int, lora: bool) -> dict[str, torch.Tensor]:
    """Mean over the dp indices of the one-process gradients (each index its own batch)."""
    refs = [param_grads(_build(family, d, lora, ckpt=False)) for d in range(dp)]
    return {n: sum(r[n] for r in refs) / dp for n in refs[0]}


def _worst(grads: dict, expected: dict) -> dict:
    # No gradient where one process's is zero too (a parameter the loss does not reach, e.g. the
    # last Qwen-Image block's text stream, dropped by the model) is that zero (param_grads' convention).
    grads = {n: (torch.zeros_like(expected[n]) if g is None and n in expected and not expected[n].any() else g)
             for n, g in grads.items()}
    missing = sorted(n for n in expected if grads.get(n) is None)
    extra = sorted(n for n, g in grads.items() if g is not None and n not in expected)
    err, name = max(((rel_err(grads[n], expected[n]), n) for n in expected if n not in missing), default=(0.0, ""))
    return {"err": err, "worst": name, "missing": missing, "extra": extra}


def _blocks_not_fsdp_units(model: torch.nn.Module) -> list[str]:
    """Blocks of the model's block lists (its plan's, or Flux's) that are not FSDP2 units."""
    from torch.distributed.fsdp import FSDPModule

    from usp_dit.training.fsdp import block_lists

    names = block_lists(model)
    blocks = [(f"{n}.{i}", b) for n in names for i, b in enumerate(getattr(model, n))]
    return [f"<not an FSDP2 unit: {path}>" for path, b in blocks if not isinstance(b, FSDPModule)] or (
        [] if blocks else ["<no block list>"])


def _grad_case(family: str, grid, fsdp: str | None, lora: bool, ckpt: bool) -> dict:
    mesh = init_usp(ulysses_degree=grid[0], ring_degree=grid[1])
    expected = _expected_grads(family, mesh.dp_degree, lora)
    case = _build(family, mesh.dp_rank, lora, ckpt)
    enable_usp(case.model, mesh=mesh)
    not_units = []
    if fsdp:
        shard_transformer(case.model, mesh, kind=fsdp)
        not_units = _blocks_not_fsdp_units(case.model)
    try:
        loss_of(case).backward()
    finally:
        disable_usp(case.model)
    if fsdp:
        grads = full_grads(case.model)
    else:
        sync_grads(case.model, mesh)
        grads = {n: p.grad for n, p in case.model.named_parameters()}
    result = _worst(grads, expected)
    result["missing"] += not_units  # a block FSDP2 did not make its own unit (its block list not found)
    if lora:  # PEFT froze the base weights: only LoRA parameters are trainable (and none is missed)
        result["extra"] += sorted(n for n in expected if "lora_" not in n)
        result["missing"] += [] if any("lora_" in n for n in expected) else ["<no LoRA parameter>"]
    return result


def _train_two_steps(case, mesh=None, fsdp: str | None = None) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Two SGD steps; returns both losses and the full parameters after them."""
    opt = torch.optim.SGD([p for p in case.model.parameters() if p.requires_grad], lr=LR, momentum=MOMENTUM)
    losses = []
    for _ in range(2):
        opt.zero_grad(set_to_none=True)
        loss = loss_of(case)
        loss.backward()
        if mesh is not None and not fsdp:
            sync_grads(case.model, mesh)
        opt.step()
        losses.append(loss.item())
    params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
              for n, p in case.model.named_parameters()}
    return losses, params


def _optimizer_case(grid, fsdp: str | None) -> dict:
    mesh = init_usp(ulysses_degree=grid[0], ring_degree=grid[1])
    if mesh.dp_degree != 1:
        raise ValueError("the two-step case compares one replica with one process: use a grid with dp = 1")
    ref_losses, ref_params = _train_two_steps(build("cogvideox", 0))
    case = build("cogvideox", 0)
    enable_usp(case.model, mesh=mesh)
    if fsdp:
        shard_transformer(case.model, mesh, kind=fsdp)
    try:
        losses, params = _train_two_steps(case, mesh, fsdp)
    finally:
        disable_usp(case.model)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    param = _worst(params, ref_params)
    return {"err": max(loss_err, param["err"]), "worst": f"loss {loss_err:.1e}; {param['worst']}",
            "missing": param["missing"], "extra": []}


GRAD_CASES = {  # id: (family, grid, fsdp kind, lora, checkpointing)
    "fsdp-full-u2r1-dp2": ("cogvideox", (2, 1), "full", False, False),
    "fsdp-full-u2r2-ckpt": ("cogvideox", (2, 2), "full", False, True),
    "fsdp-hybrid-u1r2-dp2": ("cogvideox", (1, 2), "hybrid", False, False),
    "fsdp-full-u1r2-dp2-flux": ("flux", (1, 2), "full", False, False),
    # FSDP2's units from the model plan (Wan's "blocks"), with checkpointing; an image family with masks
    "fsdp-full-u2r2-ckpt-wan": ("wan", (2, 2), "full", False, True),
    "fsdp-hybrid-u1r2-dp2-qwen_image": ("qwen_image", (1, 2), "hybrid", False, False),
    "lora-sync-u2r1-dp2": ("cogvideox", (2, 1), None, True, False),
    "lora-fsdp-u2r2-ckpt": ("cogvideox", (2, 2), "full", True, True),
}
OPT_CASES = {"sgd2-sync-u2r2": ((2, 2), None), "sgd2-fsdp-u4r1": ((4, 1), "full")}


def _record(results: dict, key: str, fn) -> None:
    try:
        results[key] = fn()
    except Exception as exc:  # recorded, asserted by the parent
        results[key] = f"{type(exc).__name__}: {exc}"


def _all_cases() -> dict:
    results = {}
    for key, (family, grid, fsdp, lora, ckpt) in GRAD_CASES.items():
        if family in AVAILABLE:
            _record(results, key, lambda: _grad_case(family, grid, fsdp, lora, ckpt))
    for key, (grid, fsdp) in OPT_CASES.items():
        _record(results, key, lambda: _optimizer_case(grid, fsdp))
    return results


@pytest.fixture(scope="module")
def results() -> list[dict]:
    # check_groups off: after FSDP2 of both kinds in one process torch keeps three groups alive past
    # destroy_process_group that no Python object holds (gc finds none): out of usp_dit's reach.
    per_rank = run_spawned(_all_cases, WORLD, check_groups=False)
    assert_no_crash(per_rank)
    return per_rank


@pytest.mark.parametrize("key", list(GRAD_CASES) + list(OPT_CASES))
def test_matches_one_process(results, key):
    if key in GRAD_CASES and GRAD_CASES[key][0] not in AVAILABLE:
        pytest.skip(f"the {GRAD_CASES[key][0]} adapter is not in this checkout")
    for rank, res in enumerate(results):
        r = res[key]
        assert not isinstance(r, str), f"rank {rank}: {r}"
        assert not r["missing"], f"rank {rank}: no gradient for {r['missing'][:5]}"
        assert not r["extra"], f"rank {rank}: gradients on frozen parameters {r['extra'][:5]}"
        assert r["err"] <= TOL, f"rank {rank}: {r['worst']} off by {r['err']:.2e}"
