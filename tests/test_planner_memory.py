"""The planner's memory per rank (usp_dit.planner.memory, Note [memory per rank]): its counts
checked against the released models instantiated on the meta device, and the fit filter.

No processes, no downloads: every model is built from its released config (Diffusers' default
config, or the release's values written here) on ``torch.device("meta")``, so nothing is
allocated; parameters are cast as ``from_pretrained(torch_dtype=torch.bfloat16)`` leaves them
(Diffusers keeps ``_keep_in_fp32_modules`` in float32; transformers keeps float32 modules only for
float16 loads) and counted once each (numel x element size, tied parameters once).

What is checked:
- every spec's transformer: block lists (names: the family plan's ``block_lists``; count, all
  parameters, the largest block), the rest, the largest outer unit, the root's own parameters, the
  total, bytes by dtype, and the widths the activations are counted from (hidden, MLP, gated):
  equal to the counted ones within 0.5 %;
- every text encoder and VAE: parameters, layers, largest layer, the rest; each spec's encoders
  and VAE are the classes its Diffusers pipeline takes (its ``__init__`` signature);
- a pipeline object (meta modules: Flux.2-dev, Wan 2.2 A14B with both experts) is counted to the
  same memory as the release's spec;
- the activation count against the world-1 peaks measured on an H200 (never under them);
- the fit filter: a small gpu_memory_gib forces sharded weights (and a sharded text encoder), a
  tiny one raises ValueError naming the smallest that works, explain() says which placement and
  why, the 24 GiB plans of Flux.2-dev and Wan 2.2 A14B on 8 GPUs exist; bad input is named;
- the memory table in docs/PERFORMANCE.md is what ``python -m usp_dit.planner --memory-table``
  prints.
"""
from __future__ import annotations

import functools
import inspect
import math
import re
import typing
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from benchmarks import planner_components as components
from benchmarks.count_planner_specs import RELEASED, transformer_class
from usp_dit.planner import memory as memory_model
from usp_dit.planner.cost import Grid, predict
from usp_dit.planner.hardware import LINKS, check_gpu
from usp_dit.planner.models import ENCODERS, OTHERS, SPECS, VAE_ESTIMATES, VAES, spec_for
from usp_dit.planner.plan import main, memory_table, plan

TOLERANCE = 0.005  # the brief's 0.5 %; the figures are exact counts, so this is a bound on typos
GIB = 2**30

