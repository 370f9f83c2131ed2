"""Cross-rank agreement on what a collective call is about, before any size-dependent transfer.

Layout: no tensors of the caller's; each rank contributes a few int64 numbers.

Note [call handshake]
    Ranks that disagree on a call's metadata (one in bfloat16 and one in float16, different batch
    or head counts, joint tokens on some ranks only, a ring schedule or a gradient on some ranks
    only) would otherwise run collectives whose sizes differ: gloo aborts the process ("Received
    data size doesn't match"), NCCL hangs or, worse, same-sized buffers of different meaning mix
    into a silent wrong answer. So before the first size-dependent collective of a call every rank
    all-gathers a FIXED-size vector (the same byte count whatever the metadata, so the gather
    itself can never mismatch):

        [ hash(field names), hash(field values), varying value ]      3 x int64 per rank

    Equal hashes everywhere: the call goes on, and the gathered ``varying`` values (e.g. every
    rank's shard length, which legitimately differs) are returned, so the handshake replaces the
    all-gather of shard lengths that had to run anyway. Any hash differs: every rank saw the same
    gathered table, so every rank takes the slow path together, all-gathers the readable values
    (``all_gather_object``) and raises the same ``ValueError`` naming each differing field and each
    rank's value. Nothing hangs and nothing garbles.

    A model wrapper that has already agreed on everything its attention calls depend on (its inputs'
    shapes and dtypes, autocast, grad mode) opens ``verified_calls(mesh)`` for the duration of the
    forward; calls inside it that know their sequence length skip the handshake (Note [verified
    calls]).

Note [verified calls]
    ``usp_attention`` runs one handshake per call unless it is inside ``verified_calls(mesh)`` for
    its mesh and was told ``seq_len``; then the call's metadata is a function of what the wrapper
    agreed on, and the per-call collective (57 per Flux step) is saved. The scope is a context
    variable, so threads and nested models do not leak it into each other.
"""
from __future__ import annotations

import contextlib
import contextvars
import hashlib
import pickle
from collections.abc import Iterator, Mapping
from typing import Any

import torch
import torch.distributed as dist

from usp_dit.distributed import traffic
from usp_dit.distributed.comm import start_all_gather_into

_VERIFIED: contextvars.ContextVar[tuple[int, ...]] = contextvars.ContextVar("usp_dit_verified_meshes", default=())


def _shown(value: Any) -> str:
    """How a field's value reads in an error message (and what is hashed)."""
    if isinstance(value, torch.dtype):
        return str(value).removeprefix("torch.")
    if value is None:
        return "not given"
    return repr(value)


def _hash(text: str) -> int:
    """A signed 64-bit digest of ``text`` (fits an int64 tensor)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little", signed=True)


def _signature(fields: Mapping[str, Any]) -> tuple[int, int, dict[str, str]]:
    shown = {name: _shown(value) for name, value in fields.items()}
    return _hash("\x1f".join(shown)), _hash("\x1f".join(shown.values())), shown


def _differences(per_rank: list[dict[str, str]], names: list[str], group: dist.ProcessGroup) -> list[str]:
    """``"name (rank 0: a, rank 1: b)"`` for each of ``names`` whose value is not the same on every rank."""
    lines = []
    for name in names:
        values = [fields.get(name, "(absent)") for fields in per_rank]
        if len(set(values)) > 1:
            ranks = ", ".join(f"rank {dist.get_global_rank(group, i)}: {v}" for i, v in enumerate(values))
            lines.append(f"{name} ({ranks})")
    return lines


def _disagreement(shown: dict[str, str], group: dist.ProcessGroup, what: str) -> ValueError:
    """The error every rank raises, built from every rank's readable fields (one slow gather)."""
    per_rank: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(per_rank, shown, group=group)
    if traffic.counting():  # the pickled payloads (the slow path only)
        sizes = [len(pickle.dumps(fields)) for fields in per_rank]
        me = dist.get_rank(group)
        traffic.record("handshake", (len(sizes) - 1) * sizes[me], sum(sizes) - sizes[me])
    names = list(dict.fromkeys(name for fields in per_rank for name in fields))
    everywhere = [name for name in names if all(name in fields for fields in per_rank)]
    lines = _differences(per_rank, everywhere, group) or _differences(per_rank, names, group)
    detail = "; ".join(lines) if lines else "their field lists differ"
    return ValueError(
        f"ranks of one USP group disagree on {what}: {detail}. Every rank must make the same call "
        f"with its own shard of the same tensors"
    )


def agree(
    fields: Mapping[str, Any],
    group: dist.ProcessGroup,
    device: torch.device,
    *,
    varying: int = 0,
    what: str = "a call",
) -> list[int]:
    """Note [call handshake]: check ``fields`` are equal on every rank of ``group``.

    Args:
        fields: name -> value (int, bool, str, None, torch.dtype or anything with a stable repr).
        group: the ranks that must agree.
        device: where the small gather runs (CUDA under NCCL, CPU under gloo).
        varying: one number allowed to differ between ranks (e.g. this rank's shard length).
        what: what the fields describe, for the error message.

    Returns:
        Every rank's ``varying``, in group rank order.

    Raises:
        ValueError: on every rank alike, naming each field that differs and every rank's value.
    """
    names_hash, values_hash, shown = _signature(fields)
    mine = torch.tensor([names_hash, values_hash, varying], dtype=torch.int64, device=device)
    # A plain blocking collective: the result is read at once, and on gloo the functional
    # collective's wrapping cost about three times this one (1.0 against 0.36 ms per call).
    table = mine.new_empty(dist.get_world_size(group) * 3)
    start_all_gather_into(table, mine, group, kind="handshake").wait()
    table = table.view(-1, 3).tolist()
    if any(row[:2] != table[0][:2] for row in table):
        raise _disagreement(shown, group, what)
    return [row[2] for row in table]


@contextlib.contextmanager
def verified_calls(mesh: object) -> Iterator[None]:
    """Note [verified calls]: attention calls on ``mesh`` given ``seq_len`` skip their handshake here."""
    token = _VERIFIED.set(_VERIFIED.get() + (id(mesh),))
    try:
        yield
    finally:
        _VERIFIED.reset(token)


def calls_verified(mesh: object) -> bool:
    """True inside ``verified_calls(mesh)``, and in code that ``torch.compile`` traces, where no
    handshake can run (Note [compiled calls] in ``usp_dit.attention.usp``)."""
    return torch.compiler.is_compiling() or id(mesh) in _VERIFIED.get()
