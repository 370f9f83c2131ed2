"""SANA-WM adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas of 2 ranks each. Models: tiny 2-layer ``SanaWMTransformer3DModel`` s (64 wide, 4 heads x
16 of self-attention, 2 x 32 of cross-attention, every weight perturbed, the zero-initialised
Plucker embedder included; ``usp_dit.demo.tiny_sana_wm``):

* "released" (block 0 GDN with the short conv on K, block 1 softmax) on a 3 x 3 x 3 token grid
  (frames x height x width), with the camera branch (random camera poses and intrinsics: the UCPE
  ray transforms and their RoPE, the Plucker embedding after attention) and a frame-valid mask of
  different lengths per element (3 and 2 frames: the GDN's gates, the softmax camera branch's -1e9
  key bias);
* "gdn" (both blocks GDN, short convs on Q, K and V) on 5 x 1 x 5, no camera, no frame mask;
* "softmax" (both blocks softmax) on 3 x 3 x 3 with the camera branch, on (2,2,1) and (1,4,1).

27 and 25 tokens divide neither 2 nor 4; each frame's 9 or 5 pixels neither. Batch 2 with a
different latent, prompt, per-frame timesteps (frame 0 at 0, the pipeline's anchor) and camera
per element; 6 text tokens with masks of different valid lengths per element (4 and 6).

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
each ring grid also with the "stream" and "gather_merge" schedules forced (there is no ring: the
GDN's per-frame sums are all-reduced and the softmax layers gather K and V, so the schedules must
not matter). Each case: output vs stock, block 0's self-attention sees at most T
x ceil(S / P) tokens (T x S tokens: every frame's piece of its S pixels), after ``disable`` the output
is bit-identical. Gradients on 2 and 4 ranks ("gdn" and
"released"). The transformer enabled with cfg_degree=2 on its batch of 2 equals stock; a frame
with fewer pixels than sequence ranks raises on every rank; one rank is bit-identical to stock.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) where only float32 sums are reordered (the GDN's
per-frame sums over pixels, then their all-reduce; the halo conv's products are the same; the
softmax layers' bf16 calls are the stock calls row for row). The stock softmax layers cast their
float32 Q/K/V to bfloat16; where a softmax layer follows a GDN layer ("released"), a float32
reordering of ~1e-7 in its input can move a value across a bfloat16 rounding boundary, one
bfloat16 step (2^-8 relative) on that value, so that shape's outputs are held to TOL_BF16 = 2e-3
TOL_BF16_GRAD = 1e-2
(a quarter of a bfloat16 step less than 2^-8 = 3.9e-3 of the largest output; measured 3e-7 to
4e-5). "gdn" (no bf16 cast) is held to 1e-5. The "softmax" shape (its blocks' inputs equal to the
stock ones bit for bit before each bf16 cast) to TOL_SOFTMAX = 1e-4: on (2,2) and (1,4) a softmax
layer's bf16 attention is merged from ring blocks, not stock's one call, and the CPU's kernels
decide whether a merged value rounds to the same bf16 neighbour (measured below 1e-5 on an AVX-512
CPU, 1.25e-5 on an AVX2 one; one bf16 step would be 3.9e-3). Gradients, summed over the sequence group (each
rank's loss L / P): "gdn" within 1e-5; "released" within TOL_BF16_GRAD = 1e-2 (measured 6.7e-3):
the stock softmax layer's backward runs in bfloat16 too (its Q/K/V gradients rounded to bfloat16,
2^-8 relative each, from inputs that differ by float32 reordering), a weaker check of that path.

``data_info["image_vae_embeds"]`` (concatenated to the latents' channels; a model of 8 input
channels) with the batch split over the cfg groups on (1,2,2) equals stock within TOL.

The stock ``SanaWMPipeline`` built tiny in code (``tiny_sana_wm.tiny_sana_wm_pipeline``: 2-layer
Gemma-2 with a character tokenizer, the tiny LTX-2 VAE (32x, 8 frames), a gradient first frame, the
action trajectory "w-8,jw-8" (17 poses) and pinhole intrinsics; 96 x 96 x 17 frames -> 3 x 3 x 3 =
27 tokens, 9 pixels a frame; guidance 4: [uncond, cond] in one call), 2 steps, through
``pipe.enable_usp()`` on (2,1,1), (2,2,1) and (2,1,2) (cfg 2 splits the batch) vs one process:
the "gdn" transformer's final latents within TOL (no bf16 cast anywhere: only float32 sums are
reordered; measured 5e-7 to 6e-7) and its decoded video (the (2,1,1) grid; decoding is the slow part)
within TOL_VIDEO = 1e-4 (an untrained random VAE's gain, as tests/test_pipeline_wan.py); the
"released" transformer's latents on (2,2,1) and (2,1,2) within TOL_BF16 (its softmax layer's bf16
cast after a GDN layer, above; measured 4.6e-5). After ``disable_usp`` the pipeline's latents are
bit-identical to the first call's. SHAPES[2] ("released", no frame mask) is tests/test_compile_grid.py's
fullgraph case on (2,1,1).
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.adapter_parity import (
    assert_one_rank_bit_identical,
    assert_within,
    cfg_split_case,
    forward,
    grad_keys,
    gradient_errors,
    latents_and,
    output_keys,
    pipeline_cases,
    pipeline_grids,
    record,
    run_grid_cases,
    sharded_output_case,
    spawn_grid,
)
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_sana_wm import (
    LATENT_CHANNELS,
    sana_wm_inputs,
    tiny_sana_wm,
    tiny_sana_wm_call,
    tiny_sana_wm_pipeline,
)
from usp_dit.pipelines import is_usp_enabled
from usp_dit.pipelines.families.sana_wm import ADAPTER
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_SOFTMAX = 1e-4  # the all-softmax shape's output (module docstring)
TOL_BF16 = 2e-3
TOL_BF16_GRAD = 1e-2
TOL_VIDEO = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    variant: str
    frames: int  # token grid
    height: int
    width: int
    camera: bool
    valid_frames: tuple[int, int] | None

    @property
    def tokens(self) -> int:
        return self.frames * self.height * self.width

    def __str__(self) -> str:
        return f"{self.variant}-{self.frames}x{self.height}x{self.width}"


# SHAPES[2] (no frame mask) is tests/test_compile_grid.py's fullgraph case only: with a frame mask the
# camera branch's key bias depends on the mask's values (the stock ``bool(token_valid_mask.all())``,
# kept for bit-exactness), a data-dependent branch that no fullgraph trace takes, stock or sharded.
SHAPES = [Shape("released", 3, 3, 3, True, (3, 2)), Shape("gdn", 5, 1, 5, False, None),
          Shape("released", 3, 3, 3, True, None)]
GRID_SHAPES = SHAPES[:2]
SOFTMAX = Shape("softmax", 3, 3, 3, True, None)
SOFTMAX_GRIDS = [(2, 2, 1), (1, 4, 1)]
GRAD_SHAPES = {2: GRID_SHAPES, 4: GRID_SHAPES}


def _build(shape: Shape, seed: int = 0):
    model = tiny_sana_wm(shape.variant, seed=seed)
    valid = None if shape.valid_frames is None else list(shape.valid_frames)
    return model, sana_wm_inputs(shape.frames, shape.height, shape.width, [4, 6], valid, camera=shape.camera)


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    """Output vs stock; block 0's attention sees at most T x ceil(S / P) tokens (every frame's piece:
    up to T - 1 more than ceil(T S / P), passed as the ``replicated`` slack)."""
    model, inputs = _build(shape)
    p = mesh.sequence_degree
    spatial = shape.height * shape.width
    slack = shape.frames * -(-spatial // p) - -(-shape.tokens // p)
    return sharded_output_case(model, inputs, ADAPTER, mesh, model.blocks[0].attn, shape.tokens, replicated=slack)


def _gradient_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return gradient_errors(model, inputs, ADAPTER, mesh)


def _too_few_pixels_case(mesh) -> dict[str, float]:
    """A 4 x 1 x 3 grid (3 pixels a frame) on 4 sequence ranks: NotImplementedError on every rank."""
    model = tiny_sana_wm()
    inputs = sana_wm_inputs(4, 1, 3, [2, 6])
    ADAPTER.enable(model, mesh, "auto")
    try:
        forward(model, inputs)
    except NotImplementedError as exc:
        return {"wrong_error": float("1 x 3 tokens over the 4 sequence ranks" not in str(exc))}
    finally:
        ADAPTER.disable(model)
    return {"did_not_raise": 1.0}


def _image_embeds_cfg_case(mesh) -> dict[str, float]:
    """``data_info["image_vae_embeds"]`` (B, 4, T, H, W), concatenated to the latents' channels, split
    with the batch over the cfg groups (a model of 8 input channels: 4 latent + 4 image)."""
    model = tiny_sana_wm("gdn", in_channels=2 * LATENT_CHANNELS)
    inputs = sana_wm_inputs(5, 1, 5, [4, 6], camera=False)
    inputs.data_info = {"image_vae_embeds": torch.randn_like(inputs.hidden_states),
                        "img_hw": torch.tensor([[160.0, 160.0]])}  # (1, 2), as the pipeline passes it: stays whole
    return cfg_split_case(model, inputs, mesh)


# ---- the stock SanaWMPipeline through pipe.enable_usp() --------------------------------------------
# "gdn" pipeline (no bf16 cast: held to TOL): decoded on one grid (the VAE is the slow part), latents on
# the others; the "released" one (its softmax layer's bf16 cast after a GDN layer): latents, TOL_BF16.
PIPELINE_GRIDS = [(2, 1, 1, "pt"), (2, 2, 1, "latent"), (2, 1, 2, "latent")]  # (U, R, cfg): cfg splits [uncond, cond]
RELEASED_PIPELINE_GRIDS = [(2, 2, 1), (2, 1, 2)]


def _generate(pipe, output_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(the final latents (1, 4, 3, 3, 3), the frames (17, 3, 96, 96) in [0, 1] or the latents again)."""
    return latents_and(pipe, "frames", **tiny_sana_wm_call(
        prompt="a red car on a desert road", negative_prompt="blurry", num_inference_steps=2, guidance_scale=4.0,
        generator=torch.Generator().manual_seed(0), output_type=output_type))


