"""CFG parallel for pipelines that call the transformer twice a step (``usp_dit.pipelines.cfg_pair``
Note [two calls a step]): the argument matching without processes, then the tiny pipelines on CPU gloo.

One spawned group of 4 ranks runs every pipeline case on each grid (U, R, cfg) = (1,2,2) and
(2,1,2) through ``pipe.enable_usp(...)``: the tiny ``FluxPipeline`` with true CFG (a negative
prompt, ``true_cfg_scale=4``), the tiny ``QwenImagePipeline`` with a negative prompt (one prompt;
and two prompts, batch 2, whose first step takes the cfg batch split), the tiny ``WanPipeline``
with guidance, the tiny two-expert Wan 2.2 ``WanPipeline``, the tiny ``HunyuanVideoPipeline`` with
true CFG (a negative prompt, ``true_cfg_scale=3``), the tiny ``ChromaPipeline`` with guidance and
the tiny ``Flux2KleinPipeline`` (base Klein, ``guidance_scale=4``: the empty negative prompt), one
prompt each. Each: the result equal to the one-process run, AND the speculation used: the number
of forward computations per rank (a pre-hook on block 0, which runs once per computation however
the call was answered) is ``steps + 1`` per transformer (the first step learns: two computations;
every later step one), where one process computes ``2 * steps``; the pair's own counters agree.
Cases where the speculation must be refused, on the Wan pipeline: a ``callback_on_step_end`` that
changes the negative embeds after step 1 (the pending result of step 2 is dropped and the pair
learned again: 6 computations in 4 steps) and one that turns guidance off after step 1 (one call a
step from then on: each step's guess is dropped at the next call; 5 computations in 4 steps); both
equal one process. After ``pipe.disable_usp()``: the forward and the state gone, the pair cleared, the run
bit-identical to the one before enable. And a pipeline with one call a step at ``cfg_degree=2``
(Flux without true CFG, batch 1: refused before this mode) runs each call whole on both cfg groups,
equal to one process, ``steps`` computations per rank (no faster, nothing speculated).

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on the final latents and on the images and
video frames, Wan's and HunyuanVideo's included. Measured: latents bit-identical to one process for
Flux, Wan, HunyuanVideo and Flux.2 Klein (at these sizes the "auto" ring schedule makes one kernel
call over the whole K/V: the same arithmetic per query row as stock), 6.4e-7 for Qwen-Image (its
masked joint text) and 1.1e-6 for Chroma (its mask as an extra Q/K coordinate); outputs 1.3e-6
(Flux, Chroma), 3.5e-7 (Qwen-Image), 5.2e-7 (Wan frames), 1.2e-6 (HunyuanVideo frames), 5.7e-7
(Flux.2 Klein): the decode's own rounding (enable_usp may split the decode over the ranks). Wan's
and HunyuanVideo's frames need no 1e-4 here: their pipeline tests allow it for the random VAEs'
gain on latents that differ by ~1e-7, and here the latents do not differ. The speculated result
is the one the call computes on cfg group 1 (the same inputs, the same grid), so speculation adds
no error of its own.
"""
from __future__ import annotations

import inspect
import logging

import pytest
import torch

from usp_dit.demo.tiny_chroma import tiny_chroma_pipeline
from usp_dit.demo.tiny_flux import tiny_flux_pipeline
from usp_dit.demo.tiny_flux2 import MISTRAL_LAYERS, tiny_flux2_klein_pipeline
from usp_dit.demo.tiny_hunyuan_video import TINY_PROMPT_TEMPLATE, tiny_hunyuan_video_pipeline
from usp_dit.demo.tiny_qwen_image import tiny_qwen_image_pipeline
from usp_dit.demo.tiny_wan import tiny_wan_pipeline
from usp_dit.pipelines import cfg_pair, is_usp_enabled
from usp_dit.pipelines.cfg_pair import (
    MISSING,
    BranchPair,
    CfgPair,
    call_mode,
    cfg_pair_for,
    learn_pair,
    matches,
    record_call,
    same,
)
from usp_dit.testing import assert_no_crash, rel_err, run_spawned

TOL = 1e-5
WORLD = 4
GRIDS = [(1, 2, 2), (2, 1, 2)]  # (U, R, cfg): every rank of the group, two cfg groups of 2


# ---- the argument matching, no processes --------------------------------------------------------


