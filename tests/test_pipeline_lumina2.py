"""Lumina-Image 2.0 adapter: sharded outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (the 2-rank grids as two data-parallel replicas).
Model: a tiny ``Lumina2Transformer2DModel`` (2 context-refiner, 2 noise-refiner and 2 joint layers;
6 query heads and 2 kv heads of 16: Lumina-Image 2.0's 3:1 GQA, which Ulysses 4 splits unevenly and
with fewer kv heads than ranks; every weight perturbed; ``usp_dit.demo.tiny_lumina2``). Shapes:
3 x 5 = 15 patches with captions of 3 and 7 valid tokens out of 9 (Note [Lumina2's joint layout]:
the image sits at offset 3 in one element and 7 in the other, the joint sequence padded and masked),
and 3 x 3 = 9 patches with 9 and 9 (equal lengths: stock passes no mask). No token count divides 2
or 4; batch 2 with different prompts and timesteps; the 3-D RoPE is the model's own.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2), each ring grid also with the
"stream" and "gather_merge" schedules forced. Each case: output vs stock, the first noise-refiner
attention sees at most ceil(tokens / P) image tokens, after ``disable`` the output is bit-identical.
Every parameter's gradient on 2 and 4 ranks per shape, and with gradient checkpointing (every layer
recomputed with its forward's rearranged table). The tiny ``Lumina2Pipeline`` (Gemma 2 text encoder,
prompts of different lengths padded to 64 and masked, true CFG: two calls of batch 2 a step) through
``pipe.enable_usp()`` on (2,1,1), (2,2,1) and (1,2,2), 2 steps, and with one prompt and
``cfg_degree=2`` (its two calls a step on the two cfg groups); bit-identical after ``disable_usp``.
On one process (sequence degree 1): bit-identical to stock, with no copying op and no attention kernel
call that stock does not make (a padded caption of batch 1, and equal captions of batch 2).
Not compiled: the stock forward reads the caption lengths with ``.tolist()`` (a graph break).

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients and the pipeline's latents:
sharding only reorders float32 sums (attention blocks merged by log-sum-exp, masked captions per
element, gradients summed over ranks). Decoded images: 1e-4 (an untrained random VAE's gain).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from tests import adapter_parity as parity
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_lumina2 import lumina2_inputs, tiny_lumina2, tiny_lumina2_pipeline
from usp_dit.pipelines import is_usp_enabled
from usp_dit.pipelines.families.lumina2 import ADAPTER
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    height: int  # patches
    width: int
    valid: tuple  # real caption tokens per element (of 9)

    def __str__(self) -> str:
        return f"s{self.height * self.width}-cap{'-'.join(map(str, self.valid))}"


SHAPES = [Shape(3, 5, (3, 7)), Shape(3, 3, (9, 9))]


def _build(shape: Shape, seed: int = 0):
    return tiny_lumina2(seed=seed), lumina2_inputs(shape.height, shape.width, list(shape.valid))


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.noise_refiner[0].attn,
                                      shape.height * shape.width)


def _gradient_case(shape: Shape, mesh, checkpointing: bool = False) -> dict[str, float]:
    model, inputs = _build(shape)
    if checkpointing:
        model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


PROMPTS = (["a red fox jumps over", "a cat"], ["blurry", "dark, dim, low quality"])


def _generate(pipe, prompts: tuple = PROMPTS) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 steps at 48 x 80 (3 x 5 = 15 image tokens), true CFG, seed 0."""
    prompt, negative_prompt = prompts
    return parity.latents_and(
        pipe,
        prompt=prompt, negative_prompt=negative_prompt, guidance_scale=4.0, height=48, width=80,
        num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt",
        system_prompt="draw", max_sequence_length=64,
    )


def _pipeline_runs(pipe, grids: list, prompts: tuple = PROMPTS) -> dict[str, dict[str, float]]:
    """Each grid's final latents and images against one process's (computed once), then the run
    after ``disable_usp`` against it bit for bit."""
    ref_latents, ref_images = _generate(pipe, prompts)
    results = {}
    for u, r, c in grids:
        pipe.enable_usp(ulysses_degree=u, ring_degree=r, cfg_degree=c)
        enabled = is_usp_enabled(pipe.transformer)
        try:
            latents, images = _generate(pipe, prompts)
        finally:
            pipe.disable_usp()
        results[(u, r, c)] = {
            "not_enabled_then_restored": float(not enabled or is_usp_enabled(pipe.transformer)),
            "latents": rel_err(latents, ref_latents),
            "images": rel_err(images, ref_images),
        }
    again_latents, _ = _generate(pipe, prompts)
    results[grids[-1]]["not_bit_identical_after_disable"] = float(not torch.equal(again_latents, ref_latents))
    return results


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])  # the last: the first step's calls split over cfg


