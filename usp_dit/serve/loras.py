"""LoRA adapters served by name: registered through ``POST /v1/loras``, applied per request.

Layout: no tensors here; the adapters' weights are PEFT's, inside the pipeline's modules.

Note [served LoRA]
    Rank 0 keeps the registry (name -> path). Registering checks the file on rank 0 (it exists and
    holds LoRA tensors: a 400 before any rank sees it) and loads nothing yet: every ``BatchSpec``
    carries the registry as it is when the batch is dispatched, and each rank of the replica that
    runs it brings its pipeline to that state first (``sync``: unload what was removed, load what
    is new), then turns on the request's adapters at their scales (``pipe.set_adapters``), or turns
    LoRA off for a request that names none. So every rank of a replica holds the same adapters
    when a batch starts, with no message of its own, and replicas catch up at their next batch.
    Requests batch together only with the same adapters and scales (they are in ``CallShape``).
    A load that fails inside ``sync`` (a file the other ranks cannot read) fails that batch on
    every rank (the step agreement), and the half-loaded adapter is dropped so the next batch
    retries. Unregistering an adapter that a queued request names fails that request with a
    message (every rank raises the same error, from the same snapshot).

    LoRA layers are PEFT's modules wrapped around the transformer's linear layers, added after
    ``enable_usp``: the sequence split lives in attention processors and hooks above them, so a
    LoRA'd projection is split like the plain one. Sharded weights (FSDP2 units fixed when they
    were sharded) and tensor-parallel projections (DTensor layers) do not take new layers: the
    registry refuses with 501 on such a server.
"""
from __future__ import annotations

import threading
from pathlib import Path

from usp_dit.serve.jobs import ServeError
from usp_dit.serve.protocol import BadRequest

MAX_SCALE = 10.0
LOADED_ATTR = "_usp_serve_loras"  # on each rank's pipeline: {name: path} of the adapters loaded there


def check_lora_file(path: str) -> None:
    """A LoRA file (``.safetensors``) or a folder holding exactly one; ``BadRequest`` otherwise."""
    from safetensors import safe_open

    target = Path(path)
    if target.is_dir():
        files = sorted(target.glob("*.safetensors"))
        if len(files) != 1:
            raise BadRequest(f"path {path!r}: a folder must hold one .safetensors file, found {len(files)}",
                             param="path")
        target = files[0]
    if not target.is_file():
        raise BadRequest(f"path {path!r} does not exist on the server", param="path")
    try:
        with safe_open(str(target), framework="pt") as handle:
            keys = list(handle.keys())
    except Exception as err:  # noqa: BLE001 -- any unreadable file is the client's 400
        raise BadRequest(f"path {path!r} is not a readable safetensors file: {err}", param="path") from None
    if not any("lora" in key for key in keys):
        raise BadRequest(f"path {path!r} holds no LoRA tensors (no key names 'lora')", param="path")


class Registry:
    """The adapters the server knows (rank 0; the HTTP threads and the serving loop share it)."""

    def __init__(self, refused: str | None = None):
        self.refused = refused  # why this server takes no LoRA (sharded or tensor-parallel weights)
        self._lock = threading.Lock()
        self._adapters: dict[str, str] = {}

    def add(self, name: object, path: object) -> dict:
        if self.refused is not None:
            raise ServeError(501, self.refused, "not_implemented")
        if not isinstance(name, str) or not name.isidentifier():
            raise BadRequest(f"name {name!r} must be a Python identifier (PEFT's adapter names)", param="name")
        if not isinstance(path, str) or not path:
            raise BadRequest(f"path {path!r} must be a file or folder path on the server", param="path")
        check_lora_file(path)
        with self._lock:
            if name in self._adapters:
                raise BadRequest(f"name {name!r} is registered already (DELETE /v1/loras/{name} first)",
                                 param="name")
            self._adapters[name] = path
        return {"object": "lora", "name": name, "path": path}

    def remove(self, name: str) -> dict:
        with self._lock:
            if name not in self._adapters:
                raise ServeError(404, f"no LoRA adapter named {name!r}", "invalid_request_error")
            path = self._adapters.pop(name)
        return {"object": "lora", "name": name, "path": path, "deleted": True}

    def listing(self) -> dict:
        with self._lock:
            data = [{"object": "lora", "name": n, "path": p} for n, p in sorted(self._adapters.items())]
        return {"object": "list", "data": data}

    def snapshot(self) -> tuple[tuple[str, str], ...]:
        with self._lock:
            return tuple(sorted(self._adapters.items()))

    def resolve(self, lora: dict[str, float] | None) -> tuple[tuple[str, float], ...]:
        """A request's ``lora`` field (name -> scale) checked: known names, finite scales; sorted."""
        if not lora:
            return ()
        if self.refused is not None:
            raise BadRequest(f"lora: {self.refused}", param="lora")
        with self._lock:
            unknown = sorted(set(lora) - set(self._adapters))
        if unknown:
            raise BadRequest(f"lora: no adapter named {unknown[0]!r} (POST /v1/loras registers one)", param="lora")
        for name, scale in lora.items():
            if not -MAX_SCALE <= scale <= MAX_SCALE:
                raise BadRequest(f"lora: scale {scale} of {name!r} must be between {-MAX_SCALE} and {MAX_SCALE}",
                                 param="lora")
        return tuple(sorted(lora.items()))


def sync(pipe, adapters: tuple[tuple[str, str], ...], active: tuple[tuple[str, float], ...]) -> None:
    """Note [served LoRA]: bring this rank's pipeline to the registry ``adapters`` (name, path), then
    turn on ``active`` (name, scale), or LoRA off when it is empty. Every rank of the replica calls
    it with the same arguments before the batch."""
    loaded: dict[str, str] = pipe.__dict__.setdefault(LOADED_ATTR, {})
    wanted = dict(adapters)
    for name in [n for n, p in loaded.items() if wanted.get(n) != p]:
        pipe.delete_adapters(name)
        del loaded[name]
    for name, path in adapters:
        if name not in loaded:
            _load(pipe, name, path)
            loaded[name] = path
    missing = [name for name, _ in active if name not in loaded]
    if missing:
        raise ValueError(f"LoRA adapter {missing[0]!r} was removed (DELETE /v1/loras) before this request ran")
    if active:
        pipe.enable_lora()
        pipe.set_adapters([name for name, _ in active], [scale for _, scale in active])
    elif loaded:
        pipe.disable_lora()


def _load(pipe, name: str, path: str) -> None:
    try:
        pipe.load_lora_weights(path, adapter_name=name)
    except Exception:
        try:  # a half-injected adapter would refuse the retry ("already in use")
            pipe.delete_adapters(name)
        except Exception:  # noqa: BLE001, S110 -- nothing was injected: nothing to drop
            pass
        raise


__all__ = ["Registry", "check_lora_file", "sync"]
