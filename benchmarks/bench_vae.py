"""VAE decode on one GPU: stock, ``enable_parallel_vae`` at world size 1, and one rank's share of a
P-way split decode simulated on the one GPU.

    PYTHONPATH=. python3 benchmarks/bench_vae.py --model flux,cogvideox,wan --parts 2,4,8 --json vae.json
    PYTHONPATH=. python3 benchmarks/bench_vae.py --vae sd,wan22,oobleck    # the planner's estimated VAEs

``--vae KEY[,KEY]`` measures a VAE of the planner's table (``usp_dit.planner.models.VAES``) whose
decode figures are estimates (Note [VAE estimates]): built from its released config
(benchmarks/planner_components.py ``VAE_CONFIGS``) at the entry's reference size (``_VAE_LATENTS``),
it prints the ``stock_peak_gib``, ``output_gib`` and (where usp_dit has a parallel recipe for the
class) the per-P fractions to put in place of the estimate, with ``source=_VAE_RUN``.

Models (full-size VAEs with random weights, configs of the released checkpoints: Diffusers'
defaults for each class are those configs; Flux's below), bf16, batch 1, ``torch.inference_mode``:
flux (1024x1024 -> latent 16 x 128 x 128), cogvideox (49 x 480 x 720 -> 16 x 13 x 60 x 90), wan
(Wan 2.1, 81 x 720 x 1280 -> 16 x 21 x 90 x 160), hunyuan_video (129 x 720 x 1280), mochi
(163 x 480 x 848), ltx_video (121 x 512 x 768), qwen_image (1328 x 1328).

Columns: the stock decode of the whole latent (ms, peak GiB above the weights and the latent);
``enable_parallel_vae`` at world size 1 (no group: nothing is replaced) against stock, timed side by
side; and for each P, rank P // 2's share: the stock ``_decode`` of that rank's rows with every
replaced convolution, norm and attention running inside a parallel decode whose communication is
simulated (``Simulated``): the neighbours' halo rows are copies of the rank's own edge rows, the
norms' all-reduces / gathers return the local statistics, the attention's K/V gather repeats the local K/V P times
(so the attention does the work of the whole image). So the share's time is its compute without
communication; the collectives it would make are counted (``halo_exchanges``, ``all_reduces``,
``gathers``) for a projection. Goal (issue 16): time <= 1.3 / P and memory <= 1.2 / P of the whole.
The gathered output (the whole decoded video on every rank) is not in the share's peak; its size
is printed (``output_gib``).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field

import torch

FLUX_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32,
    use_quant_conv=False, use_post_quant_conv=False, sample_size=1024,
)


# The planner's estimated VAEs: the latent of each entry's reference size (``VAEDecode.reference``).
_VAE_LATENTS = {
    "sd": (1, 4, 128, 128), "cogview4": (1, 16, 128, 128),  # 1024 x 1024, 8x
    "hunyuan_image": (1, 64, 64, 64), "sana": (1, 32, 32, 32),  # 2048 x 2048 and 1024 x 1024, 32x
    "qwen_image21": (1, 64, 1, 83, 83),  # 1328 x 1328, 16x, one frame
    "wan22": (1, 48, 21, 45, 80),  # 81 x 720 x 1280: 4x in time, 16x in space
    "ltx2": (1, 128, 16, 16, 24),  # 121 x 512 x 768: 8x in time, 32x in space
    "minimax_h3": (1, 24, 37, 48, 84),  # 124 x 768 x 1344: 17 n + 5 frames -> 5 n + 2 latent frames, 16x
    "oobleck": (1, 64, 1024), "oobleck_48k": (1, 64, 1500),  # 1024 x 2048 samples; 60 s at 48 kHz / 1920
    "same": (1, 256, 323), "longcat_audio": (1, 64, 351),  # 30 s: 44.1 kHz / 4096; 24 kHz / 2048
    "music3_vocoder": (1, 128, 689),  # one 200-frame window: 689 x 512 samples
}


def _planner_case(key: str) -> tuple[Callable[[], torch.nn.Module], tuple[int, ...], str]:
    from benchmarks.planner_components import VAE_CONFIGS, component_class
    from usp_dit.planner.models import VAES

    path, config = VAE_CONFIGS[key]
    reference = "x".join(str(n) for n in VAES[key].reference if n > 1) or "1"
    return (lambda: component_class(path)(**config())), _VAE_LATENTS[key], reference


def _case(name: str) -> tuple[Callable[[], torch.nn.Module], tuple[int, ...], str]:
    import diffusers as d

    if name.startswith("vae:"):
        return _planner_case(name[4:])
    cases = {
        "flux": (lambda: d.AutoencoderKL(**FLUX_VAE), (1, 16, 128, 128), "1024x1024"),
        "qwen_image": (lambda: d.AutoencoderKLQwenImage(), (1, 16, 1, 166, 166), "1328x1328"),
        "cogvideox": (lambda: d.AutoencoderKLCogVideoX(), (1, 16, 13, 60, 90), "49x480x720"),
        "wan": (lambda: d.AutoencoderKLWan(), (1, 16, 21, 90, 160), "81x720x1280"),
        "hunyuan_video": (lambda: d.AutoencoderKLHunyuanVideo(), (1, 16, 33, 90, 160), "129x720x1280"),
        "mochi": (lambda: d.AutoencoderKLMochi(), (1, 12, 28, 60, 106), "163x480x848"),
        "ltx_video": (lambda: d.AutoencoderKLLTXVideo(), (1, 128, 16, 16, 24), "121x512x768"),
    }
    return cases[name]


@dataclass
class Row:
    model: str
    shape: str
    stock_ms: float
    stock_peak_gib: float
    world1_ratio: float
    output_gib: float
    shares: dict = field(default_factory=dict)  # P -> {time_frac, mem_frac, halo_exchanges, all_reduces, gathers}


def _build(factory: Callable[[], torch.nn.Module], device: torch.device) -> torch.nn.Module:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            vae = factory()
    finally:
        torch.set_default_dtype(previous)
    return vae.to(device=device, dtype=torch.bfloat16).eval()


def _timed(fn: Callable[[], object], warmup: int, rounds: int) -> tuple[float, float, object]:
    """(median ms, peak GiB above what was allocated before, last result); on CPU (a dry run of this
    script: ``--tiny``) wall time and no memory figure."""
    if not torch.cuda.is_available():
        times, out = [], None
        for _ in range(max(rounds, 1)):
            t0 = time.perf_counter()
            out = fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times), 1.0, out
    out = None
    for _ in range(warmup):
        out = fn()
        del out
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
        if _ < rounds - 1:
            del out
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return statistics.median(times), peak, out


class Simulated:
    """Stand-ins for the parallel VAE's communication on one GPU (module docstring), counting calls."""

    def __init__(self, parts: int) -> None:
        self.parts = parts
        self.counts = {"halo_exchanges": 0, "all_reduces": 0, "gathers": 0}

    def neighbour_rows(self, real, top, bottom, rows):
        self.counts["halo_exchanges"] += 1
        above = real.narrow(-2, 0, top).clone() if top and not rows.first else None
        below = real.narrow(-2, real.shape[-2] - bottom, bottom).clone() if bottom and not rows.last else None
        return above, below

    def all_sum(self, t, group):
        self.counts["all_reduces"] += 1
        return t

    def gather_stats(self, t, group):
        self.counts["all_reduces"] += 1
        return t.unsqueeze(0).expand(self.parts, -1)

    def gather_uneven(self, x, sizes, dim, group):
        self.counts["gathers"] += 1
        return torch.cat([x] * self.parts, dim=dim)

    def gathered_counts(self, n, rows, device):
        return [n] * self.parts


