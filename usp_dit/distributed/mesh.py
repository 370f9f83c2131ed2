"""The rank grid: a ``torch.distributed`` DeviceMesh with axes ("dp", "cfg", "ring", "ulysses"),
and "tensor" innermost when ``tensor_degree > 1``.

Axes are ordered outermost to innermost, so a Ulysses group is made of neighbouring ranks (NVLink
neighbours on one node) and the ``ring_degree * ulysses_degree`` ranks of one sequence group are
contiguous (with a tensor axis: contiguous up to it). A second, flattened view ("dp", "cfg", "seq"
[, "tensor"]) gives the sequence group used to shard and gather tokens.

Note [the tensor axis]
    Tensor-parallel ranks hold the same tokens (the same ``seq_rank``) and split each block's
    heads and MLP columns (``usp_dit.pipelines.tensor``); it all-reduces activations twice a block,
    the busiest traffic of the grid, so it is the innermost axis (neighbouring ranks). Each tensor
    rank has its own Ulysses, ring and sequence groups over the ranks of the same tensor rank, so
    the Ulysses all-to-all exchanges that rank's heads only: heads are split over T x U. With
    ``tensor_degree == 1`` the axis is left out of the DeviceMesh altogether (no extra groups).

Note [sequence rank order]
    seq_rank = ring_rank * ulysses_degree + ulysses_rank
    The Ulysses all-to-all gathers shards seq_rank = r*U .. r*U+U-1 into ring block r, so every
    ring block is one contiguous range of the full sequence.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from usp_dit.distributed.comm import RingExchanger
from usp_dit.distributed.config import USPConfig
from usp_dit.distributed.gloo import gloo_threads, serialize_gloo_groups
from usp_dit.distributed.groups import (
    hold_groups,
    on_release,
    register_device_mesh,
    release_groups,  # noqa: F401  (usp_dit.distributed.mesh.release_groups stays importable)
)

_AXES = ("dp", "cfg", "ring", "ulysses")
_SEQ_AXES = ("dp", "cfg", "seq")


def mesh_axes(config: USPConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The axis names of the grid's DeviceMesh and of its sequence view (Note [the tensor axis])."""
    tensor = ("tensor",) if config.tensor_degree > 1 else ()
    return _AXES + tensor, _SEQ_AXES + tensor