def _call(**kwargs) -> dict:
    return dict(kwargs)


def test_same_is_identity_then_equal_values():
    t = torch.arange(6.0).reshape(2, 3)
    frozen = cfg_pair.freeze(t)
    assert same(frozen, t)  # identity
    assert same(frozen, t.clone())  # equal values
    assert not same(frozen, t + 1)
    assert not same(frozen, t.double())  # equal values, another dtype
    assert not same(frozen, t.reshape(3, 2))
    assert not same(frozen, None) and not same(cfg_pair.freeze(None), t)
    assert same(cfg_pair.freeze(3), 3) and not same(cfg_pair.freeze(3), 3.0) and not same(cfg_pair.freeze(True), 1)
    nan = torch.tensor([float("nan")])
    assert not same(cfg_pair.freeze(nan), nan.clone())  # torch.equal: NaN is never equal (the same on every rank)


def test_a_tensor_changed_in_place_is_never_equal():
    t = torch.ones(4)
    frozen = cfg_pair.freeze(t)
    t.add_(1)
    assert not same(frozen, t)  # the same object, changed since it was recorded
    assert not same(frozen, torch.full((4,), 2.0))


def test_containers_are_recorded_by_content():
    kwargs = {"scale": 1.0}
    shapes = [[(1, 3, 5)]]
    recorded = record_call(_call(attention_kwargs=kwargs, img_shapes=shapes), ())
    kwargs["scale"] = 0.5  # the pipeline's dict, changed in place between two calls
    shapes[0].append((1, 3, 5))
    assert not matches(recorded, _call(attention_kwargs=kwargs, img_shapes=[[(1, 3, 5)]]), ())
    assert not matches(recorded, _call(attention_kwargs={"scale": 1.0}, img_shapes=shapes), ())
    assert matches(recorded, _call(attention_kwargs={"scale": 1.0}, img_shapes=[[(1, 3, 5)]]), ())


def test_a_missing_argument_and_the_mode_differ():
    x = torch.ones(2)
    recorded = record_call(_call(hidden_states=x), ("mode a",))
    assert matches(recorded, _call(hidden_states=x), ("mode a",))
    assert not matches(recorded, _call(hidden_states=x), ("mode b",))
    assert not matches(recorded, _call(hidden_states=x, guidance=x), ("mode a",))
    assert not matches(recorded, _call(), ("mode a",))


BRANCH = ("encoder_hidden_states", "pooled_projections")


def _step_calls():
    latents, t = torch.randn(1, 8, 4), torch.tensor([0.5])
    cond, neg = torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    pooled, neg_pooled = torch.randn(1, 4), torch.randn(1, 4)
    a = _call(hidden_states=latents, timestep=t, encoder_hidden_states=cond, pooled_projections=pooled,
              return_dict=False)
    b = _call(hidden_states=latents.clone(), timestep=t * 1, encoder_hidden_states=neg,
              pooled_projections=neg_pooled, return_dict=False)
    return a, b


def test_a_pair_is_two_calls_equal_but_in_their_branch_arguments():
    a, b = _step_calls()
    pair = learn_pair(record_call(a, ()), record_call(b, ()), BRANCH)
    assert isinstance(pair, BranchPair)
    assert pair.starts(a) and not pair.starts(b)
    # the call after a (recorded) is a with b's branch values substituted: b itself
    assert matches(pair.other_of(record_call(a, ())), b, ())
    # not a pair: the latents differ (two steps, or two unrelated calls) ...
    moved = {**b, "hidden_states": b["hidden_states"] + 1}
    assert learn_pair(record_call(a, ()), record_call(moved, ()), BRANCH) is None
    # ... an argument outside the branch differs ...
    assert learn_pair(record_call(a, ()), record_call({**b, "return_dict": True}, ()), BRANCH) is None
    # ... the same call twice, or another mode
    assert learn_pair(record_call(a, ()), record_call(dict(a), ()), BRANCH) is None
    assert learn_pair(record_call(a, ("x",)), record_call(b, ("y",)), BRANCH) is None
    assert learn_pair(None, record_call(b, ()), BRANCH) is None


def test_a_branch_argument_passed_by_one_call_only():
    a, b = _step_calls()
    del b["pooled_projections"]
    pair = learn_pair(record_call(a, ()), record_call(b, ()), BRANCH)
    assert pair is not None and pair.second["pooled_projections"] is MISSING
    expected = pair.other_of(record_call(a, ()))
    assert "pooled_projections" not in expected and matches(expected, b, ())