def _pipeline_cases() -> dict[str, dict[str, float]]:
    pipe = tiny_lumina2_pipeline()
    pipe.set_progress_bar_config(disable=True)
    runs = _pipeline_runs(pipe, PIPELINE_GRIDS)
    results = {f"pipeline-u{u}r{r}cfg{c}": runs[(u, r, c)] for u, r, c in PIPELINE_GRIDS}
    # one prompt: the two calls of a step (batch 1 each) on the two cfg groups (cfg_pair)
    results["pipeline-cfg2"] = _pipeline_runs(pipe, [(1, 1, 2)], ("a red fox", "blurry and dark"))[(1, 1, 2)]
    return results


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case, _gradient_case)
    parity.record(results, "grad-ckpt-p4", lambda: _gradient_case(SHAPES[0], init_usp(2, 2), checkpointing=True))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


PIPELINE_KEYS = [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS] + ["pipeline-cfg2"]


@pytest.mark.parametrize("key", PIPELINE_KEYS)
def test_pipeline_matches_one_process_and_disable_restores_it(grid_results, key: str):
    tols = {"images": TOL_IMAGES, "not_bit_identical_after_disable": 0.0, "not_enabled_then_restored": 0.0}
    for rank, res in enumerate(grid_results):
        errors = res.get(key) or res.get("pipeline", "no result")
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        worst = {name: v for name, v in errors.items() if not v <= tols.get(name, TOL)}
        assert not worst, f"rank {rank}: {key}: above {tols} (else {TOL}): {worst}"


# ---- single process: loud failures -----------------------------------------------------------------


def test_a_model_without_refiner_layers_is_refused():
    model = tiny_lumina2()
    model.noise_refiner = torch.nn.ModuleList()
    with pytest.raises(NotImplementedError, match="num_refiner_layers=0"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


# What moves data or picks a kernel: at sequence degree 1 enable_usp adds none of these to a forward
# (the rest it adds are views: transposes, slices). The kernel ops are compared with their shapes,
# the mask's included: the same attention kernel path as stock.
_COPYING = frozenset({"aten::copy_", "aten::clone", "aten::cat", "aten::stack", "aten::repeat_interleave",
                      "aten::constant_pad_nd", "aten::index_copy", "aten::nonzero", "aten::_local_scalar_dense",
                      "aten::empty", "aten::empty_like", "aten::new_zeros", "aten::zeros"})
_KERNEL = "aten::_scaled_dot_product_flash_attention_for_cpu"


def _profiled(model, inputs) -> tuple[torch.Tensor, Counter]:
    """(output, count of each copying op and of each kernel call by its input shapes) of one forward."""
    with torch.no_grad(), torch.profiler.profile(record_shapes=True) as prof:
        out = model(**inputs.kwargs(), return_dict=False)[0]
    ops = Counter((e.name, str(e.input_shapes) if e.name == _KERNEL else "") for e in prof.events()
                  if e.name in _COPYING or e.name == _KERNEL)
    return out, ops


@pytest.mark.parametrize("valid", [(3,), (9, 9)], ids=["batch1-padded-caption", "equal-captions"])
def test_one_rank_is_bit_identical_to_stock_and_adds_no_copies(valid: tuple):
    """Note [Lumina2's joint layout] at sequence degree 1: stock's layout kept; K/V heads as stock
    repeated them (Note [Lumina2's attention call]). A padded caption of batch 1: stock drops the
    padding (no mask), and so does the adapter."""
    model, inputs = tiny_lumina2(), lumina2_inputs(3, 5, list(valid))
    ref, stock_ops = _profiled(model, inputs)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        out, usp_ops = _profiled(model, inputs)
    finally:
        ADAPTER.disable(model)
    assert torch.equal(out, ref)
    assert usp_ops == stock_ops, f"stock {sorted(stock_ops.items())}\nusp {sorted(usp_ops.items())}"


def test_a_layer_called_with_a_table_of_no_forward_is_refused():
    model = tiny_lumina2()
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        x = torch.zeros(2, 22, model.config.hidden_size)
        table = torch.ones(2, 22, 8, dtype=torch.complex64)
        with pytest.raises(NotImplementedError, match="did not make"):
            model.layers[0](x, None, table, torch.zeros(2, min(model.config.hidden_size, 1024)))
    finally:
        ADAPTER.disable(model)


def test_the_image_example_builds_and_runs_the_tiny_lumina2():
    """examples/generate_image.py --family lumina2: its tiny default pipeline on one process (1 step)."""
    from tests.test_examples_cli import _example

    ex = _example("generate_image")
    args = ex.parse_args(["--family", "lumina2", "--steps", "1", "--height", "48", "--width", "80"])
    images = ex.generate(ex.load_pipeline(args, torch.device("cpu")), args)
    assert images.shape == (1, 48, 80, 3) and bool((images >= 0).all() and (images <= 1).all())
