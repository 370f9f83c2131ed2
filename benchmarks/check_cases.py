"""CPU check of ``bench_pipelines.py``'s newer cases (not part of the test suite; ~2-3 minutes).

    PYTHONPATH=. python3 benchmarks/check_cases.py              # every family below
    PYTHONPATH=. python3 benchmarks/check_cases.py ltx2,flux3   # some

For each family: (1) the case's own code at a tiny scale (a tiny config through its ``config``
argument, small sizes), float32 on CPU, every weight perturbed: the stock forward, then the same
model after ``usp_dit.enable_usp`` at world size 1, must agree (max |diff| / max |stock| below
1e-5: the same maths, float32 rounding only); ``disable_usp`` afterwards. (2) the released config
built on the meta device: its parameter count, beside the published size where one is known.

The flex cases (``flex_cases.COMPILE``: compiled on the GPU) are checked twice. Eagerly, with
flex as a GPU's compiled kernel computes it (the NABLA cases: ``usp_dit.testing.flex``, the
BlockMask's blocks honoured, Note [flex on CPU ignores a BlockMask's blocks]; Wan-Animate-2: eager
flex is exact for its mask_mod BlockMask, built uncompiled here: ``eager_block_masks``). Then in
``bench_pipelines``' compiled mode (its own ``compile_blocks``, the case's fullgraph setting) with
``backend="aot_eager"``: inductor's CPU flex template fails to lower these calls (torch 2.13), so
what runs is Dynamo's and AOTAutograd's trace of both variants, the same graphs the GPU's inductor
gets, over eager kernels. Stock, usp, stock, usp: compiled stock must equal eager stock and
compiled usp compiled stock (1e-5); the graphs compiled in the second cycle (after a switch) are
printed (the GPU run's "graphs after warm-up" should match).

Layout: a case returns ``(model, inputs, shape)`` (``pipeline_cases``); inputs are built bf16 there
(the benchmark's dtype) and cast to float32 here, recursively through lists and tuples.
"""
from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable

import torch

try:
    import bench_pipelines  # run as benchmarks/check_cases.py: this folder is on sys.path
    import flex_cases as fc
    import pipeline_cases as pc
except ImportError:
    from benchmarks import bench_pipelines
    from benchmarks import flex_cases as fc
    from benchmarks import pipeline_cases as pc

import usp_dit
from usp_dit.demo.tiny_video import _perturb
from usp_dit.demo.tiny_wan_animate2 import eager_block_masks
from usp_dit.testing.flex import honoured_flex

TOLERANCE = 1e-5  # float32, the same computation in both variants at world size 1