def test_the_call_mode_reads_grad_and_training():
    model = torch.nn.Linear(2, 2)
    with torch.no_grad():
        off = call_mode(model)
    assert call_mode(model) != off
    model.eval()
    with torch.no_grad():
        assert call_mode(model) != off


class _FakeMesh:
    """What CfgPair reads of a mesh, for one process: cfg rank 0 of 2."""

    cfg_degree, cfg_rank, cfg_group = 2, 0, None


def _maths(scale, hidden_states, timestep, encoder_hidden_states, pooled_projections=None, return_dict=False):
    return (hidden_states * scale + encoder_hidden_states.mean() + timestep,)


class _Model(torch.nn.Module):
    """A stand-in transformer that counts its computations."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = torch.nn.Parameter(torch.tensor(2.0))
        self.computed = 0

    def forward(self, hidden_states, timestep, encoder_hidden_states, pooled_projections=None, return_dict=False):
        self.computed += 1
        return _maths(self.scale, hidden_states, timestep, encoder_hidden_states, pooled_projections, return_dict)


def _pair_calls(monkeypatch, steps, change_negative_at=None, single_from=None, grad=False):
    """A two-call denoising loop through a CfgPair as cfg rank 0 of a one-process fake mesh: the
    exchange returns this rank's output and the output cfg rank 1 would compute (the call with
    ``second`` substituted). Returns (each call's result, each call's direct result, the pair)."""
    model = _Model()
    pair = CfgPair(_FakeMesh(), BRANCH)

    def fake_exchange(out, mesh):
        expected = pair.pair.other_of(pair.last)  # the call group 1 runs (pair.last: the call speculated on)
        return out, _maths(model.scale, **{k: cfg_pair.thaw(v) for k, v in expected.items() if k != "(call mode)"})

    monkeypatch.setattr(cfg_pair, "_exchange", fake_exchange)
    signature = inspect.signature(model.forward)
    cond, neg = torch.randn(1, 3, 4), torch.randn(1, 3, 4)
    latents = torch.randn(1, 8, 4)
    results, refs = [], []
    with torch.set_grad_enabled(grad):
        for step in range(steps):
            t = torch.tensor([1.0 - step / steps])
            if change_negative_at == step:
                neg = neg * 0.5
            branches = [cond] if single_from is not None and step >= single_from else [cond, neg]
            for emb in branches:  # fresh tensors at every call, as the input sync makes them
                kwargs = dict(hidden_states=latents.clone(), timestep=t.clone(), encoder_hidden_states=emb.clone())
                results.append(pair(model.forward, model, signature.bind(**kwargs))[0])
                refs.append(_maths(model.scale, **kwargs)[0])
            latents = latents - 0.1 * results[-1].detach()
    assert pair.stats["computed"] == model.computed
    return results, refs, pair


def test_cfg_pair_speculates_and_serves_after_the_first_step(monkeypatch):
    results, refs, pair = _pair_calls(monkeypatch, steps=4)
    assert all(torch.equal(r, e) for r, e in zip(results, refs))
    assert pair.stats == dict(computed=5, speculated=3, served=3, dropped=0)


def test_cfg_pair_drops_a_guess_that_does_not_match(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="usp_dit.cfg_pair")
    results, refs, pair = _pair_calls(monkeypatch, steps=4, change_negative_at=2)
    assert all(torch.equal(r, e) for r, e in zip(results, refs))
    # step 2 speculates with the old negative embeds: dropped, computed, learned again
    assert pair.stats == dict(computed=6, speculated=3, served=2, dropped=1)
    (message,) = [r.getMessage() for r in caplog.records]  # logged once
    assert "text conditioning changed (encoder_hidden_states" in message


def test_cfg_pair_one_call_a_step(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="usp_dit.cfg_pair")
    results, refs, pair = _pair_calls(monkeypatch, steps=4, single_from=2)
    (message,) = [r.getMessage() for r in caplog.records]
    assert "not the other guidance branch (encoder_hidden_states, hidden_states, timestep differ" in message
    assert all(torch.equal(r, e) for r, e in zip(results, refs))
    assert pair.stats == dict(computed=5, speculated=3, served=1, dropped=1)
    assert pair.pending is not None  # the last step's guess, dropped at the next call or by clear()
    pair.clear()
    assert pair.pending is None and pair.pair is None and pair.last is None


def test_cfg_pair_does_not_speculate_a_call_that_needs_grad(monkeypatch):
    results, refs, pair = _pair_calls(monkeypatch, steps=3, grad=True)
    assert all(torch.equal(r, e) for r, e in zip(results, refs))
    assert pair.stats == dict(computed=6, speculated=0, served=0, dropped=0)


def test_two_call_families_are_data():
    from usp_dit.pipelines.families import chroma, cogvideox, flux, flux2, hunyuan_video, qwen_image, sd3, wan

    assert flux.ADAPTER.cfg_branch_args and qwen_image.ADAPTER.cfg_branch_args and wan.ADAPTER.cfg_branch_args
    assert hunyuan_video.ADAPTER.cfg_branch_args and chroma.ADAPTER.cfg_branch_args and flux2.ADAPTER.cfg_branch_args
    assert not cogvideox.ADAPTER.cfg_branch_args and not sd3.ADAPTER.cfg_branch_args  # batched guidance
    mesh = _FakeMesh()
    assert isinstance(cfg_pair_for(wan.ADAPTER, mesh, True), CfgPair)
    assert cfg_pair_for(cogvideox.ADAPTER, mesh, True) is None
    mesh.cfg_degree = 4
    assert cfg_pair_for(wan.ADAPTER, mesh, True) is None


# ---- the pipelines, on 4 gloo ranks -----------------------------------------------------------------


def _counting(pipe) -> tuple[dict[str, list], list]:
    """Per transformer component, a list that grows by one at each forward computation (a pre-hook
    on its first block), and the hooks' handles."""
    counts, handles = {}, []
    for name in ("transformer", "transformer_2"):
        model = getattr(pipe, name, None)
        if model is None:
            continue
        blocks = model.blocks if hasattr(model, "blocks") else model.transformer_blocks
        counts[name] = []
        handles.append(blocks[0].register_forward_pre_hook(lambda *a, seen=counts[name]: seen.append(1)))
    return counts, handles


