"""The planner (usp_dit.plan, usp_dit.planner): valid, stable and explained choices; refusals.

No processes except one small spawned check of ``enable_usp(degrees="auto")``. The exactness of
the bytes the cost model uses is tests/test_traffic.py (predicted == counted on CPU grids).

What is checked:
- every choice is a grid the job can run: degrees multiply to the world size, at most as many
  Ulysses ranks as heads, cfg 2 only where guidance has two branches (or the batch splits);
- stable: the same question gives the same answer, and every candidate is priced (a table with
  one row per grid and schedule);
- the model's parts add up, scale as they should (more GPUs never predict a slower best step on
  NVLink for the long-video models; the rest of the model divides over the sequence ranks), and
  over InfiniBand the groups that leave a node pay for it;
- explain() names the grid, the predicted time, the next best and why it is slower;
- bad input: world_size 0, an unknown model, interconnect or GPU, a transformer of a family the
  planner has no cost model for.
"""
from __future__ import annotations

import math
import re

import pytest
import torch

import usp_dit.pipelines  # noqa: F401  (registers every adapter)
from usp_dit.planner.cost import Grid, predict
from usp_dit.planner.hardware import check_gpu
from usp_dit.planner.models import CLASSES, SPECS, spec_for
from usp_dit.planner.plan import main, plan

WORLDS = (1, 2, 4, 8, 16, 32, 64)
# The specs enable_usp can run (a spec marked ``unsupported`` is refused by plan():
# tests/test_planner_memory.py).
RUNNABLE = sorted(name for name in SPECS if not spec_for(name).unsupported)
# The grids at 1 to 64 GPUs are checked on the first families (the code is the same for all; a test
# below plans every class at 1, 2, 4, 8 GPUs): ~1 s a family.
FIRST = ("flux", "flux2", "sd35", "qwen_image", "cogvideox", "mochi", "wan", "wan22", "hunyuan_video",
         "hunyuan_video15", "kandinsky6", "ltx_video")


@pytest.mark.parametrize("model", FIRST)
def test_choices_are_valid_grids(model):
    spec = spec_for(model)
    for world in WORLDS:
        for interconnect in ("nvlink", "infiniband"):
            p = plan(model, world_size=world, interconnect=interconnect)
            assert p.ulysses_degree * p.ring_degree * p.cfg_degree == world
            assert p.ulysses_degree <= spec.heads
            if p.cfg_degree == 2:
                assert spec.guidance != "distilled", "cfg 2 on a guidance-distilled model at batch 1"
            assert p.predicted_step_ms > 0 and p.memory_per_rank_gib > 0
            assert p.candidates[0].step_ms == p.predicted_step_ms
            assert all(c.grid.world == world for c in p.candidates)


def test_same_question_same_answer_and_every_candidate_priced():
    a, b = plan("wan", world_size=8), plan("wan", world_size=8)
    assert (a.degrees, a.ring_schedule, a.predicted_step_ms) == (b.degrees, b.ring_schedule, b.predicted_step_ms)
    grids = {(c.grid.ulysses, c.grid.ring, c.grid.cfg, c.schedule) for c in a.candidates}
    # 8 GPUs, Wan (40 heads, two-call CFG): U in 1,2,4,8 with cfg 1; U in 1,2,4 with cfg 2; 3 schedules
    # where there is a ring.
    assert len(grids) == len(a.candidates) == 4 * 3 - 2 + 3 * 3 - 2  # (8,1,1) and (4,1,2) have no ring
    assert [c.step_ms for c in a.candidates] == sorted(c.step_ms for c in a.candidates)


def test_one_gpu_is_the_whole_model_and_more_gpus_are_faster_for_long_video():
    for model in ("wan", "hunyuan_video", "mochi", "cogvideox"):
        times = [plan(model, world_size=w).predicted_step_ms for w in (1, 2, 4, 8)]
        assert times == sorted(times, reverse=True), (model, times)
        one = plan(model, world_size=1)
        assert one.degrees == (1, 1, 1) and one.comm_bytes_per_rank == 0


def test_parts_add_up_and_the_rest_divides_over_sequence_ranks():
    spec, gpu = spec_for("wan"), check_gpu("h200")
    one = predict(spec, Grid(1, 1), "none", gpu=gpu)
    eight = predict(spec, Grid(4, 2), "stream", gpu=gpu)
    for p in (one, eight):
        assert abs(sum(p.parts.values()) - p.step_ms) < 1e-9
    assert abs(eight.parts["rest_of_model"] * 8 - one.parts["rest_of_model"]) / one.parts["rest_of_model"] < 1e-3