# Released transformer configs: Diffusers 0.42.1's defaults are the releases' except where given.
TRANSFORMERS = {
    "flux": ("FluxTransformer2DModel", {"guidance_embeds": True}),  # Flux.1-dev
    "flux2": ("Flux2Transformer2DModel", {}),  # Flux.2-dev
    "sd35": ("SD3Transformer2DModel", {  # SD3.5 Large
        "sample_size": 128, "patch_size": 2, "in_channels": 16, "num_layers": 38, "attention_head_dim": 64,
        "num_attention_heads": 38,
        "joint_attention_dim": 4096, "caption_projection_dim": 2432, "pooled_projection_dim": 2048, "out_channels": 16,
        "pos_embed_max_size": 192, "qk_norm": "rms_norm"}),
    "qwen_image": ("QwenImageTransformer2DModel", {}),
    "cogvideox": ("CogVideoXTransformer3DModel", {  # CogVideoX-5B
        "num_attention_heads": 48, "attention_head_dim": 64, "num_layers": 42,
        "use_rotary_positional_embeddings": True}),
    "mochi": ("MochiTransformer3DModel", {}),
    "wan": ("WanTransformer3DModel", {}),  # Wan 2.1-14B T2V; each Wan 2.2 A14B expert the same
    "wan22": ("WanTransformer3DModel", {}),
    "hunyuan_video": ("HunyuanVideoTransformer3DModel", {}),
    "hunyuan_video15": ("HunyuanVideo15Transformer3DModel", {}),
    "kandinsky6": ("Kandinsky6Transformer3DModel", {}),
    "ltx_video": ("LTXVideoTransformer3DModel", {}),
    # The later families: the configs benchmarks/count_planner_specs.py counted them from.
    **{name: (cls, dict(config)) for name, (cls, config) in RELEASED.items()},
}
PIPELINES = {
    "flux": "FluxPipeline", "flux2": "Flux2Pipeline", "sd35": "StableDiffusion3Pipeline",
    "qwen_image": "QwenImagePipeline", "cogvideox": "CogVideoXPipeline", "mochi": "MochiPipeline",
    "wan": "WanPipeline", "wan22": "WanPipeline", "hunyuan_video": "HunyuanVideoPipeline",
    "hunyuan_video15": "HunyuanVideo15Pipeline", "kandinsky6": "Kandinsky6TI2VAPipeline", "ltx_video": "LTXPipeline",
    "ltx2": "LTX2Pipeline", "wan_vace": "WanVACEPipeline", "wan_animate": "WanAnimatePipeline",
    "chronoedit": "ChronoEditPipeline", "helios": "HeliosPipeline", "cosmos3": "Cosmos3OmniPipeline",
    "kandinsky5": "Kandinsky5T2VPipeline", "qwen_image21": "QwenImage21Pipeline", "zimage": "ZImagePipeline",
    "hunyuan_image": "HunyuanImagePipeline", "hidream": "HiDreamImagePipeline", "cogview4": "CogView4Pipeline",
    "lumina2": "Lumina2Pipeline", "krea2": "Krea2Pipeline", "longcat_image": "LongCatImagePipeline",
    "ovis_image": "OvisImagePipeline", "sana": "SanaPipeline", "sana_video": "SanaVideoPipeline",
    "sana_wm": "SanaWMPipeline",
    "skyreels_v2": "SkyReelsV2DiffusionForcingPipeline", "anyflow": "AnyFlowPipeline", "consisid": "ConsisIDPipeline",
    "pixart": "PixArtSigmaPipeline", "hunyuan_dit": "HunyuanDiTPipeline", "dit": "DiTPipeline",
    "auraflow": "AuraFlowPipeline", "ernie_image": "ErnieImagePipeline", "glm_image": "GlmImagePipeline",
    "ideogram4": "Ideogram4Pipeline", "bria_fibo2": "BriaFibo2Pipeline", "prx": "PRXPipeline",
    "lumina_next": "LuminaPipeline", "joyimage": "JoyImageEditPipeline", "joyimage_plus": "JoyImageEditPlusPipeline",
    "stable_audio": "StableAudioPipeline", "stable_audio3": "StableAudio3Pipeline", "ace_step": "AceStepPipeline",
    "longcat_audio_dit": "LongCatAudioDiTPipeline",
}
# Modular pipelines only: the classes of their blocks' ComponentSpecs (text encoder, VAE, held modules).
MODULAR = {
    "minimax_h3": ("modular_pipelines.minimax_h3", ["Qwen3VLForConditionalGeneration"], "AutoencoderKLMiniMaxH3",
                   ["AutoencoderKLMiniMaxH3Audio"]),
    "flux3": ("modular_pipelines.flux3", ["Qwen3VLForConditionalGeneration"], "AutoencoderKLFlux2", []),
    "minimax_music3": ("modular_pipelines.minimax_music3", [], "MiniMaxMusic3Vocoder",
                       ["Qwen3ForCausalLM", "MiniMaxMusic3RVQDepthDecoder", "MiniMaxMusic3ConditionEncoder"]),
}
# The pipelines' components held beside the text encoders (``ModelMemory.others``), by attribute.
HELD = ("image_encoder", "connectors", "audio_vae", "vocoder", "projection_model", "duration_embedder",
        "condition_encoder", "vision_language_encoder", "sound_tokenizer")