def _pipeline_cases() -> dict[str, dict[str, float]]:
    pipe = tiny_sana_wm_pipeline(variant="gdn")
    pipe.set_progress_bar_config(disable=True)
    ref_latents, ref_video = _generate(pipe, "pt")
    results = {}
    for u, r, c, output_type in PIPELINE_GRIDS:
        pipe.enable_usp(ulysses_degree=u, ring_degree=r, cfg_degree=c)
        enabled = is_usp_enabled(pipe.transformer)
        try:
            latents, video = _generate(pipe, output_type)
        finally:
            pipe.disable_usp()
        errors = {"not_enabled_then_restored": float(not enabled or is_usp_enabled(pipe.transformer)),
                  "latents": rel_err(latents, ref_latents)}
        if output_type == "pt":
            errors["video"] = rel_err(video, ref_video)
        results[f"pipeline-u{u}r{r}cfg{c}"] = errors
    again, _ = _generate(pipe, "latent")
    results["pipeline-after-disable"] = {"not_bit_identical": float(not torch.equal(again, ref_latents))}
    released = tiny_sana_wm_pipeline()
    results.update(pipeline_cases(released, lambda p: _generate(p, "latent")[:1],
                                  pipeline_grids(RELEASED_PIPELINE_GRIDS, "pipeline-released"),
                                  names=("latents",), after_disable=None))
    return results


