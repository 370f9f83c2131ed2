"""Helios adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (the 2-rank grids as two data-parallel replicas).
Models: tiny 2-layer ``HeliosTransformer3DModel`` s with the multi-term memory patches (4 heads x
16, every weight perturbed, the history key scales too; ``usp_dit.demo.tiny_helios``), batch 2
with a different prompt, timestep and set of random frame indices (RoPE positions) per element:
- "base" (the release's switches: cross-attention for the current chunk only, the history's
  modulation at timestep 0), 3 current latent frames of 3 x 5 tokens and (long, mid, short)
  history of (4, 2, 2) frames: 45 + 30 + 6 + 2 = 83 tokens, 38 of them history, so the
  history/current boundary falls inside a shard on 2 and on 4 ranks;
- "amplify" (the history's keys amplified, cross-attention and the chunk's timestep for every
  token), history (8, 3, 2): 45 + 30 + 12 + 4 = 91 tokens, 46 history: the boundary falls
  between shards on 2 and on 4 ranks;
- "nohistory": the base model called with no history (45 tokens).
No token count divides 2 or 4.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2), each ring grid also with
the "stream" and "gather_merge" schedules forced. Each case: output vs stock, block 0's attention
sees at most ceil(tokens / P) tokens, bit-identical after ``disable``. Every parameter's gradient
on 2 and 4 ranks for every shape, and with gradient checkpointing; each rank's rotated Q/K of
block 0 (after the history key scaling) equal the same rows of one process's. The stock
``HeliosPipeline``, built tiny (two chunks: the second one's history is the first's output; seeded
prompt embeds), through ``pipe.enable_usp()`` on (2,1) and (2,2) (Wan's VAE on the grid too), and
``cfg_degree=2`` (its two guidance calls a step on the two cfg groups), each equal to one process;
``HeliosPyramidPipeline`` (a stage at half resolution, then full) on (2,2).

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients, rotated Q/K and the
pipelines' final latents: sharding only reorders float32 sums (attention merged by log-sum-exp,
gradients summed over ranks). One exception, ``attn1.history_key_scale`` (the "amplify"
variant's per-head key scale): its gradient is a sum over every history key of terms that
nearly cancel, so any reordering of float32 sums moves it by more (measured: 1.5e-5 on 2 ranks,
the one-process float32 gradient itself being 5e-6 from the float64 model's). It is checked on
the float64 model instead, sharded against one process: within 1e-10 (measured 4e-15; a key
scaled on the wrong rows would be off by O(1)). The decoded frames: 1e-4 (an untrained random VAE's gain, as in
tests/test_pipeline_wan.py).
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from diffusers.models.transformers import transformer_helios

from tests import adapter_parity as parity
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_helios import helios_inputs, helios_tokens, tiny_helios, tiny_helios_pipeline
from usp_dit.demo.tiny_video import TEXT_DIM
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families.helios import ADAPTER, local_context_length
from usp_dit.pipelines.plan import submodule
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_FRAMES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    variant: str
    history: tuple[int, int, int] | None  # (long, mid, short) latent frames
    frames: int = 3
    height: int = 6
    width: int = 10

    def __str__(self) -> str:
        return f"{self.variant}-h{'x'.join(map(str, self.history)) if self.history else 0}"

    @property
    def tokens(self) -> int:
        return helios_tokens(self.frames, self.height, self.width, self.history)


SHAPES = [Shape("base", (4, 2, 2)), Shape("amplify", (8, 3, 2)), Shape("nohistory", None)]


def _build(shape: Shape, seed: int = 0):
    model = tiny_helios("base" if shape.variant == "nohistory" else shape.variant, seed=seed)
    return model, helios_inputs(model, shape.frames, shape.height, shape.width, history=shape.history)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.blocks[0].attn1, shape.tokens)


KEY_SCALE = "history_key_scale"  # the parameter judged against float64 (module docstring)


KEY_SCALE_TOL = 1e-10


def _float64(model, inputs):
    """A float64 copy of ``model`` (its FP32LayerNorms still normalise in float32) and of ``inputs``."""
    model64 = copy.deepcopy(model).double()
    inputs64 = type(inputs)(**{k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v
                               for k, v in inputs.kwargs().items()})
    return model64, inputs64


def _gradient_case(shape: Shape, mesh, checkpointing: bool = False) -> dict[str, float]:
    """tests/adapter_parity.gradient_errors (loss / P per rank, summed over the group, against one
    process), every parameter but ``history_key_scale`` in float32, that one on the float64 model
    (module docstring): ``{"grad": worst error, "key_scale_float64": worst error of the key scales}``."""
    model, inputs = _build(shape)
    if checkpointing:
        model.enable_gradient_checkpointing()
    worst = _summed_errors(model, inputs, mesh, lambda name: not name.endswith(KEY_SCALE))
    key_scale = 0.0
    if model.config.is_amplify_history:
        key_scale = _summed_errors(*_float64(model, inputs), mesh, lambda name: name.endswith(KEY_SCALE))
    return {"grad": worst, "key_scale_float64": key_scale}


def _summed_errors(model, inputs, mesh, judged) -> float:
    """The worst error, over the parameters ``judged(name)`` selects, of the sharded gradient summed
    over the sequence group against one process's."""
    ref = parity._param_grads(model, inputs, 1)
    ADAPTER.enable(model, mesh, "auto")
    try:
        grads = parity._param_grads(model, inputs, mesh.sequence_degree)
    finally:
        ADAPTER.disable(model)
    worst = 0.0
    for name, g in grads.items():
        g = g.contiguous()  # gloo reduces contiguous buffers only
        dist.all_reduce(g, group=mesh.seq_group)
        if judged(name):
            worst = max(worst, rel_err(g, ref[name]))
    return worst


