"""What every model plan promises, checked once for every family (no processes).

Each family is a ``ModelPlan`` applied by the one generic ``PlanAdapter`` (usp_dit.pipelines.plan),
so its mechanics are the same everywhere: the adapter is found by the model's class, enable swaps the
processor of each parallel attention site and leaves local ones stock, disable puts back the same
processor objects and leaves no hook, and the patcher refuses (NotImplementedError, naming the
module) a foreign processor at any attention site, an unsupported Diffusers cache (FasterCache), a model without
blocks, and at the call a processor replaced after enable. Parity on grids is each family's own
file (tests/test_pipeline_<family>.py).
"""
from __future__ import annotations

import fnmatch

import pytest
import torch

import usp_dit.pipelines  # noqa: F401  (registers every adapter)
from usp_dit import single_rank_mesh
from usp_dit.demo import (
    tiny_chroma,
    tiny_cosmos3,
    tiny_flux,
    tiny_flux2,
    tiny_hidream,
    tiny_hunyuan_video,
    tiny_hunyuan_video15,
    tiny_hunyuan_video_framepack,
    tiny_kandinsky5,
    tiny_kandinsky6,
    tiny_ltx2,
    tiny_ltx_video,
    tiny_qwen_image,
    tiny_sana,
    tiny_sd3,
    tiny_video,
    tiny_wan,
    tiny_wan_animate,
    tiny_wan_vace,
)
from usp_dit.demo.tiny_ace_step import tiny_ace_step
from usp_dit.demo.tiny_allegro import tiny_allegro
from usp_dit.demo.tiny_anyflow import tiny_anyflow
from usp_dit.demo.tiny_anyflow_far import tiny_anyflow_far
from usp_dit.demo.tiny_auraflow import tiny_auraflow
from usp_dit.demo.tiny_bria import tiny_bria, tiny_bria_fibo
from usp_dit.demo.tiny_bria_fibo2 import tiny_bria_fibo2
from usp_dit.demo.tiny_chronoedit import tiny_chronoedit
from usp_dit.demo.tiny_cogview4 import tiny_cogview3plus, tiny_cogview4
from usp_dit.demo.tiny_consisid import tiny_consisid
from usp_dit.demo.tiny_cosmos import tiny_cosmos
from usp_dit.demo.tiny_dit import tiny_dit
from usp_dit.demo.tiny_dreamlite import tiny_dreamlite
from usp_dit.demo.tiny_easyanimate import tiny_easyanimate
from usp_dit.demo.tiny_ernie_image import tiny_ernie_image
from usp_dit.demo.tiny_flux3 import tiny_flux3
from usp_dit.demo.tiny_glm_image import tiny_glm_image
from usp_dit.demo.tiny_helios import tiny_helios
from usp_dit.demo.tiny_hunyuan_dit import tiny_hunyuan_dit
from usp_dit.demo.tiny_hunyuan_image import tiny_hunyuan_image
from usp_dit.demo.tiny_ideogram4 import tiny_ideogram4
from usp_dit.demo.tiny_joyimage import tiny_joyimage
from usp_dit.demo.tiny_joyimage_plus import tiny_joyimage_plus
from usp_dit.demo.tiny_kandinsky6_sr import tiny_kandinsky6_sr
from usp_dit.demo.tiny_krea2 import tiny_krea2
from usp_dit.demo.tiny_latte import tiny_latte
from usp_dit.demo.tiny_longcat_audio_dit import tiny_longcat_audio_dit
from usp_dit.demo.tiny_longcat_image import tiny_longcat_image
from usp_dit.demo.tiny_lumina2 import tiny_lumina2
from usp_dit.demo.tiny_lumina_next import tiny_lumina_next
from usp_dit.demo.tiny_minimax_h3 import tiny_minimax_h3
from usp_dit.demo.tiny_minimax_music3 import tiny_minimax_music3
from usp_dit.demo.tiny_motif_video import tiny_motif_video
from usp_dit.demo.tiny_nucleus_moe import tiny_nucleus_moe
from usp_dit.demo.tiny_omnigen import tiny_omnigen
from usp_dit.demo.tiny_ovis_image import tiny_ovis_image
from usp_dit.demo.tiny_pixart import tiny_pixart
from usp_dit.demo.tiny_prx import tiny_prx
from usp_dit.demo.tiny_qwen_image21 import tiny_qwen_image21
from usp_dit.demo.tiny_sana_video import tiny_sana_video
from usp_dit.demo.tiny_sana_wm import tiny_sana_wm
from usp_dit.demo.tiny_sana_wm_refiner import tiny_sana_wm_refiner
from usp_dit.demo.tiny_skyreels_v2 import tiny_skyreels_v2
from usp_dit.demo.tiny_stable_audio import tiny_stable_audio
from usp_dit.demo.tiny_stable_audio3 import tiny_stable_audio3
from usp_dit.demo.tiny_wan_animate2 import tiny_wan_animate2
from usp_dit.demo.tiny_zimage import tiny_zimage
from usp_dit.pipelines.base import find_adapter, registered_adapters
from usp_dit.pipelines.plan import Parallel, PlanAdapter

