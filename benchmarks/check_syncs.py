"""Does a world-size-1 ``enable_usp`` forward synchronize the host with the GPU where stock does not?

    PYTHONPATH=. python3 benchmarks/check_syncs.py --model dit,pixart

A host-bound model (its GPU work shorter than its Python) hides every kernel behind the host, until
a sync makes the host wait: then a forward costs host + device time, not the larger of the two. For
each model of ``bench_pipelines.CASES``: one warmed-up forward per variant under
``torch.cuda.set_sync_debug_mode("warn")``, counting the warnings (each a synchronizing call, with
where it came from).
"""
from __future__ import annotations

import argparse
import sys
import warnings

import torch

import bench_pipelines as bp


def _syncs(forward) -> list[str]:
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            forward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{w.filename}:{w.lineno}: {w.message}"[:200] for w in caught if "synchroniz" in str(w.message)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="dit")
    p.add_argument("--backend", default="auto")
    args = p.parse_args()
    device = torch.device("cuda", torch.cuda.current_device())
    for name in args.model.split(","):
        model, inputs, shape = bp.CASES[name](device)
        with torch.inference_mode():
            for variant in ("stock", "usp"):
                bp.set_variant(model, variant, args.backend)
                for _ in range(2):
                    model(**inputs)
                found = _syncs(lambda: model(**inputs))
                print(f"{name} {variant}: {len(found)} synchronizing calls in one forward")
                for line in found[:10]:
                    print("   ", line)
            bp.set_variant(model, "stock", args.backend)
        del model
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