@dataclass(eq=False)
class USPMesh:
    """One USP layout in one process: degrees, this rank's coordinates and the process groups.

    Groups are ``None`` when their axis has size 1 (nothing to communicate). Several meshes of
    different shapes may coexist in one process.
    """

    config: USPConfig
    dp_degree: int
    device_type: str
    device_mesh: DeviceMesh | None = None
    seq_mesh: DeviceMesh | None = None
    released: bool = field(default=False, init=False, repr=False)
    _exchanger: RingExchanger | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        # Built here rather than on first use: a lazy attribute takes a lock on first access, which
        # torch.compile cannot trace (the first compiled call would break its graph there).
        if self.ring_group is not None:
            self._exchanger = RingExchanger(self.ring_group)

    @property
    def ulysses_degree(self) -> int:
        return self.config.ulysses_degree

    @property
    def ring_degree(self) -> int:
        return self.config.ring_degree

    @property
    def cfg_degree(self) -> int:
        return self.config.cfg_degree

    @property
    def ring_schedule(self) -> str:
        return self.config.ring_schedule

    @property
    def sequence_degree(self) -> int:
        return self.config.sequence_degree

    @property
    def comm_dtype(self) -> str:
        return self.config.comm_dtype

    @property
    def tensor_degree(self) -> int:
        return self.config.tensor_degree

    def _check_live(self) -> None:
        # A released mesh has no groups left: answering with the single-rank defaults would
        # silently compute on the local shard alone.
        if self.released:
            raise RuntimeError(
                "this USPMesh's process groups were released at process exit (usp_dit.distributed.groups.release_groups); "
                "build a new mesh with usp_dit.init_usp"
            )

    def _local_rank(self, axis: str) -> int:
        self._check_live()
        return 0 if self.device_mesh is None else self.device_mesh.get_local_rank(axis)

    def _group(self, mesh: DeviceMesh | None, axis: str, degree: int) -> dist.ProcessGroup | None:
        self._check_live()
        return None if mesh is None or degree == 1 else mesh.get_group(axis)

    @property
    def ulysses_rank(self) -> int:
        return self._local_rank("ulysses")

    @property
    def ring_rank(self) -> int:
        return self._local_rank("ring")

    @property
    def cfg_rank(self) -> int:
        return self._local_rank("cfg")

    @property
    def dp_rank(self) -> int:
        return self._local_rank("dp")

    @property
    def tensor_rank(self) -> int:
        return 0 if self.tensor_degree == 1 else self._local_rank("tensor")

    @property
    def seq_rank(self) -> int:
        """Index of this rank's shard in the sequence (Note [sequence rank order])."""
        return self.ring_rank * self.ulysses_degree + self.ulysses_rank

    @property
    def ulysses_group(self) -> dist.ProcessGroup | None:
        return self._group(self.device_mesh, "ulysses", self.ulysses_degree)

    @property
    def ring_group(self) -> dist.ProcessGroup | None:
        return self._group(self.device_mesh, "ring", self.ring_degree)

    @property
    def cfg_group(self) -> dist.ProcessGroup | None:
        return self._group(self.device_mesh, "cfg", self.cfg_degree)

    @property
    def seq_group(self) -> dist.ProcessGroup | None:
        return self._group(self.seq_mesh, "seq", self.sequence_degree)

    @property
    def tensor_group(self) -> dist.ProcessGroup | None:
        return self._group(self.device_mesh, "tensor", self.tensor_degree)

    @property
    def tensor_device_mesh(self) -> DeviceMesh | None:
        """The 1-D DeviceMesh of this rank's tensor-parallel group (for ``parallelize_module``);
        ``None`` when ``tensor_degree`` is 1."""
        self._check_live()
        return None if self.device_mesh is None or self.tensor_degree == 1 else self.device_mesh["tensor"]

    @property
    def ring_exchanger(self) -> RingExchanger:
        """The K/V ring of this rank's ring group (built with the mesh, reused by every call)."""
        self._check_live()
        if self._exchanger is None:
            raise ValueError("ring_degree is 1: there is no ring")
        return self._exchanger

    def release(self) -> None:
        """Let go of this mesh's process groups (``usp_dit.distributed.groups`` Note [groups at exit]); using it
        afterwards raises ``RuntimeError``."""
        self.device_mesh = self.seq_mesh = None
        self._exchanger = None  # it holds the ring group
        self.released = True

    def __deepcopy__(self, memo: dict) -> USPMesh:
        # A mesh is a handle on process groups, which cannot be copied: a deep copy of an enabled
        # model (an EMA copy in fine-tuning) shares its original's mesh.
        return self

    def __copy__(self) -> USPMesh:
        return self

    def __repr__(self) -> str:
        c = self.config
        tensor = f", tensor={c.tensor_degree}" if c.tensor_degree > 1 else ""
        return (
            f"USPMesh(dp={self.dp_degree}, cfg={c.cfg_degree}, ring={c.ring_degree}, "
            f"ulysses={c.ulysses_degree}{tensor}, device_type={self.device_type!r})"
        )


def single_rank_mesh(device_type: str = "cpu") -> USPMesh:
    """A mesh of one rank with no process group: every axis has size 1."""
    return USPMesh(USPConfig(), dp_degree=1, device_type=device_type)


def _ensure_process_group() -> None:
    """Start the default process group from torchrun's environment if it is not running yet."""
    if dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    else:
        serialize_gloo_groups()  # Note [gloo all-gather race]
    dist.init_process_group(backend=backend)


def _device_type() -> str:
    backend = dist.get_backend()
    return "cuda" if "nccl" in str(backend) else "cpu"