def test_groups_that_leave_a_node_pay_infiniband():
    spec, gpu = spec_for("flux"), check_gpu("h200")
    inside = predict(spec, Grid(8, 2), "gather_one_call", interconnect="infiniband", gpu=gpu)
    nvlink = predict(spec, Grid(8, 2), "gather_one_call", interconnect="nvlink", gpu=gpu)
    # Ulysses (8 ranks) stays in a node either way; the ring spans two nodes over InfiniBand.
    assert inside.parts["ulysses_all_to_all"] == pytest.approx(nvlink.parts["ulysses_all_to_all"])
    assert inside.parts["ring_exposed"] > 3 * nvlink.parts["ring_exposed"]


def test_cfg_two_only_where_guidance_splits():
    flux = {(c.grid.cfg) for c in plan("flux", world_size=4).candidates}  # guidance-distilled, batch 1
    assert flux == {1}
    assert {c.grid.cfg for c in plan("flux", world_size=4, batch=2).candidates} == {1, 2}  # a batch of 2 splits
    assert {c.grid.cfg for c in plan("cogvideox", world_size=4).candidates} == {1, 2}  # batched CFG
    assert {c.grid.cfg for c in plan("cogvideox", world_size=4, cfg=False).candidates} == {1}


def test_explain_names_the_choice_and_the_next_best():
    p = plan("cogvideox", world_size=8)
    text = p.explain()
    assert f"ulysses {p.ulysses_degree} x ring {p.ring_degree} x cfg {p.cfg_degree}" in text
    assert f"{p.predicted_step_ms:.1f} ms" in text
    assert "Next best:" in text and "projection" in text
    assert len(text.splitlines()) <= 6