def _keep_latents(last: dict, then=None):
    def callback(pipe, step, timestep, tensors):
        last["latents"] = tensors["latents"]
        return then(pipe, step, tensors) if then else {}
    return callback


def _halve_negative_after_step_1(pipe, step, tensors):
    return {"negative_prompt_embeds": tensors["negative_prompt_embeds"] * 0.5} if step == 1 else {}


def _guidance_off_after_step_1(pipe, step, tensors):
    if step == 1:
        pipe._guidance_scale = 1.0  # WanPipeline reads do_classifier_free_guidance at every step
    return {}


def _flux(pipe, callback):
    return pipe(
        "a tiny red fox", negative_prompt="blurry and dark", true_cfg_scale=4.0, guidance_scale=3.5, height=40,
        width=40, num_inference_steps=3, max_sequence_length=16, generator=torch.Generator().manual_seed(0),
        output_type="pt", callback_on_step_end=callback,
    ).images


def _qwen(prompts):
    prompt, negative = prompts

    def run(pipe, callback):
        return pipe(
            prompt=prompt, negative_prompt=negative, true_cfg_scale=4.0, height=48, width=80, num_inference_steps=3,
            generator=torch.Generator().manual_seed(0), output_type="pt", callback_on_step_end=callback,
        ).images
    return run


def _wan(steps=3, then=None):
    def run(pipe, callback):
        return pipe(
            prompt="a red fox jumps over a log", negative_prompt="blurry", height=48, width=80, num_frames=9,
            num_inference_steps=steps, max_sequence_length=16, generator=torch.Generator().manual_seed(0),
            output_type="pt", callback_on_step_end=callback,
            callback_on_step_end_tensor_inputs=["latents", "negative_prompt_embeds"],
        ).frames
    return run


def _hunyuan_video(pipe, callback):
    return pipe(
        prompt="a red fox", negative_prompt="blurry", true_cfg_scale=3.0, height=48, width=80, num_frames=9,
        num_inference_steps=3, max_sequence_length=16, prompt_template=TINY_PROMPT_TEMPLATE,
        generator=torch.Generator().manual_seed(0), output_type="pt", callback_on_step_end=callback,
    ).frames