def _run_all() -> dict[str, dict | str]:
    results = {}
    run_grid_cases(results, GRID_SHAPES, _output_case, _gradient_case, grad_shapes=GRAD_SHAPES)
    for grid in SOFTMAX_GRIDS:
        record(results, f"softmax-u{grid[0]}r{grid[1]}", lambda grid=grid: _output_case(SOFTMAX, init_usp(*grid)))
    record(results, "cfg-split", lambda: cfg_split_case(*_build(SHAPES[1]), init_usp(1, 2, 2)))
    record(results, "too-few-pixels", lambda: _too_few_pixels_case(init_usp(2, 2)))
    record(results, "cfg-split-image-embeds", lambda: _image_embeds_cfg_case(init_usp(1, 2, 2)))
    record(results, "pipeline", _pipeline_cases, many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return spawn_grid(_run_all, WORLD)


def _tol(key: str) -> float:
    return TOL_BF16 if "released" in key else TOL


@pytest.mark.parametrize("key", output_keys(GRID_SHAPES))
def test_sharded_output_matches_one_process(grid_results, key: str):
    assert_within(grid_results, key, _tol(key))


@pytest.mark.parametrize("key", grad_keys(by_world=GRAD_SHAPES))
def test_parameter_gradients_match_one_process(grid_results, key: str):
    assert_within(grid_results, key, TOL_BF16_GRAD if "released" in key else TOL)


@pytest.mark.parametrize("grid", SOFTMAX_GRIDS)
def test_all_softmax_model_matches_one_process(grid_results, grid):
    assert_within(grid_results, f"softmax-u{grid[0]}r{grid[1]}", TOL, {"out": TOL_SOFTMAX})


def test_cfg_split_of_a_masked_batch_matches_stock(grid_results):
    assert_within(grid_results, "cfg-split", TOL)


def test_a_frame_with_fewer_pixels_than_ranks_is_refused_on_every_rank(grid_results):
    assert_within(grid_results, "too-few-pixels", 0.0)


def test_cfg_split_of_image_vae_embeds_in_data_info_matches_stock(grid_results):
    assert_within(grid_results, "cfg-split-image-embeds", TOL)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c, _ in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    assert_within(grid_results, key, TOL, {"video": TOL_VIDEO}, fallback="pipeline")


@pytest.mark.parametrize("key", list(pipeline_grids(RELEASED_PIPELINE_GRIDS, "pipeline-released")))
def test_released_pipeline_matches_one_process(grid_results, key: str):
    assert_within(grid_results, key, TOL_BF16, fallback="pipeline")


def test_pipeline_after_disable_is_bit_identical(grid_results):
    assert_within(grid_results, "pipeline-after-disable", 0.0, fallback="pipeline")


# ---- single process ------------------------------------------------------------------------------


def test_one_rank_is_bit_identical_to_stock():
    assert_one_rank_bit_identical(*_build(SHAPES[0]), ADAPTER)


def test_packed_latents_are_refused():
    model = tiny_sana_wm()
    model.pack_latents = True
    with pytest.raises(NotImplementedError, match="pack_latents"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")


def test_a_custom_cross_attention_processor_is_refused():
    class Custom:
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None):
            return hidden_states

    model = tiny_sana_wm()
    model.blocks[0].cross_attn.processor = Custom()
    with pytest.raises(NotImplementedError, match="Custom"):
        ADAPTER.enable(model, single_rank_mesh(), "auto")