# A tiny model per family (the families whose files test everything else).
BUILDERS = {
    "CogVideoX": tiny_video.tiny_cogvideox,
    "Mochi": tiny_video.tiny_mochi,
    "Wan": lambda: tiny_wan.tiny_wan("i2v"),  # I2V: the added K/V cross-attention too
    "HunyuanVideo": tiny_hunyuan_video.tiny_hunyuan_video,  # the token refiner's local attention too
    "HunyuanVideo15": tiny_hunyuan_video15.tiny_hunyuan_video15,
    "HunyuanVideoFramepack": tiny_hunyuan_video_framepack.tiny_framepack,  # the history embedders beside the blocks
    "LTX-Video": tiny_ltx_video.tiny_ltx_video,
    "LTX-2": lambda: tiny_ltx2.tiny_ltx2("2.3"),  # perturbed processors (spatio-temporal guidance) too
    "QwenImage": tiny_qwen_image.tiny_qwen_image,
    "QwenImage21": tiny_qwen_image21,
    "Flux3": tiny_flux3,
    "SD3": lambda: tiny_sd3.tiny_sd3("sd3.5-medium"),  # SD3.5's dual attention (attn2) too
    "Flux": tiny_flux.tiny_flux_transformer,
    "Flux2": tiny_flux2.tiny_flux2,
    "Chroma": tiny_chroma.tiny_chroma,
    "HiDream": tiny_hidream.tiny_hidream,
    "LongCatImage": tiny_longcat_image,
    "OvisImage": tiny_ovis_image,
    "ErnieImage": tiny_ernie_image,
    "Ideogram4": tiny_ideogram4,  # [replicated text part; image shard], split at the forward's arguments
    "GlmImage": tiny_glm_image,
    "NucleusMoE": tiny_nucleus_moe,  # image queries over [image; text] keys; the MoE layers' forwards put back
    "OmniGen": tiny_omnigen,  # [replicated prefix; image shard], cut at its seams
    "Bria": tiny_bria,
    "BriaFibo": tiny_bria_fibo,
    "BriaFibo2": tiny_bria_fibo2,  # the Perceiver and injection cross-attention local
    "SkyReels-V2": lambda: tiny_skyreels_v2(num_frame_per_block=2),  # diffusion forcing's block-causal mask
    "AnyFlow": lambda: tiny_anyflow("i2v"),  # AnyFlow's own processors: routed attn1, local attn2 with image tokens
    "AnyFlowFAR": tiny_anyflow_far,  # the KV-cached causal attn1 (its own processor), local attn2
    "ChronoEdit": tiny_chronoedit,  # Wan I2V's attention with ChronoEdit's own processor class
    "Helios": lambda: tiny_helios("amplify"),  # the history's key scales too
    "WanAnimate": tiny_wan_animate.tiny_wan_animate,  # the face adapters' per-frame attention too
    "WanAnimate2": tiny_wan_animate2,  # the reference-cache self-attention (both passes), local cross-attention
    "WanVACE": tiny_wan_vace.tiny_wan_vace,  # the control blocks' attention too
    "Kandinsky5": tiny_kandinsky5.tiny_kandinsky5,  # the text stream's local attention too
    "Kandinsky6": tiny_kandinsky6.tiny_kandinsky6,  # two text streams, the replicated audio's attention too
    "Kandinsky6SR": tiny_kandinsky6_sr,  # NABLA: ring refused at enable, Ulysses whole-sequence estimate
    "Cosmos3": lambda: tiny_cosmos3.tiny_cosmos3("nemotron-omni"),  # sound and action heads too
    "MiniMax-H3": tiny_minimax_h3,  # the text refiner's local attention too
    "CogView4": tiny_cogview4,
    "CogView3Plus": tiny_cogview3plus,
    "Lumina2": tiny_lumina2,  # the context refiner's local attention too
    "LuminaNext": tiny_lumina_next,  # the cross-attention's local attention too
    "DreamLite": tiny_dreamlite,  # the cross-attention's local attention too
    "Krea2": tiny_krea2,  # the text fusion's local attention too
    "HunyuanImage": tiny_hunyuan_image,  # the token refiner's local attention too
    "ZImage": tiny_zimage,  # the context refiner's local attention too
    "Sana": lambda: tiny_sana.tiny_sana("sprint"),  # linear attention, the Mix-FFN's conv hooks, QK norms
    "SanaWM": tiny_sana_wm,  # GDN per-frame sums all-reduced, softmax over gathered K/V, per-frame pixel split
    "SANA-WM refiner": lambda: tiny_sana_wm_refiner("2.3"),  # the refiner's own attn1 routed; unused audio sites local
    "SanaVideo": tiny_sana_video,  # linear attention with RoPE, the Mix-FFN's spatial and temporal conv hooks
    "ConsisID": tiny_consisid,  # the perceiver cross-attention (not an Attention: no processor) stays
    "AuraFlow": tiny_auraflow,  # joint and single-stream blocks, one processor class
    "PixArt": lambda: tiny_pixart("alpha"),  # routed AttnProcessor2_0 (self), local masked cross-attention
    "DiT": tiny_dit,  # PixArt's routed AttnProcessor2_0 (self-attention only), ada_norm_zero blocks
    "PRX": tiny_prx,  # image queries over [text; image] keys (zero text queries)
    "HunyuanDiT": tiny_hunyuan_dit,  # the RoPE table cut at every block, local cross-attention, long skips
    "Latte": tiny_latte,  # routed spatial self-attention; local cross- and temporal attention
    "Allegro": tiny_allegro,  # routed 3D self-attention with RoPE positions cut per block; local cross-attention
    "EasyAnimate": lambda: tiny_easyanimate("mixed-control"),  # an MMDiT block and a shared-weights block
    "Cosmos": lambda: tiny_cosmos("img-context"),  # routed attn1, local attn2 (CosmosAttnProcessor2_5)
    "MotifVideo": tiny_motif_video,  # joint, decoder (both streams video) and local cross-attention
    "JoyImageEdit": tiny_joyimage,  # routed joint [image; text] attention, the image RoPE cut at every block
    "JoyImageEditPlus": tiny_joyimage_plus,  # the same, its batched RoPE cut on dim 1, a text key mask
    "StableAudio": tiny_stable_audio,  # routed F.sdpa self-attention, the RoPE argument cut there; local GQA cross-attention
    "StableAudio3": tiny_stable_audio3,  # two routed dispatch calls, RoPE a Table, inpainting rows cut per block
    "ACE-Step": tiny_ace_step,  # GQA self-attention routed, local cross-attention to the condition
    "LongCat-AudioDiT": tiny_longcat_audio_dit,  # routed self-attention, local masked cross-attention
    "MiniMax-Music3": tiny_minimax_music3,  # [time token; frames] self-attention only
}