@contextmanager
def simulated(sim: Simulated):
    from usp_dit.pipelines.vae import attention, halo, norm

    saved = (halo.neighbour_rows, norm._all_sum, norm._gather_stats, attention.gather_uneven, attention.gathered_counts)
    halo.neighbour_rows, norm._all_sum, norm._gather_stats = sim.neighbour_rows, sim.all_sum, sim.gather_stats
    attention.gather_uneven, attention.gathered_counts = sim.gather_uneven, sim.gathered_counts
    try:
        yield
    finally:
        halo.neighbour_rows, norm._all_sum, norm._gather_stats, attention.gather_uneven, attention.gathered_counts = saved


def share(vae: torch.nn.Module, z: torch.Tensor, parts: int, warmup: int, rounds: int) -> tuple[float, float, dict]:
    """(ms, peak GiB, collective counts per decode) of rank parts // 2's rows of a P-way decode."""
    from usp_dit.distributed.mesh import single_rank_mesh
    from usp_dit.pipelines.vae.halo import RowGroup, decoding
    from usp_dit.pipelines.vae.patch import _STATES, VAEState, _install, _untiled, disable_parallel_vae
    from usp_dit.pipelines.vae.recipes import classify, recipes
    from usp_dit.pipelines.vae.rows import row_offsets, row_split

    sites, reason = classify(vae.decoder, recipes()[type(vae)])
    if reason:
        raise NotImplementedError(reason)
    state = VAEState(single_rank_mesh(z.device.type), None, {"decode": None, "encode": None})
    _STATES[vae] = state
    _install(sites, state)
    rank, sizes = parts // 2, row_split(z.shape[-2], parts)
    piece = z.narrow(-2, row_offsets(sizes)[rank], sizes[rank]).contiguous()
    sim = Simulated(parts)
    rows = RowGroup(group=None, rank=rank, sizes=tuple(sizes))
    try:
        with simulated(sim), _untiled(vae):
            def run():
                with decoding(rows):
                    return type(vae)._decode(vae, piece, return_dict=False)[0]
            ms, peak, _ = _timed(run, warmup, rounds)
            sim.counts = {k: 0 for k in sim.counts}
            run()
    finally:
        disable_parallel_vae(vae)
    return ms, peak, dict(sim.counts)