def _encoder_configs() -> dict:
    """The released text encoders' configs (hidden, layers, heads, KV heads, intermediate, vocab)."""
    from transformers import (
        CLIPTextConfig,
        Gemma2Config,
        LlamaConfig,
        Mistral3Config,
        Qwen2_5_VLConfig,
        T5Config,
        UMT5Config,
    )
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLTextConfig

    t5 = {"d_ff": 10240, "num_layers": 24, "num_heads": 64, "d_kv": 64, "feed_forward_proj": "gated-gelu",
              "tie_word_embeddings": False, "d_model": 4096}
    clip_l = CLIPTextConfig(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                            vocab_size=49408, max_position_embeddings=77, projection_dim=768)
    qwen_text = {"hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28, "num_key_value_heads": 4,
                     "intermediate_size": 18944, "vocab_size": 152064}
    qwen_vision = {"depth": 32, "hidden_size": 1280, "num_heads": 16, "intermediate_size": 3420,
                   "out_hidden_size": 3584,
                       "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
    return {
        "t5_xxl": T5Config(vocab_size=32128, **t5),
        "umt5_xxl": UMT5Config(vocab_size=256384, **t5),
        "byt5_small": T5Config(d_model=1472, d_ff=3584, num_layers=12, num_decoder_layers=4, num_heads=6, d_kv=64,
                               vocab_size=384, feed_forward_proj="gated-gelu", tie_word_embeddings=False),
        "clip_l": clip_l,
        "clip_l_proj": clip_l,
        "clip_g_proj": CLIPTextConfig(hidden_size=1280, num_hidden_layers=32, num_attention_heads=20,
                                      intermediate_size=5120, vocab_size=49408, max_position_embeddings=77,
                                      projection_dim=1280),
        "llama3_8b": LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                                 intermediate_size=14336, vocab_size=128320),
        "qwen25_vl_7b": Qwen2_5_VLConfig(text_config=qwen_text, vision_config=qwen_vision, tie_word_embeddings=False),
        "qwen25_vl_7b_text": Qwen2_5_VLTextConfig(**qwen_text),
        "mistral_small_31": Mistral3Config(
            text_config={"model_type": "mistral", "hidden_size": 5120, "intermediate_size": 32768,
                         "num_hidden_layers": 40, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                         "vocab_size": 131072},
            vision_config={"model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096,
                           "num_hidden_layers": 24, "num_attention_heads": 16, "head_dim": 64, "image_size": 1540,
                           "patch_size": 14, "num_channels": 3},
            projector_hidden_act="gelu", spatial_merge_size=2, multimodal_projector_bias=False,
            tie_word_embeddings=False),
        "gemma2_2b": Gemma2Config(vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
                                  num_attention_heads=8, num_key_value_heads=4, head_dim=256),
        "llama31_8b_lm": LlamaConfig(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                                     num_key_value_heads=8, intermediate_size=14336, vocab_size=128256,
                                     tie_word_embeddings=False),
    }


def _as_loaded(model: torch.nn.Module, keep: list[str] | None) -> torch.nn.Module:
    """``model`` as ``from_pretrained(torch_dtype=torch.bfloat16)`` leaves it: bf16, parameters
    whose dotted name has a part in ``keep`` (Diffusers' ``_keep_in_fp32_modules``) float32."""
    model.to(torch.bfloat16)
    for name, param in model.named_parameters():
        if any(part in (keep or ()) for part in name.split(".")):
            param.data = param.data.float()
    return model


def _counted(module: torch.nn.Module) -> tuple[int, int]:
    """(parameters, bytes): each unique parameter once, numel x element size."""
    seen, params, nbytes = set(), 0, 0
    for p in module.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            params, nbytes = params + p.numel(), nbytes + p.numel() * p.element_size()
    return params, nbytes


@functools.cache  # built once a session (tests/test_planner.py counts them too); nothing mutates them
def _meta_transformer(model: str) -> torch.nn.Module:
    import diffusers

    cls_name, kwargs = TRANSFORMERS[model]
    cls = transformer_class(model) if model in RELEASED else getattr(diffusers, cls_name)
    with torch.device("meta"):
        return _as_loaded(cls(**kwargs), cls._keep_in_fp32_modules)


def _meta_encoder(key: str) -> torch.nn.Module:
    import transformers
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLTextModel

    if key in components.ENCODERS:  # the later families': their configs and sources there
        return components.meta_component("encoders", key)
    cls_name = ENCODERS[key].cls
    cls = Qwen2_5_VLTextModel if cls_name == "Qwen2_5_VLTextModel" else getattr(transformers, cls_name)
    with torch.device("meta"):
        return _as_loaded(cls(_encoder_configs()[key]), None)


def _meta_vae(model: str) -> torch.nn.Module:
    import diffusers

    from benchmarks.bench_vae import FLUX_VAE  # Flux.1's AutoencoderKL config (SD3's is the same)

    vae = spec_for(model).memory.vae
    key = next(k for k, v in VAES.items() if v is vae)
    if key in components.VAE_CONFIGS:  # the later families': their configs and sources there
        return components.meta_component("vaes", key)
    with torch.device("meta"):
        return getattr(diffusers, vae.name)(**(FLUX_VAE if vae.name == "AutoencoderKL" else {})).to(torch.bfloat16)


def _close(planned: float, counted: float) -> bool:
    return abs(planned - counted) <= TOLERANCE * max(abs(counted), 1)


