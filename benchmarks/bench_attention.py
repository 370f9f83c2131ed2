"""Attention benchmarks on one GPU (the lent H200): the figures behind docs/PERFORMANCE.md.

    PYTHONPATH=. python3 benchmarks/bench_attention.py --suite all --out results.json

Suites (each prints a markdown table; every pair of numbers in a row is measured side by side,
interleaved, in one run):
- world1: ``usp_attention`` at world size 1 against calling the same kernel directly through
  ``F.scaled_dot_product_attention`` with that kernel forced, forward (inference) and
  forward+backward. Goal: ratio <= 1.03.
- backends: TFLOP/s of every CUDA backend through its adapter, forward and forward+backward
  (4*S^2*H*D flops forward, 3.5x that for forward+backward).
- ring: the ring's forward schedules ("stream", "gather_merge", "gather_one_call") on one GPU without communication
  (N virtual ranks, N x N blocks merged by LSE) against one whole-sequence call of the same
  backend: t_whole / t_blocks.
- ring_graphs: the same, every variant replayed from a CUDA graph (GPU-side cost only).
- ring_compiled: the same, every variant (and the whole call) under
  ``torch.compile(mode="reduce-overhead")``: traced, fused, and replayed from CUDA graphs.
- calls: forward of one rank's queries (S/N, N = 1, 2, 4, 8) against all keys for each candidate
  of ``backend="auto"``, side by side: the fastest kernel per call size (inference).
- sage: the SageAttention adapter against ``sageattn`` called directly (what its fixes cost).
- splits: FlashAttention 3's split-KV forward at the whole shapes and at one rank's share of the
  queries against all keys (what the "gather_one_call" schedule calls, N = 2, 4, 8): 1-4 splits forced
  against the kernel's own choice (``num_splits=0``, what the adapter passes), side by side.

Shapes are those of shared/shapes.md (batch 1, bf16, image + text tokens).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from usp_dit import usp_attention
from usp_dit.kernels import KernelAttention, get_backend
from usp_dit.kernels.flash3 import fa3_forward
from usp_dit.testing.blockwise import blockwise_forward

SHAPES = {  # name: (tokens, heads, head_dim)
    "flux": (4096 + 512, 24, 128),
    "cogvideox": (17550 + 226, 48, 64),
    "mochi": (44520 + 256, 24, 128),
    "wan": (75600 + 512, 40, 128),
    "hunyuan_video": (118800 + 256, 24, 128),  # 129 x 720 x 1280
    "pixart": (4096, 16, 72),  # PixArt-Sigma 1024²'s self-attention
    "auraflow": (4096 + 8 + 256, 12, 256),  # AuraFlow v0.3 1024²: image + registers + text
}
SDPA_ENUM = {"sdpa_cudnn": SDPBackend.CUDNN_ATTENTION, "sdpa_flash": SDPBackend.FLASH_ATTENTION,
             "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}


def time_ms(fn: Callable[[], object], iters: int) -> float:
    """Mean ms of ``iters`` back-to-back calls between two CUDA events (after one warm-up call)."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def side_by_side(fns: dict[str, Callable[[], object]], iters: int, repeats: int = 5) -> dict[str, float]:
    """Median over ``repeats`` rounds, each round timing every function once (interleaved)."""
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up: compile, autotune, allocate
        for _ in range(2):
            fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(time_ms(fn, iters))
    return {k: statistics.median(v) for k, v in samples.items()}


