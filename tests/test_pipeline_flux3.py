"""FLUX.3 adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case. Models: tiny ``Flux3Transformer2DModel`` s (1 per-mode
block per mode, 2 single blocks, 4 heads x 16 head_dim, every weight perturbed:
``usp_dit.demo.tiny_flux3``). Shapes (Note [FLUX.3's per-mode split]: each mode split on its own):
t2i (a 5 x 7 image: 35 tokens, 7 text tokens) and image-to-image with the step-distilled flow map
(``target_timestep``; 35 image + a 3 x 3 reference: 9, 5 text tokens). No count divides 2 or 4. Batch 2 with a different prompt and
timestep per element; the position ids are the pipeline's layout (image grid at t = 0, references
at t = 1, text along l). FLUX.3 takes no prompt mask.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2), each ring grid also with
the "stream" and "gather_merge" schedules forced. Each case: output vs stock, block 0 of the
single blocks sees at most ceil(T / P) + ceil(N / P) + ceil(M / P) tokens, bit-identical output
after ``disable``. Per shape, on 2 and on 4 ranks: every parameter's gradient
(tests/adapter_parity.gradient_errors), and once with gradient checkpointing. The transformer
enabled with cfg_degree=2 (the batch split over cfg) equals stock. Fullgraph compile (Dynamo) on
(2,2) with every mode split evenly: one graph, equal to eager.

The stock pipelines: Diffusers ships FLUX.3 as modular pipelines (``Flux3ModularPipeline``,
``Flux3DistilledModularPipeline``), built tiny in code (``tiny_flux3_pipeline``: Qwen3-VL text
encoder, VAE, the tiny transformer; the prompt upsampler popped) and run through
``pipe.enable_usp()`` (Note [modular pipelines]) against one process, 36 x 52 (117 image tokens,
80 text), 2 steps: the guider's two calls a step on (2,1,1), (2,2,1) and (1,2,2) (there block 0
of the single blocks runs steps + 1 times a rank: ``cfg_pair``), two images a prompt on (1,2,2),
an edit with a 20 x 28 reference image on (2,2,1), the distilled flow map on (1,4,1); latents and
images, ``disable_usp`` bit for bit. Each rank's generator seeded by its rank gives rank 0's image
(and leaves each generator in rank 0's state); ranks passing different numbers of generators are
refused on every rank; ranks > 0 show no progress bar. ``examples/generate_image.py --family
flux3`` on one process.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs and gradients: sharding only reorders
float32 sums (attention blocks merged by log-sum-exp, gradients summed over ranks). Decoded
images: 1e-4 (an untrained random VAE's gain on the latents' rounding).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_flux3 import flux3_inputs, tiny_flux3
from usp_dit.pipelines.families import flux3
from usp_dit.pipelines.families.flux3 import ADAPTER
from usp_dit.testing import rel_err

TOL = 1e-5
WORLD = 4


@dataclass(frozen=True)
class Shape:
    variant: str  # "t2i", "i2i" or "flow-map"
    text: int
    reference: tuple | None  # (h, w) of the reference image

    def __str__(self) -> str:
        return f"{self.variant}-t{self.text}"


SHAPES = [Shape("t2i", 7, None), Shape("flow-map", 5, (3, 3))]
H, W = 5, 7


def _build(shape: Shape, seed: int = 0):
    model = tiny_flux3(flow_map=shape.variant == "flow-map", seed=seed)
    return model, flux3_inputs(model, 2, H, W, shape.text, shape.reference, seed=seed)


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Output vs stock, single block 0's attention length vs the per-mode ceilings, bit-identity after disable."""
    model, inputs = _build(shape)
    ref = parity.forward(model, inputs)
    p = mesh.sequence_degree
    counts = [shape.text, H * W] + ([math.prod(shape.reference)] if shape.reference else [])
    bound = sum(math.ceil(n / p) for n in counts)
    lengths = []
    hook = model.single_transformer_blocks[0].attn.register_forward_pre_hook(
        lambda m, args, kwargs: lengths.append(kwargs.get("hidden_states", args[0] if args else None).shape[1]),
        with_kwargs=True)
    ADAPTER.enable(model, mesh, "auto")
    try:
        out = parity.forward(model, inputs)
    finally:
        hook.remove()
        ADAPTER.disable(model)
    return {
        "out": rel_err(out, ref),
        "single0_tokens_above": float(not lengths or max(lengths) > bound),
        "disable_not_bit_identical": float(not torch.equal(parity.forward(model, inputs), ref)),
    }


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[1])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _cfg_split_case(mesh) -> dict[str, float]:
    return parity.cfg_split_case(*_build(SHAPES[1]), mesh)


PROMPT, NEGATIVE = "a red fox jumps", "blurry"
STEPS = 2
TOL_IMAGES = 1e-4  # decoded images: an untrained random VAE's gain (as tests/test_pipeline_qwen_image.py)