@pytest.mark.parametrize("model", sorted(SPECS))
def test_transformer_counts_are_the_released_models(model):
    spec = spec_for(model)
    mem = spec.memory
    transformer = _meta_transformer(model)
    params, nbytes = _counted(transformer)
    assert _close(mem.transformer_params, params) and _close(mem.transformer_bytes, mem.experts * nbytes)
    for group in mem.blocks:
        blocks = getattr(transformer, group.name)
        counted = [_counted(b) for b in blocks]
        assert group.count == len(blocks)
        assert _close(group.params, sum(c[0] for c in counted)) and _close(group.nbytes, sum(c[1] for c in counted))
        assert _close(group.largest_params, max(c[0] for c in counted))
        assert _close(group.largest_bytes, max(c[1] for c in counted))
        _check_widths(group, blocks[0])
    lists = {g.name for g in mem.blocks}
    outer = [_counted(c) for n, c in transformer.named_children() if n not in lists]
    root = sum(p.numel() * p.element_size() for p in transformer.parameters(recurse=False))
    assert _close(mem.outer_params, params - sum(g.params for g in mem.blocks))
    assert _close(mem.largest_outer_bytes, max(b for _, b in outer)) and mem.root_bytes == root
    assert mem.experts == (2 if model in ("wan22", "ideogram4") else 1)  # Ideogram 4: its unconditional_transformer


def _check_widths(group, block: torch.nn.Module) -> None:
    """The widths the activations are counted from are the block's own: the MLP's down projection
    (the Linear taking the most inputs) maps m (parallel blocks: d + m) to d; a gated MLP's first
    projection makes 2m (fused: 3d + 2m), an ungated one makes no 2m."""
    linears = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
    down = max(linears, key=lambda m: m.in_features)
    d, m = group.hidden, group.mlp
    assert down.out_features == d
    assert down.in_features == m + (d if group.kind != "sequential" else 0)
    makes = {lin.out_features for lin in linears}
    assert ((2 * m in makes) or (3 * d + 2 * m in makes)) == group.gated


def test_block_lists_are_the_family_plans():
    """The sharded units the memory model counts are the ones enable_usp shards."""
    import usp_dit.pipelines  # noqa: F401  (registers every adapter)
    from usp_dit.pipelines.base import registered_adapters
    from usp_dit.planner.models import CLASSES

    lists = {getattr(a, "model_class", type(None)).__name__: a.plan.block_lists for a in registered_adapters()
             if getattr(a, "plan", None) is not None}
    for cls_name, model in CLASSES.items():
        assert tuple(g.name for g in spec_for(model).memory.blocks) == tuple(lists[cls_name]), cls_name


@pytest.mark.parametrize("key", sorted(ENCODERS))
def test_text_encoder_counts_are_the_released_models(key):
    from usp_dit.planner.models import encoder_of

    planned, encoder = ENCODERS[key], _meta_encoder(key)
    params, nbytes = _counted(encoder)
    counted = encoder_of(encoder)  # the layers as usp_dit.pipelines.encoders.layer_lists finds them
    assert _close(planned.params, params) and _close(planned.nbytes, nbytes) and nbytes == 2 * params  # all bf16
    assert planned.layers == counted.layers
    assert _close(planned.largest_layer_bytes, counted.largest_layer_bytes)
    assert _close(planned.rest_bytes, counted.rest_bytes)


def test_the_layer_rule_is_the_encoders_module():
    """The planner counts the units text_encoder="shard" makes by the one rule the encoders use."""
    from usp_dit.pipelines import encoders
    from usp_dit.planner.models import layer_lists

    assert encoders.layer_lists is layer_lists
    for key in ("t5_xxl", "qwen25_vl_7b", "mistral_small_31"):
        encoder = _meta_encoder(key)
        assert [len(x) for x in layer_lists(encoder)] and all(len(x) > 1 for x in layer_lists(encoder))


def _names(annotation) -> list[str]:
    """The class names an ``__init__`` annotation allows (a class, or a union written as a string)."""
    if isinstance(annotation, str):
        return [part.strip().split(".")[-1] for part in annotation.split("|")]
    return [a.__name__ for a in (typing.get_args(annotation) or (annotation,)) if a is not type(None)]


def _takes(encoder_cls: str, annotation) -> bool:
    """Whether a pipeline's text encoder annotation takes ``encoder_cls`` (the class or a subclass)."""
    import transformers

    cls = getattr(transformers, encoder_cls, None)
    return any(name == encoder_cls or (cls is not None and issubclass(cls, getattr(transformers, name, ())))
               for name in _names(annotation))


