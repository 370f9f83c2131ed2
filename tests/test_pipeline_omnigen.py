"""OmniGen adapter: sharded transformer outputs and gradients equal one process's, on CPU gloo grids;
the stock ``OmniGenPipeline`` through ``pipe.enable_usp()``.

One spawned group of 4 ranks runs every case; the 2-rank grids run on it as two data-parallel
replicas. Model: a tiny ``OmniGenTransformer2DModel`` (``usp_dit.demo.tiny_omnigen``): 2 Phi-3
blocks, 4 heads x 16, su-scaled RoPE factors that differ per frequency, every weight perturbed.
Inputs from Diffusers' own ``OmniGenCollator`` (the mask and positions the pipeline passes):
3 x 5 = 15 output tokens with prompts of 7 and 4 tokens (element 1 left-padded: its prefix keys
differ), and 5 x 7 = 35 output tokens with prompts of 6 and 3 tokens where element 0 also holds a
2 x 3 input image spliced into its prompt (a bidirectional block inside the causal prefix); batch 2
with different timesteps. Neither token count divides 2 or 4.

Grids (U, R, cfg): (2,1,1), (1,2,1); (2,2,1), (4,1,1), (1,4,1), (1,2,2) (tests/adapter_parity.GRIDS);
ring grids also with "stream" and "gather_merge" forced (Note [schedules in CI]). Each case: output
vs stock, block 0's attention sees at most P + ceil(N / P_ranks) tokens (the prefix is replicated:
Note [OmniGen's sequence]), after ``disable`` the output is bit-identical. Every parameter's gradient
on 2 and 4 ranks, and with gradient checkpointing. Each rank's rotated image Q/K of layer 0 equal
the same rows of one process's (the prefix K all of them). The transformer enabled with cfg_degree=2 on the
text-to-image batch (position_ids kept whole: the stock RoPE reads row 0) equals stock; with input
images it is refused. The fullgraph-compiled case is in tests/test_compile_grid.py (ADAPTER_CASES).

Pipeline: the tiny ``OmniGenPipeline`` (character tokenizer, 8x VAE; text-to-image, two prompts: a
batch of [cond, cond, uncond, uncond] in one call, left-padded) 48 x 80 (15 image tokens), 2 steps,
on (2,1,1), (2,2,1) and (1,2,2) (the batch split over the cfg groups), equal to one process's;
bit-identical after ``disable_usp``.

Tolerance: max|err| / max|ref| <= 1e-5 (float32) on outputs, gradients and the pipeline's final
latents: sharding only reorders float32 sums (attention blocks merged by log-sum-exp, gradients
summed over ranks). Decoded images: 1e-4 (an untrained random VAE's gain).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from unittest import mock

import pytest
import torch
from diffusers.models.transformers import transformer_omnigen

import usp_dit
from tests import adapter_parity as parity
from tests import family_checks
from usp_dit import init_usp, single_rank_mesh
from usp_dit.demo.tiny_omnigen import omnigen_inputs, tiny_omnigen, tiny_omnigen_pipeline
from usp_dit.pipelines import _routing
from usp_dit.pipelines.families import omnigen
from usp_dit.pipelines.families.omnigen import ADAPTER, USPOmniGenAttnProcessor
from usp_dit.sharding.shard import shard_sequence
from usp_dit.testing import rel_err

TOL = 1e-5
TOL_IMAGES = 1e-4
WORLD = 4


@dataclass(frozen=True)
class Shape:
    height: int
    width: int
    text_lens: tuple[int, ...]
    image: tuple[int, int] | None = None  # element 0's input image, in patches

    @property
    def tokens(self) -> int:
        return self.height * self.width

    @property
    def prefix(self) -> int:
        """P: the longest prompt (with its input image's tokens) and the time token."""
        image = math.prod(self.image) if self.image else 0
        return max(self.text_lens[0] + image, *self.text_lens[1:]) + 1

    def __str__(self) -> str:
        return f"{self.height}x{self.width}-t{'-'.join(map(str, self.text_lens))}" + ("-img" if self.image else "")


SHAPES = [
    Shape(3, 5, (7, 4)),  # 15 output tokens, text to image, element 1 left-padded
    Shape(5, 7, (6, 3), (2, 3)),  # 35 output tokens; element 0's prompt holds a 2 x 3 input image
]


def _build(shape: Shape, seed: int = 0):
    return tiny_omnigen(seed=seed), omnigen_inputs(shape.height, shape.width, shape.text_lens, shape.image)


# ---- what each rank runs ---------------------------------------------------------------------------


def _output_case(shape: Shape, mesh) -> dict[str, float]:
    model, inputs = _build(shape)
    return parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.layers[0].self_attn, shape.tokens,
                                      replicated=shape.prefix)


