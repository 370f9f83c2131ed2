"""What a gradient on the log-sum-exp costs a kernel's backward (Note [LSE gradient] in
``usp_dit.kernels.lse_grad``), on one GPU:

    PYTHONPATH=. python3 benchmarks/bench_lse_grad.py

For each CUDA backend with a backward, bf16, batch 1, Flux-like (4608 tokens, 24 heads) and
Wan-like (32760 tokens, 40 heads) shapes at head_dim 128: the plain backward, the one-call
augmented backward (where a wider head dim fits) and the two-call one, measured side by side
(interleaved, median of CUDA-event timings). Prints a markdown table.
"""
from __future__ import annotations

import statistics

import torch

from usp_dit.kernels import get_backend
from usp_dit.kernels.lse_grad import augmented_width, backward_augmented, backward_two_calls, lse_columns

SHAPES = {"flux": (1, 4608, 24, 128), "wan": (1, 32760, 40, 128)}
BACKENDS = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flash_attn_3", "flash_attn_2")


def _time(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def bench(name: str, shape: tuple[int, int, int, int], rounds: int = 5, reps: int = 3) -> dict[str, float] | None:
    backend = get_backend(name)
    b, s, h, d = shape
    if not backend.available() or backend.caps.why_not("cuda", torch.bfloat16, d, True) is not None:
        return None
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, dout = (torch.randn(b, s, h, d, generator=g, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    dlse = torch.randn(b, s, h, generator=g, device="cuda")
    out, lse = backend.forward(q, k, v, d ** -0.5)
    width = augmented_width(backend, q, lse_columns(q.dtype))
    variants = {"plain": lambda: backend.backward(dout, q, k, v, out, lse, d ** -0.5),
                "two_calls": lambda: backward_two_calls(backend, dout, q, k, v, out, lse, dlse, d ** -0.5, {})}
    if width is not None:
        variants["augmented"] = lambda: backward_augmented(backend, dout, q, k, v, out, lse, dlse, d ** -0.5, width, {})
    for fn in variants.values():  # warm-up
        fn()
    times = {key: [] for key in variants}
    for _ in range(rounds):
        for key, fn in variants.items():
            times[key].append(_time(fn, reps))
    return {key: statistics.median(t) for key, t in times.items()} | {"width": width or 0}


def main() -> None:
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| shape | backend | plain ms | augmented ms (width) | two calls ms |")
    print("| --- | --- | --- | --- | --- |")
    for shape_name, shape in SHAPES.items():
        for name in BACKENDS:
            res = bench(name, shape)
            if res is None:
                continue
            aug = "-"
            if "augmented" in res:
                aug = f"{res['augmented']:.2f} ({res['width']}) = {res['augmented'] / res['plain']:.2f}x"
            print(f"| {shape_name} {shape} | {name} | {res['plain']:.2f} | {aug} | "
                  f"{res['two_calls']:.2f} = {res['two_calls'] / res['plain']:.2f}x |")


if __name__ == "__main__":
    main()
