"""The registry of named attention backends (each adapter module registers its backend on import).

Layout: see ``usp_dit.kernels.protocol``.
"""
from __future__ import annotations

from usp_dit.kernels.protocol import AttentionBackend

_REGISTRY: dict[str, AttentionBackend] = {}
# Bumped at every registration, so that cached selections (``usp_dit.kernels.policy``) made before
# a backend was added or replaced are made again.
_GENERATION = [0]


def register_backend(backend: AttentionBackend) -> AttentionBackend:
    """Add ``backend`` to the registry under ``backend.name`` (a later one replaces an earlier)."""
    _REGISTRY[backend.name] = backend
    _GENERATION[0] += 1
    return backend


def list_backends() -> list[str]:
    """Names of the registered backends."""
    return sorted(_REGISTRY)


def get_backend(name: str) -> AttentionBackend:
    """The registered backend called ``name``.

    Raises:
        ValueError: no backend has that name.
    """
    if name not in _REGISTRY:
        raise ValueError(f"backend={name!r} is not registered; choose 'auto' or one of {list_backends()}")
    return _REGISTRY[name]


def backends_with_lse() -> list[str]:
    """Names of the registered backends that return a log-sum-exp (usable in a ring)."""
    return sorted(n for n, b in _REGISTRY.items() if b.caps.returns_lse)


def registered(name: str) -> AttentionBackend | None:
    """The backend registered as ``name``, or ``None``."""
    return _REGISTRY.get(name)


def generation() -> int:
    """How many registrations have happened (cache key for selections)."""
    return _GENERATION[0]


def with_backward(device: str, dtype: torch.dtype, head_dim: int) -> list[str]:
    """Names of the registered backends that can run this case with a backward."""
    return [n for n, b in _REGISTRY.items() if b.caps.why_not(device, dtype, head_dim, True) is None]