def _checkpointed_gradient_case(mesh) -> dict[str, float]:
    model, inputs = _build(SHAPES[1])
    model.enable_gradient_checkpointing()
    return parity.gradient_errors(model, inputs, ADAPTER, mesh)


def _cfg_images_refused_case(mesh) -> dict[str, float]:
    """cfg_degree=2 with input images: NotImplementedError at the call (their list and dict cannot be split)."""
    model, inputs = _build(SHAPES[1])
    usp_dit.enable_usp(model, mesh=mesh)
    try:
        parity.forward(model, inputs)
    except NotImplementedError as exc:
        return {"wrong_error": float("input images with cfg_degree > 1" not in str(exc))}
    finally:
        usp_dit.disable_usp(model)
    return {"did_not_raise": 1.0}


class _SpyFunctional:
    """``torch.nn.functional`` for the stock processor's module, keeping each attention call's (q, k)."""

    def __init__(self, seen: list) -> None:
        self.seen = seen

    def scaled_dot_product_attention(self, q, k, v, *args, **kwargs):
        self.seen.append((q.clone(), k.clone()))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(torch.nn.functional, name)


def _rotated_qk_case(mesh) -> dict[str, float]:
    """Each rank's rotated image Q/K of layer 0 equal the same rows of one process's, the prefix K all
    of them (element 0: the longest prompt, so every prefix token is a key of its first call)."""
    shape = SHAPES[0]
    model, inputs = _build(shape)
    stock = []
    with mock.patch.object(transformer_omnigen, "F", _SpyFunctional(stock)):
        parity.forward(model, inputs)
    q_ref, k_ref = (t[:1].transpose(1, 2) for t in stock[0])  # (1, L, H, D)
    seen = []
    inner = _routing.usp_attention

    def spy(q, k, v, *args, **kwargs):
        seen.append((q.clone(), k.clone(), kwargs["joint_k"]))
        return inner(q, k, v, *args, **kwargs)

    ADAPTER.enable(model, mesh, "auto")
    try:
        with mock.patch.object(_routing, "usp_attention", spy):
            parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
    q, k, prefix_k = seen[0]
    return {"q": rel_err(q, shard_sequence(q_ref[:, shape.prefix:], mesh)),
            "k": rel_err(k, shard_sequence(k_ref[:, shape.prefix:], mesh)),
            "prefix_k": rel_err(prefix_k, k_ref[:, :shape.prefix])}


def _generate(pipe) -> tuple[torch.Tensor, torch.Tensor]:
    """(final latents, images) of 2 steps at 48 x 80 (3 x 5 = 15 image tokens), two prompts, seed 0."""
    return parity.latents_and(pipe, prompt=["a red fox jumps", "a cat"], guidance_scale=3.0, height=48, width=80,
                              num_inference_steps=2, generator=torch.Generator().manual_seed(0), output_type="pt")


PIPELINE_GRIDS = parity.ci_grids([(2, 1, 1), (2, 2, 1), (1, 2, 2)])


