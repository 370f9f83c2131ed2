"""The server's overhead (``usp_dit.serve``) against calling the pipeline directly, on one rank.

    python benchmarks/bench_serve.py                       # tiny Flux, CPU
    python benchmarks/bench_serve.py --size 256x256 --steps 8 --requests 20
    python benchmarks/bench_serve.py --random-flux-dev /tmp/flux_dev_random --size 1024x1024 --steps 28 \
        --requests 3 --throughput-requests 8       # a GPU: Flux.1-dev's shapes, random weights, bf16

Measures, for the same request (prompt, size, steps, seed):
  1. latency: the pipeline called in this process (``output_type="np"``), then the same request
     through a server started here (``python -m usp_dit.serve``, world size 1, PNG answer over HTTP
     on 127.0.0.1); median of ``--requests`` each, one at a time; the ratio is the overhead;
  2. throughput with batching (``--max-batch``): images per second with 1, 2 and 4 clients, each
     sending its requests back to back (every request a different seed, so each is real work);
  3. memory: the server process's resident set after 10 requests and after 200 (a leak shows as growth);
     on a GPU, rank 0's CUDA memory (``usp_dit_gpu_memory_bytes``) idle after a good request and after
     a request that fails inside the pipeline (the test-only fault of ``usp_dit.serve.worker``,
     raised at the end of its first step): a failed request must leave nothing held.

Direct calls and served requests alternate, one at a time (the other side idle), so that a loaded
machine slows both alike; on a GPU both share the card, the pipeline loaded twice. Prints a Markdown
table (docs/PERFORMANCE.md has the figures).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "a lighthouse on a cliff at dawn"


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        return json.loads(resp.read())


def _histograms(port: int) -> dict[str, tuple[float, float]]:
    """(sum, count) of the server's ``usp_dit_batch_seconds`` (its own pipeline time, from the batch's
    pick) as "batch", and of ``usp_dit_request_latency_seconds{kind="image"}`` (arrival to the
    encoded answer) as "latency"."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    value = {ln.rsplit(" ", 1)[0]: float(ln.rsplit(" ", 1)[1]) for ln in lines if ln.startswith("usp_dit_")}
    latency = 'usp_dit_request_latency_seconds_{}{{kind="image"}}'
    return {"batch": (value["usp_dit_batch_seconds_sum"], value["usp_dit_batch_seconds_count"]),
            "latency": (value.get(latency.format("sum"), 0.0), value.get(latency.format("count"), 0.0))}


def _mean_between(before: dict, after: dict, name: str) -> float:
    return (after[name][0] - before[name][0]) / (after[name][1] - before[name][1])


def _encode_ms(call_direct_output) -> float:
    """Median ms of the server's PNG + base64 encoding of one image (``usp_dit.serve.encode``)."""
    from usp_dit.serve.encode import png_b64

    times = []
    for _ in range(3):
        start = time.perf_counter()
        png_b64(call_direct_output)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def _gpu_mib(port: int) -> dict[str, float]:
    """Rank 0's CUDA memory as the server reports it (``usp_dit_gpu_memory_bytes``), MiB; {} on CPU."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        lines = resp.read().decode().splitlines()
    out = {}
    for line in lines:
        if line.startswith("usp_dit_gpu_memory_bytes{"):
            kind = line.split('kind="')[1].split('"')[0]
            out[kind] = float(line.rsplit(" ", 1)[1]) / 2**20
    return out


def _failed_request_memory(url: str, port: int, body: dict) -> tuple[dict, dict, int]:
    """(memory idle after a good request, memory after a failed one, the failed request's HTTP status)."""
    from urllib.error import HTTPError

    from usp_dit.serve.worker import FAULT_SENTINEL

    _post(url, {**body, "seed": 7})
    idle = _gpu_mib(port)
    try:
        _post(url, {**body, "prompt": f"{PROMPT} {FAULT_SENTINEL}", "seed": 8})
        status = 200
    except HTTPError as err:
        status = err.code
    return idle, _gpu_mib(port), status


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def save_random_flux_dev(path: str) -> None:
    """FLUX.1-dev's transformer, VAE, CLIP-L and T5-XXL shapes with random weights (bf16), saved to
    ``path`` for ``--model`` (nothing is downloaded: the tokenizers are the tiny per-character ones)."""
    import torch
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    from usp_dit.demo.tiny_flux import _tokenizers

    clip_tok, t5_tok = _tokenizers(77)[0], _tokenizers(512)[1]
    torch.set_default_dtype(torch.bfloat16)  # built in bf16: 17 B parameters in float32 would not fit an 80 GB card
    with torch.device("cuda"):
        transformer = FluxTransformer2DModel(guidance_embeds=True)
        vae = AutoencoderKL(in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2,
                            down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                            block_out_channels=(128, 256, 512, 512), scaling_factor=0.3611, shift_factor=0.1159,
                            use_quant_conv=False, use_post_quant_conv=False)
        clip = CLIPTextModel(CLIPTextConfig(vocab_size=len(clip_tok), hidden_size=768, intermediate_size=3072,
                                            num_hidden_layers=12, num_attention_heads=12, max_position_embeddings=77,
                                            projection_dim=768, bos_token_id=0, eos_token_id=1, pad_token_id=1))
        t5 = T5EncoderModel(T5Config(vocab_size=len(t5_tok), d_model=4096, d_kv=64, d_ff=10240, num_layers=24,
                                     num_heads=64, feed_forward_proj="gated-gelu", pad_token_id=0, eos_token_id=1))
    torch.set_default_dtype(torch.float32)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
                                                base_image_seq_len=256, max_image_seq_len=4096)
    pipe = FluxPipeline(scheduler=scheduler, vae=vae, text_encoder=clip, tokenizer=clip_tok, text_encoder_2=t5,
                        tokenizer_2=t5_tok, transformer=transformer).to(torch.bfloat16)
    pipe.save_pretrained(path)


