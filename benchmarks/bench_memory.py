"""Activation memory per rank of training with USP, projected on one GPU (world size 1).

    PYTHONPATH=. python3 benchmarks/bench_memory.py                    # CogVideoX-5B width, 4 blocks, bf16
    PYTHONPATH=. python3 benchmarks/bench_memory.py --degrees 1 2 4 8 --layers 4 --out memory.json

Layout: video tokens (1, S_video, 3072), text tokens (1, 226, 3072), Q/K/V (1, heads, seq, 64).

What is measured: the peak CUDA memory of forward + backward of a stack of Diffusers'
``CogVideoXBlock`` at CogVideoX-5B width (48 heads x 64 = 3072, time embedding 512, bf16, weights
requiring grad, their gradients allocated before the measurement so that only activations and
temporaries count), minus what is allocated before the forward. One row per sequence degree P, as
one rank of a USP grid of P ranks would hold it (CogVideoX's adapter replicates the 226 text tokens):

    local tokens      ceil(S_video / P) video + 226 text: every per-token op (norms, projections,
                      modulation, MLP) runs on these
    "local attention" attention over the local tokens only: what a Ulysses rank saves for backward
                      (after its all-to-all it holds all S tokens of H/P heads: the same bytes)
    "full K/V"        local queries against K/V of all S tokens (the other ranks' K/V as a constant
                      buffer, as if every ring block were kept for backward): an upper bound

The ratio columns divide by the P = 1 figure; ideal is 1/P. This is a projection from one GPU: a
multi-GPU run must confirm it (communication buffers, NCCL workspace and the all-to-all copies are
not in it). Exits non-zero without CUDA or on any error.
"""
from __future__ import annotations

import argparse
import json
import math
import sys

import torch
import torch.nn.functional as F

TEXT_TOKENS = 226
VIDEO_TOKENS = 17550  # CogVideoX-5B, 49 frames at 480 x 720: 13 x 30 x 45 patches
WIDTH = dict(heads=48, head_dim=64, time_embed_dim=512)


class LocalAttnProcessor:
    """CogVideoX attention of a rank's local tokens, optionally against a buffer of remote K/V.

    ``remote``: None (attend over the local text + video tokens), or a pair of constant tensors
    (1, heads, S_remote, head_dim) appended to the local K and V.
    """

    def __init__(self, remote: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        self.remote = remote

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        text_len = encoder_hidden_states.shape[1]
        x = torch.cat([encoder_hidden_states, hidden_states], dim=1)  # (1, T + S_local, C)
        q, k, v = (proj(x).unflatten(2, (attn.heads, -1)).transpose(1, 2) for proj in (attn.to_q, attn.to_k, attn.to_v))
        q, k = attn.norm_q(q), attn.norm_k(k)  # (1, H, T + S_local, D)
        if self.remote is not None:
            k, v = torch.cat([k, self.remote[0]], dim=2), torch.cat([v, self.remote[1]], dim=2)
        out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        out = attn.to_out[1](attn.to_out[0](out))
        return out[:, text_len:], out[:, :text_len]


def build_stack(layers: int, device: torch.device) -> torch.nn.ModuleList:
    from diffusers.models.transformers.cogvideox_transformer_3d import CogVideoXBlock

    dim = WIDTH["heads"] * WIDTH["head_dim"]
    blocks = torch.nn.ModuleList(
        CogVideoXBlock(dim, WIDTH["heads"], WIDTH["head_dim"], WIDTH["time_embed_dim"], attention_bias=True)
        for _ in range(layers)
    )
    return blocks.to(device=device, dtype=torch.bfloat16)


def measure(blocks: torch.nn.ModuleList, local_video: int, remote_tokens: int | None, device: torch.device) -> float:
    """Peak MiB above the pre-forward allocation of forward + backward on ``local_video`` + text tokens."""
    dim = WIDTH["heads"] * WIDTH["head_dim"]
    kw = dict(device=device, dtype=torch.bfloat16)
    remote = None
    if remote_tokens:
        remote = tuple(torch.randn(1, WIDTH["heads"], remote_tokens, WIDTH["head_dim"], **kw) for _ in range(2))
    for block in blocks:
        block.attn1.set_processor(LocalAttnProcessor(remote))
    video = torch.randn(1, local_video, dim, **kw, requires_grad=True)
    text = torch.randn(1, TEXT_TOKENS, dim, **kw, requires_grad=True)
    temb = torch.randn(1, WIDTH["time_embed_dim"], **kw)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    h, t = video, text
    for block in blocks:
        h, t = block(h, t, temb)
    (h.float().square().mean() + t.float().square().mean()).backward()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - before
    del h, t, video, text, remote
    return peak / 2**20


def run(degrees: list[int], layers: int, video_tokens: int) -> list[dict]:
    device = torch.device("cuda")
    blocks = build_stack(layers, device)
    for p in blocks.parameters():  # gradients exist before the measurement: only activations count
        p.grad = torch.zeros_like(p)
    measure(blocks, 256, None, device)  # warm-up: kernels chosen, workspaces allocated
    rows = []
    for degree in degrees:
        local_video = math.ceil(video_tokens / degree)
        local = measure(blocks, local_video, None, device)
        remote = video_tokens - local_video
        full_kv = measure(blocks, local_video, remote, device) if remote else local
        rows.append(dict(P=degree, local_tokens=local_video + TEXT_TOKENS, local_attention_mib=local,
                         full_kv_mib=full_kv))
    base_local, base_full = rows[0]["local_attention_mib"], rows[0]["full_kv_mib"]
    for row in rows:
        row["local_ratio"] = row["local_attention_mib"] / base_local
        row["full_kv_ratio"] = row["full_kv_mib"] / base_full
    return rows


def markdown(rows: list[dict], layers: int, video_tokens: int) -> str:
    head = (f"CogVideoXBlock x {layers} at 5B width (48 x 64, bf16), {video_tokens} video + {TEXT_TOKENS} text tokens; "
            f"peak activation MiB of forward+backward per rank (projection at world size 1)\n\n"
            "| P | local tokens | local attention MiB | ratio | full K/V MiB | ratio | ideal 1/P |\n"
            "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n")
    lines = [f"| {r['P']} | {r['local_tokens']} | {r['local_attention_mib']:.0f} | {r['local_ratio']:.3f} | "
             f"{r['full_kv_mib']:.0f} | {r['full_kv_ratio']:.3f} | {1 / r['P']:.3f} |" for r in rows]
    return head + "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="Activation memory per rank of USP training (one-GPU projection)")
    p.add_argument("--degrees", type=int, nargs="+", default=[1, 2, 4, 8], help="sequence degrees P (the first is the baseline)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--video-tokens", type=int, default=VIDEO_TOKENS)
    p.add_argument("--out", default=None, help="also write the rows as JSON here")
    args = p.parse_args(argv)
    if any(d < 1 for d in args.degrees) or args.layers < 1 or args.video_tokens < 1:
        p.error(f"degrees, layers and video-tokens must be positive, got {args.degrees}, {args.layers}, {args.video_tokens}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_memory needs a CUDA GPU", file=sys.stderr)
        return 2
    rows = run(args.degrees, args.layers, args.video_tokens)
    print(markdown(rows, args.layers, args.video_tokens))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