def _components(model: str) -> tuple[list, object, list[str]]:
    """(text encoder annotations in order, the VAE annotation, the held modules' class names) of the
    family's pipeline: its ``__init__``, or a modular pipeline's blocks' ComponentSpecs."""
    import importlib

    import diffusers

    if model in MODULAR:
        package, encoders, vae, held = MODULAR[model]
        specs = set()
        module = importlib.import_module(f"diffusers.{package}")
        for name in dir(module):  # every block class of the package: its expected components
            block = getattr(module, name)
            if isinstance(block, type) and hasattr(block, "expected_components"):
                try:
                    specs |= {getattr(c.type_hint, "__name__", "") for c in block().expected_components}
                except Exception:  # noqa: BLE001  (a block that needs arguments: its parts are listed too)
                    continue
        assert set(encoders + [vae] + held) <= specs, (model, set(encoders + [vae] + held) - specs)
        return encoders, vae, held
    signature = inspect.signature(getattr(diffusers, PIPELINES[model]).__init__).parameters
    encoders = [signature[n].annotation for n in ("text_encoder", "text_encoder_2", "text_encoder_3",
                                                  "text_encoder_4") if n in signature]
    held = [name for n in HELD if n in signature for name in _names(signature[n].annotation)]
    return encoders, signature["vae"].annotation if "vae" in signature else None, held


@pytest.mark.parametrize("model", sorted(SPECS))
def test_encoders_and_vae_are_the_pipelines_components(model):
    """Each counted encoder, VAE and held module is one the family's pipeline takes, the encoders in
    order; every text encoder is counted; what is not counted is named in ``left_out`` with why."""
    mem = spec_for(model).memory
    wanted, vae, held = _components(model)
    if model == "consisid":  # a placeholder (*args, **kwargs): an optional dependency is missing here
        wanted, vae, held = [e.cls for e in mem.encoders], None, []
    taken = iter(wanted)  # the counted encoders are a subsequence of the pipeline's
    assert all(any(_takes(e.cls, a) for a in taken) for e in mem.encoders), (model, [e.cls for e in mem.encoders])
    assert len(mem.encoders) == len(wanted), model
    assert all(m.cls in held for m in mem.others), (model, [m.cls for m in mem.others], held)
    assert mem.vae is not None, model
    if vae is not None:
        assert mem.vae.name in (_names(vae) if not isinstance(vae, str) or "|" in vae else [vae]), model
    params, nbytes = _counted(_meta_vae(model))
    assert _close(mem.vae.params, params) and _close(mem.vae.nbytes, nbytes)
    # Nothing is left out but what no meta build here can count: modules of other packages.
    assert not mem.left_out or "outside Diffusers and transformers" in mem.left_out, (model, mem.left_out)


@pytest.mark.parametrize("key", sorted(OTHERS))
def test_held_module_counts_are_the_released_models(key):
    params, nbytes = _counted(components.meta_component("others", key))
    assert _close(OTHERS[key].params, params) and _close(OTHERS[key].nbytes, nbytes)
    assert OTHERS[key].cls == components.OTHERS[key][0].rpartition(".")[2]


@pytest.mark.parametrize("key", sorted(components.VAE_CONFIGS))
def test_vae_counts_are_the_released_models(key):
    """Every VAE built from benchmarks/planner_components.py, its count and its decode's source:
    an estimate (Note [VAE estimates]) names the command that measures it."""
    params, nbytes = _counted(components.meta_component("vaes", key))
    vae = VAES[key]
    assert _close(vae.params, params) and _close(vae.nbytes, nbytes)
    assert vae.name == components.VAE_CONFIGS[key][0].rpartition(".")[2]
    assert f"python benchmarks/bench_vae.py --vae {key}" in vae.source


def test_count_planner_specs_prints_the_planners_component_figures():
    """``python -m benchmarks.count_planner_specs --components`` prints what the planner holds (one
    entry of each table: the tests above count every entry)."""
    from benchmarks.count_planner_specs import count_component

    e = ENCODERS["t5_base"]
    assert f"{e.params}, {e.layers}, {e.largest_layer_bytes // 2}, {e.rest_bytes // 2})" in \
        count_component("encoders", "t5_base")
    held = OTHERS["ltx2_vocoder"]
    assert f"{held.params}, {held.nbytes})" in count_component("others", "ltx2_vocoder")
    assert f"{VAES['sd'].params} parameters, {VAES['sd'].nbytes} bytes" in count_component("vaes", "sd")


