"""Text encoders on a grid (Note [text encoders on a grid] in ``usp_dit.pipelines.encoders``), CPU gloo.

One spawned group of 4 ranks, one model replica of 4 (2 x 2). For the text encoders of the
supported pipelines (CLIP and T5 of Flux; SD3's two CLIPs with projection and T5; HunyuanVideo's
Llama and CLIP; Qwen-Image's Qwen2.5-VL; Flux.2's Mistral 3 and Flux.2 Klein's Qwen3; Wan's umT5),
in the modes "shard" and "rank0":
  * ``pipe.encode_prompt`` (two prompts of different lengths) returns exactly the one-process
    tensors (0: "shard" computes with the same weights, "rank0" hands over the one rank's output);
  * resident encoder parameter bytes between calls: "shard" <= total / 4 + FSDP2's padding on
    every rank; "rank0" the whole encoder on rank 0 and nothing on the others;
  * ``disable_usp`` gives every rank the encoder back bit for bit (plain parameters, no hook,
    the model's own class) and encoding again gives the same tensors.
Then the whole tiny Flux pipeline with ``shard_weights=True`` (transformer and encoders sharded)
makes exactly the image of the unsharded grid, and the refusals: an unknown ``text_encoder``
value, and "shard" on a bare transformer, raise ValueError on every rank before anything changes.
"""
from __future__ import annotations

import pytest
import torch
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.utils._pytree import tree_flatten

from tests.adapter_parity import record
from usp_dit import disable_usp, init_usp
from usp_dit.pipelines import weights
from usp_dit.pipelines.encoders import encoder_components
from usp_dit.testing import assert_no_crash, run_spawned

WORLD = 4
MODES = ("shard", "rank0")
PROMPTS = ["a red fox in the snow", "a cat"]


def _pipelines() -> dict:
    """name: (builder, encode_prompt keyword arguments)."""
    from usp_dit.demo.tiny_flux import tiny_flux_pipeline
    from usp_dit.demo.tiny_flux2 import MISTRAL_LAYERS, tiny_flux2_klein_pipeline, tiny_flux2_pipeline
    from usp_dit.demo.tiny_hunyuan_video import tiny_hunyuan_video_pipeline
    from usp_dit.demo.tiny_qwen_image import tiny_qwen_image_pipeline
    from usp_dit.demo.tiny_sd3 import tiny_sd3_pipeline
    from usp_dit.demo.tiny_wan import tiny_wan_pipeline

    return {
        "flux": (tiny_flux_pipeline, {"prompt": PROMPTS, "prompt_2": None, "max_sequence_length": 16}),
        "sd3": (tiny_sd3_pipeline, {"prompt": PROMPTS, "prompt_2": None, "prompt_3": None, "max_sequence_length": 7,
                                    "do_classifier_free_guidance": True, "negative_prompt": ["", "blurry"]}),
        "hunyuan_video": (tiny_hunyuan_video_pipeline, {"prompt": PROMPTS, "prompt_2": None, "max_sequence_length": 16}),
        "qwen_image": (tiny_qwen_image_pipeline, {"prompt": PROMPTS}),
        "flux2": (tiny_flux2_pipeline, {"prompt": PROMPTS, "text_encoder_out_layers": MISTRAL_LAYERS,
                                        "max_sequence_length": 192}),
        "flux2_klein": (tiny_flux2_klein_pipeline, {"prompt": PROMPTS, "text_encoder_out_layers": MISTRAL_LAYERS,
                                                    "max_sequence_length": 48}),
        "wan": (tiny_wan_pipeline, {"prompt": PROMPTS, "negative_prompt": "", "max_sequence_length": 16}),
    }


def _encode(pipe, kwargs: dict) -> list[torch.Tensor]:
    with torch.no_grad():
        return [x for x in tree_flatten(pipe.encode_prompt(**kwargs))[0] if torch.is_tensor(x)]


def _diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return float("inf")
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def _fsdp_left(module: torch.nn.Module) -> int:
    return sum(isinstance(m, FSDPModule) + len(m._forward_pre_hooks) + len(m._forward_hooks)
               + any(isinstance(p, DTensor) for p in m.parameters(recurse=False)) + ("forward" in m.__dict__)
               for m in module.modules())


