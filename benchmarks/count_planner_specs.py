"""Count what the planner's model specs hold (``usp_dit.planner.models`` Note [model memory]) from a
released transformer config built on the meta device: nothing is allocated, ~0.1 s a family.

    PYTHONPATH=. python -m benchmarks.count_planner_specs               # every family below
    PYTHONPATH=. python -m benchmarks.count_planner_specs ltx2,sana     # some
    PYTHONPATH=. python -m benchmarks.count_planner_specs --components  # encoders, held modules, VAEs

Layout: no tensors; prints, per family, the parameter count and the ``_counted(...)`` call of
``usp_dit/planner/models.py`` that holds its block lists (the family plan's ``block_lists``: count,
parameters, the largest block, widths, float32 parameters as ``from_pretrained(torch_dtype=bf16)``
leaves them), the rest (outer children, the root's own parameters) and, where the family plan
declares tensor-parallel cuts, each list's ``BlockCut`` (``tensor_cuts_of``). The configs are
``RELEASED`` below (the released or assumed configs of ``pipeline_cases``, with their sources there);
tests/test_planner_memory.py builds the same ones and checks the planner's figures against them.
``--components`` prints the ``ENCODERS`` / ``OTHERS`` / ``VAES`` figures of the text encoders, the
modules held beside them and the VAEs of ``benchmarks.planner_components`` (their released configs
and sources there).
"""
from __future__ import annotations

import sys

import torch

from benchmarks import pipeline_cases as pc

# spec name -> (the Diffusers transformer class, its released config as the benchmark cases build it).
RELEASED: dict[str, tuple[str, dict]] = {
    "ltx2": ("LTX2VideoTransformer3DModel", pc.LTX2),
    "wan_vace": ("WanVACETransformer3DModel", dict(pc.WAN_14B, vace_in_channels=96)),
    "wan_animate": ("WanAnimateTransformer3DModel", pc.WAN_ANIMATE_14B),
    "chronoedit": ("ChronoEditTransformer3DModel", pc.CHRONOEDIT_14B),
    "helios": ("HeliosTransformer3DModel", pc.HELIOS),
    "cosmos3": ("Cosmos3OmniTransformer", pc.COSMOS3_NANO),
    "minimax_h3": ("MiniMaxH3Transformer3DModel", pc.MINIMAX_H3),
    "kandinsky5": ("Kandinsky5Transformer3DModel", pc.KANDINSKY5_LITE),
    "qwen_image21": ("QwenImage21Transformer2DModel", pc.QWEN_IMAGE21),
    "flux3": ("Flux3Transformer2DModel", pc.FLUX3),
    "zimage": ("ZImageTransformer2DModel", {}),
    "hunyuan_image": ("HunyuanImageTransformer2DModel", {"text_embed_2_dim": 1472}),
    "hidream": ("HiDreamImageTransformer2DModel", pc.HIDREAM_I1),
    "cogview4": ("CogView4Transformer2DModel", pc.COGVIEW4_6B),
    "lumina2": ("Lumina2Transformer2DModel", pc.LUMINA2),
    "krea2": ("Krea2Transformer2DModel", {}),
    "longcat_image": ("LongCatImageTransformer2DModel", {}),
    "ovis_image": ("OvisImageTransformer2DModel", {}),
    "sana": ("SanaTransformer2DModel", {}),
    "sana_video": ("SanaVideoTransformer3DModel", {}),
    "sana_wm": ("SanaWMTransformer3DModel", {}),
    "skyreels_v2": ("SkyReelsV2Transformer3DModel", pc.SKYREELS_DF_1_3B),
    "pixart": ("PixArtTransformer2DModel", pc.PIXART_SIGMA),
    "hunyuan_dit": ("HunyuanDiT2DModel", pc.HUNYUAN_DIT),
    "dit": ("DiTTransformer2DModel", pc.DIT_XL_2_512),
    "auraflow": ("AuraFlowTransformer2DModel", pc.AURAFLOW_V03),
    "consisid": ("ConsisIDTransformer3DModel", pc.CONSISID),
    "anyflow": ("AnyFlowTransformer3DModel", {}),
    "ernie_image": ("ErnieImageTransformer2DModel", {}),
    "glm_image": ("GlmImageTransformer2DModel", {}),
    "ideogram4": ("Ideogram4Transformer2DModel", {}),
    "bria_fibo2": ("BriaFibo2Transformer2DModel", {}),
    "prx": ("PRXTransformer2DModel", {}),
    "lumina_next": ("LuminaNextDiT2DModel", pc.LUMINA_NEXT),
    "joyimage": ("JoyImageEditTransformer3DModel", {}),
    "joyimage_plus": ("JoyImageEditPlusTransformer3DModel", {}),
    # The audio DiTs: Diffusers' defaults, written for these releases (usp_dit.planner.models Note
    # [audio specs] says which were confirmed): Stable Audio Open 1.0, Stable Audio 3 Medium,
    # ACE-Step 1.5 (2 B), LongCat-AudioDiT 1B, MiniMax Music 3's 2.4 B flow-matching DiT.
    "stable_audio": ("StableAudioDiTModel", {}),
    "stable_audio3": ("StableAudio3DiTModel", {}),
    "ace_step": ("AceStepTransformer1DModel", {}),
    "longcat_audio_dit": ("LongCatAudioDiTTransformer", {}),
    "minimax_music3": ("MiniMaxMusic3Transformer1DModel", {}),
}


def transformer_class(name: str) -> type:
    import diffusers

    cls_name = RELEASED[name][0]
    if hasattr(diffusers, cls_name):
        return getattr(diffusers, cls_name)
    from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer

    assert cls_name == "Cosmos3OmniTransformer", cls_name
    return Cosmos3OmniTransformer


