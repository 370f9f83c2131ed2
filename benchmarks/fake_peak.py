"""A VAE decode's activation peak without a GPU: the stock decode and one rank's share of a P-way
parallel decode (``bench_vae.share``'s, communication simulated) run under ``FakeTensorMode``
(shapes only, no data, no arithmetic), a dispatch mode counting the bytes of the storages ops
create while they are alive (``LiveBytes``). The estimates GPU_PENDING and the planner cite for decodes not measured yet
(HunyuanVideo 1.5's ~82 GiB at 480p) come from this method; it is not the caching allocator
(no fragmentation, no kernel workspaces), so read it as a lower bound of ``max_memory_allocated``.

    PYTHONPATH=. python3 benchmarks/fake_peak.py --model sana_dcae,hunyuan_video15_480p --parts 2,4,8

Prints per case the stock decode's peak GiB above the weights and each share's as a fraction of it.
"""
from __future__ import annotations

import argparse
import sys

import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

try:
    import bench_vae as bv  # run from benchmarks/: this folder is on sys.path
except ImportError:
    from benchmarks import bench_vae as bv


class LiveBytes(TorchDispatchMode):
    """The peak over a region of the bytes of storages its ops created and that are still alive
    (views and in-place results share a storage already counted; storages that existed before the
    region, the weights and the input, are never counted). (torch's ``MemTracker`` does this per
    module, and refuses a module called twice, as these decoders do.)"""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0
        self.seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage not in self.seen:
                    self.seen[storage] = True
                    nbytes = storage.nbytes()
                    self.live += nbytes
                    weakref.finalize(storage, self._free, nbytes)
        self.peak = max(self.peak, self.live)
        return out


def _peak_gib(fn, before: list[torch.Tensor]) -> tuple[float, object]:
    """(peak GiB of the storages ``fn()`` creates, those of ``before`` (weights, input) left out;
    ``fn()``'s result)."""
    tracker = LiveBytes()
    for t in before:
        tracker.seen[t.untyped_storage()] = True
    with tracker:
        result = fn()
    return tracker.peak / 2**30, result


def run(name: str, parts: list[int]) -> dict:
    case = bv._case(name)
    vae = bv._build(case.build, torch.device("cpu"))  # real weights (fake mode cannot convert a module's dtype)
    with FakeTensorMode(allow_non_fake_inputs=True):
        z = torch.randn(case.latent, dtype=torch.bfloat16)
        before = [*vae.parameters(), *vae.buffers(), z]
        with torch.no_grad():
            stock, _ = _peak_gib(lambda: bv._decode_rows(vae, z), before)
            shares = {}
            for p in parts:  # share() is None where the latent is too short for p pieces
                peak, measured = _peak_gib(lambda p=p: bv.share(vae, z, p, warmup=0, rounds=1), before)
                shares[p] = None if measured is None else round(peak / stock, 3)
    return {"model": name, "shape": case.label, "stock_peak_gib": round(stock, 2), "share_fractions": shares}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="sana_dcae")
    p.add_argument("--parts", default="2,4,8")
    args = p.parse_args(argv)
    parts = [int(x) for x in args.parts.split(",")]
    for name in args.model.split(","):
        print(run(name, parts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