def _first_attention_call(model, inputs, module, name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The (q, k), each (B, S or S_local, H, D), of the first attention call of a forward: rotated,
    and the history's keys amplified."""
    seen = []
    inner = getattr(module, name)

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.clone(), k.clone()))
        return inner(q, k, v, *args, **kwargs)

    with mock.patch.object(module, name, spy):
        parity.forward(model, inputs)
    return seen[0]


def _rotated_qk_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[1])
    q_ref, k_ref = _first_attention_call(model, inputs, transformer_helios, "dispatch_attention_fn")
    ADAPTER.enable(model, mesh, "auto")
    try:
        q, k = _first_attention_call(model, inputs, _routing, "usp_attention")
    finally:
        ADAPTER.disable(model)
    return {"q": rel_err(q, shard_sequence(q_ref, mesh)), "k": rel_err(k, shard_sequence(k_ref, mesh))}


def _embeds() -> dict[str, torch.Tensor]:
    """Seeded prompt embeds (the pipelines' prompt cleaning needs ftfy, which the tests do not)."""
    g = torch.Generator().manual_seed(1)
    return {"prompt_embeds": torch.randn(1, 16, TEXT_DIM, generator=g),
            "negative_prompt_embeds": torch.randn(1, 16, TEXT_DIM, generator=g)}