def bench(name: str, parts: list[int], warmup: int, rounds: int) -> Row:
    from usp_dit import disable_parallel_vae, enable_parallel_vae, single_rank_mesh

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    factory, shape, label = _case(name)
    if device.type == "cpu":  # a dry run: the same code on a tiny latent
        shape = shape[:-1] + (9,) if len(shape) == 3 else shape[:-2] + (9, 7)
    vae = _build(factory, device)
    if name.startswith("vae:"):  # as from_pretrained(torch_dtype=bf16) loads it (MiniMax-H3's keeps float32 parts)
        from benchmarks.planner_components import as_loaded

        vae = as_loaded(vae, True)
    z = torch.randn(shape, generator=torch.Generator(device).manual_seed(0), device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        stock_ms, stock_peak, out = _timed(lambda: _decode(vae, z), warmup, rounds)
        output_gib = out.numel() * out.element_size() / 2**30
        del out
        # world size 1, side by side: stock, then enabled (no group: nothing is replaced), 3 pairs
        pairs = []
        from usp_dit.pipelines.vae.recipes import recipes

        splits = type(vae) in recipes()
        for _ in range(3 if splits else 0):
            s, _, o = _timed(lambda: _decode(vae, z), 0, 1)
            del o
            enable_parallel_vae(vae, single_rank_mesh(device.type))
            u, _, o = _timed(lambda: _decode(vae, z), 0, 1)
            del o
            disable_parallel_vae(vae)
            pairs.append(u / s)
        row = Row(name, label, round(stock_ms, 1), round(stock_peak, 2),
                  round(statistics.median(pairs), 3) if pairs else float("nan"), round(output_gib, 3))
        for p in parts if splits else ():  # no recipe: every rank decodes whole (fractions None)
            ms, peak, counts = share(vae, z, p, warmup, rounds)
            row.shares[p] = dict(ms=round(ms, 1), time_frac=round(ms / stock_ms, 3), time_goal=round(1.3 / p, 3),
                                 peak_gib=round(peak, 2), mem_frac=round(peak / stock_peak, 3),
                                 mem_goal=round(1.2 / p, 3), **counts)
    return row


def _decode(vae: torch.nn.Module, z: torch.Tensor) -> torch.Tensor:
    """The stock decode of ``z``: ``vae.decode`` (or the module's call, a vocoder), its tensor."""
    out = vae.decode(z) if hasattr(vae, "decode") else vae(z)
    out = getattr(out, "sample", out)
    return out[0] if isinstance(out, (tuple, list)) else out


def planner_line(row: Row, key: str) -> str:
    """The measured ``VAEDecode`` fields of the planner's ``VAES[key]`` (to replace its estimate)."""
    fractions = {int(p): share["mem_frac"] for p, share in row.shares.items()} or None
    if not torch.cuda.is_available():
        return f"# --vae {key}: a CPU dry run (a tiny latent, no memory figures): nothing to put in the planner"
    return (f'# --vae {key}: measured {row.shape}; in usp_dit/planner/models.py VAES["{key}"]:\n'
            f"stock_peak_gib={row.stock_peak_gib}, output_gib={row.output_gib}, fractions={fractions}, "
            f"source=_VAE_RUN")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="flux,cogvideox,wan")
    parser.add_argument("--vae", default=None, help="the planner's VAES keys to measure (replaces --model)")
    parser.add_argument("--parts", default="2,4,8")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    parts = [int(p) for p in args.parts.split(",")]
    names = [f"vae:{key}" for key in args.vae.split(",")] if args.vae else args.model.split(",")
    rows, failed = [], False
    print("| model | shape | stock ms | stock peak GiB | world-1 ratio | " + " | ".join(
        f"P={p} time / mem (goal {1.3 / p:.2f} / {1.2 / p:.2f})" for p in parts) + " |", flush=True)
    for name in names:
        try:
            row = bench(name, parts, args.warmup, args.rounds)
        except Exception:  # noqa: BLE001  (report and go on with the next model)
            traceback.print_exc()
            failed = True
            torch.cuda.empty_cache()
            continue
        rows.append(row)
        torch.cuda.empty_cache()
        cells = " | ".join(f"{row.shares[p]['time_frac']:.3f} / {row.shares[p]['mem_frac']:.3f}" if p in row.shares
                           else "whole (no recipe)" for p in parts)
        print(f"| {row.model} | {row.shape} | {row.stock_ms} | {row.stock_peak_gib} | {row.world1_ratio} | {cells} |",
              flush=True)
        if name.startswith("vae:"):
            print(planner_line(row, name[4:]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
