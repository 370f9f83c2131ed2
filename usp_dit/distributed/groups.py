"""Group teardown: what usp_dit lets go of at interpreter exit (``release_groups``, run by ``atexit``).

Layout: no tensors; process groups and the objects that hold them.

Note [groups at exit]
    A gloo group still referenced when the interpreter tears down is destroyed there with its
    worker threads running, which can abort a finished job (SIGABRT) after all the work was done.
    So every holder of groups usp_dit makes registers here, weakly (nothing is kept alive by it):

        hold_groups(obj)              an object with ``release()`` (a ``USPMesh`` built by init_usp)
        register_device_mesh(mesh)    a DeviceMesh usp_dit made (its own, FSDP2's)
        @on_release                   a function dropping a cache of such objects (mesh.py's
                                      default mesh and Note [one mesh per grid])

    ``release_groups`` (at exit, after the job's ``destroy_process_group``) drops the caches, has
    every holder release its groups and clears each DeviceMesh's group registry, while the
    interpreter is whole: the groups are destroyed and their threads joined then.
"""
from __future__ import annotations

import atexit
import gc
import weakref
from collections.abc import Callable
from typing import Protocol

from torch.distributed.device_mesh import DeviceMesh


class GroupHolder(Protocol):
    """An object holding process groups that it can let go of (``USPMesh``)."""

    def release(self) -> None:
        """Drop every reference to a process group; using the object afterwards raises."""
        ...


# Held weakly: the objects with process groups (init_usp's meshes) and every DeviceMesh usp_dit made.
_GROUP_HOLDERS: weakref.WeakSet[GroupHolder] = weakref.WeakSet()
_DEVICE_MESHES: weakref.WeakSet[DeviceMesh] = weakref.WeakSet()
_CACHE_CLEARS: list[Callable[[], None]] = []


def hold_groups(holder: GroupHolder) -> GroupHolder:
    """Have ``release_groups`` call ``holder.release()`` at exit; returns ``holder``."""
    _GROUP_HOLDERS.add(holder)
    return holder


def register_device_mesh(device_mesh: DeviceMesh) -> DeviceMesh:
    """Have ``release_groups`` let go of ``device_mesh``'s process groups at exit; returns it."""
    _DEVICE_MESHES.add(device_mesh)
    return device_mesh


def on_release(clear: Callable[[], None]) -> Callable[[], None]:
    """Have ``release_groups`` call ``clear`` (drop a cache of group holders) first; returns it."""
    _CACHE_CLEARS.append(clear)
    return clear


def release_groups() -> None:
    """Let go of the process groups of every mesh usp_dit built, and of the default mesh.

    Runs at interpreter exit (``atexit``), after the job's ``destroy_process_group`` (Note [groups
    at exit]). A released mesh raises ``RuntimeError`` if used again.
    """
    for clear in _CACHE_CLEARS:
        clear()
    for holder in list(_GROUP_HOLDERS):
        holder.release()
    for device_mesh in list(_DEVICE_MESHES):
        # torch's DTensor caches (sharding propagation, redistribution plans, mesh topology) keep
        # every DeviceMesh they have seen for the life of the process, and a DeviceMesh keeps its
        # groups in this registry (slices use their root's).
        registry = getattr(device_mesh, "_pg_registry", None)
        if isinstance(registry, dict):
            registry.clear()
    gc.collect()  # groups held in reference cycles go now too, not during teardown


atexit.register(release_groups)
