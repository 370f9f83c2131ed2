"""The contract between ``enable_usp`` and the per-model-family adapters.

An adapter makes one Diffusers transformer class run sequence-parallel on a ``USPMesh``: it shards
the tokens once at the transformer input, swaps the attention processors for ones that call
``usp_dit.usp_attention``, slices positional tables like the tokens, and gathers the output once.
It must leave the model exactly as it found it on ``disable``.

What is *not* the adapter's business: pipelines, CFG parallel (the batch split over the "cfg" axis
is done around the adapter's forward by ``usp_dit.pipelines.replica_forward``), kernels.
"""
from __future__ import annotations

import copy
import inspect
from collections.abc import Callable, Iterable
from typing import Any, Protocol

import torch

from usp_dit.distributed.mesh import USPMesh
from usp_dit.pipelines.refusals import refusal_reason


class ModelAdapter(Protocol):
    """One model family (e.g. Flux): see the module docstring."""

    name: str
    model_class: type  # the Diffusers transformer class it handles (usp_dit.pipelines.coverage reads it)

    def matches(self, transformer: torch.nn.Module) -> bool:
        """True when this adapter handles ``transformer`` (checked by class)."""
        ...

    def enable(self, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> None:
        """Make ``transformer`` sequence-parallel over ``mesh``'s sequence group, in place."""
        ...

    def disable(self, transformer: torch.nn.Module) -> None:
        """Restore the original processors and forward exactly."""
        ...


_ADAPTERS: list[ModelAdapter] = []


def register_adapter(adapter: ModelAdapter) -> ModelAdapter:
    """Add an adapter; later registrations are tried first."""
    _ADAPTERS.insert(0, adapter)
    return adapter


def model_class_of(transformer: torch.nn.Module) -> type:
    """The class an adapter matches ``transformer`` by: its own, or for a module FSDP2's
    ``fully_shard`` has wrapped (its class becomes a generated subclass ``FSDP<Name>`` of
    ``(FSDPModule, <Name>)``), the class it wrapped."""
    cls = type(transformer)
    from torch.distributed.fsdp import FSDPModule

    if issubclass(cls, FSDPModule):
        bases = [b for b in cls.__bases__ if b is not FSDPModule]
        if len(bases) == 1:
            return bases[0]
    return cls


def registered_adapters() -> tuple[ModelAdapter, ...]:
    """Every registered adapter, in the order ``find_adapter`` tries them."""
    return tuple(_ADAPTERS)


def find_adapter(transformer: torch.nn.Module) -> ModelAdapter:
    """The adapter for ``transformer``.

    Raises:
        NotImplementedError: no adapter handles this class (the message says why, from
            ``usp_dit.pipelines.coverage``, and names the supported families).
    """
    for adapter in _ADAPTERS:
        if adapter.matches(transformer):
            return adapter
    supported = sorted(a.name for a in _ADAPTERS)
    raise NotImplementedError(
        f"usp_dit cannot run {type(transformer).__name__} sequence-parallel: {refusal_reason(model_class_of(transformer))}; "
        f"supported model families: {supported} (docs/COVERAGE.md)"
    )


class _Missing:
    """The type of ``MISSING``; a deep copy or a pickle of it is ``MISSING`` itself."""

    def __repr__(self) -> str:
        return "MISSING"

    def __reduce__(self) -> str:
        # copy.deepcopy and pickle take a string as "the module global of this name": an enabled
        # transformer's deep copy must restore to MISSING (delete its attribute), not to a new object.
        return "MISSING"


MISSING = _Missing()  # "the object had no instance attribute of that name"


def saved_instance_attr(obj: object, name: str) -> object:
    """``obj``'s own attribute ``name`` (not a class attribute), or ``MISSING``: what to restore later."""
    return obj.__dict__.get(name, MISSING)


def restore_instance_attr(obj: object, name: str, saved: object) -> None:
    """Undo a patch of ``obj.name``: put ``saved`` back, or delete the instance attribute if it was ``MISSING``."""
    if saved is MISSING:
        delattr(obj, name)
    else:
        setattr(obj, name, saved)


class MethodWrapper:
    """A callable installed as an instance attribute (a transformer's ``forward``), wrapping ``inner``.

    Subclasses implement ``__call__`` and keep what they need as attributes.

    Note [deep copies]
        An enabled transformer may be deep-copied: an EMA copy in fine-tuning. ``copy.deepcopy``
        copies a *function* by reference, so a closure stored as ``transformer.forward`` would
        make the copy call the original's bound forward: the original's weights, silently. So
        every wrapper usp_dit installs is an object: its ``inner`` (a bound method, or another
        wrapper) and its state deep-copy with the module, and the copy's memo maps the original
        module to its copy, so the copy's wrapper calls the copy's forward. Processors and hooks
        are objects already and copy the same way; the mesh is shared (``USPMesh.__deepcopy__``:
        process groups cannot be copied) and so are the registered adapters (stateless).

                transformer.forward = Wrapper(inner=<bound forward of transformer>, state)
        deepcopy ─► copy.forward    = Wrapper(inner=<bound forward of copy>, deepcopy(state))
    """

    def __init__(self, inner: Callable[..., Any]) -> None:
        self.inner = inner
        # inspect.signature(wrapper) reads this: callers that inspect the forward (e.g. pipelines
        # checking for an argument) see the model's own signature.
        self.__signature__ = inspect.signature(inner)
        self.__doc__ = getattr(inner, "__doc__", None)
        self.__name__ = getattr(inner, "__name__", type(self).__name__)

    def __deepcopy__(self, memo: dict[int, Any]) -> MethodWrapper:
        clone = object.__new__(type(self))
        memo[id(self)] = clone
        for name, value in self.__dict__.items():
            # The signature is immutable (and its annotations need not be copyable): shared.
            clone.__dict__[name] = value if name == "__signature__" else copy.deepcopy(value, memo)
        return clone

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.inner!r})"


