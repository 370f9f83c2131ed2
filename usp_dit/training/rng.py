"""Random numbers shared by the ranks of one model replica and distinct across data-parallel ranks.

Layout: whatever shapes the caller draws (noise like the latent, timesteps (batch,)).

Note [RNG sync]
    The ranks of a replica (``usp_dit.training.reduce`` Note [who is a replica, who is data
    parallel]) shard one sample; they must add the same noise at the same timestep, or each
    computes the loss of a different problem and their averaged gradient is wrong, silently.
    Two ways, both supported:
      * seed: ``replica_generator(seed, mesh)`` gives every rank of a replica a generator in the
        same state (seeded from ``seed`` and the dp index only); drawing the same shapes in the
        same order keeps them in step with no communication;
      * broadcast: draw anywhere, then ``broadcast_from_group_leader(noise, mesh)``.
    Different dp indices get different seeds, so the replicas see different noise.
"""
from __future__ import annotations

import torch

from usp_dit.distributed.mesh import USPMesh

_MIX = (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB)  # odd 64-bit constants (splitmix64)


def _mix(x: int) -> int:
    """splitmix64's finaliser: nearby inputs give unrelated 64-bit outputs."""
    x = (x + _MIX[0]) & ((1 << 64) - 1)
    x = ((x ^ (x >> 30)) * _MIX[1]) & ((1 << 64) - 1)
    x = ((x ^ (x >> 27)) * _MIX[2]) & ((1 << 64) - 1)
    return x ^ (x >> 31)


def replica_seed(seed: int, mesh: USPMesh, step: int = 0) -> int:
    """A 63-bit seed from (``seed``, dp index, ``step``): identical on the ranks of one replica.

    Raises:
        ValueError: ``seed`` or ``step`` is not a non-negative int.
    """
    for name, value in (("seed", seed), ("step", step)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return _mix(_mix(_mix(seed) ^ mesh.dp_rank) ^ step) >> 1


def replica_generator(seed: int, mesh: USPMesh, step: int = 0, device: str | torch.device = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` in the same state on every rank of this rank's replica.

    One generator per ``step`` (seeded from it) makes a resumed run draw what the uninterrupted
    run drew at that step, with no generator state to save.

    Raises:
        ValueError: ``seed`` or ``step`` is not a non-negative int.
    """
    return torch.Generator(device=device).manual_seed(replica_seed(seed, mesh, step))