def _condition_image():
    """A 20 x 28 reference image (RGB noise, seeded): padded by FLUX.3's image processor to its
    4-pixel grid canvas, whose size the generation then takes."""
    import numpy as np
    from PIL import Image

    return Image.fromarray((np.random.RandomState(3).rand(20, 28, 3) * 255).astype("uint8"))


def _generate(pipe, seed: int = 0, generator: torch.Generator | None = None, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of one modular pipeline call, 2 steps; 36 x 52 (9 x 13 = 117 image
    tokens, 80 text tokens: the prompt window's pad multiple) unless a reference image sets the size.
    ``generator``: the call's (default: a fresh one seeded ``seed``)."""
    size = {} if "image" in kwargs else {"height": 36, "width": 52}
    generator = generator if generator is not None else torch.Generator().manual_seed(seed)
    out = pipe(prompt=PROMPT, num_inference_steps=STEPS, text_encoder_out_layers=(2,), output_type="pt",
               generator=generator, output=["latents", "images"], **size, **kwargs)
    return out["latents"], out["images"]


# (distilled, pipeline arguments, grids): the guider's two calls a step (on the cfg axis at cfg 2);
# two images per prompt (batch 2 in each call); an edit with a reference image (VAE-encoded
# reference tokens, the image-conditioned denoise blocks); the step-distilled flow map (one call a step).
PIPELINE_RUNS = {
    "pipeline": (False, {"negative_prompt": NEGATIVE}, [(2, 1, 1), (2, 2, 1), (1, 2, 2)]),
    "pipeline-batch2": (False, {"negative_prompt": NEGATIVE, "num_images_per_prompt": 2}, [(1, 2, 2)]),
    "pipeline-edit": (False, {"image": "condition"}, [(2, 2, 1)]),
    "pipeline-distilled": (True, {}, [(1, 4, 1)]),
}
PIPELINE_KEYS = [key for prefix, (_, _, grids) in PIPELINE_RUNS.items() for key in parity.pipeline_grids(grids, prefix)]


def _pipeline_cases() -> dict[str, dict[str, float]]:
    """FLUX.3's stock modular pipelines (tiny: ``tiny_flux3_pipeline``) through ``pipe.enable_usp()``
    on each run's grids, against the same pipeline on one process (``adapter_parity.pipeline_cases``);
    at cfg 2, block 0 of the single blocks runs ``steps + 1`` times a rank (``cfg_pair``)."""
    from usp_dit.demo.tiny_flux3 import tiny_flux3_pipeline

    pipes = {distilled: tiny_flux3_pipeline(distilled=distilled) for distilled in (False, True)}
    results = {}
    for prefix, (distilled, kwargs, grids) in PIPELINE_RUNS.items():
        kwargs = {k: (_condition_image() if v == "condition" else v) for k, v in kwargs.items()}
        probe = None if distilled or "image" in kwargs else (
            lambda pipe, grid: parity.cfg_pair_computations(pipe, grid, STEPS, "single_transformer_blocks"))
        results.update(parity.pipeline_cases(
            pipes[distilled], lambda p, kwargs=kwargs: _generate(p, **kwargs), parity.pipeline_grids(grids, prefix),
            after_disable="pipeline-after-disable" if prefix == "pipeline" else None, probe=probe))
    return results


def _rank_seeded_case() -> dict[str, float]:
    """Note [modular pipelines]: each rank passes a generator of its own seed; under
    ``pipe.enable_usp()`` on (2,2,1) every rank's latents and image equal one process's with rank
    0's seed, and every rank's generator ends in the state rank 0's one-process call left its own
    in; with no generator and each rank's global RNG seeded by its rank, the latents are one
    process's with seed 0. A call where rank 0 passes a generator and the others none raises
    ValueError on every rank.
    Ranks > 0 show no progress bar (every loop block's, however deep) while enabled, and
    ``disable_usp`` gives back the pipeline's own blocks object and each bar's config."""
    import torch.distributed as dist

    from usp_dit.demo.tiny_flux3 import tiny_flux3_pipeline
    from usp_dit.pipelines.modular import _loop_blocks

    pipe = tiny_flux3_pipeline()
    rank = dist.get_rank()
    torch.manual_seed(0)
    unseeded_ref = pipe(prompt=PROMPT, num_inference_steps=1, text_encoder_out_layers=(2,), height=36, width=52,
                        generator=None, output="latents")
    ref_generator = torch.Generator().manual_seed(0)
    ref = _generate(pipe, generator=ref_generator, negative_prompt=NEGATIVE)
    generator = torch.Generator().manual_seed(rank)
    blocks, loops = pipe._blocks, list(_loop_blocks(pipe._blocks))
    before = [dict(getattr(b, "_progress_bar_config", {})) for b in loops]
    pipe.enable_usp(ulysses_degree=2, ring_degree=2)
    try:
        quiet = all(getattr(b, "_progress_bar_config", {}).get("disable") for b in loops)
        synced_copy = pipe._blocks is not blocks and type(pipe._blocks).__name__ == type(blocks).__name__
        got = _generate(pipe, generator=generator, negative_prompt=NEGATIVE)
        torch.manual_seed(rank)  # no generator: the blocks draw from each rank's global RNG
        unseeded = pipe(prompt=PROMPT, num_inference_steps=1, text_encoder_out_layers=(2,), height=36, width=52,
                        generator=None, output="latents")
        try:
            pipe(prompt=PROMPT, num_inference_steps=1, text_encoder_out_layers=(2,), height=36, width=52,
                 generator=generator if rank == 0 else None, output="latents")  # rank 0 passes one, the others none
            refused = False
        except ValueError as exc:
            refused = "different numbers or kinds of torch.Generator" in str(exc)
    finally:
        pipe.disable_usp()
    return {"latents": rel_err(got[0], ref[0]), "images": rel_err(got[1], ref[1]),
            "bars_not_quiet": float(bool(loops) and rank > 0 and not quiet),
            "generator_not_rank0s": float(not torch.equal(generator.get_state(), ref_generator.get_state())),
            "global_rng_latents": rel_err(unseeded, unseeded_ref),
            "mismatch_not_refused": float(not refused),
            "blocks_not_a_synced_copy": float(not synced_copy), "blocks_not_restored": float(pipe._blocks is not blocks),
            "bars_not_restored": float([dict(getattr(b, "_progress_bar_config", {})) for b in loops] != before)}


def _compiled_case() -> dict[str, float]:
    """``enable_usp`` then ``torch.compile(fullgraph=True)`` (Dynamo, backend "eager") on (2,2): one
    graph, output equal to the eager enabled model. Each mode splits evenly here (8 text and 4 x 5
    = 20 image tokens on 4 ranks): the single blocks' pieces are then the standard split of the
    joint length, which the call passes (Note [FLUX.3's per-mode split]); on a grid where they are
    not, the call passes no length and ``usp_attention`` refuses to be traced (it would gather the
    lengths), as docs/COMPILE.md says."""
    model = tiny_flux3()
    inputs = flux3_inputs(model, 2, 4, 5, 8)
    return parity.compiled_case(model, inputs, init_usp(2, 2), backend="eager")


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: _cfg_split_case(init_usp(1, 2, 2)))
    parity.record(results, "pipeline", _pipeline_cases, many=True)
    parity.record(results, "pipeline-rank-seeded", _rank_seeded_case)
    parity.record(results, "compiled", _compiled_case)
    two_heads = tiny_flux3(num_heads=2, head_dim=32)
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(two_heads, ADAPTER, init_usp(ulysses_degree=4)))
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    # check_groups=False: the compiled case's torch compile caches (functional collectives' graphs)
    # keep references to the process groups past the job, as in tests/test_compile_grid.py.
    return parity.spawn_grid(_run_all, WORLD, check_groups=False)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL,
)


