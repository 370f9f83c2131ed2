"""Ideogram 4 adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo
grids; the stock ``Ideogram4Pipeline`` (two transformers: asymmetric CFG) through ``pipe.enable_usp()``.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas. Model: a tiny ``Ideogram4Transformer2DModel`` (2 layers, 4 heads x 16, every weight
perturbed; ``usp_dit.demo.tiny_ideogram4``). Inputs packed as the pipeline packs them
(``[left padding; text; image]``, ``Ideogram4Pipeline._prepare_ids``: MRoPE positions of the text
and of the image grid at its 65536 offset, padding in segment -1): 3 x 5 = 15 image tokens beside 6
text rows with prompts of 2 and 5 valid tokens (padding rows differ per element: the segment mask
differs per element), 5 x 7 = 35 image tokens beside 9 rows with 7 and 3 valid tokens and a
per-token (B, L) timestep, the unconditional call's 5 x 7 image alone, and 15 image tokens beside
4 unpadded text rows (no padding segment); neither 15 nor 35
divides 2 or 4; batch 2 with different latents, features and times. The text part is replicated,
the image split (``usp_dit.pipelines.families.ideogram4`` Note [Ideogram 4's packed sequence]); the
whole output is compared, the padding rows included.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced (Note [schedules in CI]).
Each case: output vs stock, block 0's attention sees at most ceil(N / P) image tokens beside the
text rows, after ``disable`` the output is bit-identical. Every parameter's gradient (``GRAD_SHAPES``):
both padded shapes on 4 ranks, the first and the image alone on 2; once with gradient checkpointing. The transformer enabled with cfg_degree=2
(its batch of 2 split over the cfg groups) equals stock. Fullgraph compile: the blocks
(``compile_repeated_blocks(fullgraph=True)``, through AOTAutograd) on (2,2), one graph, equal to
eager. Tensor parallelism (heads and SwiGLU width) with tensor_degree=2, alone and beside
ulysses_degree=2, equals stock and leaves the weights as found. Refusals: image tokens that are not one suffix, or span two segments, on 2 ranks.

Pipeline: the tiny ``Ideogram4Pipeline`` (36-layer tiny Qwen3-VL, character tokenizer, 2x Flux.2
VAE, two transformers), two prompts of different lengths left-padded to 40 tokens, 20 x 28 (35
image tokens), 2 steps, on (2,1,1), (2,2,1) and (1,2,2), equal to one process's (the unconditional
transformer's block 0 seeing its shard of the image), and bit-identical after ``disable_usp``.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients and the pipeline's final
latents: sharding only reorders float32 sums (attention blocks merged by log-sum-exp, gradients
summed over ranks, tensor-parallel partial products all-reduced). Decoded images: 1e-4 (an untrained random VAE's gain).
"""
from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass

import pytest
import torch

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import disable_usp, enable_usp, init_usp, single_rank_mesh
from usp_dit.demo.tiny_ideogram4 import ideogram4_inputs, tiny_ideogram4, tiny_ideogram4_pipeline
from usp_dit.pipelines.families.ideogram4 import ADAPTER, USPIdeogram4AttnProcessor
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    grid_h: int
    grid_w: int
    text_lens: tuple[int, ...]
    max_text: int
    per_token_time: bool = False

    @property
    def tokens(self) -> int:
        return self.grid_h * self.grid_w

    def __str__(self) -> str:
        time = "-tL" if self.per_token_time else ""
        return f"{self.grid_h}x{self.grid_w}-t{'-'.join(map(str, self.text_lens))}of{self.max_text}{time}"


SHAPES = [
    Shape(3, 5, (2, 5), 6),  # 15 image tokens, padded prompts of different lengths
    Shape(5, 7, (7, 3), 9, per_token_time=True),  # 35 image tokens, (B, L) time
    Shape(5, 7, (0, 0), 0),  # the unconditional call: the image alone
    Shape(3, 5, (4, 4), 4),  # no padding: every text key is the image's (one joint call, no local part)
]


# Gradients: the padded shapes on 4 ranks, the padded and the image-alone ones on 2.
GRAD_SHAPES = {2: [SHAPES[0], SHAPES[2]], 4: [SHAPES[0], SHAPES[1]]}


def _build(shape: Shape, seed: int = 0):
    inputs = ideogram4_inputs(shape.grid_h, shape.grid_w, shape.text_lens, shape.max_text,
                              per_token_time=shape.per_token_time)
    return tiny_ideogram4(seed=seed), inputs


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.layers[0].attention, shape.tokens,
                                      replicated=shape.max_text)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[0])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _compiled_blocks_case(mesh) -> dict[str, float]:
    """The blocks compiled with fullgraph=True (Diffusers' regional compilation) under the adapter,
    vs the eager enabled model: one graph for both blocks."""
    from torch._dynamo.testing import CompileCounterWithBackend

    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, mesh, "auto")
    try:
        ref = parity.forward(model, inputs)
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(parity.compile_backend())
        model.compile_repeated_blocks(backend=counter, fullgraph=True)
        got = parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
    return {"err": rel_err(got, ref), "graphs_not_1": float(counter.frame_count != 1)}