def as_loaded(model: torch.nn.Module, keep: list[str] | None) -> torch.nn.Module:
    """``model`` as ``from_pretrained(torch_dtype=torch.bfloat16)`` leaves it: bf16, parameters
    whose dotted name has a part in ``keep`` (Diffusers' ``_keep_in_fp32_modules``) float32."""
    model.to(torch.bfloat16)
    for name, param in model.named_parameters():
        if any(part in (keep or ()) for part in name.split(".")):
            param.data = param.data.float()
    return model


def meta_transformer(name: str) -> torch.nn.Module:
    """The released transformer ``name`` on the meta device, as loaded in bf16."""
    cls = transformer_class(name)
    with torch.device("meta"):
        return as_loaded(cls(**RELEASED[name][1]), cls._keep_in_fp32_modules)


def _fp32(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.dtype == torch.float32)


def widths(block: torch.nn.Module, single: bool) -> tuple[int, int, bool, str]:
    """(d, m, gated, kind) of a block from its Linears (tests/test_planner_memory.py ``_check_widths``
    reads them back the same way): the MLP's down projection is the Linear taking the most inputs."""
    linears = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
    down = max(linears, key=lambda m: m.in_features)
    d = down.out_features
    makes = {lin.out_features for lin in linears}
    if single and down.in_features > d:
        m = down.in_features - d
        kind = "fused" if (3 * d + m in makes or 3 * d + 2 * m in makes) else "parallel"
    else:
        m, kind = down.in_features, "sequential"
    return d, m, (2 * m in makes) or (3 * d + 2 * m in makes), kind


def count(name: str) -> str:
    """The ``_counted(...)`` call of ``usp_dit/planner/models.py`` for the released ``name``."""
    import usp_dit.pipelines  # noqa: F401  (registers the families)
    from usp_dit.pipelines.base import registered_adapters
    from usp_dit.planner.models import _count, tensor_cuts_of

    model = meta_transformer(name)
    plan = next(a.plan for a in registered_adapters()
                if getattr(a, "plan", None) is not None and a.plan.model_class is type(model))
    cuts = tensor_cuts_of(model, plan.tensor) if plan.tensor is not None else {}
    params, _ = _count(model)
    groups, in_lists = [], 0
    for list_name in plan.block_lists:
        blocks = list(getattr(model, list_name))
        counted = [(_count(b)[0], _fp32(b)) for b in blocks]
        largest = max(counted)
        d, m, gated, kind = widths(blocks[0], "single" in list_name)
        total, fp32 = sum(c[0] for c in counted), sum(c[1] for c in counted)
        in_lists += total
        extra = (", gated=True" if gated else "") + (f", kind={kind!r}" if kind != "sequential" else "")
        extra += f", fp32={fp32}, largest_fp32={largest[1]}" if fp32 else ""
        if list_name in cuts:
            c = cuts[list_name]
            extra += f", cut=_cut({c.head_params}, {c.width_params}, reduces={c.reduces}, collectives={c.collectives})"
        groups.append(f'_group("{list_name}", {len(blocks)}, {total}, {largest[0]}, {d}, {m}{extra})')
    lists = set(plan.block_lists)
    outer = [(_count(c)[1], _fp32(c)) for n, c in model.named_children() if n not in lists]
    outer_fp32 = sum(_fp32(c) for n, c in model.named_children() if n not in lists)
    root = list(model.parameters(recurse=False))
    root_params, root_fp32 = sum(p.numel() for p in root), sum(p.numel() for p in root if p.dtype == torch.float32)
    largest_outer = max(outer, default=(0, 0))
    return (f"# {name}: {params} parameters ({type(model).__name__}); python -m benchmarks.count_planner_specs {name}\n"
            f"_counted(({', '.join(groups)},), {params - in_lists}, {outer_fp32 + root_fp32}, {largest_outer[0]}, "
            f"{root_params}, {root_fp32})")


def count_component(table: str, key: str) -> str:
    """The planner's figures of the released module ``key`` of ``table`` ("encoders", "others", "vaes")."""
    from benchmarks.planner_components import ENCODERS, OTHERS, VAE_CONFIGS, meta_component
    from usp_dit.planner.models import _count, encoder_of

    path = {"encoders": ENCODERS, "others": OTHERS, "vaes": VAE_CONFIGS}[table][key][0]
    module = meta_component(table, key)
    params, nbytes = _count(module)
    cls = path.rpartition(".")[2]
    if table == "encoders":  # _encoder(name, cls, params, layers, largest layer, rest): all bf16
        e = encoder_of(module)
        return (f'"{key}": _encoder("...", "{cls}", {params}, {e.layers}, {e.largest_layer_bytes // 2}, '
                f'{e.rest_bytes // 2}),')
    if table == "others":
        return f'"{key}": HeldModule("...", "{cls}", {params}, {nbytes}),'
    return f'"{key}": {cls}: {params} parameters, {nbytes} bytes'


def main(argv: list[str]) -> int:
    if argv and argv[0] == "--components":
        from benchmarks.planner_components import ENCODERS, OTHERS, VAE_CONFIGS

        wanted = set(argv[1].split(",")) if len(argv) > 1 else None
        for table, keys in (("encoders", ENCODERS), ("others", OTHERS), ("vaes", VAE_CONFIGS)):
            for key in keys:
                if wanted is None or key in wanted:
                    print(count_component(table, key))
        return 0
    names = argv[0].split(",") if argv else list(RELEASED)
    for name in names:
        print(count(name))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