def test_cfg_split_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", PIPELINE_KEYS)
def test_modular_pipeline_matches_one_process(grid_results, key: str):
    """Latents within TOL, decoded images within TOL_IMAGES, on every rank; at cfg 2 the guider's
    two calls of a step ran on the two cfg groups (steps + 1 computations a rank)."""
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES}, fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


def test_enabled_model_compiles_fullgraph_in_one_graph(grid_results):
    parity.assert_within(grid_results, "compiled", TOL)


def test_rank_seeded_noise_is_the_first_ranks(grid_results):
    parity.assert_within(grid_results, "pipeline-rank-seeded", TOL, {"images": TOL_IMAGES})


# ---- single process: registration, refusals ---------------------------------------------------


test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_flux3, ADAPTER, flux3, "_ROUTED_CALL")


def test_ids_unlike_the_tokens_are_refused():
    model, inputs = _build(SHAPES[0])
    inputs.img_ids = inputs.img_ids[:-1]
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        with pytest.raises(ValueError, match="img_ids has 34 rows but hidden_states has 35 tokens"):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)



def test_the_image_example_builds_and_runs_the_tiny_flux3():
    """examples/generate_image.py --family flux3: its tiny modular pipeline on one process (1 step,
    the guider's two calls with the default negative prompt, scale 4), RGB in [0, 1]."""
    from tests.test_examples_cli import _example

    ex = _example("generate_image")
    args = ex.parse_args(["--family", "flux3", "--steps", "1", "--guidance", "4"])
    images = ex.generate(ex.load_pipeline(args, torch.device("cpu")), args)
    assert images.shape == (1, 36, 52, 3) and bool((images >= 0).all() and (images <= 1).all())