def check_ulysses_degree(num_heads: int, mesh: USPMesh, model: str) -> None:
    """Before patching: a Ulysses (or tensor) degree the model's attention cannot be split over.

    Every Ulysses rank computes attention for at least one query head, so ``ulysses_degree`` can
    be at most the heads it shares out (usp_dit.sharding.partition.head_plan would refuse it at the
    first forward; this says it at ``enable_usp``, with the model's number). With tensor
    parallelism each tensor rank keeps ``ceil(heads / tensor_degree)`` of them (the last ones
    padded: Note [uneven tensor splits] in ``usp_dit.pipelines.tensor``) and the Ulysses ranks
    share those; ``tensor_degree`` itself can be at most the head count.

    Raises:
        ValueError: ``tensor_degree`` exceeds ``num_heads``, or ``ulysses_degree`` the heads of a
            tensor rank.
    """
    tensor = mesh.tensor_degree
    if tensor > num_heads:
        raise ValueError(
            f"tensor_degree={tensor} exceeds the {num_heads} attention heads of this {model}: each tensor rank "
            f"needs at least one head; tensor_degree can be at most {num_heads}"
        )
    local = -(-num_heads // tensor)
    if mesh.ulysses_degree > local:
        per = f"the {local} heads of a tensor rank ({num_heads} over tensor_degree={tensor})" if tensor > 1 else \
            f"the {num_heads} attention heads"
        raise ValueError(
            f"ulysses_degree={mesh.ulysses_degree} exceeds {per} of this {model}: "
            f"ulysses_degree can be at most {local} (each Ulysses rank takes at least one head); "
            f"put the remaining ranks on ring_degree"
        )


def check_model_device(
    devices: Iterable[torch.device], local_rank: int | None, num_cuda_devices: int, current_cuda_device: int | None,
) -> None:
    """A model on a GPU that is not this rank's: the mistake of moving a pipeline to ``"cuda"``
    (GPU 0 on every rank) before ``torch.cuda.set_device(local_rank)``.

    Args:
        devices: where the model's parameters and buffers are.
        local_rank: torchrun's ``LOCAL_RANK`` (``None`` when not launched by it: nothing to check).
        num_cuda_devices: GPUs this process sees. When ``local_rank`` is not below it, each process
            sees only its own GPUs (e.g. ``CUDA_VISIBLE_DEVICES`` set per rank) and indices say
            nothing about ranks: nothing to check.
        current_cuda_device: ``torch.cuda.current_device()`` (``None`` without CUDA), where
            collectives and new tensors go.

    Raises:
        ValueError: a CUDA parameter or buffer sits on another GPU than ``cuda:{local_rank}``, or
            the current device is not it, naming the device and the fix.
    """
    if local_rank is None or local_rank >= num_cuda_devices:
        return
    # torch.device("cuda") without an index means the current device.
    current = 0 if current_cuda_device is None else current_cuda_device
    cuda = sorted({current if d.index is None else d.index for d in devices if d.type == "cuda"})
    if not cuda:
        return
    fix = (f"call torch.cuda.set_device({local_rank}) and move the model to f\"cuda:{{LOCAL_RANK}}\" "
           f"(cuda:{local_rank} here; a bare \"cuda\" is GPU 0 on every rank) before enable_usp")
    wrong = [i for i in cuda if i != local_rank]
    if wrong:
        where = ", ".join(f"cuda:{i}" for i in wrong)
        raise ValueError(
            f"the transformer has parameters on {where}, but this rank's LOCAL_RANK is {local_rank}: two ranks "
            f"would share one GPU; {fix}"
        )
    if current_cuda_device is not None and current_cuda_device != local_rank:
        raise ValueError(
            f"the current CUDA device is cuda:{current_cuda_device}, but this rank's LOCAL_RANK is {local_rank} "
            f"(the model is on cuda:{local_rank}): collectives would run on another rank's GPU; {fix}"
        )