def test_cli_prints_every_grid(capsys):
    assert main(["--model", "flux", "--world-size", "8"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n| ") >= len(plan("flux", world_size=8).candidates)
    assert main(["--model", "flux", "--world-size", "0"]) == 2


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=0), "world_size=0 must be an int >= 1"),
    (dict(world_size=4, interconnect="ethernet"), "interconnect='ethernet'"),
    (dict(world_size=4, gpu="a100"), "gpu='a100'"),
    (dict(world_size=4, batch=0), "batch=0"),
])
def test_bad_input_is_named(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan("flux", **kwargs)


def test_unknown_models_are_refused_with_the_known_ones():
    with pytest.raises(ValueError, match="model='dalle' is not one the planner knows"):
        plan("dalle", world_size=2)
    from usp_dit.demo.tiny_chroma import tiny_chroma

    with pytest.raises(ValueError, match="cannot plan a ChromaTransformer2DModel"):
        plan(tiny_chroma(), world_size=2)


def test_the_planners_classes_are_the_adapters_classes():
    """The planner names transformer classes itself (it sits below the integration): each is one a
    registered adapter runs, and maps to the spec of that adapter's family."""
    from usp_dit.pipelines.base import registered_adapters
    from usp_dit.planner.models import CLASSES

    by_class = {getattr(a, "model_class", type(None)).__name__: a.name for a in registered_adapters()}
    family_spec = {"Flux": "flux", "Flux2": "flux2", "SD3": "sd35", "QwenImage": "qwen_image",
                   "CogVideoX": "cogvideox", "Mochi": "mochi", "Wan": "wan", "HunyuanVideo": "hunyuan_video",
                   "HunyuanVideo15": "hunyuan_video15", "LTX-Video": "ltx_video",
                   "Kandinsky6": "kandinsky6", "LTX-2": "ltx2", "WanVACE": "wan_vace", "WanAnimate": "wan_animate",
                   "ChronoEdit": "chronoedit", "Helios": "helios", "Cosmos3": "cosmos3", "MiniMax-H3": "minimax_h3",
                   "Kandinsky5": "kandinsky5", "QwenImage21": "qwen_image21", "Flux3": "flux3", "ZImage": "zimage",
                   "HunyuanImage": "hunyuan_image", "HiDream": "hidream", "CogView4": "cogview4",
                   "Lumina2": "lumina2", "Krea2": "krea2", "LongCatImage": "longcat_image",
                   "OvisImage": "ovis_image", "Sana": "sana", "SanaVideo": "sana_video", "SanaWM": "sana_wm",
                   "SkyReels-V2": "skyreels_v2", "AnyFlow": "anyflow", "ConsisID": "consisid", "PixArt": "pixart",
                   "HunyuanDiT": "hunyuan_dit", "DiT": "dit", "AuraFlow": "auraflow", "ErnieImage": "ernie_image",
                   "GlmImage": "glm_image", "Ideogram4": "ideogram4", "BriaFibo2": "bria_fibo2", "PRX": "prx",
                   "LuminaNext": "lumina_next", "JoyImageEdit": "joyimage", "JoyImageEditPlus": "joyimage_plus",
                   "StableAudio": "stable_audio", "StableAudio3": "stable_audio3", "ACE-Step": "ace_step",
                   "LongCat-AudioDiT": "longcat_audio_dit", "MiniMax-Music3": "minimax_music3"}
    assert {name: family_spec[by_class[name]] for name in CLASSES} == CLASSES
    # wan22 (Wan 2.2 A14B) is two WanTransformer3DModels: the "wan" class, both experts counted.
    assert set(CLASSES.values()) == set(RUNNABLE) - {"wan22"}


def test_a_transformer_object_is_planned_from_its_own_config():
    from usp_dit.demo.tiny_flux import tiny_flux_transformer

    model = tiny_flux_transformer()
    p = plan(model, world_size=4, height=256, width=256)
    spec = p.candidates[0]
    assert p.ulysses_degree <= model.config.num_attention_heads
    assert spec.grid.world == 4


def test_bench_scaling_prints_the_prediction_beside_each_measurement():
    from benchmarks.bench_scaling import markdown, predicted_ms

    assert predicted_ms("flux-klein", 2, 1, "auto") is None
    flux4 = predicted_ms("flux", 2, 2, "auto")
    assert 0 < flux4 < predicted_ms("flux", 1, 1, "auto")
    row = dict(model="flux", shape="1024x1024", world=4, ulysses=2, ring=2, schedule="auto", t1_ms=170.0,
               tp_ms=50.0, predicted_ms=flux4, speedup=3.4, efficiency=0.85, max_rel_diff=1e-3)
    assert f"| {flux4:.1f} |" in markdown(row)


def test_examples_take_degrees_auto(monkeypatch):
    from tests.test_examples_cli import _example
    from usp_dit.cli.launch import UsageError

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    args = _example("generate_image").parse_args(["--degrees", "auto"])
    assert args.degrees == (1, 1, 1)
    monkeypatch.setenv("WORLD_SIZE", "4")
    args = _example("generate_video").parse_args(["--model", "wan", "--degrees", "auto"])
    u, r, c = args.degrees
    assert u * r * c == 4 and args.ring_schedule in ("auto", "stream", "gather_merge", "gather_one_call")
    with pytest.raises(UsageError, match="--degrees auto with --ulysses 2"):
        _example("generate_video").parse_args(["--model", "wan", "--degrees", "auto", "--ulysses", "2"])
    with pytest.raises(UsageError, match="no cost model for this family"):
        _example("generate_image").parse_args(["--family", "chroma", "--degrees", "auto"])


def _auto_degrees_job() -> dict:
    """On 2 ranks: enable_usp(degrees="auto") picks a grid of the world size and computes the stock output."""
    from tests.adapter_parity import forward
    from tests.test_pipeline_flux import SHAPES, _call_args
    from usp_dit import disable_usp, enable_usp
    from usp_dit.demo.tiny_flux import tiny_flux_transformer
    from usp_dit.testing import rel_err

    model, inputs = tiny_flux_transformer(), _call_args(SHAPES[1])
    ref = forward(model, inputs)
    mesh = enable_usp(model, degrees="auto")
    try:
        out = forward(model, inputs)
    finally:
        disable_usp(model)
    # A plan that shards (as one made for a small GPU would): enable_usp takes its placement.
    import dataclasses

    from torch.distributed.fsdp import FSDPModule

    from usp_dit.demo.tiny_flux import tiny_flux_pipeline

    pipe = tiny_flux_pipeline()
    placed = dataclasses.replace(usp_dit.plan(pipe, world_size=2), shard_weights=True, text_encoder="rank0")
    enable_usp(pipe, degrees=placed)
    sharded = isinstance(pipe.transformer, FSDPModule)
    rank0 = type(pipe.text_encoder_2.__dict__.get("forward")).__name__
    pipe.disable_usp()
    return {"degrees": (mesh.ulysses_degree, mesh.ring_degree, mesh.cfg_degree), "err": rel_err(out, ref),
            "placement": (sharded, rank0)}


def test_enable_usp_degrees_auto_on_two_ranks():
    from usp_dit.testing import run_spawned

    for res in run_spawned(_auto_degrees_job, 2, check_groups=False):  # FSDP2's caches keep the meshes
        u, r, c = res["degrees"]
        assert u * r * c == 2 and res["err"] <= 1e-5, res
        assert res["placement"] == (True, "RankZeroForward"), res


def test_enable_usp_refuses_a_plan_for_another_world():
    from usp_dit import enable_usp
    from usp_dit.demo.tiny_flux import tiny_flux_transformer

    with pytest.raises(ValueError, match="the plan is for world_size=4"):
        enable_usp(tiny_flux_transformer(), degrees=plan("flux", world_size=4))
    with pytest.raises(ValueError, match="degrees='manual'"):
        enable_usp(tiny_flux_transformer(), degrees="manual")


def test_usp_dit_plan_is_callable_and_a_module():
    import usp_dit

    assert usp_dit.plan("flux", world_size=2).degrees == plan("flux", world_size=2).degrees
    from usp_dit.planner.plan import Plan

    assert isinstance(usp_dit.plan("wan", world_size=4), Plan)


# ---- every class the planner knows: its spec's counts and a plan (or refusal) on 80 GiB GPUs ------


@pytest.fixture(scope="module")
def released_params() -> dict[str, int]:
    """Spec name -> parameters of its released config built once on the meta device (ms each)."""
    from tests.test_planner_memory import _counted, _meta_transformer

    return {name: _counted(_meta_transformer(name))[0] for name in sorted(set(CLASSES.values()))}


def test_every_class_s_spec_is_its_released_config(released_params):
    """``ModelSpec.params`` (what the time model uses) and the memory's transformer parameters agree
    with a meta-device build of the released config within 1 % (the figures check themselves)."""
    for cls, name in CLASSES.items():
        spec, counted = spec_for(name), released_params[name]
        assert abs(spec.params - counted) <= 0.01 * counted, (cls, spec.params, counted)
        assert abs(spec.memory.transformer_params - counted) <= 0.01 * counted, cls
        assert spec.tokens > 0 and spec.heads % spec.kv_heads == 0 and spec.layers > 0, cls


REFUSAL = (r"gpu_memory_gib=80: no grid and placement of .* fits on \d+ GPU\(s\); "
           r"the smallest that works is gpu_memory_gib=")


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_every_class_plans_on_80_gib_gpus_or_says_what_it_needs(world):
    """Planning each class's release at its usual size on 1, 2, 4, 8 GPUs of 80 GiB returns a plan
    that fits, or refuses naming the memory it would need (which then plans)."""
    for name in sorted(set(CLASSES.values())):
        try:
            p = plan(name, world_size=world, gpu_memory_gib=80)
        except ValueError as exc:
            assert re.search(REFUSAL, str(exc)), (name, str(exc))
            need = float(re.search(r"smallest that works is gpu_memory_gib=([0-9.]+)", str(exc)).group(1))
            assert need > 80 and plan(name, world_size=world, gpu_memory_gib=need).memory_per_rank_gib <= need
            continue
        assert p.ulysses_degree * p.ring_degree * p.cfg_degree * p.tensor_degree == world, name
        assert 0 < p.memory_per_rank_gib <= 80 and p.predicted_step_ms > 0, name
        left_out, caveat = spec_for(name).memory.left_out, spec_for(name).caveat
        assert (left_out in p.explain()) and (caveat in p.explain()), name


# ---- audio DiTs: a length in seconds (usp_dit.planner.models Note [audio specs]) --------------------

AUDIO = {  # spec -> (the class, seconds, the tokens the grid splits at that length)
    "stable_audio": ("StableAudioDiTModel", 30.0, 1 + 1024),  # always the 1024 frames, cropped after
    "stable_audio3": ("StableAudio3DiTModel", 60.0, 64 + math.ceil(60 * 44100 / 4096)),
    "ace_step": ("AceStepTransformer1DModel", 240.0, math.ceil(240 * 25 / 2)),
    "longcat_audio_dit": ("LongCatAudioDiTTransformer", 30.0, 30 * 24000 // 2048),
    "minimax_music3": ("MiniMaxMusic3Transformer1DModel", 240.0, 1 + 689),  # one 200-frame window a call
}


@pytest.mark.parametrize("model", sorted(AUDIO))
def test_audio_models_plan_from_seconds_on_1_2_4_8_gpus(model):
    """An audio DiT's length turns into its tokens; it plans on 1, 2, 4 and 8 GPUs, by its spec key
    and by its class's spec; its memory holds its text encoders, held modules and VAE."""
    cls, seconds, tokens = AUDIO[model]
    spec = spec_for(model, seconds=seconds)
    assert CLASSES[cls] == model and spec.tokens == tokens and spec.seconds == seconds
    assert spec.output_size[1:] == (1, 1) and spec.memory.vae is not None and not spec.memory.left_out
    for world in (1, 2, 4, 8):
        p = plan(model, world_size=world, seconds=seconds, gpu_memory_gib=80)
        assert p.ulysses_degree * p.ring_degree * p.cfg_degree * p.tensor_degree == world
        assert p.memory.text_encoders * 2**30 == pytest.approx(spec.memory.encoder_bytes)
        assert p.memory.others * 2**30 == pytest.approx(spec.memory.other_bytes)
        assert p.memory_per_rank_gib <= 80 and p.memory.vae_weights > 0
    if model != "minimax_music3":  # no text encoder: its 8 B language model is a held module
        assert spec.memory.encoders and p.memory.text_encoders > 0
    else:
        assert p.memory.others > 16  # the 8.6 B language model in bf16


def test_an_audio_model_that_cannot_fit_names_the_smallest_memory():
    """MiniMax Music 3 holds its 8.6 B language model beside the DiT on every rank: 8 GiB GPUs are
    too small, and the error names the smallest limit that plans."""
    with pytest.raises(ValueError, match=r"gpu_memory_gib=8: no grid and placement of MiniMax Music 3 fits on "
                                         r"4 GPU\(s\); the smallest that works is gpu_memory_gib=") as err:
        plan("minimax_music3", world_size=4, gpu_memory_gib=8)
    need = float(re.search(r"smallest that works is gpu_memory_gib=([0-9.]+)", str(err.value)).group(1))
    assert need > 16 and plan("minimax_music3", world_size=4, gpu_memory_gib=need).memory_per_rank_gib <= need


def test_audio_length_and_image_sizes_are_not_mixed():
    """seconds= is an audio model's only size; an image model refuses it (and the reverse); a length
    outside the model's range is named."""
    with pytest.raises(ValueError, match=r"height=512: model 'stable_audio' takes a size of \['seconds'\] only"):
        spec_for("stable_audio", height=512)
    with pytest.raises(ValueError, match=r"seconds=10: model 'flux' takes a size of \['height', 'width', "):
        plan("flux", world_size=2, seconds=10)
    with pytest.raises(ValueError, match=r"seconds=60: Stable Audio Open generates 0 < seconds <= 47.5"):
        spec_for("stable_audio", seconds=60)
    assert spec_for("ace_step", seconds=30).tokens < spec_for("ace_step", seconds=240).tokens


def test_cli_takes_seconds(capsys):
    assert main(["--model", "ace_step", "--world-size", "4", "--seconds", "120", "--gpu-memory-gib", "80"]) == 0
    assert "ace_step on 4 GPU(s)" in capsys.readouterr().out
    assert main(["--model", "ace_step", "--world-size", "4", "--height", "512"]) == 2
    assert "takes a size of ['seconds'] only" in capsys.readouterr().err


def test_an_audio_pipeline_object_counts_its_own_modules():
    """plan(pipe) on a (tiny) StableAudioPipeline counts its own text encoder, projection model
    (a held module) and VAE, at the release's length in tokens."""
    from usp_dit.demo.tiny_stable_audio import tiny_stable_audio_pipeline

    pipe = tiny_stable_audio_pipeline()

    def nbytes(module):
        return sum(p.numel() * p.element_size() for p in module.parameters())

    p = plan(pipe, world_size=2, seconds=10)
    assert p.memory.text_encoders * 2**30 == pytest.approx(nbytes(pipe.text_encoder))
    assert p.memory.others * 2**30 == pytest.approx(nbytes(pipe.projection_model))
    assert p.memory.vae_weights * 2**30 == pytest.approx(nbytes(pipe.vae))