def init_usp(ulysses_degree: int = 1, ring_degree: int = 1, cfg_degree: int = 1, ring_schedule: str = "auto",
             tensor_degree: int = 1, comm_dtype: str = "model") -> USPMesh:
    """Build the USP rank grid over the default process group and make it the default mesh.

    Starts the default process group from torchrun's environment variables when needed (NCCL
    with CUDA, else gloo). With a world size of 1 and no process group, returns a single-rank mesh
    without starting one. Ranks beyond ``cfg * ring * ulysses`` form the data-parallel axis.

    ``ring_schedule`` ("auto", "stream", "gather" or "allgather") is how the ring's forward moves
    K/V blocks (Note [ring schedule] in ``usp_dit.attention.ring``). ``tensor_degree`` ranks split
    each block's weights (tensor parallelism; Note [the tensor axis]). ``comm_dtype`` ("model" or
    "fp8") is what the Ulysses exchanges of its calls carry by default (Note [fp8 wire]: lossy,
    forward only, opt-in).

    The same degrees give the same mesh and process groups again (Note [one mesh per grid]), so
    calling it, or ``enable_usp``, in a loop opens no new groups.

    Raises:
        ValueError: a degree is not a positive int, the degrees do not fit the world size, or
            ``ring_schedule`` is not one of ``usp_dit.distributed.config.RING_SCHEDULES``.
    """
    config = USPConfig(ulysses_degree, ring_degree, cfg_degree, ring_schedule, tensor_degree, comm_dtype)
    env_world = int(os.environ.get("WORLD_SIZE", "1"))
    if not dist.is_initialized() and env_world == 1:
        config.data_parallel_degree(1)
        mesh = USPMesh(config, dp_degree=1, device_type="cuda" if torch.cuda.is_available() else "cpu")
    else:
        _ensure_process_group()
        mesh = _mesh_of(config)
    set_default_mesh(mesh)
    return mesh


# Note [one mesh per grid]
#     Every DeviceMesh built opens new process groups: for gloo about 5 groups, 15 threads and 20
#     file descriptors per rank, which nothing frees until the process ends. A job that enables
#     and disables USP in a loop (a sweep over grids, a test harness) would run out of file
#     descriptors after a few hundred cycles. So init_usp keeps the meshes it built, one per grid
#     shape, and hands out the same groups for the same shape again. Meshes that differ only in
#     ring_schedule or comm_dtype share their groups (neither is a property of the groups). The cache
#     is dropped when the default group it was built on is destroyed, and by release_groups.
_MESHES: dict[tuple, USPMesh] = {}


@on_release
def _forget_meshes() -> None:
    """For ``release_groups``: no default mesh and no cached mesh hold a group any more."""
    set_default_mesh(None)
    _MESHES.clear()


def _groups_alive(mesh: USPMesh) -> bool:
    """True while every process group of ``mesh`` is still registered with torch.distributed."""
    if mesh.released or mesh.device_mesh is None:
        return False
    registered = dist.distributed_c10d._world.pg_map
    axes, seq_axes = mesh_axes(mesh.config)
    groups = [mesh.device_mesh.get_group(a) for a in axes] + [mesh.seq_mesh.get_group(a) for a in seq_axes]
    return all(g in registered for g in groups)


def _mesh_of(config: USPConfig) -> USPMesh:
    """The mesh of ``config`` over the default group: the cached one (Note [one mesh per grid]),
    one sharing the groups of a cached mesh of the same shape, or a new one."""
    world, device_type = dist.get_world_size(), _device_type()
    dp = config.data_parallel_degree(world)
    shape = (dp, config.cfg_degree, config.ring_degree, config.ulysses_degree, config.tensor_degree, device_type)
    for key in [k for k, m in _MESHES.items() if not _groups_alive(m)]:
        del _MESHES[key]
    if (shape, config) in _MESHES:
        return _MESHES[(shape, config)]
    same_shape = next((m for (s, _), m in _MESHES.items() if s == shape), None)
    if same_shape is not None:
        mesh = USPMesh(config, dp, device_type, same_shape.device_mesh, same_shape.seq_mesh)
    else:
        mesh = _build_mesh(config, dp, device_type)
    _MESHES[(shape, config)] = hold_groups(mesh)
    return mesh