# name -> (case, tiny config overrides, tiny sizes, diffusers class name, released config, published size)
FAMILIES: dict[str, tuple[Callable, dict, dict, str, dict, str]] = {
    "qwen_image21": (
        pc.qwen_image21_case,
        dict(in_channels=8, out_channels=8, num_layers=2, attention_head_dim=16, num_attention_heads=4,
             context_in_dim=32, axes_dims_rope=(4, 6, 6)),
        dict(height=128, width=96, text_len=7), "QwenImage21Transformer2DModel", pc.QWEN_IMAGE21, "not published",
    ),
    "bria_fibo2": (
        pc.bria_fibo2_case,
        dict(in_channels=4, dim=64, n_layers=2, n_refiner_layers=1, n_heads=4, cap_feat_dim=32,
             injection_layer_ids=(1,), perceiver_num_layers=1, min_num_gist_tokens=3, max_num_gist_tokens=9,
             gist_step=3, gist_min_text_len=2, gist_max_text_len=12, axes_dims=(4, 6, 6), axes_lens=(32, 16, 16)),
        dict(height=80, width=112, text_len=7), "BriaFibo2Transformer2DModel", {}, "not found",
    ),
    "flux3": (
        pc.flux3_case,
        dict(in_channels=8, cond_in_channels=8, num_layers=1, num_single_layers=2, attention_head_dim=16,
             num_attention_heads=4, joint_attention_dim=32, timestep_channels=32, axes_dims_rope=(4, 4, 4, 4)),
        dict(height=96, width=112, text_len=10), "Flux3Transformer2DModel", pc.FLUX3, "not found",
    ),
    "sana_wm": (
        pc.sana_wm_case,
        dict(in_channels=4, num_layers=2, hidden_size=64, num_attention_heads=2, softmax_every_n=2,
             linear_head_dim=16, chunk_plucker_channels=6, chunk_plucker_post_attn_blocks=-1, caption_channels=32,
             mlp_ratio=2.0, image_size=64),
        dict(frames=17, height=96, width=160, text_len=9, valid=5), "SanaWMTransformer3DModel", {},
        "1.6 B (SANA-WM 1600M)",
    ),
    "ltx2": (
        pc.ltx2_case,
        dict(in_channels=4, out_channels=4, num_attention_heads=4, attention_head_dim=16, cross_attention_dim=64,
             audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=4, audio_attention_head_dim=8,
             audio_cross_attention_dim=32, num_layers=2, caption_channels=32),
        dict(frames=17, height=96, width=160, text_len=9), "LTX2VideoTransformer3DModel", pc.LTX2,
        "19 B (LTX-2 model card: 14 B video + 5 B audio)",
    ),
    "kandinsky5": (
        pc.kandinsky5_case,
        dict(in_visual_dim=4, out_visual_dim=4, in_text_dim=32, in_text_dim2=32, time_dim=32, model_dim=64,
             ff_dim=96, num_visual_blocks=2, axes_dims=(4, 6, 6)),
        dict(frames=9, height=48, width=80, text_len=7), "Kandinsky5Transformer3DModel", pc.KANDINSKY5_LITE,
        "2 B (Kandinsky 5.0 T2V Lite)",
    ),
    "chronoedit": (
        pc.chronoedit_case,
        dict(num_attention_heads=4, attention_head_dim=16, in_channels=12, out_channels=4, text_dim=32, freq_dim=16,
             ffn_dim=96, num_layers=2, image_dim=24, added_kv_proj_dim=64, rope_max_seq_len=32,
             rope_temporal_skip_len=4),
        dict(frames=5, height=48, width=80, image_len=5), "ChronoEditTransformer3DModel", pc.CHRONOEDIT_14B,
        "14 B (ChronoEdit-14B)",
    ),
    "anyflow": (
        pc.anyflow_case,
        dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32, freq_dim=16,
             ffn_dim=96, num_layers=2, rope_max_seq_len=32),
        dict(frames=9, height=48, width=80, text_len=7), "AnyFlowTransformer3DModel", {},
        "14 B (AnyFlow-Wan2.1-T2V-14B: Wan 2.1-14B's backbone)",
    ),
    "helios": (
        pc.helios_case,
        dict(num_attention_heads=4, attention_head_dim=16, in_channels=4, out_channels=4, text_dim=32, freq_dim=16,
             ffn_dim=96, num_layers=2, rope_dim=(8, 4, 4)),
        dict(height=64, width=64, chunk=3, history=(4, 2, 1)), "HeliosTransformer3DModel", pc.HELIOS,
        "14 B (Helios)",
    ),
    "cosmos3": (
        pc.cosmos3_case,
        dict(head_dim=16, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
             num_hidden_layers=2, latent_channel=4, patch_latent_dim=16, rope_axes_dim=(4, 2, 2), vocab_size=128,
             rope_theta=10000.0, rope_scaling=None, sound_dim=6, action_dim=5, num_embodiment_domains=3),
        dict(frames=9, height=96, width=160, text_len=7), "Cosmos3OmniTransformer", pc.COSMOS3_NANO,
        "not found (Cosmos 3 Nano)",
    ),
    "wan_animate": (
        pc.wan_animate_case,
        dict(num_attention_heads=4, attention_head_dim=16, latent_channels=4, in_channels=12, out_channels=4,
             text_dim=32, freq_dim=16, ffn_dim=96, num_layers=2, image_dim=24, added_kv_proj_dim=64,
             rope_max_seq_len=32, motion_encoder_channel_sizes={"16": 8, "8": 8, "4": 8}, motion_encoder_size=16,
             motion_style_dim=16, motion_dim=4, motion_encoder_dim=16, face_encoder_hidden_dim=16,
             face_encoder_num_heads=2, inject_face_latents_blocks=1, motion_encoder_batch_size=4),
        dict(segment_frames=9, height=48, width=80, image_len=5), "WanAnimateTransformer3DModel",
        pc.WAN_ANIMATE_14B, "14 B (Wan2.2-Animate-14B)",
    ),
    "minimax_h3": (
        pc.minimax_h3_case,
        dict(num_attention_heads=4, attention_head_dim=16, hidden_size=48, num_layers=2, num_refiner_layers=1,
             ffn_dim=96, in_channels=4, audio_in_channels=6, text_dim=24, freq_dim=16, time_embed_hidden_dim=32,
             time_embed_dim=24, rope_freq_dim=2),
        dict(height=64, width=64, text_len=7), "MiniMaxH3Transformer3DModel", pc.MINIMAX_H3,
        "33 B (66 GB of bf16 shards)",
    ),
    # ---- the flex cases (flex_cases.COMPILE), checked eagerly and compiled ----
    # NABLA: P 0.3 and a 1 x 1 x 1 STA window, so that the tiny mask drops blocks (the release's window
    # covers every block of a 6-block grid); 3 x 8 x 16 = 384 tokens, six 64-token blocks.
    "kandinsky5_nabla": (
        fc.kandinsky5_nabla_case,
        dict(in_visual_dim=4, out_visual_dim=4, in_text_dim=32, in_text_dim2=32, time_dim=32, model_dim=64,
             ff_dim=96, num_visual_blocks=2, axes_dims=(4, 6, 6), attention_P=0.3, attention_wT=1, attention_wH=1,
             attention_wW=1),
        dict(frames=9, height=128, width=256, text_len=7), "Kandinsky5Transformer3DModel", fc.KANDINSKY5_LITE_10S,
        "2 B (Kandinsky 5.0 T2V Lite)",
    ),
    "kandinsky5_nabla_pro": (
        fc.kandinsky5_nabla_pro_case,
        dict(in_visual_dim=4, out_visual_dim=4, in_text_dim=32, in_text_dim2=32, time_dim=32, model_dim=64,
             ff_dim=96, num_text_blocks=2, num_visual_blocks=2, axes_dims=(4, 6, 6), attention_P=0.3,
             attention_wT=1, attention_wH=1, attention_wW=1),
        dict(frames=9, height=128, width=256, text_len=7), "Kandinsky5Transformer3DModel", fc.KANDINSKY5_PRO_10S,
        "19 B (Kandinsky 5.0 Video Pro)",
    ),
    "kandinsky6_sr": (
        fc.kandinsky6_sr_case,
        dict(in_visual_dim=4, out_visual_dim=4, time_dim=32, model_dim=64, ff_dim=96, num_visual_blocks=2,
             axes_dims=(4, 6, 6), nabla_threshold=0.5, nabla_window=(1, 1, 1)),
        dict(frames=9, height=128, width=256), "Kandinsky6SRTransformer3DModel", fc.KANDINSKY6_SR, "not found",
    ),
    "wan_animate2": (
        fc.wan_animate2_case,
        dict(patch_size=(1, 2, 2), text_len=16, in_dim=12, dim=64, ffn_dim=96, freq_dim=16, text_dim=32, out_dim=4,
             num_heads=4, num_layers=2),
        dict(segment_frames=9, height=64, width=96, text_len=7, image_len=5), "WanAnimate2Transformer3DModel",
        fc.WAN_ANIMATE2, "not found (Wan 14B backbone)",
    ),
}
NABLA = ("kandinsky5_nabla", "kandinsky5_nabla_pro", "kandinsky6_sr")