def _plan_adapters() -> list[PlanAdapter]:
    return [a for a in registered_adapters() if isinstance(a, PlanAdapter) and a.name in BUILDERS]


def _processors(model: torch.nn.Module) -> dict[str, object]:
    return {path: m.processor for path, m in model.named_modules() if getattr(m, "processor", None) is not None}


def _site(adapter: PlanAdapter, path: str):
    return next(s for s in adapter.plan.attention if fnmatch.fnmatchcase(path, s.pattern))


def _hooked(model: torch.nn.Module) -> list[str]:
    return [name for name, m in model.named_modules() if m._forward_hooks or m._forward_pre_hooks]


families = pytest.mark.parametrize("adapter", _plan_adapters(), ids=lambda a: a.name)


def test_every_plan_family_has_a_builder_here():
    plans = {a.name for a in registered_adapters() if isinstance(a, PlanAdapter)}
    assert set(BUILDERS) == plans


@families
def test_found_by_class_and_only_parallel_sites_swapped_then_all_put_back(adapter):
    model = BUILDERS[adapter.name]()
    assert find_adapter(model) is adapter
    before = _processors(model)
    adapter.enable(model, single_rank_mesh(), "auto")
    during = _processors(model)
    for path, proc in during.items():
        swapped = proc is not before[path]
        assert swapped == isinstance(_site(adapter, path), Parallel), path
    if any(isinstance(site, Parallel) for site in adapter.plan.attention):  # SanaWM: forwards replaced, no processor
        assert any(proc is not before[p] for p, proc in during.items())
    adapter.disable(model)
    assert all(proc is before[p] for p, proc in _processors(model).items())
    assert not _hooked(model), f"hooks left on {_hooked(model)}"
    assert "forward" not in model.__dict__ and not hasattr(model, "_usp_dit_patch")