def _run_all() -> dict[str, dict | str]:
    results = {}
    parity.run_grid_cases(results, SHAPES, _output_case,
                          lambda shape, mesh: parity.gradient_errors(*_build(shape), ADAPTER, mesh))
    parity.record(results, "grad-ckpt-p4", lambda: _checkpointed_gradient_case(init_usp(2, 2)))
    parity.record(results, "rotated-qk", lambda: _rotated_qk_case(init_usp(2, 2)))
    parity.record(results, "cfg-split", lambda: parity.cfg_split_case(*_build(SHAPES[0]), init_usp(1, 2, 2)))
    parity.record(results, "cfg-images-refused", lambda: _cfg_images_refused_case(init_usp(1, 2, 2)))
    parity.record(results, "ulysses-above-heads",
                  lambda: parity.ulysses_above_heads_case(tiny_omnigen(num_heads=2, head_dim=32), ADAPTER,
                                                          init_usp(ulysses_degree=4)))
    parity.record(results, "pipeline",
                  lambda: parity.pipeline_cases(tiny_omnigen_pipeline(), _generate,
                                                parity.pipeline_grids(PIPELINE_GRIDS)), many=True)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(SHAPES), parity.grad_keys(SHAPES) + ["grad-ckpt-p4"], TOL)


def test_rope_rotates_each_rank_like_the_same_rows_of_one_process(grid_results):
    parity.assert_within(grid_results, "rotated-qk", TOL)


def test_cfg_split_keeps_the_first_rows_positions_and_matches_stock(grid_results):
    parity.assert_within(grid_results, "cfg-split", TOL)


def test_input_images_with_cfg_parallel_are_refused(grid_results):
    parity.assert_within(grid_results, "cfg-images-refused", 0.0)


def test_ulysses_above_heads_raises_at_enable(grid_results):
    parity.assert_within(grid_results, "ulysses-above-heads", 0.0)


@pytest.mark.parametrize("key", [f"pipeline-u{u}r{r}cfg{c}" for u, r, c in PIPELINE_GRIDS])
def test_pipeline_matches_one_process(grid_results, key: str):
    parity.assert_within(grid_results, key, TOL, {"images": TOL_IMAGES, "not_enabled_then_restored": 0.0},
                         fallback="pipeline")


def test_disable_usp_gives_back_the_bit_identical_image(grid_results):
    parity.assert_within(grid_results, "pipeline-after-disable", 0.0)


# ---- single process: registration, restore exactly, loud failures ---------------------------------


test_find_adapter_finds_omnigen = family_checks.adapter_found(tiny_omnigen, ADAPTER)


test_disable_restores_processors_and_hooks = family_checks.disable_restores(
    lambda: _build(SHAPES[1]), ADAPTER, USPOmniGenAttnProcessor)


def _enabled_call(inputs, **changes):
    model = tiny_omnigen()
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        return parity.forward(model, type(inputs)(**{**inputs.kwargs(), **changes}))
    finally:
        ADAPTER.disable(model)


def test_a_mask_letting_the_prompt_see_the_image_is_refused():
    _, inputs = _build(SHAPES[0])
    mask = inputs.attention_mask.clone()
    mask[:, 3, -1] = 1  # a prompt token attends an output image token: the prefix needs the image
    with pytest.raises(NotImplementedError, match="a condition token attends the output image"):
        _enabled_call(inputs, attention_mask=mask)


def test_padded_output_images_are_refused():
    _, inputs = _build(SHAPES[0])
    mask = inputs.attention_mask.clone()
    mask[1, :, -2:] = 0  # element 1's last two image tokens padding (a batch of mixed output sizes)
    with pytest.raises(NotImplementedError, match="does not attend every output image token"):
        _enabled_call(inputs, attention_mask=mask)


def test_no_mask_is_refused():
    _, inputs = _build(SHAPES[0])
    with pytest.raises(NotImplementedError, match="needs the attention mask"):
        _enabled_call(inputs, attention_mask=None)


test_foreign_processor_is_refused = family_checks.foreign_processor_refused(tiny_omnigen, ADAPTER, "layers.1.self_attn")
test_a_processor_without_the_routed_call_is_refused = family_checks.routed_call_refused(
    tiny_omnigen, ADAPTER, omnigen, "_routed_call", lambda state: None,
    match="does not call F.scaled_dot_product_attention")
test_tensor_parallelism_is_refused_by_name = family_checks.tensor_parallelism_refused(tiny_omnigen, ADAPTER, "OmniGen")
