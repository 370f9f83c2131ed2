"""Single-process checks most family files have, as test functions a file binds at module level
(tests/test_pipeline_<family>.py), like ``adapter_parity.grid_tests``:

    test_foreign_processor_is_refused = foreign_processor_refused(tiny_prx, ADAPTER, "blocks.1.attention")

Each generator takes what differs between families (the builder, the adapter, a dotted module path,
the family's name in a message, the module attribute holding its routed call); the body, and the
message it matches, are the same for every family. Builders are called inside the test, never at
import. Checks that are special to one family stay hand-written in its file.

Layout: no tensors of their own; the builders return the family's tiny transformer, the
``build_with_inputs`` ones ``(model, inputs)`` as the family's ``_build``.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tests.adapter_parity import assert_disable_restores, assert_one_rank_bit_identical
from usp_dit import single_rank_mesh
from usp_dit.pipelines.base import find_adapter

Build = Callable[[], torch.nn.Module]
BuildWithInputs = Callable[[], tuple[torch.nn.Module, Any]]

ROUTED_CALL = "does not call dispatch_attention_fn, the call usp_dit routes"  # the common refusal (_routing)


def adapter_found(build: Build, adapter) -> Callable[[], None]:
    """``find_adapter`` of the built transformer is ``adapter`` (the family's registration)."""

    def test() -> None:
        assert find_adapter(build()) is adapter

    return test


def foreign_processor_refused(build: Build, adapter, attention: str,
                              processor: Callable[[], object] = object) -> Callable[[], None]:
    """``attention`` (a dotted path in the built model, e.g. "blocks.1.attention") given a
    ``processor()`` (default a bare ``object()``) that the adapter does not know: enable raises
    NotImplementedError naming the path and the processor's class, and leaves no ``forward`` patched
    on the model."""

    def test() -> None:
        model = build()
        proc = processor()
        module = model.get_submodule(attention)
        module.set_processor(proc) if hasattr(module, "set_processor") else setattr(module, "processor", proc)
        match = rf"{re.escape(attention)}\.processor is {type(proc).__name__}\b"
        with pytest.raises(NotImplementedError, match=match):
            adapter.enable(model, single_rank_mesh(), "auto")
        assert "forward" not in model.__dict__

    return test


def context_parallelism_refused(build: Build, adapter, attention: str) -> Callable[[], None]:
    """``attention``'s processor carrying Diffusers' own context-parallel config (``_parallel_config``,
    set by ``enable_parallelism``): enable raises NotImplementedError naming the path."""

    def test() -> None:
        model = build()
        model.get_submodule(attention).processor._parallel_config = object()
        match = re.escape(f"{attention} runs diffusers' own context parallelism")
        with pytest.raises(NotImplementedError, match=match):
            adapter.enable(model, single_rank_mesh(), "auto")

    return test


def no_blocks_refused(build_empty: Build, adapter) -> Callable[[], None]:
    """A transformer built with no blocks: enable raises NotImplementedError saying so."""

    def test() -> None:
        with pytest.raises(NotImplementedError, match=r"no transformer blocks \(num_layers=0\)"):
            adapter.enable(build_empty(), single_rank_mesh(), "auto")

    return test


def routed_call_refused(build: Build, adapter, module: object, attr: str, replacement: object = None,
                        match: str = ROUTED_CALL) -> Callable[[pytest.MonkeyPatch], None]:
    """Should a future diffusers' processor stop making the call usp_dit routes (``module.attr``,
    the family's routed processor or the function finding the call, patched to ``replacement``:
    "not found"), enable refuses with ``match`` instead of running local attention on a shard."""

    def test(monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(module, attr, replacement)
        with pytest.raises(NotImplementedError, match=match):
            adapter.enable(build(), single_rank_mesh(), "auto")

    return test


def tensor_parallelism_refused(build: Build, adapter, family: str) -> Callable[[], None]:
    """The adapter declares no TensorPlan: the check enable_usp makes before anything changes
    refuses tensor_degree 2, naming ``family``."""

    def test() -> None:
        from usp_dit.pipelines.tensor import check_tensor_plan

        assert adapter.plan.tensor is None
        with pytest.raises(NotImplementedError, match=f"usp_dit's {family} plan declares no tensor-parallel cuts"):
            check_tensor_plan(build(), adapter.plan.tensor, adapter.name, 2)

    return test


def disable_restores(build_with_inputs: BuildWithInputs, adapter,
                     processor: type | tuple[type, ...]) -> Callable[[], None]:
    """``adapter_parity.assert_disable_restores`` on ``build_with_inputs()``."""

    def test() -> None:
        assert_disable_restores(*build_with_inputs(), adapter, processor)

    return test


def one_rank_bit_identical(build_with_inputs: BuildWithInputs, adapter) -> Callable[[], None]:
    """``adapter_parity.assert_one_rank_bit_identical`` on ``build_with_inputs()``."""

    def test() -> None:
        assert_one_rank_bit_identical(*build_with_inputs(), adapter)

    return test