def test_vae_estimates_follow_their_rule():
    """Note [VAE estimates] by hand: the SD VAE is Flux.1's decoder (its figures); the Wan 2.2 VAE is
    Wan 2.1's at C 64 / 96 (256 channels at half resolution) with Wan's fractions; LTX-2's has no
    parallel recipe (every rank decodes whole); an audio VAE's reference is in samples."""
    est = VAE_ESTIMATES
    assert (est["sd"].stock_peak_gib, est["sd"].fractions) == (VAES["flux"].stock_peak_gib, VAES["flux"].fractions)
    assert est["wan22"].stock_peak_gib == pytest.approx(VAES["wan"].stock_peak_gib * 64 / 96, abs=0.01)
    assert est["wan22"].fractions == VAES["wan"].fractions and est["ltx2"].fractions is None
    assert est["oobleck"].reference == (1024 * 2048, 1, 1)
    assert est["oobleck"].stock_peak_gib == pytest.approx(VAES["flux"].stock_peak_gib * 2, abs=0.01)
    assert not VAES["wan"].estimated and VAES["flux2"].estimated  # measured; an older estimate
    assert all(e.estimated for e in est.values())


@pytest.mark.parametrize("key", sorted(VAE_ESTIMATES))
def test_a_measured_vae_replaces_only_the_decodes_figures(key):
    """Where the GPU measured an estimated VAE (2026-12-06), its entry keeps the counted weights,
    the reference size and the output's size, and says where the figures came from; a parallel
    recipe's shares shrink with P."""
    vae, est = VAES[key], VAE_ESTIMATES[key]
    assert (vae.name, vae.params, vae.nbytes, vae.reference, vae.output_gib) == \
        (est.name, est.params, est.nbytes, est.reference, est.output_gib)
    if not vae.estimated:
        assert "one H100, 2026-12-06" in vae.source and vae.stock_peak_gib > 0
        assert vae.fractions is None or vae.fractions[2] > vae.fractions[4] > vae.fractions[8] > 0


def test_explain_says_a_vae_figure_is_an_estimate():
    text = plan("flux2", world_size=8, gpu_memory_gib=80).explain()
    assert "The VAE decode's memory (AutoencoderKLFlux2) is an estimate: Flux.1's VAE measured" in text
    for measured in ("wan", "cogview4"):  # cogview4's: an estimate until measured on 2026-12-06
        assert "is an estimate" not in plan(measured, world_size=8, gpu_memory_gib=80).explain()


def test_held_modules_are_on_every_rank_in_every_phase():
    """LTX-2's connectors, audio VAE and vocoder are held whole by every rank whatever the placement."""
    spec = spec_for("ltx2")
    held = sum(OTHERS[k].nbytes for k in ("ltx2_connectors", "ltx2_audio_vae", "ltx2_vocoder")) / GIB
    for shard, encoder in ((False, "replicate"), (True, "shard")):
        m = memory_model.breakdown(spec, 8, 1, 8, "none", 1, shard_weights=shard, text_encoder=encoder)
        assert m.others == pytest.approx(held)
        bare = replace(m, others=0.0)
        assert all(m.phases[p] == pytest.approx(bare.phases[p] + held) for p in m.phases)
    assert "other modules 2.9" in plan("ltx2", world_size=8, gpu_memory_gib=80).explain()


@pytest.mark.parametrize("model, encoders", [("flux2", ("mistral_small_31",)), ("wan22", ("umt5_xxl",))])
def test_a_pipeline_object_is_counted_as_the_release(model, encoders):
    """plan(pipe) counts the pipeline's own modules (both Wan 2.2 experts): the release's memory."""
    pipe = SimpleNamespace(transformer=_meta_transformer(model), vae=_meta_vae(model),
                           **{name: _meta_encoder(key) for name, key in zip(("text_encoder", "text_encoder_2"),
                                                                             encoders)})
    if model == "wan22":
        pipe.transformer_2 = _meta_transformer(model)
    from_objects = plan(pipe, world_size=8, gpu_memory_gib=24)
    from_release = plan(model, world_size=8, gpu_memory_gib=24)
    assert (from_objects.degrees, from_objects.shard_weights, from_objects.text_encoder) == \
        (from_release.degrees, from_release.shard_weights, from_release.text_encoder)
    for part in ("weights", "weights_between_calls", "text_encoders", "text_encoders_encoding", "activations",
                 "vae_weights", "vae_decode"):
        assert getattr(from_objects.memory, part) == pytest.approx(getattr(from_release.memory, part), rel=1e-6), part


# docs/PERFORMANCE.md "Whole transformers at world size 1" (one H200, random weights, bf16, one
# forward): the stock peak GiB, with the text tokens each run used.
MEASURED_PEAKS = {
    "flux": (512, 22.7), "sd35": (333, 15.8), "cogvideox": (226, 11.7), "mochi": (256, 23.2), "wan": (512, 34.7),
    "hunyuan_video": (256, 36.3), "qwen_image": (128, 38.7), "flux2": (512, 61.2), "ltx_video": (128, 4.0),
}