def _chroma(pipe, callback):
    return pipe(
        prompt="a red fox", negative_prompt="dark dim", guidance_scale=4.0, height=12, width=20,
        num_inference_steps=3, max_sequence_length=12, generator=torch.Generator().manual_seed(0),
        output_type="pt", callback_on_step_end=callback,
    ).images


def _flux2_klein(pipe, callback):
    return pipe(
        prompt="a red fox", guidance_scale=4.0, height=12, width=20, num_inference_steps=3, max_sequence_length=40,
        text_encoder_out_layers=MISTRAL_LAYERS, generator=torch.Generator().manual_seed(0), output_type="pt",
        callback_on_step_end=callback,
    ).images


def _flux_one_call(pipe, callback):
    return pipe(
        "a tiny red fox", guidance_scale=3.5, height=40, width=40, num_inference_steps=3, max_sequence_length=16,
        generator=torch.Generator().manual_seed(0), output_type="pt", callback_on_step_end=callback,
    ).images


# name -> (pipeline builder, run(pipe, callback), a step callback or None)
CASES = {
    "flux": (tiny_flux_pipeline, _flux, None),
    "qwen": (tiny_qwen_image_pipeline, _qwen(("a red fox jumps", "blurry")), None),
    "qwen-batch2": (tiny_qwen_image_pipeline, _qwen((["a red fox jumps", "a cat"], ["blurry", "dark and dim"])), None),
    "wan": (tiny_wan_pipeline, _wan(), None),
    "wan22": (lambda: tiny_wan_pipeline(two_experts=True), _wan(steps=6), None),
    "wan-negative-changed": (tiny_wan_pipeline, _wan(steps=4), _halve_negative_after_step_1),
    "wan-guidance-off": (tiny_wan_pipeline, _wan(steps=4), _guidance_off_after_step_1),
    "hunyuan_video": (tiny_hunyuan_video_pipeline, _hunyuan_video, None),
    "chroma": (tiny_chroma_pipeline, _chroma, None),
    "flux2-klein": (tiny_flux2_klein_pipeline, _flux2_klein, None),
    "flux-one-call-a-step": (tiny_flux_pipeline, _flux_one_call, None),
}


def _generate(pipe, run, then):
    last = {}
    out = run(pipe, _keep_latents(last, then))
    if then is _guidance_off_after_step_1:
        pipe._guidance_scale = None  # set again by the next call
    return last["latents"], out


def _pipeline_case(name: str) -> dict:
    build, run, then = CASES[name]
    pipe = build()
    pipe.set_progress_bar_config(disable=True)
    counts, handles = _counting(pipe)
    ref_latents, ref_out = _generate(pipe, run, then)
    ref_counts = {k: len(v) for k, v in counts.items()}
    results = {}
    for u, r, c in GRIDS:
        for seen in counts.values():
            seen.clear()
        pipe.enable_usp(ulysses_degree=u, ring_degree=r, cfg_degree=c)
        pairs = {k: getattr(pipe, k)._usp_dit_state.cfg_pair for k in counts}
        try:
            latents, out = _generate(pipe, run, then)
            stats = {k: dict(p.stats) for k, p in pairs.items()}
        finally:
            pipe.disable_usp()
        restored = all(not is_usp_enabled(getattr(pipe, k)) and "forward" not in getattr(pipe, k).__dict__
                       for k in counts)
        cleared = all(p.pending is None and p.pair is None and p.last is None for p in pairs.values())
        results[f"u{u}r{r}cfg{c}"] = {
            "latents": rel_err(latents, ref_latents), "out": rel_err(out, ref_out),
            "computed": {k: len(v) for k, v in counts.items()}, "stats": stats,
            "restored": restored, "cleared": cleared,
        }
    for seen in counts.values():
        seen.clear()
    again_latents, again_out = _generate(pipe, run, then)
    for h in handles:
        h.remove()
    results["one-process"] = {"computed": ref_counts}
    results["after-disable-bit-identical"] = torch.equal(again_latents, ref_latents) and torch.equal(again_out, ref_out)
    return results


def _run_all() -> dict:
    results = {}
    for name in CASES:
        try:
            results[name] = _pipeline_case(name)
        except Exception as exc:  # the parent reports it; the other cases still run
            results[name] = f"{type(exc).__name__}: {exc}"
    return results


