"""Transformer step on one GPU: stock Diffusers against the same model after ``enable_usp`` (world 1).

    PYTHONPATH=. python3 benchmarks/bench_pipelines.py --model flux          # Flux.1-dev, 1024x1024
    PYTHONPATH=. python3 benchmarks/bench_pipelines.py --model cogvideox     # CogVideoX-5B, 49 x 480 x 720
    PYTHONPATH=. python3 benchmarks/bench_pipelines.py --model mochi         # Mochi-1, 163 x 480 x 848
    PYTHONPATH=. python3 benchmarks/bench_pipelines.py --model all --json out.json
    PYTHONPATH=. python3 benchmarks/bench_pipelines.py --model wan,qwen_image,sd35   # several, in order

Also: wan (Wan 2.1-14B 81x720x1280), hunyuan_video (720p x 129 frames), qwen_image (1328x1328),
sd35 (SD3.5 Large 1024x1024), ltx_video (121x512x768), flux2 (Flux.2-dev 1024x1024), krea2 (1024x1024),
hunyuan_image (HunyuanImage 2.1, 2048x2048), zimage (Z-Image / Z-Image-Turbo 1024x1024), pixart (PixArt-Sigma
1024x1024), hunyuan_dit (HunyuanDiT v1.2 1024x1024), qwen_image21 (1024x1024), flux3 (1024x1024), ltx2 (LTX-2
121x512x768, video + audio), kandinsky5 (T2V Lite 121x512x768), chronoedit (5x480x832), helios (384x640 chunk),
cosmos3 (189x720x1280), wan_animate (77x720x1280 segment), minimax_h3 (33 B, 124x768x1344), anyflow
(AnyFlow-Wan2.1-T2V-14B, 81x480x832):
benchmarks/pipeline_cases.py (benchmarks/check_cases.py checks those on CPU; benchmarks/GPU_PENDING.md: the
commands for their first GPU figures). Compiled always (stock attends with a flex BlockMask, which needs
torch.compile: benchmarks/flex_cases.py, Note [why these cases are compiled]): kandinsky5_nabla (T2V Lite 10 s,
241x512x768), kandinsky5_nabla_pro (T2V Pro 10 s, 19 B), kandinsky6_sr (a 121x512x768 tile), wan_animate2
(a generation call, 81x800x640 segment).

Compiled mode (``--compile``, or always for the flex cases): the model's repeated blocks are
``torch.compile``d once (Diffusers' ``compile_repeated_blocks``: regional compilation, the default
inductor mode; ``fullgraph=True`` where the case says so, else graph breaks allowed) before either
variant runs; both variants then run those compiled blocks (Dynamo keeps a graph per variant: the
switch changes what its guards see), so each row is still compiled stock against compiled usp_dit.
The warm-up runs each variant, then each again after a switch (a guard the switch invalidates
recompiles there); each timed round starts with one untimed forward after its switch, so a
recompile never lands inside a timing. Dynamo's recompile limit is raised to 64 and made an error:
a variant never falls back to eager silently (for the flex cases eager is the O(S^2) math path).
The row's shape says "compiled ..." and how many graphs were compiled after the warm-up.

Full-size transformers with random weights (configs of the released checkpoints, written below),
bf16, batch 1, ``torch.inference_mode``. One model is built per family; the two variants are timed
side by side by switching it between stock and USP with ``enable_usp`` / ``disable_usp`` (which
restores the stock processors and forward exactly): each round times ``--iters`` back-to-back
forwards of each variant between two CUDA events; the reported figure is the median over
``--rounds`` rounds, in ms per forward (one denoising step). Peak memory is each variant's
largest over its timed rounds. The outputs of the two variants are compared
(max |diff| / max |stock|): kernels differ (stock Diffusers calls SDPA with PyTorch's own kernel
choice, usp_dit's "auto" picks cuDNN where it fits), so bf16 rounding differences are expected.

Output: one markdown table row per model (header printed first), and ``--json`` if given. Exits
non-zero on any error. Goal of issue 3: usp / stock <= 1.00. Stock on 2026-12-02 (torch 2.11,
one H200): Flux 172.7 ms, CogVideoX-5B 879.5 ms.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch

try:
    import flex_cases  # run as benchmarks/bench_pipelines.py: this folder is on sys.path
    import pipeline_cases
except ImportError:
    from benchmarks import flex_cases, pipeline_cases

# Flux.1-dev: diffusers' FluxTransformer2DModel defaults are the dev checkpoint's config.
FLUX_DEV = dict(
    patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)
# CogVideoX-5B (THUDM/CogVideoX-5b, transformer/config.json).
COGVIDEOX_5B = dict(
    num_attention_heads=48, attention_head_dim=64, in_channels=16, out_channels=16, flip_sin_to_cos=True,
    freq_shift=0, time_embed_dim=512, text_embed_dim=4096, num_layers=42, dropout=0.0, attention_bias=True,
    sample_width=90, sample_height=60, sample_frames=49, patch_size=2, temporal_compression_ratio=4,
    max_text_seq_length=226, activation_fn="gelu-approximate", timestep_activation_fn="silu",
    norm_elementwise_affine=True, norm_eps=1e-5, spatial_interpolation_scale=1.875,
    temporal_interpolation_scale=1.0, use_rotary_positional_embeddings=True,
    use_learned_positional_embeddings=False,
)


@dataclass
class Row:
    model: str
    shape: str
    stock_ms: float
    usp_ms: float
    ratio: float
    stock_peak_gib: float
    usp_peak_gib: float
    max_rel_diff: float
    params_b: float
    compiled: str = ""  # "", "blocks, fullgraph" or "blocks, graph breaks"
    recompiles_after_warmup: int | None = None  # Dynamo graphs compiled after the warm-up (compiled mode)


def build(cls, config: dict, device: torch.device) -> torch.nn.Module:
    """``cls(**config)`` created directly on ``device`` in bf16 (no fp32 copy on the host)."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = cls(**config)
    finally:
        torch.set_default_dtype(previous)
    return model.to(device=device, dtype=torch.bfloat16).eval()  # buffers made from numpy start on the host


