"""Which attention kernels run here, and which ``backend="auto"`` picks.

    python -m usp_dit.kernels                       # this machine's GPU (else CPU), bf16 (float32 on CPU), head_dim 128
    python -m usp_dit.kernels --dtype float16 --head-dim 64

One row per registered backend: installed or not (with the line that installs it), whether it can
run the case, with a backward and an LSE; then what "auto" chooses for inference and for training.
"auto" may still pass over a kernel for small calls (``BackendCaps.min_call_flops``): the picks
shown are for calls large enough for every kernel.
"""
from __future__ import annotations

import argparse

import torch

from usp_dit.kernels import get_backend, list_backends, select_backend

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def backend_rows(device: str, dtype: torch.dtype, head_dim: int) -> list[tuple[str, str, str, str, str]]:
    """(name, installed, runs this case, backward, lse) for every registered backend."""
    rows = []
    for name in list_backends():
        backend = get_backend(name)
        caps = backend.caps
        try:
            backend.require()  # raises exactly when the backend is not available
            installed = "yes"
        except RuntimeError as err:  # the adapter's own message, with its install line
            installed = f"no: {err}"
        reason = caps.why_not(device, dtype, head_dim, needs_grad=False)
        rows.append((name, installed, "yes" if reason is None else f"no: {reason}",
                     "yes" if caps.supports_backward else "no", "yes" if caps.returns_lse else "no"))
    return rows


def auto_pick(device: str, dtype: torch.dtype, head_dim: int, needs_grad: bool) -> str:
    """The backend "auto" resolves to for this case, or the reason none can run it."""
    try:
        return select_backend("auto", device, dtype, head_dim, needs_grad).name
    except NotImplementedError as err:
        return f"none ({err})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=sorted(_DTYPES), default=None, help="default: bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args(argv)
    dtype = _DTYPES[args.dtype or ("bfloat16" if args.device == "cuda" else "float32")]
    print(f"device={args.device} dtype={dtype} head_dim={args.head_dim}")
    print("| backend | installed | runs this case | backward | LSE (rings) |\n|---|---|---|---|---|")
    for row in backend_rows(args.device, dtype, args.head_dim):
        print("| " + " | ".join(row) + " |")
    print(f"auto, inference: {auto_pick(args.device, dtype, args.head_dim, False)}")
    print(f"auto, training:  {auto_pick(args.device, dtype, args.head_dim, True)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
