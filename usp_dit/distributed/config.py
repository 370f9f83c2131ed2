"""USPConfig: the parallel degrees of one Unified Sequence Parallel layout, validated once."""
from __future__ import annotations

from dataclasses import dataclass

from usp_dit.distributed.fp8_wire import check_comm_dtype

# How a ring's forward moves K/V blocks (Note [ring schedule] in usp_dit.attention.ring): "stream" passes
# them round block by block, "gather_merge" gathers all of them while the local block computes and
# merges the partial results, "gather_one_call" gathers all of them and makes one kernel call.
RING_SCHEDULES = ("auto", "stream", "gather_merge", "gather_one_call")
# The names of 0.1 (still accepted): "gather" and "allgather" differed in what they did after the
# gather, which the names did not say.
RING_SCHEDULE_ALIASES = {"gather": "gather_merge", "allgather": "gather_one_call"}


def canonical_schedule(name: str) -> str:
    """``name`` as one of ``RING_SCHEDULES`` (an alias of 0.1 becomes its new name).

    Raises:
        ValueError: ``name`` is neither a schedule nor an alias.
    """
    name = RING_SCHEDULE_ALIASES.get(name, name)
    if name not in RING_SCHEDULES:
        raise ValueError(
            f"ring_schedule must be one of {RING_SCHEDULES} (or an old name: {sorted(RING_SCHEDULE_ALIASES)}), "
            f"got {name!r}"
        )
    return name


@dataclass(frozen=True)
class USPConfig:
    """Degrees of the rank grid, outermost to innermost: data-parallel, cfg, ring, ulysses, tensor.

    ``ulysses_degree`` ranks exchange heads for sequence with an all-to-all (cheap inside a node,
    so they are neighbouring ranks); ``ring_degree`` ranks pass K/V blocks around a ring;
    ``cfg_degree`` splits the conditional / unconditional batch halves; the data-parallel degree is
    whatever is left of the world size. ``ring_schedule`` is the default of calls on this grid
    (each ``usp_attention`` call may name its own): "stream" (block by block, least memory),
    "gather_merge" (all blocks at once, the local block computed while they travel, partial
    results merged), "gather_one_call" (all blocks at once, then one kernel call, no merge) or
    "auto" (by block length; Note [ring schedule choice] in ``usp_dit.attention.ring``).
    ``tensor_degree`` ranks hold the same tokens and split each block's projections and MLPs
    (tensor parallelism, ``usp_dit.pipelines.tensor``): the innermost axis, since it all-reduces
    activations twice a block. ``comm_dtype`` is what the Ulysses exchanges carry by default:
    "model" (the tensors' own dtype, exact) or "fp8" (Q, V and the output in e4m3 with a scale per
    (token, head), forward only: Note [fp8 wire] in ``usp_dit.distributed.fp8_wire``).
    """

    ulysses_degree: int = 1
    ring_degree: int = 1
    cfg_degree: int = 1
    ring_schedule: str = "auto"
    tensor_degree: int = 1
    comm_dtype: str = "model"

    def __post_init__(self) -> None:
        for name in ("ulysses_degree", "ring_degree", "cfg_degree", "tensor_degree"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        object.__setattr__(self, "ring_schedule", canonical_schedule(self.ring_schedule))
        check_comm_dtype(self.comm_dtype)

    @property
    def sequence_degree(self) -> int:
        """Ranks that share one sequence: ``ulysses_degree * ring_degree``."""
        return self.ulysses_degree * self.ring_degree

    @property
    def model_degree(self) -> int:
        """Ranks that run one model replica: ``cfg_degree * ring_degree * ulysses_degree * tensor_degree``."""
        return self.cfg_degree * self.sequence_degree * self.tensor_degree

    def data_parallel_degree(self, world_size: int) -> int:
        """The data-parallel degree for ``world_size`` ranks; raises if the grid does not fit."""
        if world_size % self.model_degree:
            raise ValueError(
                f"world_size={world_size} is not a multiple of cfg_degree*ring_degree*ulysses_degree*tensor_degree="
                f"{self.cfg_degree}*{self.ring_degree}*{self.ulysses_degree}*{self.tensor_degree}={self.model_degree}; "
                f"choose degrees whose product divides the world size"
            )
        return world_size // self.model_degree


def fill_degrees(world_size: int, ulysses: int | None = None, ring: int | None = None, cfg: int = 1) -> tuple[int, int, int]:
    """(ulysses, ring, cfg) that fill ``world_size``, completing the degrees not given.

    With neither given, Ulysses takes 2 ranks when they fit (all-to-all inside a node is the cheap
    axis) and the ring the rest; with one given, the other fills what is left. Raises ValueError when
    the result does not fit the world size.
    """
    per_cfg = max(1, world_size // cfg)
    if ulysses is None:
        ulysses = max(1, per_cfg // ring) if ring else (2 if per_cfg % 2 == 0 else 1)
    ring = ring or max(1, per_cfg // ulysses)
    USPConfig(ulysses, ring, cfg).data_parallel_degree(world_size)
    return ulysses, ring, cfg