def _tensor_case(mesh) -> dict[str, float]:
    """The transformer enabled with a tensor degree (heads and SwiGLU width cut): equal to stock, its
    weights left as found."""
    model, inputs = _build(SHAPES[1])
    ref = parity.forward(model, inputs)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    enable_usp(model, mesh=mesh)
    try:
        out = parity.forward(model, inputs)
    finally:
        disable_usp(model)
    after = model.state_dict()
    return {"out": rel_err(out, ref),
            "weights_not_restored": float(not all(torch.equal(after[k], v) for k, v in before.items()))}


def _refusal_case(mesh) -> dict[str, float]:
    """A sequence the split cannot run exactly raises NotImplementedError on every rank."""
    model, inputs = _build(SHAPES[0])
    first = dict(inputs.kwargs())
    first["indicator"] = first["indicator"].flip(1)  # image first: not a suffix
    two = dict(inputs.kwargs())
    two["segment_ids"] = two["segment_ids"].clone()
    two["segment_ids"][:, -1] = 5  # the last image token in a segment of its own
    missed = {}
    ADAPTER.enable(model, mesh, "auto")
    try:
        for name, call, match in (("not_suffix", first, "contiguous suffix"), ("two_segments", two, "one segment_id")):
            try:
                model(**call)
                missed[name] = 1.0
            except NotImplementedError as exc:
                missed[name] = float(match not in str(exc))
    finally:
        ADAPTER.disable(model)
    return missed


PROMPTS = ["a red fox in snow", "cat"]  # of different lengths: left-padded, padding in its own segment


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    return parity.latents_and(pipe, prompt=PROMPTS, height=20, width=28, num_inference_steps=2, guidance_scale=4.0,
                              guidance_schedule=None, max_sequence_length=40,
                              generator=torch.Generator().manual_seed(0), output_type="pt")


PIPELINE_GRIDS = parity.ci_grids(parity.pipeline_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)]))


@contextlib.contextmanager
def _unconditional_split(pipe, grid: tuple[int, int, int]):
    """A ``pipeline_cases`` probe: 1.0 under "unconditional_not_split" unless the second model's block 0
    saw at most ceil(35 / (U * R)) tokens (``pipe.enable_usp()`` enabled ``unconditional_transformer`` too)."""
    seen = []
    attention = pipe.unconditional_transformer.layers[0].attention
    hook = attention.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[1]))
    try:
        yield lambda: {"unconditional_not_split": float(not seen or max(seen) > math.ceil(35 / (grid[0] * grid[1])))}
    finally:
        hook.remove()


def _run_all() -> dict[str, dict | str]:
    warnings.filterwarnings("ignore", category=FutureWarning)
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh),
                          grad_shapes=GRAD_SHAPES)
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: parity.cfg_split_case(*_build(SHAPES[0]), init_usp(1, 2, 2)))
    parity.record(results, "compiled-blocks", lambda: _compiled_blocks_case(init_usp(2, 2)))
    parity.record(results, "tensor-t2", lambda: _tensor_case(init_usp(tensor_degree=2)))
    parity.record(results, "tensor-t2-u2", lambda: _tensor_case(init_usp(ulysses_degree=2, tensor_degree=2)))
    parity.record(results, "refusals", lambda: _refusal_case(init_usp(2, 1)))
    parity.record(results, "pipeline",
                  lambda: parity.pipeline_cases(tiny_ideogram4_pipeline(), _generate, PIPELINE_GRIDS,
                                                probe=_unconditional_split), many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(by_world=GRAD_SHAPES) + ["grad-ckpt-p4"], TOL)


def test_cfg_degree_2_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


def test_compiled_blocks_are_one_graph_equal_to_eager(grid_results):
    parity.assert_within(grid_results, "compiled-blocks", TOL, {"graphs_not_1": 0.0})


@pytest.mark.parametrize("key", ["tensor-t2", "tensor-t2-u2"])
def test_tensor_parallel_matches_stock_and_restores_weights(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL)


def test_inexact_layouts_are_refused(grid_results):
    parity.assert_within(grid_results, "refusals", 0.0)


@pytest.mark.parametrize("key", list(PIPELINE_GRIDS))
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0, fallback="pipeline")


# ---- single process: registration, restore exactly, loud failures ---------------------------------


test_find_adapter_finds_ideogram4 = family_checks.adapter_found(tiny_ideogram4, ADAPTER)
test_disable_restores_processors_and_forward = family_checks.disable_restores(
    lambda: _build(SHAPES[0]), ADAPTER, USPIdeogram4AttnProcessor)
test_one_rank_is_bit_identical = family_checks.one_rank_bit_identical(lambda: _build(SHAPES[0]), ADAPTER)
test_foreign_processor_is_refused = family_checks.foreign_processor_refused(
    tiny_ideogram4, ADAPTER, "layers.1.attention")


def test_processor_swapped_after_enable_is_refused_at_the_call():
    from diffusers.models.transformers.transformer_ideogram4 import Ideogram4AttnProcessor

    model, inputs = _build(SHAPES[0])
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        model.layers[0].attention.set_processor(Ideogram4AttnProcessor())
        with pytest.raises(NotImplementedError, match="became Ideogram4AttnProcessor after enable_usp"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)