def flux_case(device: torch.device, height: int = 1024, width: int = 1024) -> tuple[torch.nn.Module, dict, str]:
    """Flux.1-dev transformer and one step's inputs: (h/16)*(w/16) image tokens + 512 text tokens."""
    from diffusers import FluxTransformer2DModel

    model = build(FluxTransformer2DModel, FLUX_DEV, device)
    rows, cols = height // 16, width // 16
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(r), r, c], -1).reshape(-1, 3).to(device, torch.bfloat16)
    g = torch.Generator(device).manual_seed(0)
    bf = dict(device=device, dtype=torch.bfloat16)
    inputs = dict(
        hidden_states=torch.randn(1, rows * cols, 64, generator=g, **bf),
        encoder_hidden_states=torch.randn(1, 512, 4096, generator=g, **bf),
        pooled_projections=torch.randn(1, 768, generator=g, **bf),
        timestep=torch.full((1,), 0.5, **bf), guidance=torch.full((1,), 3.5, **bf),
        img_ids=img_ids, txt_ids=torch.zeros(512, 3, **bf), return_dict=False,
    )
    return model, inputs, f"{height}x{width} ({rows * cols} + 512 tokens)"


def cogvideox_case(device: torch.device, frames: int = 49, height: int = 480, width: int = 720):
    """CogVideoX-5B transformer and one step's inputs, RoPE table as CogVideoXPipeline makes it."""
    from diffusers import CogVideoXTransformer3DModel
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    model = build(CogVideoXTransformer3DModel, COGVIDEOX_5B, device)
    lat_f, lat_h, lat_w = (frames - 1) // 4 + 1, height // 8, width // 8
    grid = (lat_h // 2, lat_w // 2)  # at the model's native 480x720 the pipeline's crop is the whole grid
    cos, sin = get_3d_rotary_pos_embed(
        embed_dim=64, crops_coords=((0, 0), grid), grid_size=grid, temporal_size=lat_f, device=device,
    )
    g = torch.Generator(device).manual_seed(0)
    bf = dict(device=device, dtype=torch.bfloat16)
    inputs = dict(
        hidden_states=torch.randn(1, lat_f, 16, lat_h, lat_w, generator=g, **bf),
        encoder_hidden_states=torch.randn(1, 226, 4096, generator=g, **bf),
        timestep=torch.full((1,), 500, device=device, dtype=torch.long),
        image_rotary_emb=(cos.to(device), sin.to(device)), return_dict=False,
    )
    tokens = lat_f * grid[0] * grid[1]
    return model, inputs, f"{frames}x{height}x{width} ({tokens} + 226 tokens)"


def mochi_case(device: torch.device, frames: int = 163, height: int = 480, width: int = 848, valid: int = 256):
    """Mochi-1 transformer (diffusers' defaults are the released config) and one step's inputs:
    latents (1, 12, (frames-1)/6+1, h/8, w/8), 2x2 patches, 256 prompt tokens, the first
    ``valid`` of them real (all by default)."""
    from diffusers import MochiTransformer3DModel

    model = build(MochiTransformer3DModel, {}, device)
    lat_f, lat_h, lat_w = (frames - 1) // 6 + 1, height // 8, width // 8
    g = torch.Generator(device).manual_seed(0)
    bf = dict(device=device, dtype=torch.bfloat16)
    inputs = dict(
        hidden_states=torch.randn(1, 12, lat_f, lat_h, lat_w, generator=g, **bf),
        encoder_hidden_states=torch.randn(1, 256, 4096, generator=g, **bf),
        timestep=torch.full((1,), 500, device=device, dtype=torch.long),
        encoder_attention_mask=torch.arange(256, device=device)[None] < valid, return_dict=False,
    )
    tokens = lat_f * (lat_h // 2) * (lat_w // 2)
    return model, inputs, f"{frames}x{height}x{width} ({tokens} + 256 tokens, {valid} real)"


def _later(case: Callable) -> Callable:
    """A ``pipeline_cases`` case, given this module's ``build``."""
    return lambda device, **kwargs: case(build, device, **kwargs)


CASES: dict[str, Callable] = {
    "flux": flux_case, "cogvideox": cogvideox_case, "mochi": mochi_case,
    # A typical prompt: 60 real tokens of 256 (stock drops the padding, usp_dit compiled masks it).
    "mochi_padded": lambda device: mochi_case(device, valid=60),
    "wan": _later(pipeline_cases.wan_case), "hunyuan_video": _later(pipeline_cases.hunyuan_video_case),
    "qwen_image": _later(pipeline_cases.qwen_image_case), "sd35": _later(pipeline_cases.sd35_case),
    "ltx_video": _later(pipeline_cases.ltx_video_case), "flux2": _later(pipeline_cases.flux2_case),
    "skyreels_df": _later(pipeline_cases.skyreels_df_case),
    "hunyuan_video15": _later(pipeline_cases.hunyuan_video15_case), "wan_vace": _later(pipeline_cases.wan_vace_case),
    "cogview4": _later(pipeline_cases.cogview4_case), "lumina2": _later(pipeline_cases.lumina2_case), "lumina_next": _later(pipeline_cases.lumina_next_case), "dreamlite": _later(pipeline_cases.dreamlite_case),
    "krea2": _later(pipeline_cases.krea2_case), "hunyuan_image": _later(pipeline_cases.hunyuan_image_case),
    "zimage": _later(pipeline_cases.zimage_case),
    "sana": _later(pipeline_cases.sana_case),
    "sana_video": _later(pipeline_cases.sana_video_case),
    "sana_wm": _later(pipeline_cases.sana_wm_case),
    "hidream": _later(pipeline_cases.hidream_case),
    "pixart": _later(pipeline_cases.pixart_case),
    "hunyuan_dit": _later(pipeline_cases.hunyuan_dit_case),
    "longcat_image": _later(pipeline_cases.longcat_image_case), "ovis_image": _later(pipeline_cases.ovis_image_case),
    "consisid": _later(pipeline_cases.consisid_case),
    "auraflow": _later(pipeline_cases.auraflow_case),
    "bria": _later(pipeline_cases.bria_case), "bria_fibo2": _later(pipeline_cases.bria_fibo2_case),
    "qwen_image21": _later(pipeline_cases.qwen_image21_case), "flux3": _later(pipeline_cases.flux3_case),
    "ltx2": _later(pipeline_cases.ltx2_case), "kandinsky5": _later(pipeline_cases.kandinsky5_case),
    "chronoedit": _later(pipeline_cases.chronoedit_case), "helios": _later(pipeline_cases.helios_case),
    "cosmos3": _later(pipeline_cases.cosmos3_case), "wan_animate": _later(pipeline_cases.wan_animate_case),
    # 33 B: 62 GiB of bf16 weights (one copy: the variants switch one model), see benchmarks/GPU_PENDING.md.
    "minimax_h3": _later(pipeline_cases.minimax_h3_case),
    "ernie_image": _later(pipeline_cases.ernie_image_case),
    "glm_image": _later(pipeline_cases.glm_image_case),
    "nucleus_moe": _later(pipeline_cases.nucleus_moe_case),
    "omnigen": _later(pipeline_cases.omnigen_case),
    "joyimage": _later(pipeline_cases.joyimage_case),
    "anyflow": _later(pipeline_cases.anyflow_case),
    "joyimage_plus": _later(pipeline_cases.joyimage_plus_case),
    "ideogram4": _later(pipeline_cases.ideogram4_case),
    "prx": _later(pipeline_cases.prx_case),
    "dit": _later(pipeline_cases.dit_case),
    # Compiled always (flex_cases.COMPILE): stock's flex BlockMask attention needs torch.compile.
    "kandinsky5_nabla": _later(flex_cases.kandinsky5_nabla_case),
    "kandinsky5_nabla_pro": _later(flex_cases.kandinsky5_nabla_pro_case),
    "kandinsky6_sr": _later(flex_cases.kandinsky6_sr_case),
    "wan_animate2": _later(flex_cases.wan_animate2_case),
}


def time_round(fn: Callable[[], object], iters: int) -> float:
    """ms per call of ``iters`` back-to-back calls between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def set_variant(model: torch.nn.Module, variant: str, backend: str) -> None:
    import usp_dit

    usp_dit.disable_usp(model)
    if variant == "usp":
        usp_dit.enable_usp(model, backend=backend)


def compile_blocks(model: torch.nn.Module, fullgraph: bool, backend: str = "inductor") -> str:
    """``torch.compile`` the model's repeated blocks, once, for both variants (see the module
    docstring): Diffusers' ``compile_repeated_blocks``, or each block of the family's plan where
    the class names none. ``backend``: torch.compile's (check_cases.py traces with "aot_eager").
    Returns how (the row's ``compiled``)."""
    from usp_dit.pipelines.base import find_adapter

    torch._dynamo.config.recompile_limit = 64  # a graph per variant and per hook set, never near it
    torch._dynamo.config.fail_on_recompile_limit_hit = True  # never a silent fall-back to eager
    if getattr(model, "_repeated_blocks", None):
        model.compile_repeated_blocks(fullgraph=fullgraph, backend=backend)
    else:
        for list_name in find_adapter(model).plan.block_lists:
            for block in getattr(model, list_name):
                block.compile(fullgraph=fullgraph, backend=backend)
    return "blocks, fullgraph" if fullgraph else "blocks, graph breaks"


def _graphs_compiled() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def bench(name: str, args: argparse.Namespace, device: torch.device) -> Row:
    """Build ``name``'s model, warm both variants up, time them interleaved, compare outputs."""
    start = time.perf_counter()
    model, inputs, shape = CASES[name](device)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    print(f"# {name}: {params:.2f} B parameters built in {time.perf_counter() - start:.0f} s", file=sys.stderr)
    compiled = ""
    if name in flex_cases.COMPILE:
        flex_cases.pin_flex_tiles()
    if args.compile or name in flex_cases.COMPILE:
        compiled = compile_blocks(model, flex_cases.COMPILE.get(name, False))

    def forward() -> torch.Tensor:
        out = model(**inputs)[0]
        return torch.stack(out) if isinstance(out, list) else out  # Z-Image: one sample per element

    outputs, samples = {}, {"stock": [], "usp": []}
    with torch.inference_mode():
        for cycle in range(2 if compiled else 1):  # warm-up: compiled, kernels chosen, allocator filled
            for variant in ("stock", "usp"):
                t0 = time.perf_counter()
                set_variant(model, variant, args.backend)
                for _ in range(args.warmup if cycle == 0 else 1):
                    outputs[variant] = forward()
                torch.cuda.synchronize()
                print(f"# {name} {variant}: warm-up {cycle} in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        graphs = _graphs_compiled()
        peaks = {"stock": 0.0, "usp": 0.0}
        for _ in range(args.rounds):
            for variant in ("stock", "usp"):
                set_variant(model, variant, args.backend)
                if compiled:  # a recompile after the switch lands here, not in the timing
                    forward()
                torch.cuda.reset_peak_memory_stats()
                samples[variant].append(time_round(forward, args.iters))
                peaks[variant] = max(peaks[variant], torch.cuda.max_memory_allocated() / 2**30)
        set_variant(model, "stock", args.backend)
    recompiles = _graphs_compiled() - graphs if compiled else None
    ref, got = outputs["stock"].float(), outputs["usp"].float()
    diff = ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()
    stock, usp = statistics.median(samples["stock"]), statistics.median(samples["usp"])
    del model, inputs, outputs
    if compiled:
        torch._dynamo.reset()  # the compiled graphs hold the model's weights
    torch.cuda.empty_cache()
    return Row(name, shape, stock, usp, usp / stock, peaks["stock"], peaks["usp"], diff, params, compiled, recompiles)


def markdown(row: Row) -> str:
    shape = row.shape
    if row.compiled:
        shape += f"; compiled {row.compiled}, {row.recompiles_after_warmup} graphs after warm-up"
    return (f"| {row.model} | {shape} | {row.stock_ms:.1f} | {row.usp_ms:.1f} | {row.ratio:.3f} | "
            f"{row.stock_peak_gib:.1f} | {row.usp_peak_gib:.1f} | {row.max_rel_diff:.1e} |")


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="flux", help=f"'all' or a comma-separated list of {', '.join(CASES)}")
    p.add_argument("--backend", default="auto", help="usp_dit attention backend for the usp variant")
    p.add_argument("--warmup", type=int, default=3, help="untimed forwards per variant")
    p.add_argument("--iters", type=int, default=3, help="forwards per timed round")
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds; the median is reported")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile every case's blocks in both variants (graph breaks allowed; the flex cases "
                        "are compiled always, as benchmarks/flex_cases.COMPILE says)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    if not torch.cuda.is_available():
        print("bench_pipelines.py needs a CUDA GPU", file=sys.stderr)
        return 2
    import diffusers

    import usp_dit

    device = torch.device("cuda", torch.cuda.current_device())
    print(f"# {torch.cuda.get_device_name(device)}, torch {torch.__version__}, diffusers {diffusers.__version__}, "
          f"usp_dit {usp_dit.__version__}; bf16, batch 1, world size 1; ms per transformer forward "
          f"(median of {args.rounds} rounds x {args.iters})")
    print("| model | shape | stock ms | usp ms | usp/stock | stock peak GiB | usp peak GiB | max rel diff |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    names = list(CASES) if args.model == "all" else args.model.split(",")
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"--model: unknown {unknown}; choose from {list(CASES)}", file=sys.stderr)
        return 2
    for name in names:
        rows.append(bench(name, args, device))
        print(markdown(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=2)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:  # any failure: the traceback and a non-zero status, never a half table passing as done
        traceback.print_exc()
        sys.exit(1)