def direct_caller(args):
    """A function running the request with a seed on the pipeline loaded in this process; seconds."""
    import torch

    from usp_dit.serve.families import TINY_TEXT_LEN, load_pipeline

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pipe = load_pipeline(args.family, args.model, device)
    pipe.set_progress_bar_config(disable=True)
    width, height = map(int, args.size.split("x"))
    torch.set_num_threads(os.cpu_count() or 1)  # as the server's one rank (usp_dit.cli.launch.init_distributed)
    extra = {"max_sequence_length": TINY_TEXT_LEN} if args.model is None else {}

    def call(seed: int) -> float:
        start = time.perf_counter()
        out = pipe(prompt=[PROMPT], height=height, width=width, num_inference_steps=args.steps,
                   generator=[torch.Generator().manual_seed(seed)], output_type="np", **extra)
        if device.type == "cuda":
            torch.cuda.synchronize()
        took = time.perf_counter() - start
        call.last_image = out.images[0]  # the encoding is timed on it, as the server encodes its own
        return took

    return call


def start_server(args) -> tuple[subprocess.Popen, int]:
    """The server on a port it picks (``--port 0``; it names it in ``--port-file``) and that port."""
    from usp_dit.serve.worker import FAULT_ENV

    # Rank 0 raises in a request whose prompt holds the fault sentinel (and in no other).
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), FAULT_ENV: "0"}
    cmd = [sys.executable, "-m", "usp_dit.serve", "--family", args.family, "--port", "0",
           "--max-batch", str(args.max_batch), "--queue-size", "256", "--warmup", args.size,
           "--max-side", "2048", "--steps", str(args.steps)] + (["--model", args.model] if args.model else [])
    log = open(os.environ.get("BENCH_SERVE_LOG", "/tmp/bench_serve_server.log"), "w")  # noqa: SIM115 -- the server's lifetime
    port_file = Path(f"{log.name}.port")
    port_file.unlink(missing_ok=True)
    proc = subprocess.Popen([*cmd, "--port-file", str(port_file)], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            port = int(port_file.read_text())
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as resp:
                if resp.status == 200:
                    return proc, port
        except OSError:
            time.sleep(0.5)
    proc.kill()
    tail = Path(log.name).read_text(errors="replace").splitlines()[-30:]
    raise RuntimeError("the server did not start; its last lines:\n" + "\n".join(tail))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", default="flux")
    p.add_argument("--size", default="256x256", help="WIDTHxHEIGHT")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--requests", type=int, default=10, help="requests timed for the latency, each way")
    p.add_argument("--max-batch", type=int, default=4)
    p.add_argument("--throughput-requests", type=int, default=16, help="requests per client count")
    p.add_argument("--model", default=None, help="a checkpoint folder (default: the tiny random pipeline)")
    p.add_argument("--random-flux-dev", default=None, metavar="DIR",
                   help="save FLUX.1-dev-shaped random weights to DIR first and serve them (--model DIR)")
    p.add_argument("--memory-requests", type=int, default=200)
    args = p.parse_args()
    if args.random_flux_dev:
        if not Path(args.random_flux_dev, "model_index.json").exists():
            save_random_flux_dev(args.random_flux_dev)
        args.family, args.model = "flux", args.random_flux_dev

    call_direct = direct_caller(args)
    server, port = start_server(args)
    url = f"http://127.0.0.1:{port}/v1/images/generations"
    body = {"prompt": PROMPT, "size": args.size, "steps": args.steps}
    try:
        call_direct(0)
        _post(url, {**body, "seed": 0})
        # Alternated, one at a time: a shared or loaded machine slows both alike.
        direct_s, served_s = [], []
        before = _histograms(port)
        for i in range(args.requests):
            direct_s.append(call_direct(i))
            start = time.perf_counter()
            _post(url, {**body, "seed": i})
            served_s.append(time.perf_counter() - start)
        direct, served = statistics.median(direct_s), statistics.median(served_s)
        after = _histograms(port)
        served_mean = statistics.mean(served_s)
        inside, latency = _mean_between(before, after, "batch"), _mean_between(before, after, "latency")
        encode_ms = _encode_ms(call_direct.last_image)
        throughput = {}
        for clients in (1, 2, 4):
            per_client = args.throughput_requests // clients
            start = time.perf_counter()
            with ThreadPoolExecutor(clients) as pool:
                list(pool.map(lambda c: [_post(url, {**body, "seed": 1000 * c + i}) for i in range(per_client)],
                              range(clients)))
            throughput[clients] = per_client * clients / (time.perf_counter() - start)
        idle_mem, failed_mem, failed_status = _failed_request_memory(url, port, body)
        small = {**body, "size": "64x64", "steps": 1}
        for i in range(10):
            _post(url, {**small, "seed": i})
        rss_10 = _rss_mib(server.pid)
        for i in range(args.memory_requests - 10):
            _post(url, {**small, "seed": i})
        rss_200 = _rss_mib(server.pid)
    finally:
        server.terminate()
        server.wait(60)

    print(f"machine: {platform.machine()}, {os.cpu_count()} CPU(s), {platform.python_version()}; "
          f"{time.strftime('%Y-%m-%d')}")
    print(f"request: {args.model or 'tiny ' + args.family}, {args.size}, {args.steps} steps, one image, PNG answer\n")
    print("| measure | value |\n| --- | --- |")
    print(f"| direct pipeline call, median of {args.requests} | {direct * 1000:.1f} ms |")
    print(f"| through the server (HTTP, queue, PNG), median of {args.requests} | {served * 1000:.1f} ms |")
    print(f"| server / direct (two processes: the machine's load moves both) | {served / direct:.3f}x |")
    print(f"| the server's own pipeline call (mean, its /metrics), and the served mean | "
          f"{inside * 1000:.1f} ms, {served_mean * 1000:.1f} ms |")
    print(f"| what the server adds (HTTP, queue, control plane, PNG): served / its pipeline call | "
          f"{served_mean / inside:.3f}x ({(served_mean - inside) * 1000:.1f} ms) |")
    print(f"| of which: queue, PNG and control plane (arrival to encoded answer, less the pipeline call) | "
          f"{(latency - inside) * 1000:.1f} ms |")
    print(f"| of which: the PNG + base64 encoding alone (this process, the same image) | {encode_ms:.1f} ms |")
    print(f"| of which: HTTP and JSON (client's time less arrival to encoded answer) | "
          f"{(served_mean - latency) * 1000:.1f} ms |")
    for clients, rate in throughput.items():
        print(f"| throughput, {clients} client(s), --max-batch {args.max_batch} | {rate:.2f} images/s |")
    print(f"| server RSS after 10 / {args.memory_requests} requests (64x64, 1 step) | {rss_10:.0f} MiB / {rss_200:.0f} MiB |")
    print(f"| a request failing inside the pipeline (its first step) | HTTP {failed_status} |")
    for kind in sorted(idle_mem):
        print(f"| rank 0 GPU memory {kind}, idle after a good request / after the failed one | "
              f"{idle_mem[kind]:.0f} MiB / {failed_mem[kind]:.0f} MiB |")


if __name__ == "__main__":
    main()