def _encoder_case(name: str, mode: str, mesh) -> dict[str, float]:
    build, kwargs = _pipelines()[name]
    pipe = build()
    reference = _encode(pipe, kwargs)
    encoders = [module for _, module in encoder_components(pipe)]
    # transformers installs its output-recording hooks on a model's first call: counted here.
    hooks_before = sum(_fsdp_left(e) for e in encoders)
    originals = [{n: p.detach().clone() for n, p in e.named_parameters()} for e in encoders]
    totals = [sum(p.numel() * p.element_size() for p in e.parameters()) for e in encoders]
    padding = [sum(3 * p[0].numel() * p.element_size() for p in e.parameters() if p.dim() > 0) for e in encoders]
    pipe.enable_usp(mesh=mesh, text_encoder=mode, parallel_vae=False)
    placed = _encode(pipe, kwargs)
    resident = [weights.resident_parameter_bytes(e) for e in encoders]
    pipe.disable_usp()
    restored = all(torch.equal(p, o[n]) and type(p) is torch.nn.Parameter
                   for e, o in zip(encoders, originals) for n, p in e.named_parameters())
    rank = torch.distributed.get_rank()
    if mode == "shard":
        over = any(r > t // WORLD + pad for r, t, pad in zip(resident, totals, padding))
    else:
        over = any(r != (t if rank == 0 else 0) for r, t in zip(resident, totals))
    return {
        "embeddings": _diff(placed, reference),
        "resident_off": float(over),
        "not_restored": float(not restored),
        "fsdp_left": float(sum(_fsdp_left(e) for e in encoders) - hooks_before),
        "after_disable": _diff(_encode(pipe, kwargs), reference),
        "encoders": float(len(encoders)),
    }


def _flux_pipeline_case(mesh) -> dict[str, float]:
    from usp_dit.demo.tiny_flux import tiny_flux_pipeline

    def image(shard: bool) -> torch.Tensor:
        pipe = tiny_flux_pipeline()
        pipe.enable_usp(mesh=mesh, shard_weights=shard)
        sharded = isinstance(pipe.transformer, FSDPModule) and isinstance(pipe.text_encoder_2.encoder.block[0], FSDPModule)
        out = pipe(PROMPTS[0], height=64, width=64, num_inference_steps=2, max_sequence_length=16,
                   generator=torch.Generator().manual_seed(0), output_type="pt").images
        pipe.disable_usp()
        assert sharded == shard, (sharded, shard)
        return out

    return {"image_vs_unsharded": (image(True) - image(False)).abs().max().item()}


def _refusal_case(mesh) -> dict[str, float]:
    from usp_dit.demo.tiny_flux import tiny_flux_pipeline

    pipe = tiny_flux_pipeline()
    out = {}
    for key, target, kwargs in (("unknown", pipe, {"text_encoder": "cpu"}),
                                ("bare", pipe.transformer, {"text_encoder": "shard"})):
        try:
            (pipe.enable_usp if target is pipe else __import__("usp_dit").enable_usp)(
                *(() if target is pipe else (target,)), mesh=mesh, **kwargs)
            out[key] = 0.0
            disable_usp(target)
        except ValueError as err:
            out[key] = float("text_encoder=" in str(err) and getattr(pipe.transformer, "_usp_dit_state", None) is None)
    return out


def _run_all() -> dict:
    results: dict = {}
    mesh = init_usp(2, 2, 1)
    for name in _pipelines():
        for mode in MODES:
            record(results, f"{name}-{mode}", lambda: _encoder_case(name, mode, mesh))
    record(results, "flux-pipeline", lambda: _flux_pipeline_case(mesh))
    record(results, "refusals", lambda: _refusal_case(mesh))
    return results


@pytest.fixture(scope="module")
def results() -> list[dict]:
    # check_groups=False: FSDP2's and DTensor's caches keep the meshes they have seen (as in
    # tests/test_shard_weights.py).
    per_rank = run_spawned(_run_all, WORLD, check_groups=False)
    assert_no_crash(per_rank)
    return per_rank


def _cases(results: list[dict], key: str) -> list[dict]:
    cases = [r[key] for r in results]
    for case in cases:
        assert not isinstance(case, str), case
    return cases


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["flux", "sd3", "hunyuan_video", "qwen_image", "flux2", "flux2_klein", "wan"])
def test_prompt_embeddings_equal_one_process(results, name, mode):
    for rank, case in enumerate(_cases(results, f"{name}-{mode}")):
        assert case["encoders"] >= 1, case
        assert case["embeddings"] == 0.0 and case["after_disable"] == 0.0, (rank, case)
        assert case["resident_off"] == 0.0 and case["not_restored"] == 0.0 and case["fsdp_left"] == 0.0, (rank, case)


def test_the_sharded_flux_pipeline_makes_the_unsharded_image(results):
    for case in _cases(results, "flux-pipeline"):
        assert case["image_vs_unsharded"] == 0.0, case


def test_bad_text_encoder_values_are_refused_on_every_rank(results):
    for case in _cases(results, "refusals"):
        assert case == {"unknown": 1.0, "bare": 1.0}, case