@families
def test_enable_twice_and_disable_unpatched_raise(adapter):
    model = BUILDERS[adapter.name]()
    with pytest.raises(ValueError, match="not sequence-parallel"):
        adapter.disable(model)
    adapter.enable(model, single_rank_mesh(), "auto")
    with pytest.raises(ValueError, match="already sequence-parallel"):
        adapter.enable(model, single_rank_mesh(), "auto")
    adapter.disable(model)


@families
def test_a_foreign_processor_at_any_site_is_refused_and_nothing_is_patched(adapter):
    for path in _processors(BUILDERS[adapter.name]()):
        model = BUILDERS[adapter.name]()
        model.get_submodule(path).processor = object()
        with pytest.raises(NotImplementedError, match=rf"{path}\.processor is object"):
            adapter.enable(model, single_rank_mesh(), "auto")
        assert not _hooked(model)


@families
def test_an_unsupported_diffusers_cache_is_refused(adapter):
    """FasterCache cannot be made consistent under USP (usp_dit.pipelines.caches); the four others
    run on a grid and are tested in tests/test_caches.py."""
    from diffusers import FasterCacheConfig

    model = BUILDERS[adapter.name]()
    if not hasattr(model, "enable_cache"):
        pytest.skip(f"{type(model).__name__} has no Diffusers cache support")
    try:
        model.enable_cache(FasterCacheConfig(current_timestep_callback=lambda: 500))
    except Exception as exc:  # a model whose blocks the cache cannot hook: nothing to refuse
        pytest.skip(f"{type(model).__name__}: enable_cache raised {type(exc).__name__}")
    with pytest.raises(NotImplementedError, match="diffusers cache"):
        adapter.enable(model, single_rank_mesh(), "auto")


@families
def test_a_model_without_blocks_is_refused(adapter):
    model = BUILDERS[adapter.name]()
    for name in adapter.plan.block_lists:
        setattr(model, name, torch.nn.ModuleList())
    with pytest.raises(NotImplementedError):  # "num_layers=0", or the split block that no longer exists
        adapter.enable(model, single_rank_mesh(), "auto")


@families
def test_a_processor_replaced_after_enable_is_refused_at_the_call(adapter):
    """A PAG pipeline swaps processors at each call: the layer would attend over the shard alone."""
    if not any(isinstance(site, Parallel) for site in adapter.plan.attention):
        pytest.skip(f"{adapter.name} has no processor-based parallel site (its self-attention forwards are replaced)")
    model = BUILDERS[adapter.name]()
    stock = _processors(model)
    adapter.enable(model, single_rank_mesh(), "auto")
    try:
        path = next(p for p in stock if isinstance(_site(adapter, p), Parallel))
        model.get_submodule(path).processor = stock[path]
        with pytest.raises(NotImplementedError, match=rf"{path}\.processor became"):
            model()  # refused by the pre-hook, before the forward reads any argument
    finally:
        adapter.disable(model)
