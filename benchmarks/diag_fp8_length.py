"""How the FP8 attention backends' error grows with the key length (one GPU, no model).

For DiT-like Q, K, V (per-channel offsets and scales, three heavy channels a head in Q and K:
``usp_dit.testing.activations.dit_like_qkv``, as tests/gpu/test_fp8_attention_gpu.py draws them)
at 24 x 128 heads and lengths from 4k to HunyuanVideo 720p's 118 877 tokens: cosine and relative
L1 of each FP8 backend's output against bf16 SDPA of the same call, the whole call and
(``--blocks``) the keys split into N blocks merged by LSE as N ring ranks would
(usp_dit.testing.blockwise, "stream").

    PYTHONPATH=/tmp/site:$PWD python3 benchmarks/diag_fp8_length.py --backends fp8_cudnn,fp8_fa3 --json out.json
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from usp_dit.kernels import get_backend
from usp_dit.testing.activations import dit_like_qkv
from usp_dit.testing.blockwise import blockwise_forward


def key_chunks(backend, q, k, v, scale: float, chunk: int) -> torch.Tensor:
    """The whole query set against its keys in chunks of ``chunk`` keys, merged by LSE in float32."""
    parts = [backend.forward(q, k[:, i:i + chunk], v[:, i:i + chunk], scale) for i in range(0, k.shape[1], chunk)]
    lses = torch.stack([lse for _, lse in parts])  # (n, B, S, H)
    w = torch.exp(lses - torch.logsumexp(lses, dim=0))
    return sum(w[i][..., None] * o.float() for i, (o, _) in enumerate(parts)).to(q.dtype)


def timed_ms(fn) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 3


def errors(out: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    a, b = out.double().flatten(), ref.double().flatten()
    return F.cosine_similarity(a, b, dim=0).item(), ((a - b).abs().sum() / b.abs().sum()).item()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="fp8_cudnn,fp8_fa3,fp8_flashinfer")
    p.add_argument("--lengths", default="4097,16385,32769,65537,118877")
    p.add_argument("--blocks", default="2,4,8")
    p.add_argument("--chunks", default="8192,16384,32768", help="key chunks merged by LSE (longest length only)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    names = [n for n in args.backends.split(",") if get_backend(n).available()]
    print(f"# {torch.cuda.get_device_name()}; backends {names}\n| length | backend | N | cosine | rel L1 |\n|---|---|---|---|---|")
    rows = []
    lengths = [int(x) for x in args.lengths.split(",")]
    for s in lengths:
        q, k, v = dit_like_qkv(1, s, 24, 24, 128)
        scale = 128 ** -0.5
        with torch.no_grad():
            ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 scale=scale).transpose(1, 2)
            for name in names:
                backend = get_backend(name)
                for n in [1, *map(int, args.blocks.split(","))]:
                    out = backend.forward(q, k, v, scale)[0] if n == 1 else blockwise_forward(q, k, v, backend, scale, n)[0]
                    cos, l1 = errors(out, ref)
                    rows.append({"length": s, "backend": name, "blocks": n, "cosine": cos, "rel_l1": l1})
                    print(f"| {s} | {name} | {n} | {cos:.6f} | {l1:.3e} |", flush=True)
                if s != lengths[-1]:
                    continue
                whole = timed_ms(lambda: backend.forward(q, k, v, scale))
                rows.append({"length": s, "backend": name, "chunk": None, "ms": whole})
                print(f"| {s} | {name} | whole call | {whole:.1f} ms | |", flush=True)
                for c in map(int, args.chunks.split(",")):
                    cos, l1 = errors(key_chunks(backend, q, k, v, scale, c), ref)
                    ms = timed_ms(lambda: key_chunks(backend, q, k, v, scale, c))
                    rows.append({"length": s, "backend": name, "chunk": c, "cosine": cos, "rel_l1": l1, "ms": ms})
                    print(f"| {s} | {name} | keys in chunks of {c} | {cos:.6f} | {l1:.3e} | {ms:.1f} ms |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