@pytest.mark.parametrize("model", sorted(MEASURED_PEAKS))
def test_one_call_is_never_under_the_measured_peak(model):
    """Weights + one call's activations + the reserve against the measured world-1 peak: never
    under it, and over it by at most 3 GiB (the reserve and the slack of Note [memory per rank])."""
    text, measured = MEASURED_PEAKS[model]
    spec = replace(spec_for(model), text=text)
    mem = memory_model.breakdown(spec, 1, 1, 1, "none", 1)
    predicted = mem.weights + mem.activations + mem.reserve
    assert measured <= predicted <= measured + 3.0, (model, predicted, measured)


def test_the_memory_formulas():
    """Note [memory per rank] by hand on Flux.2-dev at 8 ranks."""
    spec = spec_for("flux2")
    mem = spec.memory
    sharded = memory_model.breakdown(spec, 8, 1, 8, "none", 1, shard_weights=True, text_encoder="shard")
    whole = memory_model.breakdown(spec, 8, 1, 8, "none", 1, shard_weights=False, text_encoder="rank0")
    assert sharded.weights * GIB == pytest.approx(mem.transformer_bytes / 8 + 2 * mem.blocks[0].largest_bytes)
    assert sharded.weights_between_calls * GIB == pytest.approx(mem.transformer_bytes / 8)
    mistral = ENCODERS["mistral_small_31"]
    assert sharded.text_encoders * GIB == pytest.approx(mistral.nbytes / 8)
    assert sharded.text_encoders_encoding * GIB == pytest.approx(
        mistral.nbytes / 8 + mistral.rest_bytes + 2 * mistral.largest_layer_bytes)
    # "rank0": its first rank holds the whole encoder, as "replicate" does.
    assert whole.weights * GIB == mem.transformer_bytes and whole.text_encoders * GIB == mistral.nbytes
    assert sharded.total == pytest.approx(max(sharded.phases.values()) + memory_model.RESERVE_GIB)
    # Activations follow the rank's tokens: 4608 / 8 at 8 ranks.
    one = memory_model.activation_bytes(spec, 1, 1, "none", 1)
    assert memory_model.rank_tokens(spec, 8, 1) == 576
    assert memory_model.activation_bytes(spec, 8, 1, "none", 1) < one / 4
    # The VAE's share: measured fractions at 2, 4, 8; beyond, the P = 8 fraction x 8 / P.
    vae = VAES["wan"]
    assert memory_model.vae_fraction(vae, 8) == 0.135 and memory_model.vae_fraction(vae, 16) == 0.135 / 2
    assert memory_model.vae_fraction(replace(VAES["hunyuan_video15"], fractions=None), 8) == 1.0  # no parallel recipe


def test_sharding_costs_the_exposed_gathers():
    """Note [sharded weights cost]: a long video call hides every prefetched block (only the first
    units' gathers show); a short image call does not; the bytes sent and received grow by (P-1)/P of a
    transformer a call."""
    gpu = check_gpu("h200")
    for model, grid, hidden in (("wan22", Grid(1, 4, 2), True), ("flux2", Grid(8, 1), False)):
        spec = spec_for(model)
        repl = predict(spec, grid, "stream", cfg=True, gpu=gpu)
        shard = predict(spec, grid, "stream", cfg=True, gpu=gpu, shard_weights=True)
        outer, blocks = memory_model.gathered_units(spec)
        link, world = LINKS["nvlink"], grid.world
        first = link.seconds(outer * (world - 1) / world) + link.seconds(blocks[0][0] * (world - 1) / world)
        gather = shard.parts["weight_gather"] / shard.calls_per_step / 1e3
        assert (gather == pytest.approx(first)) == hidden and gather >= first
        assert shard.step_ms == pytest.approx(repl.step_ms + shard.parts["weight_gather"])
        per_call = 2 * (outer + sum(b for b, _ in blocks)) * (world - 1) / world  # sent and received
        assert shard.comm_bytes_per_rank - repl.comm_bytes_per_rank == pytest.approx(shard.calls_per_step * per_call)


