"""A pipeline's text encoders on a grid: replicated, sharded per layer, or run on one rank.

Layout: an encoder's inputs and outputs are whatever it takes and returns (token ids, masks;
hidden states ``(batch, tokens, width)``); nothing here reads them except to broadcast them.

Note [text encoders on a grid]
    Every rank of a model replica encodes the same prompts (the pipeline runs on every rank with
    the same arguments), so by default each holds a whole copy of every text encoder: T5-XXL's
    4.7 B parameters, Flux.2's 24 B Mistral. ``enable_usp(..., text_encoder=...)`` chooses:
      "replicate"  as before (the default without ``shard_weights``);
      "shard"      (the default with ``shard_weights=True``) each encoder's layers (every list of
                   like modules: T5's ``block``, CLIP's and the LLMs' ``layers``, a vision
                   tower's ``blocks``) and then the rest become FSDP2 units over the replica, as
                   the transformer's blocks do (Note [sharded weights]): a rank holds 1/P of the
                   encoder plus the layer running and the next, prefetched;
      "rank0"      the replica's first rank alone keeps the encoder and runs it; its outputs
                   (the whole ``ModelOutput``: hidden states, every layer's when asked, masks)
                   are broadcast to the replica; every other rank drops the encoder's weights
                   (empty tensors of the same dtype and device, so ``encoder.dtype`` and
                   ``.device`` still answer) and its forward only receives. No all-gathers, one
                   broadcast of the embeddings per call; the first rank holds the whole encoder.
    Both are exact: "shard" computes with the same weights, "rank0" hands every rank the one
    rank's output, which is what one process computes. ``disable_usp`` gives every rank its full
    encoder back ("rank0": the weights broadcast from the first rank).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from usp_dit.distributed.mesh import USPMesh
from usp_dit.distributed.replica import replica_group
from usp_dit.pipelines.base import MethodWrapper
from usp_dit.pipelines.composition import unwrap_forward, wrap_forward
from usp_dit.pipelines.weights import ShardedWeights, replica_device_mesh, shard_units, unshard_weights
from usp_dit.planner.models import layer_lists

MODES = ("replicate", "shard", "rank0")
# The pipeline components that are text encoders (SD3 has three, HunyuanVideo two).
_COMPONENTS = ("text_encoder", "text_encoder_2", "text_encoder_3")


def encoder_components(pipe: Any) -> list[tuple[str, torch.nn.Module]]:
    """``[(name, module)]`` of the pipeline's text encoders that are modules with parameters."""
    out = []
    for name in _COMPONENTS:
        module = getattr(pipe, name, None)
        if isinstance(module, torch.nn.Module) and any(True for _ in module.parameters()):
            out.append((name, module))
    return out


def shard_encoder(encoder: torch.nn.Module, mesh: USPMesh) -> ShardedWeights | None:
    """"shard" (Note [text encoders on a grid]): each layer of each layer list, then the rest, over
    the replica, the next layer of a list prefetched. ``None`` on a replica of one rank."""
    device_mesh = replica_device_mesh(mesh)
    if device_mesh is None:
        return None
    lists = layer_lists(encoder)
    layers = [layer for lst in lists for layer in lst]
    record = ShardedWeights()
    shard_units(record, [*layers, encoder], device_mesh)
    _keep_output_capture(encoder, record.classes[id(encoder)])
    for lst in lists:
        for current, following in zip(lst, lst[1:]):
            current.set_modules_to_forward_prefetch([following])
    return record


def _keep_output_capture(encoder: torch.nn.Module, cls: type) -> None:
    """transformers 5 finds which layers' outputs a model records (``output_hidden_states``: the
    hidden states HunyuanVideo and Flux.2 take from inner layers) in a registry keyed by the
    model's class name; ``fully_shard`` gives the model a generated class, which would find
    nothing (hidden_states None). The generated class gets the model's entry. (transformers
    internals: without that registry there is nothing to do.)"""
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:
        return
    flags = dict.get(_CAN_RECORD_REGISTRY, str(cls))
    if flags is not None:
        dict.__setitem__(_CAN_RECORD_REGISTRY, str(type(encoder)), flags)