def make_qkv(shape: str, requires_grad: bool = False):
    s, h, d = SHAPES[shape]
    g = torch.Generator(device="cuda").manual_seed(0)
    return [torch.randn(1, s, h, d, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_(requires_grad)
            for _ in range(3)]


def iters_for(shape: str) -> int:
    return {"flux": 50, "cogvideox": 10, "mochi": 4, "wan": 2, "hunyuan_video": 1, "pixart": 50, "auraflow": 50}[shape]


def suite_world1(shapes: list[str]) -> list[dict]:
    rows = []
    for shape in shapes:
        for name in ("sdpa_cudnn", "sdpa_flash"):
            for mode in ("fwd", "fwd+bwd"):
                if mode == "fwd+bwd" and shape in ("mochi", "wan"):
                    continue
                grad = mode == "fwd+bwd"
                q, k, v = make_qkv(shape, grad)
                dout = torch.randn_like(q)

                def direct():
                    with sdpa_kernel([SDPA_ENUM[name]]):
                        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
                    out = out.transpose(1, 2)
                    if grad:
                        out.backward(dout)

                def ours():
                    out = usp_attention(q, k, v, backend=name).out
                    if grad:
                        out.backward(dout)

                with torch.inference_mode(not grad):
                    t = side_by_side({"direct": direct, "usp": ours}, iters_for(shape))
                rows.append({"suite": "world1", "shape": shape, "backend": name, "mode": mode,
                             "direct_ms": t["direct"], "usp_ms": t["usp"], "ratio": t["usp"] / t["direct"]})
                print(f"| {shape} | {name} | {mode} | {t['direct']:.3f} | {t['usp']:.3f} | {t['usp'] / t['direct']:.3f} |",
                      flush=True)
    return rows


def suite_auto(shapes: list[str]) -> list[dict]:
    """Forward at world size 1: what a stock Diffusers processor calls (``F.scaled_dot_product_attention``
    with PyTorch's own kernel choice) against ``usp_attention`` under ``auto`` and each SDPA kernel,
    side by side: where ``auto`` loses to PyTorch's choice, a family's world-size-1 step loses too."""
    rows = []
    for shape in shapes:
        q, k, v = make_qkv(shape)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        fns = {"stock": lambda: F.scaled_dot_product_attention(qt, kt, vt),
               "auto": lambda: usp_attention(q, k, v).out}
        for name in SDPA_ENUM:  # those that run this head_dim
            if get_backend(name).caps.why_not("cuda", q.dtype, q.shape[-1], False) is None:
                fns[name] = lambda name=name: usp_attention(q, k, v, backend=name).out
        with torch.inference_mode():
            t = side_by_side(fns, iters_for(shape))
        rows.append({"suite": "auto", "shape": shape, **{f"{n}_ms": ms for n, ms in t.items()}})
        cells = [f"{t[n]:.3f} ({t[n] / t['stock']:.2f}x)" if n in t else "—" for n in ("stock", "auto", *SDPA_ENUM)]
        print(f"| {shape} | " + " | ".join(cells) + " |", flush=True)
    return rows


CUDA_BACKENDS = ("sdpa_cudnn", "sdpa_flash", "sdpa_efficient", "flash_attn_4", "flash_attn_3", "flash_attn_2",
                 "flashinfer", "sage", "fp8", "fp8_flashinfer", "fp8_fa3", "fp8_cudnn")


class _FA3Varlen:
    """Bench-only kernels of the ``fp8_fa3`` backend's library (vLLM's FA3 build, varlen):
    ``fa3_varlen`` its bf16 forward (FA3 bf16 from the same build, the fair baseline of its FP8),
    ``fp8_fa3_kernel`` its FP8 forward on Q, K, V quantised once outside the timed call (what the
    kernel alone costs; ``fp8_fa3`` includes the quantisation)."""

    def __init__(self, name: str):
        from usp_dit.kernels import fp8_fa3

        self.name, self._mod = name, fp8_fa3
        self.caps = get_backend("fp8_fa3").caps
        self._cache: dict = {}

    def available(self) -> bool:
        return get_backend("fp8_fa3").available()

    def forward(self, q, k, v, scale):
        if self.name == "fa3_varlen":
            return self._mod.varlen_forward(q, k, v, scale)
        key = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        if key not in self._cache:
            from usp_dit.kernels.fp8_quant import head_quant, kv_head_quant

            (q8, sq), (k8, sk), (v8, sv) = kv_head_quant(q, k.shape[2]), head_quant(k), head_quant(v)
            self._cache = {key: (q8, k8, v8, (sq, sk, sv))}
        q8, k8, v8, descales = self._cache[key]
        return self._mod.varlen_forward(q8, k8, v8, scale, descales=descales)


class _CudnnKernel:
    """Bench-only: ``fp8_cudnn_kernel`` is the ``fp8_cudnn`` backend's cuDNN FP8 forward on Q, K, V
    quantised once outside the timed call (what the kernel alone costs)."""

    name = "fp8_cudnn_kernel"

    def __init__(self, name: str):
        from usp_dit.kernels import fp8_cudnn

        self._mod, self.caps, self._cache = fp8_cudnn, get_backend("fp8_cudnn").caps, {}

    def available(self) -> bool:
        return get_backend("fp8_cudnn").available()

    def forward(self, q, k, v, scale):
        key = (q.data_ptr(), k.data_ptr(), v.data_ptr())
        if key not in self._cache:
            from usp_dit.kernels.fp8_quant import tensor_quant

            (q8, sq), (k8, sk), (v8, sv) = tensor_quant(q), tensor_quant(k), tensor_quant(v)
            self._cache = {key: (q8, k8, v8, (sq, sk, sv))}
        q8, k8, v8, descales = self._cache[key]
        return self._mod.quantised_forward(q8, k8, v8, descales, scale, q.dtype)


BENCH_ONLY = {"fa3_varlen": _FA3Varlen, "fp8_fa3_kernel": _FA3Varlen, "fp8_cudnn_kernel": _CudnnKernel}
SLOW_AT_WAN = ("sdpa_flash", "sdpa_efficient", "flash_attn_2")  # 1.6-3x cuDNN's 0.2 s a call: left out at Wan


def suite_backends(shapes: list[str], names: tuple[str, ...] = CUDA_BACKENDS) -> list[dict]:
    rows = []
    for shape in shapes:
        s, h, d = SHAPES[shape]
        flops = 4 * s * s * h * d
        for name in names:
            if shape in ("wan", "hunyuan_video") and name in SLOW_AT_WAN:
                continue
            backend = BENCH_ONLY[name](name) if name in BENCH_ONLY else get_backend(name)
            if not backend.available():  # an optional package this machine lacks
                continue
            q, k, v = make_qkv(shape, True)
            dout = torch.randn_like(q)
            scale = d ** -0.5

            def fwd():
                with torch.no_grad():
                    backend.forward(q, k, v, scale)

            def fwd_bwd():
                out, _ = KernelAttention.apply(q, k, v, backend, scale)
                out.backward(dout)

            fns = {"fwd": fwd, "fwd+bwd": fwd_bwd} if backend.caps.supports_backward else {"fwd": fwd}
            try:
                t = side_by_side(fns, iters_for(shape), repeats=3)
            except NotImplementedError as err:  # a shape the kernel refuses: say so, time the rest
                rows.append({"suite": "backends", "shape": shape, "backend": name, "refused": str(err)})
                print(f"| {shape} | {name} | refused: {err} | | | |", flush=True)
                continue
            row = {"suite": "backends", "shape": shape, "backend": name, "fwd_ms": t["fwd"],
                   "fwd_tflops": flops / t["fwd"] / 1e9}
            if "fwd+bwd" in t:
                row.update(fwdbwd_ms=t["fwd+bwd"], fwdbwd_tflops=3.5 * flops / t["fwd+bwd"] / 1e9)
            rows.append(row)
            bwd = f"{t['fwd+bwd']:.2f} | {row['fwdbwd_tflops']:.0f}" if "fwd+bwd" in t else "— | —"
            print(f"| {shape} | {name} | {t['fwd']:.2f} | {row['fwd_tflops']:.0f} | {bwd} |", flush=True)
    return rows


def cuda_graphed(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured once in a CUDA graph; returns the replay (no per-launch CPU cost)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


NS = (2, 4, 8)
SCHEDULES = ("stream", "gather_merge", "gather_one_call")
RING_HEADER = ("\n| shape | backend | whole ms | " + " | ".join(f"{s} N={n}" for s in SCHEDULES for n in NS) + " |\n"
               + "|---" * (3 + len(SCHEDULES) * len(NS)) + "|")


def _ring_rows(suite: str, shapes: list[str], backend_name: str, wrap: Callable) -> list[dict]:
    """Both forward schedules of ``usp_dit.attention.ring`` simulated on one GPU (N virtual ranks computed
    one after another, no communication) against one whole-sequence call: t_whole / t_blocks."""
    rows = []
    backend = get_backend(backend_name)
    for shape in shapes:
        q, k, v = make_qkv(shape)
        scale = SHAPES[shape][2] ** -0.5
        with torch.inference_mode():
            fns = {"whole": wrap(lambda: backend.forward(q, k, v, scale))}
            for sched in SCHEDULES:
                for n in NS:
                    fns[f"{sched} N={n}"] = wrap(lambda n=n, sched=sched: blockwise_forward(q, k, v, backend, scale, n, sched))
            t = side_by_side(fns, iters_for(shape), repeats=3)
        ratios = {key: t["whole"] / t[key] for key in fns if key != "whole"}
        rows.append({"suite": suite, "shape": shape, "backend": backend_name, "whole_ms": t["whole"], **ratios})
        print(f"| {shape} | {backend_name} | {t['whole']:.2f} | " + " | ".join(f"{r:.2f}" for r in ratios.values()) + " |",
              flush=True)
    return rows


def suite_ring(shapes: list[str], backend_name: str = "sdpa_cudnn") -> list[dict]:
    """Eager: what the library pays per call, Python and launches included."""
    return _ring_rows("ring", shapes, backend_name, lambda fn: fn)


def suite_ring_graphs(shapes: list[str], backend_name: str = "sdpa_cudnn") -> list[dict]:
    """Every variant replayed from a CUDA graph: the GPU-side cost of blocks and merges without
    Python and launch overhead (what a captured or compiled step would pay)."""
    return _ring_rows("ring_graphs", shapes, backend_name, cuda_graphed)


def torch_compiled(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` under ``torch.compile(mode="reduce-overhead")``: the library's own code traced by
    Dynamo, fused by inductor and replayed from CUDA graphs (issue 17); warmed before timing."""
    # Every variant is one lambda's code with other closure values: a recompile each, past
    # Dynamo's default limit of 8 (after which it would silently run the rest eagerly).
    torch._dynamo.config.recompile_limit = 64
    compiled = torch.compile(fn, mode="reduce-overhead")
    for _ in range(3):
        compiled()
    return compiled


def suite_ring_compiled(shapes: list[str], backend_name: str = "sdpa_cudnn") -> list[dict]:
    """Every variant compiled with CUDA graphs (``torch.compile(mode="reduce-overhead")``), the
    whole call too: what a compiled step pays for a ring's blocks and merges."""
    return _ring_rows("ring_compiled", shapes, backend_name, torch_compiled)


def suite_splits(shapes: list[str]) -> list[dict]:
    """FA3 forward with 1-4 key splits forced and with the kernel's own choice, per call shape."""
    backend = get_backend("flash_attn_3")
    if not backend.available():
        print("flash_attn_3 is not installed: splits suite skipped", flush=True)
        return []
    rows = []
    for shape in shapes:
        q, k, v = make_qkv(shape)
        scale = SHAPES[shape][2] ** -0.5
        for n in (1, 2, 4, 8):
            qn = q[:, : q.shape[1] // n]  # one rank's queries (the allgather schedule's call)
            fns = {}
            for forced in (1, 2, 3, 4, 0):
                def call(forced=forced):
                    fa3_forward(qn, k, v, scale, num_splits=forced)
                fns["kernel's" if forced == 0 else f"s={forced}"] = call
            with torch.inference_mode():
                t = side_by_side(fns, iters_for(shape) * n, repeats=3)
            rows.append({"suite": "splits", "shape": shape, "ranks": n, "seq_q": qn.shape[1], **t})
            print(f"| {shape} | {n} | {qn.shape[1]} | " + " | ".join(f"{t[key]:.3f}" for key in fns) + " |", flush=True)
    return rows


CALL_BACKENDS = ("sdpa_cudnn", "flash_attn_4", "flash_attn_3", "flashinfer")  # the candidates of "auto" on an H200


def suite_calls(shapes: list[str], names: list[str]) -> list[dict]:
    """Forward of one rank's queries (S / N) against all S keys, N = 1, 2, 4, 8 (the call the
    "gather_one_call" ring schedule and Ulysses' 1/N of the heads make, in flops), the installed
    candidates of "auto" (``names``) side by side: which kernel is fastest at which call size."""
    rows = []
    for shape in shapes:
        q, k, v = make_qkv(shape)
        scale = SHAPES[shape][2] ** -0.5
        for n in (1, 2, 4, 8):
            qn = q[:, : q.shape[1] // n]
            fns = {name: (lambda b=get_backend(name): b.forward(qn, k, v, scale)) for name in names}
            with torch.inference_mode():
                t = side_by_side(fns, iters_for(shape) * n, repeats=5)
            flops = 4 * qn.shape[1] * k.shape[1] * SHAPES[shape][1] * SHAPES[shape][2]
            best = min(t, key=t.get)
            rows.append({"suite": "calls", "shape": shape, "ranks": n, "seq_q": qn.shape[1], "flops": flops, **t,
                         "fastest": best})
            print(f"| {shape} | {n} | {flops:.2e} | " + " | ".join(f"{t[name]:.3f}" for name in names)
                  + f" | {best} |", flush=True)
    return rows


def suite_sage(shapes: list[str]) -> list[dict]:
    """What the SageAttention adapter adds to ``sageattn`` itself (a copy of K smoothed instead of
    the caller's K in place, V rescaled into fp16's range and the output back), side by side."""
    backend = get_backend("sage")
    if not backend.available():
        print("sageattention is not installed: sage suite skipped", flush=True)
        return []
    from sageattention import sageattn

    rows = []
    for shape in shapes:
        q, k, v = make_qkv(shape)
        k_scratch = k.clone()  # sageattn subtracts the mean key from it in place, every call
        scale = SHAPES[shape][2] ** -0.5
        fns = {"sageattn": lambda: sageattn(q, k_scratch, v, tensor_layout="NHD", sm_scale=scale),
               "adapter": lambda: backend.forward(q, k, v, scale)}
        with torch.inference_mode():
            t = side_by_side(fns, iters_for(shape), repeats=5)
        rows.append({"suite": "sage", "shape": shape, **t, "ratio": t["adapter"] / t["sageattn"]})
        print(f"| {shape} | {t['sageattn']:.3f} | {t['adapter']:.3f} | {t['adapter'] / t['sageattn']:.3f} |", flush=True)
    rows.append(_sage_large_values(backend, sageattn))
    return rows


def _sage_large_values(backend, sageattn) -> dict:
    """Flux's shape with a quarter of the heads' V scaled by 3e4 (past fp16's 65504): is the output
    finite, called directly and through the adapter, and how far is the adapter's from float64."""
    q, k, v = make_qkv("flux")
    v[:, :, :6] *= 3e4
    with torch.inference_mode():
        raw = sageattn(q, k.clone(), v, tensor_layout="NHD", sm_scale=128 ** -0.5)
        ours = backend.forward(q, k, v, 128 ** -0.5)[0]
        ref = F.scaled_dot_product_attention(*(t.double().transpose(1, 2) for t in (q, k, v))).transpose(1, 2)
    err = ((ours.double() - ref).norm() / ref.norm()).item()
    row = {"suite": "sage_large_v", "raw_finite": bool(torch.isfinite(raw).all()),
           "adapter_finite": bool(torch.isfinite(ours).all()), "adapter_rel_err": err}
    print(f"V x 3e4 on 6 of 24 heads: sageattn finite={row['raw_finite']}, adapter finite={row['adapter_finite']}, "
          f"adapter rel err {err:.2e}", flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="all",
                   choices=["all", "world1", "auto", "backends", "ring", "ring_graphs", "ring_compiled", "splits", "calls", "sage"])
    p.add_argument("--shapes", default="flux,cogvideox,mochi,wan")
    p.add_argument("--out", default=None, help="write all rows as JSON here")
    p.add_argument("--backend", default="sdpa_cudnn", help="kernel of the ring suites")
    p.add_argument("--backends", default=",".join(CUDA_BACKENDS), help="kernels of the backends suite")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = args.shapes.split(",")
    print(f"# {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    rows = []
    if args.suite in ("all", "world1"):
        print("\n| shape | kernel | mode | direct ms | usp_attention ms | ratio |\n|---|---|---|---|---|---|")
        rows += suite_world1(shapes)
    if args.suite in ("all", "auto"):
        print("\n| shape | stock (PyTorch's choice) | usp auto | " + " | ".join(SDPA_ENUM) + " |\n" + "|---" * (3 + len(SDPA_ENUM)) + "|")
        rows += suite_auto(shapes)
    if args.suite in ("all", "backends"):
        print("\n| shape | backend | fwd ms | fwd TF/s | fwd+bwd ms | fwd+bwd TF/s |\n|---|---|---|---|---|---|")
        rows += suite_backends(shapes, tuple(args.backends.split(",")))
    if args.suite in ("all", "ring"):
        print(RING_HEADER)
        rows += suite_ring([s for s in shapes if s != "wan"], args.backend)
    if args.suite in ("all", "ring_graphs"):
        print(RING_HEADER)
        rows += suite_ring_graphs([s for s in shapes if s != "wan"], args.backend)
    if args.suite == "ring_compiled":  # not in "all": each variant compiles (minutes)
        print(RING_HEADER)
        rows += suite_ring_compiled([s for s in shapes if s != "wan"], args.backend)
    if args.suite in ("all", "splits"):
        print("\n| shape | N | seq_q | s=1 ms | s=2 ms | s=3 ms | s=4 ms | kernel's choice ms |"
              "\n|---|---|---|---|---|---|---|---|")
        rows += suite_splits([s for s in shapes if s != "wan"])
    if args.suite in ("all", "calls"):
        names = [n for n in CALL_BACKENDS if get_backend(n).available()]
        print("\n| shape | N | flops per call | " + " | ".join(f"{n} ms" for n in names) + " | fastest |\n"
              + "|---" * (4 + len(names)) + "|")
        rows += suite_calls(shapes, names)
    if args.suite in ("all", "sage"):
        print("\n| shape | sageattn ms | adapter ms | ratio |\n|---|---|---|---|")
        rows += suite_sage(shapes)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