def test_a_small_limit_forces_sharding():
    free = plan("flux2", world_size=8)
    assert (free.shard_weights, free.text_encoder, free.gpu_memory_gib) == (False, "replicate", None)
    roomy = plan("flux2", world_size=8, gpu_memory_gib=141)  # replicated fits on an H200: no gathers
    assert (roomy.shard_weights, roomy.text_encoder) == (False, "replicate")
    assert roomy.predicted_step_ms == pytest.approx(free.predicted_step_ms)
    tight = plan("flux2", world_size=8, gpu_memory_gib=24)
    assert tight.shard_weights and tight.text_encoder == "shard"
    assert tight.memory_per_rank_gib <= 24 and tight.predicted_step_ms > free.predicted_step_ms
    assert all(c.memory_per_rank_gib <= 24 for c in tight.candidates)
    assert tight.unfit and all(c.memory_per_rank_gib > 24 for c in tight.unfit)
    # Sharding the weights alone suffices for Qwen-Image at 8 x 24 GiB: its text encoder stays whole.
    qwen = plan("qwen_image", world_size=8, gpu_memory_gib=24)
    assert qwen.shard_weights and qwen.text_encoder == "replicate"


def test_a_tiny_limit_names_the_smallest_that_works():
    with pytest.raises(ValueError, match=r"gpu_memory_gib=4: no grid and placement of Flux.2-dev fits") as err:
        plan("flux2", world_size=8, gpu_memory_gib=4)
    need = float(re.search(r"the smallest that works is gpu_memory_gib=([0-9.]+)", str(err.value)).group(1))
    assert plan("flux2", world_size=8, gpu_memory_gib=need).memory_per_rank_gib <= need
    with pytest.raises(ValueError, match="the smallest that works"):
        plan("flux2", world_size=8, gpu_memory_gib=need - 0.2)
    with pytest.raises(ValueError, match=r"on 1 GPU\(s\); the smallest that works is gpu_memory_gib=10[0-9.]+"):
        plan("flux2", world_size=1, gpu_memory_gib=80)  # one GPU holds everything whole


def test_explain_says_the_placement_and_why():
    text = plan("flux2", world_size=8, gpu_memory_gib=24).explain()
    assert "weights sharded, text encoder 'shard'" in text and "of 24 GiB per rank" in text
    assert "replicated weights need at least" in text and "ms a step of weight all-gathers" in text
    assert "a whole text encoder on a rank" in text and "once per prompt" in text
    roomy = plan("flux2", world_size=8, gpu_memory_gib=141).explain()
    assert "weights replicated, text encoder 'replicate'" in roomy and "replicated weights fit" in roomy
    assert "not checked against a GPU" in plan("flux2", world_size=8).explain()


@pytest.mark.parametrize("model", ["flux2", "wan22"])
def test_24_gib_plans_on_8_gpus(model):
    p = plan(model, world_size=8, gpu_memory_gib=24)
    assert p.ulysses_degree * p.ring_degree * p.cfg_degree * p.tensor_degree == 8
    assert p.shard_weights and p.memory.total <= 24 and p.memory_per_rank_gib == p.memory.total


@pytest.mark.parametrize("value", [0, -24, True, "24", math.nan, math.inf])
def test_bad_gpu_memory_is_named(value):
    with pytest.raises(ValueError, match=re.escape(f"gpu_memory_gib={value!r} must be a number of GiB > 0")):
        plan("flux2", world_size=8, gpu_memory_gib=value)


def test_models_enable_usp_cannot_run_are_not_planned(monkeypatch):
    # Every model of the memory table runs now: one marked as not runnable stands in for the next.
    spec = SPECS["kandinsky6"]
    monkeypatch.setitem(SPECS, "kandinsky6", lambda **kw: replace(spec(**kw), unsupported="enable_usp has no "
                                                                  "adapter for Kandinsky6Transformer3DModel yet"))
    with pytest.raises(ValueError, match="enable_usp has no adapter for .* yet"):
        plan("kandinsky6", world_size=8, gpu_memory_gib=80)


def test_cli(capsys):
    assert main(["--model", "flux2", "--world-size", "8", "--gpu-memory-gib", "24"]) == 0
    out = capsys.readouterr().out
    assert "| sharded | shard |" in out and "weights sharded, text encoder 'shard'" in out
    assert main(["--model", "flux2", "--world-size", "8", "--gpu-memory-gib", "0"]) == 2
    assert "gpu_memory_gib=0.0 must be" in capsys.readouterr().err


def test_the_memory_table_in_the_docs_is_the_cli_s(capsys):
    """docs/PERFORMANCE.md's table is ``python -m usp_dit.planner --memory-table``'s output."""
    assert main(["--memory-table"]) == 0
    printed = capsys.readouterr().out.strip()
    assert printed == memory_table()
    rows = printed.splitlines()
    assert len(rows) == 2 + 5 * 4
    doc = (Path(__file__).resolve().parents[1] / "docs" / "PERFORMANCE.md").read_text()
    assert printed in doc, "rerun python -m usp_dit.planner --memory-table and paste it into docs/PERFORMANCE.md"