@pytest.fixture(scope="module")
def pipeline_results() -> list[dict]:
    per_rank = run_spawned(_run_all, WORLD)
    assert_no_crash(per_rank)
    return per_rank


def _case(per_rank: list[dict], name: str) -> list[dict]:
    for rank, res in enumerate(per_rank):
        assert not isinstance(res[name], str), f"rank {rank}: {res[name]}"
    return [res[name] for res in per_rank]


GRID_IDS = [f"u{u}r{r}cfg{c}" for u, r, c in GRIDS]


@pytest.mark.parametrize("grid", GRID_IDS)
@pytest.mark.parametrize("name", list(CASES))
def test_two_call_pipeline_matches_one_process(pipeline_results, name: str, grid: str):
    for rank, res in enumerate(_case(pipeline_results, name)):
        got = res[grid]
        assert got["latents"] <= TOL, f"rank {rank}: latents {got['latents']:.2e}"
        assert got["out"] <= TOL, f"rank {rank}: output {got['out']:.2e}"
        assert got["restored"] and got["cleared"], f"rank {rank}: disable_usp left state behind"


def _steps_per_transformer(res: dict) -> dict[str, int]:
    """Steps each transformer ran in one process: two calls a step there."""
    return {k: n // 2 for k, n in res["one-process"]["computed"].items()}


@pytest.mark.parametrize("grid", GRID_IDS)
@pytest.mark.parametrize("name", ["flux", "qwen", "qwen-batch2", "wan", "wan22", "hunyuan_video", "chroma",
                                  "flux2-klein"])
def test_speculation_halves_the_computations_after_the_first_step(pipeline_results, name: str, grid: str):
    for rank, res in enumerate(_case(pipeline_results, name)):
        steps = _steps_per_transformer(res)
        assert all(n >= 1 for n in steps.values())
        if name == "wan22":
            assert set(steps) == {"transformer", "transformer_2"} and min(steps.values()) >= 2, steps
        got = res[grid]
        assert got["computed"] == {k: s + 1 for k, s in steps.items()}, f"rank {rank}: {got['computed']} for {steps}"
        for k, s in steps.items():
            assert got["stats"][k] == dict(computed=s + 1, speculated=s - 1, served=s - 1, dropped=0), (rank, k)


@pytest.mark.parametrize("grid", GRID_IDS)
def test_changed_negative_embeds_refuse_one_guess(pipeline_results, grid: str):
    """4 steps: learn (2), served (1), callback halves the negative embeds, step 2's guess dropped
    and the pair learned again (2), served (1)."""
    for rank, res in enumerate(_case(pipeline_results, "wan-negative-changed")):
        assert res["one-process"]["computed"] == {"transformer": 8}
        assert res[grid]["computed"] == {"transformer": 6}, f"rank {rank}"
        assert res[grid]["stats"]["transformer"] == dict(computed=6, speculated=3, served=2, dropped=1)


@pytest.mark.parametrize("grid", GRID_IDS)
def test_guidance_off_for_some_steps_refuses_the_guesses(pipeline_results, grid: str):
    """4 steps, guidance off after step 1: learn (2), served (1), then one call a step, each
    speculated and its guess dropped at the next call (1 + 1)."""
    for rank, res in enumerate(_case(pipeline_results, "wan-guidance-off")):
        assert res["one-process"]["computed"] == {"transformer": 6}
        assert res[grid]["computed"] == {"transformer": 5}, f"rank {rank}"
        assert res[grid]["stats"]["transformer"] == dict(computed=5, speculated=3, served=1, dropped=1)


@pytest.mark.parametrize("name", list(CASES))
def test_disable_restores_the_one_process_pipeline(pipeline_results, name: str):
    for rank, res in enumerate(_case(pipeline_results, name)):
        assert res["after-disable-bit-identical"], f"rank {rank}"


@pytest.mark.parametrize("grid", GRID_IDS)
def test_one_call_a_step_runs_whole_on_both_cfg_groups(pipeline_results, grid: str):
    """Flux without true CFG: no pair to learn; every call computed (on both groups), none speculated."""
    for rank, res in enumerate(_case(pipeline_results, "flux-one-call-a-step")):
        assert res["one-process"]["computed"] == {"transformer": 3}
        assert res[grid]["computed"] == {"transformer": 3}, f"rank {rank}"
        assert res[grid]["stats"]["transformer"] == dict(computed=3, speculated=0, served=0, dropped=0)
