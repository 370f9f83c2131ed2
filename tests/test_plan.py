"""The generic patcher of model plans (usp_dit.pipelines.plan), on one rank: what it refuses, what it
puts back, how it checks a per-token table, and the FSDP2 block lists it gives.

No processes: a single-rank mesh applies a plan's hooks and processor swaps exactly as a grid does
(the splits are identities), so the plan's mechanics are checked here and its parity on grids in
each family's tests (tests/test_pipeline_*.py). Model: the tiny Wan 2.1 (usp_dit.demo.tiny_wan).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
from diffusers.models.attention_processor import AttnProcessor2_0

import usp_dit.pipelines  # noqa: F401  (registers every adapter)
from usp_dit import single_rank_mesh
from usp_dit.demo.tiny_wan import tiny_wan, wan_inputs
from usp_dit.pipelines.families import wan
from usp_dit.pipelines.plan import PlanAdapter, Table
from usp_dit.training.fsdp import block_lists


def _model_and_inputs():
    model = tiny_wan("t2v")
    return model, wan_inputs(model, 3, 6, 10).kwargs()


def _run(model, inputs) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs, return_dict=False)[0]


def test_enable_swaps_only_the_parallel_sites_and_disable_puts_back_the_same_objects():
    model, inputs = _model_and_inputs()
    before = {name: m.processor for name, m in model.named_modules() if hasattr(m, "processor")}
    ref = _run(model, inputs)
    wan.ADAPTER.enable(model, single_rank_mesh(), "auto")
    swapped = {name for name, m in model.named_modules() if hasattr(m, "processor") and m.processor is not before[name]}
    assert swapped == {f"blocks.{i}.attn1" for i in range(len(model.blocks))}  # attn2 (cross) stays local
    assert torch.allclose(_run(model, inputs), ref, rtol=0, atol=1e-6)
    wan.ADAPTER.disable(model)
    assert all(m.processor is before[name] for name, m in model.named_modules() if hasattr(m, "processor"))
    assert not model.rope._forward_hooks and not model.blocks[0]._forward_pre_hooks
    assert torch.equal(_run(model, inputs), ref)


def test_an_attention_module_the_plan_does_not_name_is_refused():
    model, _ = _model_and_inputs()
    plan = dataclasses.replace(wan.PLAN, attention=wan.PLAN.attention[:1])  # attn2 no longer named
    with pytest.raises(NotImplementedError, match=r"does not say how to run blocks\.0\.attn2"):
        PlanAdapter(plan, wan.__name__).enable(model, single_rank_mesh(), "auto")
    assert all(type(b.attn1.processor).__name__ == "WanAttnProcessor" for b in model.blocks)  # nothing patched


def test_a_foreign_processor_a_cache_and_no_blocks_are_refused():
    model, _ = _model_and_inputs()
    model.blocks[1].attn2.processor = AttnProcessor2_0()
    with pytest.raises(NotImplementedError, match=r"blocks\.1\.attn2\.processor is AttnProcessor2_0"):
        wan.ADAPTER.enable(model, single_rank_mesh(), "auto")
    empty = tiny_wan("t2v")
    empty.blocks = torch.nn.ModuleList()
    with pytest.raises(NotImplementedError, match="num_layers=0"):
        wan.ADAPTER.enable(empty, single_rank_mesh(), "auto")


def test_a_table_whose_length_is_not_the_token_count_raises():
    """A per-token table cut like the tokens must have one row per token, or rows would misalign."""
    model, inputs = _model_and_inputs()
    plan = dataclasses.replace(wan.PLAN, tables=(Table("rope", dim=3, items=(0, 1)),))  # head_dim, not seq
    adapter = PlanAdapter(plan, wan.__name__)
    adapter.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match="table of this call has 16 rows but the transformer has 45 tokens"):
            _run(model, inputs)
    finally:
        adapter.disable(model)


def test_fsdp2_block_lists_come_from_the_plan():
    from usp_dit.demo.tiny_flux import tiny_flux_transformer

    assert block_lists(tiny_wan("t2v")) == ("blocks",)  # Wan's plan (before: Wan had no FSDP units)
    assert block_lists(tiny_flux_transformer()) == ("transformer_blocks", "single_transformer_blocks")  # no plan


def test_a_deep_copy_of_an_enabled_model_feeds_its_own_state():
    """An EMA copy of an enabled model (copy.deepcopy) runs its own weights and its own call state:
    every hook the plan installs deep-copies with the model (base Note [deep copies])."""
    import copy

    from usp_dit.demo.tiny_wan import tiny_wan as build

    model = build("ti2v-5b")
    # TI2V: the timestep hook reads the seq_len the RoPE table's hook sets
    inputs = wan_inputs(model, 3, 6, 14, per_token_timestep=True).kwargs()
    wan.ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        twin = copy.deepcopy(model)
        with torch.no_grad():
            for p in twin.parameters():
                p.mul_(1.01)  # the copy's own weights
        ref = _run(twin, inputs)
        state, twin_state = model._usp_dit_patch.state, twin._usp_dit_patch.state
        assert twin_state is not state
        state.seq_len = twin_state.seq_len = None
        out = _run(twin, inputs)
        assert twin_state.seq_len == 63 and state.seq_len is None  # the copy's tables fed the copy's state
        assert torch.equal(out, ref)
    finally:
        wan.ADAPTER.disable(model)
