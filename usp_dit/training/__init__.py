"""Fine-tuning Diffusion Transformers with USP: gradient reduction, shared noise, FSDP2, checkpoints.

Layout: model tensors as the model holds them; see each module. The semantics (how the loss is
formed, why the mean over a replica is the one-process gradient, RNG sync, data parallelism) are in
docs/TRAINING.md, the Notes of ``reduce`` and ``rng``, and Note [who is a replica, who is data
parallel] in ``usp_dit.distributed.replica`` (the communication within a replica these helpers build on).
"""
from __future__ import annotations

from usp_dit.distributed.replica import replica_groups
from usp_dit.training.reduce import (
    broadcast_from_group_leader,
    check_same_on_replica,
    data_parallel_group,
    mean_over_data_parallel,
    reduction_groups,
    sync_grads,
)
from usp_dit.training.rng import replica_generator, replica_seed

__all__ = [
    "broadcast_from_group_leader",
    "check_same_on_replica",
    "data_parallel_group",
    "mean_over_data_parallel",
    "reduction_groups",
    "replica_generator",
    "replica_groups",
    "replica_seed",
    "sync_grads",
]