def flex_as_on_gpu(name: str) -> contextlib.AbstractContextManager:
    """What a flex case needs on CPU to compute what the GPU's compiled flex does (module docstring)."""
    if name in NABLA:
        return honoured_flex()
    if name == "wan_animate2":
        return eager_block_masks()
    return contextlib.nullcontext()


def build_tiny(cls, config: dict, device: torch.device) -> torch.nn.Module:
    """``cls(**config)`` in float32, every parameter perturbed (no default-init zero hides a term)."""
    torch.manual_seed(0)
    model = cls(**config)
    _perturb(model, 1)
    return model.to(device).eval()


def as_float32(value):
    if torch.is_tensor(value):
        return value.float() if value.is_floating_point() and value.dtype != torch.float64 else value
    if isinstance(value, (list, tuple)):
        return type(value)(as_float32(v) for v in value)
    return value


def first_output(out) -> torch.Tensor:
    """Every tensor of the first ``return_dict=False`` element (or of all elements when the model
    returns several streams: LTX-2, MiniMax-H3, Cosmos 3), flattened into one vector."""
    parts = out if isinstance(out, (list, tuple)) else [out]
    flat = []
    for part in parts:
        if part is None:
            continue
        for t in (part if isinstance(part, (list, tuple)) else [part]):
            if torch.is_tensor(t):
                flat.append(t.flatten())
    return torch.cat(flat)


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()


