"""The contract between ``enable_usp`` and the per-model-family adapters.

An adapter makes one Diffusers transformer class run sequence-parallel on a ``USPMesh``: it shards
the tokens once at the transformer input, swaps the attention processors for ones that call
``usp_dit.usp_attention``, slices positional tables like the tokens, and gathers the output once.
It must leave the model exactly as it found it on ``disable``.

What is *not* the adapter's business: pipelines, CFG parallel (the batch split over the "cfg" axis
is done around the adapter's forward by ``usp_dit.pipelines.api``), kernels.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

import torch

from usp_dit.mesh import USPMesh


class ModelAdapter(Protocol):
    """One model family (e.g. Flux): see the module docstring."""

    name: str

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


def find_adapter(transformer: torch.nn.Module) -> ModelAdapter:
    """The adapter for ``transformer``.

    Raises:
        NotImplementedError: no adapter handles this class (the message names the supported ones).
    """
    for adapter in _ADAPTERS:
        if adapter.matches(transformer):
            return adapter
    supported = sorted(a.name for a in _ADAPTERS)
    raise NotImplementedError(
        f"usp_dit has no adapter for {type(transformer).__name__}; supported model families: {supported}"
    )


MISSING = object()  # "the object had no instance attribute of that name"


def saved_instance_attr(obj: object, name: str) -> object:
    """``obj``'s own attribute ``name`` (not a class attribute), or ``MISSING``: what to restore later."""
    return obj.__dict__.get(name, MISSING)


def restore_instance_attr(obj: object, name: str, saved: object) -> None:
    """Undo a patch of ``obj.name``: put ``saved`` back, or delete the instance attribute if it was ``MISSING``."""
    if saved is MISSING:
        delattr(obj, name)
    else:
        setattr(obj, name, saved)


def check_ulysses_degree(num_heads: int, mesh: USPMesh, model: str) -> None:
    """Before patching: a Ulysses degree the model's attention cannot be split over.

    Every Ulysses rank computes attention for at least one query head, so ``ulysses_degree`` can
    be at most the model's head count (usp_dit.partition.head_plan would refuse it at the first
    forward; this says it at ``enable_usp``, with the model's number).

    Raises:
        ValueError: ``ulysses_degree`` exceeds ``num_heads``.
    """
    if mesh.ulysses_degree > num_heads:
        raise ValueError(
            f"ulysses_degree={mesh.ulysses_degree} exceeds the {num_heads} attention heads of this {model}: "
            f"ulysses_degree can be at most {num_heads} (each Ulysses rank takes at least one head); "
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