def _build_mesh(config: USPConfig, dp: int, device_type: str) -> USPMesh:
    """A new USPMesh with its own process groups."""
    axes, seq_axes = mesh_axes(config)
    tensor = (config.tensor_degree,) if config.tensor_degree > 1 else ()
    shape = (dp, config.cfg_degree, config.ring_degree, config.ulysses_degree, *tensor)
    if device_type == "cpu":
        serialize_gloo_groups()  # the groups below run one collective at a time (Note [gloo all-gather race])
    device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=axes, backend_override=_own_groups(device_type, axes))
    # seq_rank = ring_rank * U + ulysses_rank (Note [sequence rank order]): merging the ring and
    # Ulysses axes keeps every rank's place, the tensor axis stays innermost.
    seq_mesh = init_device_mesh(device_type, (dp, config.cfg_degree, config.sequence_degree, *tensor),
                                mesh_dim_names=seq_axes, backend_override=_own_groups(device_type, seq_axes))
    _inherit_timeout((device_mesh, axes), (seq_mesh, seq_axes))
    return USPMesh(config, dp, device_type, register_device_mesh(device_mesh), register_device_mesh(seq_mesh))


def _own_groups(device_type: str, axes: tuple[str, ...]) -> dict[str, str] | None:
    """DeviceMesh's ``backend_override`` that gives every axis a group of its own, where the
    default group is a gloo group running more than one worker thread (one the user started
    before usp_dit): an axis spanning the whole world would otherwise reuse it, and its
    collectives could run two at a time (Note [gloo all-gather race]). None (torch's choice)
    elsewhere."""
    if device_type != "cpu" or (gloo_threads() or 1) <= 1:
        return None
    return {axis: "gloo" for axis in axes}  # a fresh dict: torch pops what it reads


def default_timeout(device_type: str):
    """The default process group's timeout on ``device_type``'s backend, or None when it has none."""
    default = dist.distributed_c10d._get_default_group()
    try:
        return default._get_backend(torch.device(device_type)).options._timeout
    except (AttributeError, RuntimeError):
        return None


def _inherit_timeout(*meshes: tuple[DeviceMesh, tuple[str, ...]]) -> None:
    """Give the mesh's groups the default group's timeout.

    New groups otherwise get the backend's default (30 minutes for gloo), so a rank stuck in a
    collective after its peer failed would wait that long even when the job asked for less.
    """
    timeout = default_timeout(_device_type())
    if timeout is None:  # a backend without options: keep the groups' own default
        return
    for device_mesh, axes in meshes:
        for axis in axes:
            device_mesh.get_group(axis).set_timeout(timeout)


class _Default:
    """Holds the mesh that ``usp_attention(mesh=None)`` uses (the last one ``init_usp`` built)."""

    mesh: USPMesh | None = None
    single: USPMesh | None = None  # resolve_mesh's mesh of one rank, kept


def set_default_mesh(mesh: USPMesh | None) -> None:
    """Make ``mesh`` the one used when no mesh is passed (``None`` clears it)."""
    _Default.mesh = mesh


def resolve_mesh(mesh: USPMesh | None) -> USPMesh:
    """``mesh`` itself, else the default mesh, else a single-rank mesh in a single process.

    Raises:
        ValueError: no mesh was given or initialised while several processes are running: computing
            attention on the local shard alone would silently give a wrong answer.
    """
    if mesh is not None:
        return mesh
    if _Default.mesh is not None:
        return _Default.mesh
    if dist.is_initialized() and dist.get_world_size() > 1:
        raise ValueError(
            "mesh=None but no USP mesh was initialised in this multi-process job: "
            "call usp_dit.init_usp(ulysses_degree=..., ring_degree=...) first or pass mesh="
        )
    # One kept instance (a new mesh a call was a third of a small call's Python time); a released
    # one is replaced.
    if _Default.single is None or _Default.single.released:
        _Default.single = single_rank_mesh()
    return _Default.single