def check_tiny(name: str) -> float:
    case, tiny, sizes, *_ = FAMILIES[name]
    with flex_as_on_gpu(name):
        model, inputs, shape = case(build_tiny, torch.device("cpu"), config=tiny, **sizes)
        inputs = {k: as_float32(v) for k, v in inputs.items()}
        with torch.inference_mode():
            ref = first_output(model(**inputs))
            usp_dit.enable_usp(model)
            got = first_output(model(**inputs))
            usp_dit.disable_usp(model)
        diff = rel(got, ref)
        print(f"{name}: tiny {shape}: {ref.numel()} outputs, stock vs enable_usp max rel diff {diff:.1e}")
        if name in fc.COMPILE:
            diff = max(diff, check_compiled(name, model, inputs, ref))
    return diff


def check_compiled(name: str, model: torch.nn.Module, inputs: dict, eager_stock: torch.Tensor) -> float:
    """``bench_pipelines``' compiled mode at tiny scale (module docstring): the worst of compiled
    stock vs eager stock and compiled usp vs compiled stock, over two switch cycles."""
    torch._dynamo.reset()
    fc.pin_flex_tiles()  # as bench_pipelines runs these cases: the wrapper traced too
    how = bench_pipelines.compile_blocks(model, fc.COMPILE[name], backend="aot_eager")
    outs: dict[tuple[str, int], torch.Tensor] = {}
    start = bench_pipelines._graphs_compiled()  # a process-wide counter: the graphs before this check
    with torch.inference_mode():
        for cycle in range(2):
            if cycle == 1:
                graphs = bench_pipelines._graphs_compiled()
            for variant in ("stock", "usp"):
                bench_pipelines.set_variant(model, variant, "auto")
                outs[variant, cycle] = first_output(model(**inputs))
        bench_pipelines.set_variant(model, "stock", "auto")
    after = bench_pipelines._graphs_compiled() - graphs
    diff = max(max(rel(outs["stock", c], eager_stock), rel(outs["usp", c], outs["stock", c])) for c in (0, 1))
    print(f"  compiled {how} (aot_eager): stock vs eager stock and usp vs stock, max rel diff {diff:.1e}; "
          f"{graphs - start} graphs compiled in the first switch cycle, {after} in the second")
    torch._dynamo.reset()
    return diff


def released_params(name: str) -> float:
    import diffusers
    from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer

    *_, cls_name, config, published = FAMILIES[name]
    cls = Cosmos3OmniTransformer if cls_name == "Cosmos3OmniTransformer" else getattr(diffusers, cls_name)
    with torch.device("meta"):
        model = cls(**config)
    params = sum(p.numel() for p in model.parameters()) / 1e9
    print(f"{name}: released config {cls_name}: {params:.2f} B parameters (published: {published})")
    return params


def main() -> int:
    names = list(FAMILIES) if len(sys.argv) < 2 else sys.argv[1].split(",")
    failed = []
    for name in names:
        start = time.perf_counter()
        diff = check_tiny(name)
        released_params(name)
        print(f"  ({time.perf_counter() - start:.1f} s)", flush=True)
        if not diff <= TOLERANCE:
            failed.append(name)
    if failed:
        print(f"FAILED (max rel diff above {TOLERANCE}): {failed}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