# ---------------------------------------------------------------------------------------------
# "rank0"


def _broadcast_output(out: Any, group: dist.ProcessGroup, device: torch.device) -> Any:
    """``out`` of the group's first rank on every rank: its structure and tensor metadata as one
    object, then each tensor (received into buffers of that shape, dtype and device)."""
    source = group.rank() == 0
    leaves, spec = tree_flatten(out) if source else ([], None)
    meta = [(tuple(x.shape), x.dtype) if torch.is_tensor(x) else ("value", x) for x in leaves]
    box = [(spec, meta)]
    dist.broadcast_object_list(box, group=group, group_src=0)
    spec, meta = box[0]
    result = []
    for i, (shape, dtype) in enumerate(meta):
        if shape == "value":
            result.append(dtype)  # a non-tensor leaf travelled in the object
            continue
        buf = leaves[i].contiguous() if source else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(buf, group=group, group_src=0)
        result.append(buf)
    return tree_unflatten(result, spec)


class RankZeroForward(MethodWrapper):
    """An encoder's ``forward`` under "rank0": computed on the replica's first rank, broadcast."""

    def __init__(self, inner: Callable[..., Any], group: dist.ProcessGroup, device: torch.device) -> None:
        super().__init__(inner)
        self.group = group
        self.device = device

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self.inner(*args, **kwargs) if self.group.rank() == 0 else None
        return _broadcast_output(out, self.group, self.device)


@dataclass
class RankZeroEncoder:
    """What "rank0" did to one encoder: its forward attribute, and the shapes of dropped weights."""

    group: dist.ProcessGroup
    forward_attr: RankZeroForward  # the wrapper installed
    shapes: dict[str, torch.Size] = field(default_factory=dict)


def _encoder_device(encoder: torch.nn.Module) -> torch.device:
    return next(encoder.parameters()).device


def run_on_first_rank(encoder: torch.nn.Module, mesh: USPMesh) -> RankZeroEncoder | None:
    """"rank0": the first rank keeps and runs ``encoder``; the others drop its weights and receive."""
    group = replica_group(mesh)
    if group is None:
        return None
    device = _encoder_device(encoder)  # beneath an offload hook (composition Note [wrappers beneath the hooks])
    record = RankZeroEncoder(group, wrap_forward(encoder, lambda inner: RankZeroForward(inner, group, device)))
    if group.rank() != 0:
        for name, param in encoder.named_parameters():
            record.shapes[name] = param.shape
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)  # frees the weights
    return record


def restore_on_every_rank(encoder: torch.nn.Module, record: RankZeroEncoder) -> None:
    """Undo ``run_on_first_rank``: the first rank's weights broadcast to the others, the forward back."""
    unwrap_forward(encoder, record.forward_attr)
    for name, param in encoder.named_parameters():  # the same order on every rank
        shape = record.shapes.get(name, param.shape)
        buf = param.data if record.group.rank() == 0 else torch.empty(shape, dtype=param.dtype, device=param.device)
        dist.broadcast(buf, group=record.group, group_src=0)
        param.data = buf


# ---------------------------------------------------------------------------------------------
# A pipeline's encoders


def place_encoders(pipe: Any, mesh: USPMesh, mode: str) -> list[tuple[torch.nn.Module, Any]]:
    """Apply ``mode`` (Note [text encoders on a grid]) to every text encoder of ``pipe``; returns
    ``[(encoder, record)]`` for ``restore_encoders``."""
    if mode not in MODES:
        raise ValueError(f"text_encoder={mode!r}: choose one of {MODES}")
    placed = []
    for _, encoder in encoder_components(pipe):
        if mode == "shard":
            record = shard_encoder(encoder, mesh)
        elif mode == "rank0":
            record = run_on_first_rank(encoder, mesh)
        else:
            record = None
        if record is not None:
            placed.append((encoder, record))
    return placed


def restore_encoders(placed: list[tuple[torch.nn.Module, Any]]) -> None:
    """Every encoder whole on every rank again, as before ``place_encoders``."""
    for encoder, record in placed:
        if isinstance(record, ShardedWeights):
            unshard_weights(encoder, record)
        else:
            restore_on_every_rank(encoder, record)
    placed.clear()