def _generate(pipe, pyramid: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, frames). Stage 1: two chunks of 3 latent frames at 32 x 48 (18 current +
    12 short + 2 mid + 1 long = 33 tokens a call), 2 steps each; pyramid: one chunk at 64 x 96,
    a step at half resolution, then one at full (the history stays at full: 74, then 128 tokens)."""
    size = dict(height=64, width=96, num_frames=9, pyramid_num_inference_steps_list=[1, 1]) if pyramid else dict(
        height=32, width=48, num_frames=18, num_inference_steps=2)
    return parity.latents_and(
        pipe, "frames",
        **_embeds(), **size, history_sizes=[4, 2, 1], num_latent_frames_per_chunk=3,
        generator=torch.Generator().manual_seed(0), output_type="pt",
    )


PIPELINE_GRIDS = parity.ci_grids({"pipeline-u2r1": (2, 1, 1), "pipeline-u2r2": (2, 2, 1), "pipeline-cfg2": (1, 1, 2)})


def _pipeline_cases() -> dict[str, dict[str, float]]:
    """The tiny HeliosPipeline through ``pipe.enable_usp`` on each of ``PIPELINE_GRIDS``, bit-identical
    after ``pipe.disable_usp``; the pyramid pipeline on (2, 2)."""
    results = parity.pipeline_cases(tiny_helios_pipeline(), _generate, PIPELINE_GRIDS, names=("latents", "frames"),
                                    check_enabled=False)
    results.update(parity.pipeline_cases(
        tiny_helios_pipeline(pyramid=True), lambda p: _generate(p, pyramid=True), {"pipeline-pyramid-u2r2": (2, 2, 1)},
        names=("latents", "frames"), check_enabled=False, after_disable=None,
    ))
    return results


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    parity.record(results, "grad-ckpt-p4", lambda: _gradient_case(SHAPES[1], init_usp(2, 2), checkpointing=True))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(tiny_helios(num_heads=2, head_dim=32), ADAPTER,
                                                          init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


@pytest.mark.parametrize("key", parity.output_keys(SHAPES))
def test_sharded_output_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL)


@pytest.mark.parametrize("key", parity.grad_keys(SHAPES) + ["grad-ckpt-p4"])
def test_parameter_gradients_match_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL)
    assert all(res[key]["key_scale_float64"] <= KEY_SCALE_TOL for res in grid_results), [res[key] for res in grid_results]


def test_rope_and_history_key_scale_match_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", [*PIPELINE_GRIDS, "pipeline-pyramid-u2r2"])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"frames": TOL_FRAMES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_video(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process ------------------------------------------------------------------------------


class _Mesh:
    """What ``local_context_length`` reads of a mesh: the sequence rank and degree."""

    def __init__(self, seq_rank: int, sequence_degree: int) -> None:
        self.seq_rank, self.sequence_degree = seq_rank, sequence_degree


@pytest.mark.parametrize("seq_rank, expected", [(0, 0), (1, 4), (2, 21), (3, 20)])
def test_local_context_length_counts_the_current_tokens_of_each_shard(seq_rank, expected):
    """83 tokens, 38 history, on 4 ranks (21, 21, 21, 20 tokens): rank 0 is history, rank 1 holds
    17 history and 4 current tokens, ranks 2 and 3 only current ones."""
    from usp_dit.pipelines._token_sharding import ShardState

    state = ShardState(_Mesh(seq_rank, 4), "auto", seq_len=83)
    with mock.patch("usp_dit.pipelines.families.helios.layout_sizes", lambda seq, mesh, layout: [21, 21, 21, 20]):
        assert local_context_length(state, 83 - 38) == expected


def test_plan_paths_take_a_negative_block_index():
    model = tiny_helios()
    assert submodule(model, "blocks.-1") is model.blocks[1] and submodule(model, "blocks.0.attn1") is model.blocks[0].attn1
    assert submodule(model, "") is model
    with pytest.raises(AttributeError):
        submodule(model, "blocks.-1.nothing")


def test_attention_mask_is_refused():
    model, _ = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(NotImplementedError, match="attention_mask"):
            model.blocks[0].attn1(torch.randn(1, 5, 64), None, torch.ones(1, 1, 5, 5, dtype=torch.bool), None, 5)
    finally:
        ADAPTER.disable(model)


def test_context_length_beyond_the_sequence_is_refused():
    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        block = model.blocks[0]
        x = torch.randn(2, 83, 64)
        with pytest.raises(ValueError, match=re.escape("original_context_length=90: the sequence has 83 tokens")):
            block(x, torch.randn(2, 9, 64), torch.randn(2, 83, 6, 64), torch.randn(1, 83, 32), 90)
    finally:
        ADAPTER.disable(model)


# ---- the video example's Helios option (argument checks only: nothing loads) ----------------------


def test_video_example_helios_defaults(monkeypatch):
    from tests.test_examples_cli import _example

    for name in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    ex = _example("generate_video")
    args = ex.parse_args(["--model", "helios"])
    assert (args.frames, args.height, args.width, args.degrees) == (17, 96, 144, (1, 1, 1))
    assert "helios" in ex.EMBEDS_FAMILIES and ex.TINY_HELIOS_CHUNKS["num_latent_frames_per_chunk"] == 3
    with pytest.raises(ex.launch.UsageError, match="only chronoedit, consisid, hunyuan_video_framepack, sana_wm, wan_animate take an image"):
        ex.parse_args(["--model", "helios", "--image", "x.png"])
