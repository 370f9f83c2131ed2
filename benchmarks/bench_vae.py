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
defaults for each class are those configs; Flux's, Wan 2.2's and HunyuanImage's below), bf16,
batch 1, ``torch.inference_mode``: flux (1024x1024 -> latent 16 x 128 x 128), cogvideox
(49 x 480 x 720 -> 16 x 13 x 60 x 90), wan (Wan 2.1, 81 x 720 x 1280 -> 16 x 21 x 90 x 160),
hunyuan_video (129 x 720 x 1280), mochi (163 x 480 x 848), ltx_video (121 x 512 x 768), qwen_image
(1328 x 1328); the 2025-26 families' (issue 29): ltx2 (121 x 512 x 768 -> 128 x 16 x 16 x 24),
sana_wm_ltx2 (LTX-2's VAE at SANA-WM's 161 x 704 x 1280), wan22 (TI2V-5B, 121 x 704 x 1280 ->
48 x 31 x 44 x 80), hunyuan_video15 (121 x 720 x 1280 -> 32 x 31 x 45 x 80; untiled it cannot fit
one GPU: ``--skip-stock``) and hunyuan_video15_480p (121 x 480 x 848), qwen_image21 (1024 x 1024),
hunyuan_image (2048 x 2048 -> 64 x 64 x 64), hunyuan_image_refiner (2048 x 2048, one frame) and
sana_dcae (Sana's DC-AE at 4096 x 4096 -> 32 x 128 x 128; also PRX's and SANA-Video's VAE),
cosmos1 (Cosmos 1's tokenizer, 121 x 704 x 1280 -> 16 x 16 x 88 x 160) and easyanimate (EasyAnimate
V5.1's Magvit VAE, 49 x 512 x 512 -> 16 x 13 x 64 x 64).
Kandinsky 6 decodes with HunyuanVideo's VAE, Cosmos 3, Helios, ChronoEdit and SANA-Video 480p
with Wan 2.1's, SANA-Video 720p with LTX-2's: their cases above stand for them.

Without CUDA the script is a dry run on the CPU (the same code, wall time, no memory figure) on a
latent of 9 x 7 (at most 2 frames), with the small config of the same class where the case has one
(the 2025-26 cases; the others build full size).

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
is printed (``output_gib``). A stock decode that runs out of memory (or ``--skip-stock``) leaves
its columns empty and each share in ms and GiB.
"""
from __future__ import annotations

import argparse
import json
import math
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
# Wan 2.2 TI2V-5B's VAE (recalled from Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json, unconfirmed
# offline): 48 latent channels, patchify 2 then 8x: 16x spatial, 4x temporal; residual blocks.
WAN22_VAE = dict(
    base_dim=160, decoder_base_dim=256, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
    temperal_downsample=[False, True, True], is_residual=True, in_channels=12, out_channels=12, patch_size=2,
    scale_factor_spatial=16, scale_factor_temporal=4, latents_mean=[0.0] * 48, latents_std=[1.0] * 48,
)
# HunyuanImage 2.1's VAE (recalled from tencent/HunyuanImage-2.1 vae config, unconfirmed offline): 32x
# spatial by pixel-unshuffles, 64 latent channels; its pipeline's default is 2048 x 2048.
HUNYUAN_IMAGE_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=64, block_out_channels=(128, 256, 512, 512, 1024, 1024),
    layers_per_block=2, spatial_compression_ratio=32, sample_size=384, scaling_factor=0.75289,
)

# Sana's DC-AE (recalled from mit-han-lab/dc-ae-f32c32-sana-1.0-diffusers, unconfirmed offline): 32x,
# 32 latent channels, ResBlocks with BatchNorm then EfficientViT blocks with ReLU linear attention.
SANA_DC_AE = dict(
    in_channels=3, latent_channels=32, attention_head_dim=32,
    encoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
    decoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
    encoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
    decoder_block_out_channels=(128, 256, 512, 512, 1024, 1024),
    encoder_layers_per_block=(2, 2, 2, 3, 3, 3), decoder_layers_per_block=(3, 3, 3, 3, 3, 3),
    encoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)), decoder_qkv_multiscales=((), (), (), (5,), (5,), (5,)),
    upsample_block_type="interpolate", downsample_block_type="Conv",
    decoder_norm_types=("batch_norm",) * 3 + ("rms_norm",) * 3, decoder_act_fns=("relu",) * 3 + ("silu",) * 3,
    scaling_factor=0.41407,
)


@dataclass(frozen=True)
class Case:
    """A VAE at its released config (``build``) and usual latent, and a small config of the same class
    (``tiny``, for the CPU dry run; None: the full size on a tiny latent)."""

    build: Callable[[], torch.nn.Module]
    latent: tuple[int, ...]
    label: str
    tiny: Callable[[], torch.nn.Module] | None = None


def _tiny_wan22():
    import diffusers as d

    small = dict(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
                 latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
    return d.AutoencoderKLWan(**{**WAN22_VAE, **small})


def _tiny_qwen_image21():
    import diffusers as d

    return d.AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1, 1],
                                      num_res_blocks=1, latents_mean=[0.0] * 4, latents_std=[1.0] * 4)


def _tiny_dc_ae():
    import diffusers as d

    kinds = ("ResBlock", "ResBlock", "EfficientViTBlock")
    small = dict(latent_channels=4, encoder_block_types=kinds, decoder_block_types=kinds,
                 encoder_block_out_channels=(8, 16, 32), decoder_block_out_channels=(8, 16, 32),
                 encoder_layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
                 encoder_qkv_multiscales=((), (), (5,)), decoder_qkv_multiscales=((), (), (5,)),
                 decoder_norm_types=("batch_norm", "batch_norm", "rms_norm"), decoder_act_fns=("relu", "relu", "silu"))
    return d.AutoencoderDC(**{**SANA_DC_AE, **small})


def _allegro_vae():
    import diffusers as d

    vae = d.AutoencoderKLAllegro()
    vae.enable_tiling()  # it decodes only tiled
    return vae


def _tiny_allegro_vae():
    from usp_dit.demo.tiny_allegro import tiny_allegro_vae

    vae = tiny_allegro_vae(8, 32, 32)
    vae.kernel, vae.stride = (8, 32, 32), (8, 16, 16)  # overlapping cubes over the dry run's 9 x 7 latent
    return vae


def _demo(module: str, name: str) -> Callable[[], torch.nn.Module]:
    def build():
        import importlib

        return getattr(importlib.import_module(f"usp_dit.demo.{module}"), name)()
    return build


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


# Latent frames of a CPU dry run where 2 are too few: MiniMax-H3's decode cuts 5 n + 2 latent frames
# into clips of 5 after the first 2 (with n = 0 it has no clip to decode).
_DRY_RUN_FRAMES = {"vae:minimax_h3": 7}


def _planner_case(key: str) -> Case:
    from benchmarks.planner_components import VAE_CONFIGS, component_class
    from usp_dit.planner.models import VAES

    path, config = VAE_CONFIGS[key]
    reference = "x".join(str(n) for n in VAES[key].reference if n > 1) or "1"
    return Case(lambda: component_class(path)(**config()), _VAE_LATENTS[key], reference)


def _case(name: str) -> Case:
    """Diffusers' defaults for each class are the released config unless a dict above says otherwise;
    latents are the pipelines' default sizes."""
    import diffusers as d

    if name.startswith("vae:"):
        return _planner_case(name[4:])
    cases = {
        "flux": Case(lambda: d.AutoencoderKL(**FLUX_VAE), (1, 16, 128, 128), "1024x1024"),
        "qwen_image": Case(lambda: d.AutoencoderKLQwenImage(), (1, 16, 1, 166, 166), "1328x1328"),
        "cogvideox": Case(lambda: d.AutoencoderKLCogVideoX(), (1, 16, 13, 60, 90), "49x480x720"),
        "wan": Case(lambda: d.AutoencoderKLWan(), (1, 16, 21, 90, 160), "81x720x1280"),
        "hunyuan_video": Case(lambda: d.AutoencoderKLHunyuanVideo(), (1, 16, 33, 90, 160), "129x720x1280"),
        "mochi": Case(lambda: d.AutoencoderKLMochi(), (1, 12, 28, 60, 106), "163x480x848"),
        "ltx_video": Case(lambda: d.AutoencoderKLLTXVideo(), (1, 128, 16, 16, 24), "121x512x768"),
        # The 2025-26 families (issue 29). LTX-2: Diffusers' defaults as LTX-2's release (recalled:
        # 128 channels, 32x / 8x, reflect-padded decoder); LTX2Pipeline's default 121 x 512 x 768.
        "ltx2": Case(lambda: d.AutoencoderKLLTX2Video(), (1, 128, 16, 16, 24), "121x512x768",
                     _demo("tiny_ltx2", "tiny_ltx2_vae")),
        # SANA-WM (and SANA-Video 720p) decode with LTX-2's VAE; SanaWMPipeline's default 161 x 704 x 1280.
        "sana_wm_ltx2": Case(lambda: d.AutoencoderKLLTX2Video(), (1, 128, 21, 22, 40), "161x704x1280",
                             _demo("tiny_ltx2", "tiny_ltx2_vae")),
        # Wan 2.2 TI2V-5B at its 720p (recalled: 121 x 704 x 1280).
        "wan22": Case(lambda: d.AutoencoderKLWan(**WAN22_VAE), (1, 48, 31, 44, 80), "121x704x1280", _tiny_wan22),
        # HunyuanVideo 1.5 (Diffusers' defaults: 32 channels, 16x / 4x), 720p and 480p at 121 frames
        # (HunyuanVideo15Pipeline's num_frames default); untiled it decodes the whole video at once.
        "hunyuan_video15": Case(lambda: d.AutoencoderKLHunyuanVideo15(), (1, 32, 31, 45, 80), "121x720x1280",
                                _demo("tiny_hunyuan_video15", "tiny_hunyuan_video15_vae")),
        "hunyuan_video15_480p": Case(lambda: d.AutoencoderKLHunyuanVideo15(), (1, 32, 31, 30, 53), "121x480x848",
                                     _demo("tiny_hunyuan_video15", "tiny_hunyuan_video15_vae")),
        # Qwen-Image 2.1 (Diffusers' defaults: 64 channels, 16x); its pipeline's output_resolution 1024.
        "qwen_image21": Case(lambda: d.AutoencoderKLQwenImage21(), (1, 64, 1, 64, 64), "1024x1024",
                             _tiny_qwen_image21),
        "hunyuan_image": Case(lambda: d.AutoencoderKLHunyuanImage(**HUNYUAN_IMAGE_VAE), (1, 64, 64, 64), "2048x2048",
                              _demo("tiny_hunyuan_image", "tiny_hunyuan_image_vae")),
        # The refiner (Diffusers' defaults: 32 channels, 16x) on the base model's 2048 x 2048 output, one frame.
        "hunyuan_image_refiner": Case(lambda: d.AutoencoderKLHunyuanImageRefiner(), (1, 32, 1, 128, 128), "2048x2048",
                                      _demo("tiny_hunyuan_image", "tiny_hunyuan_image_refiner_vae")),
        # Sana's DC-AE (also PRX's, SANA-Video's) at Sana 4K's 4096 x 4096 (latent 32 x 128 x 128).
        "sana_dcae": Case(lambda: d.AutoencoderDC(**SANA_DC_AE), (1, 32, 128, 128), "4096x4096", _tiny_dc_ae),
        # Cosmos 1's tokenizer: Diffusers' defaults are CV8x8x8-1.0 (its source says so of its latents'
        # statistics; the block widths recalled as the release's); CosmosTextToWorldPipeline's default
        # 121 x 704 x 1280 (8x in time and space, 16 channels).
        "cosmos1": Case(lambda: d.AutoencoderKLCosmos(), (1, 16, 16, 88, 160), "121x704x1280",
                        _demo("tiny_cosmos", "tiny_cosmos_vae")),
        # EasyAnimate V5.1's Magvit VAE: Diffusers' defaults (recalled as the release's: 16 channels, 8x /
        # 4x, spatial_group_norm); EasyAnimatePipeline's default 49 x 512 x 512. Its decode is framewise
        # (one latent frame a decoder call, the causal convolutions' frame caches between calls).
        "easyanimate": Case(lambda: d.AutoencoderKLMagvit(), (1, 16, 13, 64, 64), "49x512x512",
                            _demo("tiny_easyanimate", "tiny_magvit_vae")),
        # Allegro's VAE: Diffusers' defaults as the release (4 channels, 8x / 4x; cubes of 24 x 320 x 320
        # pixels every 16 x 200 x 240), tiled as AllegroPipeline decodes; its 88 x 720 x 1280 (75 cubes).
        "allegro": Case(_allegro_vae, (1, 4, 22, 90, 160), "88x720x1280", _tiny_allegro_vae),
        # Kandinsky 6 SR's K-VAE: Diffusers' defaults (its docstring's: 64 channels, 16x / 4x, decoder
        # widths 16 .. 2048); a 2x super-resolved 61-frame 1088 x 1920 video (16 latent frames: four
        # of its 16-frame time segments). Its convolutions chunk time above 2e9 elements.
        "kandinsky6_sr": Case(lambda: d.Kandinsky6SRVAE(), (1, 64, 16, 68, 120), "61x1088x1920",
                              _demo("tiny_kandinsky6_sr", "tiny_kandinsky6_sr_vae")),
    }
    if name not in cases:
        raise ValueError(f"--model {name!r}: expected one of {', '.join(cases)}")
    return cases[name]


@dataclass
class Row:
    model: str
    shape: str
    stock_ms: float | None  # None: the stock decode was skipped (--skip-stock) or ran out of memory
    stock_peak_gib: float | None
    world1_ratio: float | None
    output_gib: float
    # P -> {ms, peak_gib, time_frac, mem_frac, halo_exchanges, all_reduces, gathers} (or skipped)
    shares: dict = field(default_factory=dict)


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

    saved = (halo.neighbour_rows, norm._all_sum, norm._gather_stats, attention.gather_uneven, attention.gathered_counts,
             attention._all_sum)
    halo.neighbour_rows, norm._all_sum, norm._gather_stats = sim.neighbour_rows, sim.all_sum, sim.gather_stats
    attention.gather_uneven, attention.gathered_counts, attention._all_sum = (sim.gather_uneven, sim.gathered_counts,
                                                                              sim.all_sum)
    try:
        yield
    finally:
        (halo.neighbour_rows, norm._all_sum, norm._gather_stats, attention.gather_uneven, attention.gathered_counts,
         attention._all_sum) = saved


def _decode_rows(vae: torch.nn.Module, piece: torch.Tensor) -> torch.Tensor:
    """The stock method the parallel VAE splits (``_decode``; Kandinsky 6 SR's ``decode``) on ``piece``:
    a tensor, whatever the class returns (HunyuanVideo 1.5's and the HunyuanImage refiner's
    ``_decode`` take no ``return_dict`` and return the tensor), with the frame caches cleared after
    it as the class's ``decode`` does."""
    import inspect

    from usp_dit.pipelines.vae.recipes import recipes

    decode = getattr(type(vae), recipes()[type(vae)].calls["decode"])
    out = decode(vae, piece, return_dict=False) if "return_dict" in inspect.signature(decode).parameters else decode(
        vae, piece)
    if hasattr(vae, "_clear_conv_cache"):  # EasyAnimate's frame caches: its ``decode`` clears them after ``_decode``
        vae._clear_conv_cache()
    return out if torch.is_tensor(out) else out[0]


def share(vae: torch.nn.Module, z: torch.Tensor, parts: int, warmup: int,
          rounds: int) -> tuple[float, float, dict] | None:
    """(ms, peak GiB, collective counts per decode) of rank parts // 2's rows of a P-way decode; None
    where the latent has too few rows for ``parts`` pieces as thick as the widest halo."""
    from usp_dit.distributed.mesh import single_rank_mesh
    from usp_dit.pipelines.vae.halo import RowGroup, decoding
    from usp_dit.pipelines.vae.patch import _STATES, VAEState, _install, _untiled, disable_parallel_vae
    from usp_dit.pipelines.vae.recipes import classify, recipes
    from usp_dit.pipelines.vae.rows import can_split, row_offsets, row_split

    sites, reason = classify(vae.decoder, recipes()[type(vae)])
    if reason:
        raise NotImplementedError(reason)
    if not can_split(z.shape[-2], parts, sites.halo):  # a parallel decode would run whole (patch._sizes)
        return None
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
                    return _decode_rows(vae, piece)
            ms, peak, _ = _timed(run, warmup, rounds)
            sim.counts = {k: 0 for k in sim.counts}
            run()
    finally:
        disable_parallel_vae(vae)
    return ms, peak, dict(sim.counts)


def _rank_share(parts: int):
    """A stand-in for ``tiles.dealt`` on one GPU: rank parts // 2's run of the pieces computed, the
    gather simulated by repeating them (what follows then gets P copies: the same work as the real
    results); and the count of gathers it stands for."""
    from usp_dit.pipelines.vae.rows import row_offsets, row_split

    rank, counts = parts // 2, {"gathers": 0}

    def dealt(inputs, run, group):
        sizes = row_split(len(inputs), parts)
        start = row_offsets(sizes)[rank]
        mine = [run(x) for x in inputs[start:start + sizes[rank]]] or [run(inputs[0])]
        counts["gathers"] += 1
        return [mine[i % len(mine)] for i in range(len(inputs))]

    return dealt, counts


def _share_dealt(vae: torch.nn.Module, z: torch.Tensor, parts: int, warmup: int, rounds: int, module,
                 method: str, split) -> tuple[float, float, dict]:
    """Rank parts // 2's share of a decode whose pieces ``module`` (vit, allegro) deals out: its
    ``dealt`` replaced by ``_rank_share``'s stand-in, the VAE's ``method`` by ``split`` (the split
    call, no group) for the timing. (ms, peak GiB, gathers per decode)."""
    dealt, counts = _rank_share(parts)
    saved, module.dealt = module.dealt, dealt
    setattr(vae, method, split)
    try:
        ms, peak, _ = _timed(lambda: _decode(vae, z), warmup, rounds)
        counts["gathers"] = 0
        _decode(vae, z)
    finally:
        module.dealt = saved
        delattr(vae, method)
    return ms, peak, counts


def share_cubes(vae: torch.nn.Module, z: torch.Tensor, parts: int, warmup: int, rounds: int) -> tuple[float, float, dict]:
    """``share`` for Allegro's cube-dealt decode (Note [Allegro's cubes dealt out]): rank parts // 2
    decodes its run of the cubes, the gather simulated (``_rank_share``)."""
    import functools

    from usp_dit.pipelines.vae import allegro

    split = functools.partial(allegro.tiled_decode, vae, None)
    return _share_dealt(vae, z, parts, warmup, rounds, allegro, "tiled_decode", split)


def share_tiles(vae: torch.nn.Module, z: torch.Tensor, parts: int, warmup: int, rounds: int) -> tuple[float, float, dict]:
    """``share`` for MiniMax-H3's tile-dealt decode (Note [a parallel ViT VAE]): rank parts // 2
    decodes its run of each clip's tiles; the gather is simulated by repeating them (its stitch
    then blends P copies: the same work as the real one)."""
    import functools

    from usp_dit.pipelines.vae import vit

    split = functools.partial(vit.decode_clip, vae, None, False)
    return _share_dealt(vae, z, parts, warmup, rounds, vit, "_decode_clip", split)


# The VAEs split per call (their tiles dealt out), by class name -> their tiled share's timing.
_PER_CALL = {"AutoencoderKLMiniMaxH3": share_tiles, "AutoencoderKLAllegro": share_cubes}


def _latent_channels(vae: torch.nn.Module) -> int:
    config = vae.config
    return config["latent_channels"] if "latent_channels" in config else config["z_dim"]


def _stock(vae: torch.nn.Module, z: torch.Tensor, warmup: int, rounds: int, device: torch.device):
    """(ms, peak GiB, output GiB, world-1 ratio) of the stock whole decode, or Nones where it runs out
    of memory (the shares still run: each holds about 1/P of it)."""
    from usp_dit import disable_parallel_vae, enable_parallel_vae, single_rank_mesh

    try:
        stock_ms, stock_peak, out = _timed(lambda: _decode(vae, z), warmup, rounds)
    except torch.cuda.OutOfMemoryError:
        print(f"stock decode of {tuple(z.shape)}: out of memory; shares only", flush=True)
        torch.cuda.empty_cache()
        return None, None, None, None
    output_gib = out.numel() * out.element_size() / 2**30
    del out
    from usp_dit.pipelines.vae.recipes import recipes

    pairs = []  # world size 1, side by side: stock, then enabled (no group: nothing is replaced), 3 pairs
    split = type(vae) in recipes() or type(vae).__name__ in _PER_CALL
    for _ in range(3 if split else 0):  # no recipe: enabling replaces nothing
        s, _, o = _timed(lambda: _decode(vae, z), 0, 1)
        del o
        enable_parallel_vae(vae, single_rank_mesh(device.type))
        u, _, o = _timed(lambda: _decode(vae, z), 0, 1)
        del o
        disable_parallel_vae(vae)
        pairs.append(u / s)
    world1 = round(statistics.median(pairs), 3) if pairs else None
    return round(stock_ms, 1), round(stock_peak, 2), output_gib, world1


def bench(name: str, parts: list[int], warmup: int, rounds: int, skip_stock: bool = False) -> Row:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    case = _case(name)
    factory, shape = case.build, case.latent
    if device.type == "cpu":  # a dry run: the same code on a tiny latent (and a tiny config where the case has one)
        factory = case.tiny or factory
    vae = _build(factory, device)
    if name.startswith("vae:"):  # as from_pretrained(torch_dtype=bf16) loads it (MiniMax-H3's keeps float32 parts)
        from benchmarks.planner_components import as_loaded

        vae = as_loaded(vae, True)
    if device.type == "cpu" and len(shape) == 3:  # an audio latent (batch, channels, frames)
        shape = shape[:-1] + (9,)
    elif device.type == "cpu":
        frames = min(shape[2], _DRY_RUN_FRAMES.get(name, 2))
        shape = (shape[0], _latent_channels(vae)) + ((frames,) if len(shape) == 5 else ()) + (9, 7)
    z = torch.randn(shape, generator=torch.Generator(device).manual_seed(0), device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        stock = (None,) * 4 if skip_stock else _stock(vae, z, warmup, rounds, device)
        stock_ms, stock_peak, output_gib, world1 = stock
        row = Row(name, case.label, stock_ms, stock_peak, world1, None)
        from usp_dit.pipelines.vae.recipes import recipes

        dealt = _PER_CALL.get(type(vae).__name__) if getattr(vae, "use_tiling", False) else None
        for p in parts if type(vae) in recipes() or dealt else ():  # no recipe: every rank decodes whole
            try:
                result = (dealt or share)(vae, z, p, warmup, rounds)
            except torch.cuda.OutOfMemoryError:
                print(f"{name}: the P={p} share ran out of memory", flush=True)
                torch.cuda.empty_cache()
                result = "out of memory"
            if not isinstance(result, tuple):
                row.shares[p] = dict(ms=None, time_frac=None, peak_gib=None, mem_frac=None,
                                     skipped=result or "too few rows: decoded whole")
                continue
            ms, peak, counts = result
            row.shares[p] = dict(ms=round(ms, 1), time_frac=round(ms / stock_ms, 3) if stock_ms else None,
                                 time_goal=round(1.3 / p, 3), peak_gib=round(peak, 2),
                                 mem_frac=round(peak / stock_peak, 3) if stock_peak else None,
                                 mem_goal=round(1.2 / p, 3), **counts)
        channels = 4 if name == "qwen_image21" else 3  # Qwen-Image 2.1's VAE decodes 4 channels
        if output_gib is None:  # the whole output's size, from the latent and the compression
            output_gib = _output_gib(vae, shape, channels)
        row.output_gib = round(output_gib, 2)
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


def _output_gib(vae: torch.nn.Module, latent: tuple[int, ...], channels: int) -> float:
    """bf16 GiB of the decoded sample of ``latent`` (for a case whose stock decode did not run)."""
    s = _setting(vae, "spatial_compression_ratio")
    t = _setting(vae, "temporal_compression_ratio")
    frames = ((latent[2] - 1) * t + 1,) if len(latent) == 5 else ()
    return latent[0] * channels * math.prod(frames) * latent[-2] * s * latent[-1] * s * 2 / 2**30


def _setting(vae: torch.nn.Module, name: str) -> int:
    from usp_dit.pipelines.vae.patch import _setting as setting

    return setting(vae, name)


def _cell(share: dict) -> str:
    if share.get("skipped"):
        return share["skipped"]
    if share["time_frac"] is None:
        return f"{share['ms']} ms / {share['peak_gib']} GiB"
    return f"{share['time_frac']:.3f} / {share['mem_frac']:.3f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="flux,cogvideox,wan")
    parser.add_argument("--vae", default=None, help="the planner's VAES keys to measure (replaces --model)")
    parser.add_argument("--parts", default="2,4,8")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--skip-stock", action="store_true",
                        help="time only the shares (a whole decode that cannot fit the GPU): ms and GiB, no fractions")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    parts = [int(p) for p in args.parts.split(",")]
    names = [f"vae:{key}" for key in args.vae.split(",")] if args.vae else args.model.split(",")
    rows, failed = [], False
    print("| model | shape | stock ms | stock peak GiB | world-1 ratio | " + " | ".join(
        f"P={p} time / mem (goal {1.3 / p:.2f} / {1.2 / p:.2f})" for p in parts) + " |", flush=True)
    for name in names:
        try:
            row = bench(name, parts, args.warmup, args.rounds, args.skip_stock)
        except Exception:  # noqa: BLE001  (report and go on with the next model)
            traceback.print_exc()
            failed = True
            torch.cuda.empty_cache()
            continue
        rows.append(row)
        torch.cuda.empty_cache()
        cells = " | ".join(_cell(row.shares[p]) if p in row.shares else "whole (no recipe)" for p in parts)
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
