"""Checkpoints of a sequence-parallel (optionally FSDP2-sharded) fine-tune, loadable by Diffusers.

Layout of a checkpoint folder::

    checkpoint-<step>/
      transformer/config.json                          what ModelMixin.save_pretrained writes:
      transformer/diffusion_pytorch_model.safetensors  Diffusers' from_pretrained loads it
      training_state.pt                                step, optimizer state (keyed by parameter name)

Full (unsharded) tensors: ``torch.distributed.checkpoint.state_dict`` gathers FSDP2 shards (and
passes plain modules through), so a checkpoint does not depend on the world size or grid it was
written with. Rank 0 writes into ``<folder>.tmp`` and renames it when complete, so a crash while
saving never leaves a folder that looks finished.
"""
from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"
STATE_NAME = "training_state.pt"
_CKPT_RE = re.compile(r"^checkpoint-(\d+)$")


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def _options(**kwargs: Any) -> StateDictOptions:
    return StateDictOptions(full_state_dict=True, **kwargs)


def checkpoint_dir(output_dir: str | os.PathLike, step: int) -> Path:
    return Path(output_dir) / f"checkpoint-{step}"


def save_checkpoint(output_dir: str | os.PathLike, step: int, transformer: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, extra: dict | None = None) -> Path:
    """Write ``checkpoint-<step>`` under ``output_dir`` (collective: call on every rank).

    Returns the folder. ``extra`` (small picklable values) is stored in ``training_state.pt``.
    """
    from safetensors.torch import save_file

    opts = _options(cpu_offload=True)  # with cpu_offload only rank 0 receives the full tensors
    model_state = get_model_state_dict(transformer, options=opts)
    optim_state = get_optimizer_state_dict(transformer, optimizer, options=opts)
    final = checkpoint_dir(output_dir, step)
    if _rank() == 0:
        tmp = final.with_name(final.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / "transformer").mkdir(parents=True)
        transformer.save_config(tmp / "transformer")
        tensors = {k: v.detach().contiguous() for k, v in model_state.items()}
        save_file(tensors, str(tmp / "transformer" / WEIGHTS_NAME), metadata={"format": "pt"})
        torch.save({"step": step, "optimizer": optim_state, "extra": extra or {}}, tmp / STATE_NAME)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
    _barrier()
    return final


def latest_checkpoint(output_dir: str | os.PathLike) -> Path | None:
    """The finished ``checkpoint-<step>`` with the highest step under ``output_dir``, or None."""
    root = Path(output_dir)
    if not root.is_dir():
        return None
    found = [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _CKPT_RE.match(p.name))]
    return max(found)[1] if found else None


def load_checkpoint(folder: str | os.PathLike, transformer: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None = None) -> dict:
    """Load weights (and optimizer state) from a ``save_checkpoint`` folder into the live objects.

    Every rank reads the files (a shared file system, or a copy per node) and keeps its own shards.
    Returns the training state: ``{"step", "extra"}``.

    Raises:
        ValueError: ``folder`` is not a finished checkpoint.
    """
    from safetensors.torch import load_file

    folder = Path(folder)
    weights, state_file = folder / "transformer" / WEIGHTS_NAME, folder / STATE_NAME
    if not weights.is_file() or not state_file.is_file():
        raise ValueError(f"{str(folder)!r} is not a checkpoint: it needs transformer/{WEIGHTS_NAME} and {STATE_NAME}")
    set_model_state_dict(transformer, load_file(str(weights)), options=_options())
    state = torch.load(state_file, map_location="cpu", weights_only=True)
    if optimizer is not None:
        set_optimizer_state_dict(transformer, optimizer, state["optimizer"], options=_options())
    return {"step": state["step"], "extra": state.get("extra", {})}
