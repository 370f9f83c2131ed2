"""enable_usp beside Diffusers' offloading and quantized weights (Note [offload and quantization
under USP] in usp_dit.pipelines.composition), each in both orders, on CPU gloo grids.

One spawned group of 4 ranks; grids (U, R, cfg) (2,1,1) (two data-parallel replicas of 2 ranks)
and (1,2,2) (ring and cfg): model offload and the quantizations on both, block_level group offload
on (2,1,1), leaf_level and "rank0" encoders on (1,2,2). Every composition that works is compared
with the same offloaded or quantized run on one process (same seeded tiny models, built on every
rank):

  * offload, on the tiny ``WanPipeline`` (T5, 2 steps with guidance, Wan VAE decode, parallel VAE
    on): ``enable_model_cpu_offload(device="cpu")``, ``enable_group_offload`` block_level and
    leaf_level (``onload_device=cpu``), and model offload with ``text_encoder="rank0"``; offload
    then ``enable_usp``, and ``enable_usp`` then offload. Two pipeline calls (Diffusers'
    ``maybe_free_model_hooks`` re-installs model-offload hooks after each: Diffusers issue 12533)
    with usp_dit's replica wrapper counted on both, the offload hooks counted too; then
    ``disable_usp`` and a third call: the offload still works, the model is the plain one.
    On CPU "offload to cpu" moves no data, but every hook runs.
  * quantization, on the tiny Wan transformer (``usp_dit.demo.tiny_wan``, 45 tokens, batch 2):
    torchao int8 weight-only, float8 weight-only, int8 dynamic (per-token activation scales) and
    GGUF Q8_0 (Diffusers' GGUFQuantizer + GGUFParameter), quantized before and after enable_usp
    (GGUF after: its module swap is refused at the call, usp_dit's hooks being on the old modules).
  * refusals, each raised on every rank at the call: int8 dynamic with a per-tensor activation
    scale (at enable_usp, and at the first call when quantized after it); shard_weights=True with
    model offload, group offload, torchao weights (at enable_usp; offload or quantize_ added after
    shard_weights: at the first call); text_encoder="rank0" with group offload.

Not here: sequential CPU offload (accelerate 1.16 cannot offload to a CPU execution device under
torch 2.13: ``set_module_tensor_to_device`` fails on the first module, with or without usp_dit),
``use_stream=True`` (needs CUDA), float8 dynamic activation (torchao needs CUDA SM >= 8.9) and
bitsandbytes 4-bit (Diffusers' bnb quantizer needs a GPU): tests/gpu/test_memory_composition_gpu.py.
The quantization libraries are optional: a case whose library is missing is skipped by name.

Tolerances: latents and transformer outputs max|err| / max|ref| <= 1e-5 (float32: sharding only
reorders sums; a quantized Linear computes each token's row from that row, so the shard's rows are
the whole sequence's); decoded frames 1e-4 (an untrained random VAE's gain, as in
tests/test_pipeline_wan.py); after disable_usp the offloaded pipeline equals its one-process run
bit for bit (the same model, the same calls). int8 dynamic activations on (1,2,2): 3e-2 (measured
1.2e-2): rounding to int8 is a step function, and where the attention sums in another order (ring
merges, a cfg half batch: ~1e-7) a value on a rounding boundary moves one step (1/127 of its
token's max); on (2,1,1) the arithmetic is the same and the bar is 1e-5 (measured 0).
"""
from __future__ import annotations

import contextlib
import importlib.util
from unittest import mock

import pytest
import torch

from tests.adapter_parity import forward, record
from usp_dit import disable_usp, enable_usp, init_usp
from usp_dit.demo.tiny_wan import tiny_wan, tiny_wan_pipeline, wan_inputs
from usp_dit.pipelines.replica_forward import ReplicaForward
from usp_dit.testing import assert_no_crash, rel_err, run_spawned

TOL = 1e-5
TOL_FRAMES = 1e-4
TOL_DYNAMIC = 3e-2  # int8 dynamic activations on ring / cfg grids: one int8 rounding step moved (below)
WORLD = 4
GRIDS = ((2, 1, 1), (1, 2, 2))
ORDERS = ("first", "after")  # offload/quantize before enable_usp, or after it
QUANTS = ("int8wo", "float8wo", "int8dyn", "gguf")
HAVE = {"torchao": importlib.util.find_spec("torchao") is not None,
        "gguf": importlib.util.find_spec("gguf") is not None}


def _needs(quant: str) -> str:
    return "gguf" if quant == "gguf" else "torchao"


# ---------------------------------------------------------------------------------------------
# Offload on the pipeline


def _offload(pipe, kind: str) -> None:
    if kind.startswith("model"):
        pipe.enable_model_cpu_offload(device="cpu")
    else:
        level = {"block": "block_level", "leaf": "leaf_level"}[kind]
        extra = {"num_blocks_per_group": 1} if level == "block_level" else {}
        pipe.enable_group_offload(onload_device=torch.device("cpu"), offload_type=level, **extra)


def _call(pipe, output_type: str) -> torch.Tensor:
    out = pipe("a cat", negative_prompt="blurry", height=48, width=80, num_frames=9, num_inference_steps=2,
               guidance_scale=4.0, max_sequence_length=16, generator=torch.Generator().manual_seed(0),
               output_type=output_type)
    return out.frames


@contextlib.contextmanager
def _counting(cls: type, name: str):
    """Count calls of ``cls.name`` (the method still runs)."""
    counter = {"n": 0}
    original = getattr(cls, name)

    def spy(*args, **kwargs):
        counter["n"] += 1
        return original(*args, **kwargs)

    with mock.patch.object(cls, name, spy):
        yield counter


def _offload_hook_class(kind: str) -> tuple[type, str]:
    """What each offload runs at every onload (group offloading binds its hooks' methods when it
    registers them, so its module groups' ``onload_`` is counted)."""
    if kind.startswith("model"):
        from accelerate.hooks import CpuOffload
        return CpuOffload, "pre_forward"
    from diffusers.hooks.group_offloading import ModuleGroup
    return ModuleGroup, "onload_"


def _offload_case(kind: str, order: str, mesh, reference: dict) -> dict[str, float]:
    """Both orders: two calls under USP equal one offloaded process, usp_dit's wrapper runs on
    both; after disable_usp the offload still works and usp_dit has left nothing behind."""
    text_encoder = "rank0" if kind.endswith("rank0") else None
    pipe = tiny_wan_pipeline()
    if order == "first":
        _offload(pipe, kind)
    pipe.enable_usp(mesh=mesh, text_encoder=text_encoder)
    if order == "after":
        _offload(pipe, kind)
    with _counting(ReplicaForward, "__call__") as usp, _counting(*_offload_hook_class(kind)) as hooks:
        frames = _call(pipe, "pt")
        latents = _call(pipe, "latent")
    pipe.disable_usp()
    with _counting(ReplicaForward, "__call__") as usp_after, \
            _counting(*_offload_hook_class(kind)) as hooks_after:
        plain = _call(pipe, "latent")
    chain = [pipe.transformer.__dict__.get("forward"), pipe.transformer.__dict__.get("_old_forward")]
    return {
        "frames": rel_err(frames, reference["frames"]),
        "latents": rel_err(latents, reference["latents"]),
        "after_disable": (plain - reference["latents"]).abs().max().item(),
        # 2 calls x 2 steps x 2 guidance branches = 8 transformer calls, each through the wrapper
        "usp_calls": float(usp["n"]), "usp_calls_after_disable": float(usp_after["n"]),
        "hooks_fired": float(hooks["n"] > 0 and hooks_after["n"] > 0),
        "wrapper_left": float(any(isinstance(f, ReplicaForward) for f in chain)),
    }


def _offload_reference(kind: str) -> dict:
    pipe = tiny_wan_pipeline()
    _offload(pipe, kind)
    return {"frames": _call(pipe, "pt"), "latents": _call(pipe, "latent")}


# ---------------------------------------------------------------------------------------------
# Quantized transformers


def _quantize(model: torch.nn.Module, quant: str) -> None:
    if quant == "gguf":
        _gguf_q8(model)
        return
    from torchao.quantization import (
        Float8WeightOnlyConfig,
        Int8DynamicActivationInt8WeightConfig,
        Int8WeightOnlyConfig,
        PerTensor,
        quantize_,
    )
    config = {"int8wo": Int8WeightOnlyConfig, "float8wo": Float8WeightOnlyConfig,
              "int8dyn": Int8DynamicActivationInt8WeightConfig,
              "int8dyn-pertensor": lambda: Int8DynamicActivationInt8WeightConfig(granularity=PerTensor())}[quant]()
    quantize_(model, config)


def _gguf_q8(model: torch.nn.Module) -> None:
    """What Diffusers' GGUF loading does, from weights quantized here: Q8_0 GGUFParameters for
    every Linear whose input width is a multiple of Q8_0's block (32), GGUFLinear modules."""
    import gguf
    from diffusers import GGUFQuantizationConfig
    from diffusers.quantizers.gguf.gguf_quantizer import GGUFQuantizer
    from diffusers.quantizers.gguf.utils import GGUFParameter

    q8 = gguf.GGMLQuantizationType.Q8_0
    state, biases = {}, {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and module.in_features % 32 == 0:
            data = gguf.quants.quantize(module.weight.detach().numpy(), q8)
            state[f"{name}.weight"] = GGUFParameter(torch.from_numpy(data), quant_type=q8)
            if module.bias is not None:
                biases[name] = module.bias.detach().clone()
    quantizer = GGUFQuantizer(GGUFQuantizationConfig(compute_dtype=torch.float32))
    quantizer._process_model_before_weight_loading(model, device_map=None, state_dict=state)
    for key, value in state.items():
        quantizer.create_quantized_param(model, value, key, torch.device("cpu"), state)
    for name, bias in biases.items():
        model.get_submodule(name)._parameters["bias"] = torch.nn.Parameter(bias, requires_grad=False)


def _wan(quant: str | None = None):
    model = tiny_wan("t2v", seed=30)
    if quant is not None:
        _quantize(model, quant)
    return model, wan_inputs(model, frames=5, height=6, width=6, batch=2, seed=1)


def _quant_case(quant: str, order: str, mesh, reference: torch.Tensor) -> dict[str, float]:
    model, inputs = _wan(quant if order == "first" else None)
    enable_usp(model, mesh=mesh)
    if order == "after":
        _quantize(model, quant)
    if quant == "gguf" and order == "after":
        refused = _refused(lambda: forward(model, inputs))
        disable_usp(model)
        return {"refused": refused}
    out = forward(model, inputs)
    disable_usp(model)
    return {"out": rel_err(out, reference), "after_disable": (forward(model, inputs) - reference).abs().max().item()}


# ---------------------------------------------------------------------------------------------
# Refusals


def _refused(fn) -> str:
    """The NotImplementedError's message, or "" when ``fn`` ran."""
    try:
        fn()
    except NotImplementedError as err:
        return str(err)
    return ""


def _per_tensor_case(mesh) -> dict[str, str]:
    first, inputs = _wan("int8dyn-pertensor")
    at_enable = _refused(lambda: enable_usp(first, mesh=mesh))
    model, _ = _wan()
    enable_usp(model, mesh=mesh)
    _quantize(model, "int8dyn-pertensor")
    at_call = _refused(lambda: forward(model, inputs))
    disable_usp(model)
    return {"at_enable": at_enable, "at_call": at_call,
            "left_enabled": str(getattr(first, "_usp_dit_state", None) is not None)}


def _shard_refusals(mesh) -> dict[str, str]:
    out = {}
    for kind in ("model", "block"):
        pipe = tiny_wan_pipeline()
        _offload(pipe, kind)
        out[f"{kind}-first"] = _refused(lambda: pipe.enable_usp(mesh=mesh, shard_weights=True))
        out[f"{kind}-first-left_enabled"] = str(pipe.transformer.__dict__.get("_usp_dit_state") is not None)
    pipe = tiny_wan_pipeline()
    pipe.enable_usp(mesh=mesh, shard_weights=True)
    pipe.enable_model_cpu_offload(device="cpu")
    out["model-after"] = _refused(lambda: _call(pipe, "latent"))
    model, inputs = _wan("int8wo")
    out["int8wo-first"] = _refused(lambda: enable_usp(model, mesh=mesh, shard_weights=True))
    model, inputs = _wan()
    enable_usp(model, mesh=mesh, shard_weights=True)
    try:
        _quantize(model, "int8wo")
        out["int8wo-after"] = _refused(lambda: forward(model, inputs))
    except Exception as err:  # torchao refusing DTensor weights itself is a refusal too
        out["int8wo-after"] = f"quantize_ raised {type(err).__name__}: shard_weights=True {err}"
    pipe = tiny_wan_pipeline()
    _offload(pipe, "block")
    out["rank0-block"] = _refused(lambda: pipe.enable_usp(mesh=mesh, text_encoder="rank0"))
    return out


# Each offload on the grids that matter for it (CI time): model offload (the one Diffusers
# re-installs after every call) on both, the others on one each.
_OFFLOAD_GRIDS = (("model", GRIDS), ("block", GRIDS[:1]), ("leaf", GRIDS[1:]), ("model+rank0", GRIDS[1:]))
OFFLOAD_CASES = tuple((kind, order, grid) for kind, grids in _OFFLOAD_GRIDS for grid in grids for order in ORDERS)


def _run_all() -> dict:
    results: dict = {}
    meshes = {grid: init_usp(*grid) for grid in GRIDS}
    references = {kind: _offload_reference(kind) for kind in ("model", "block", "leaf")}
    for kind, order, grid in OFFLOAD_CASES:
        reference = references[kind.split("+")[0]]
        record(results, f"{kind}-{order}-{grid}", lambda: _offload_case(kind, order, meshes[grid], reference))
    for quant in QUANTS:
        if not HAVE[_needs(quant)]:
            continue
        model, inputs = _wan(quant)
        reference = forward(model, inputs)
        for grid in GRIDS:
            for order in ORDERS:
                record(results, f"{quant}-{order}-{grid}", lambda: _quant_case(quant, order, meshes[grid], reference))
    if HAVE["torchao"]:
        record(results, "per-tensor", lambda: _per_tensor_case(meshes[(2, 1, 1)]))
        record(results, "shard", lambda: _shard_refusals(meshes[(2, 1, 1)]))
    return results


@pytest.fixture(scope="module")
def results() -> list[dict]:
    # check_groups=False: FSDP2's and DTensor's caches keep the meshes they have seen (shard_weights).
    per_rank = run_spawned(_run_all, WORLD, check_groups=False)
    assert_no_crash(per_rank)
    return per_rank


def _case(results: list[dict], key: str) -> list[dict]:
    cases = [r[key] for r in results]
    for case in cases:
        assert not isinstance(case, str), case  # record() keeps a failing case's traceback
    return cases


@pytest.mark.parametrize(("kind", "order", "grid"), OFFLOAD_CASES, ids=lambda v: "u{}r{}cfg{}".format(*v)
                         if isinstance(v, tuple) else v)
def test_offload_under_usp_equals_one_offloaded_process(results, kind, order, grid):
    for rank, case in enumerate(_case(results, f"{kind}-{order}-{grid}")):
        assert case["latents"] <= TOL and case["frames"] <= TOL_FRAMES, (rank, case)
        assert case["usp_calls"] == 8.0 and case["usp_calls_after_disable"] == 0.0, (rank, case)
        assert case["hooks_fired"] == 1.0 and case["wrapper_left"] == 0.0, (rank, case)
        assert case["after_disable"] == 0.0, (rank, case)


@pytest.mark.parametrize("grid", GRIDS, ids=lambda g: "u{}r{}cfg{}".format(*g))
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("quant", QUANTS)
def test_quantized_transformer_under_usp_equals_one_quantized_process(results, quant, order, grid):
    if not HAVE[_needs(quant)]:
        pytest.skip(f"{_needs(quant)} is not installed (pip install {_needs(quant)})")
    if quant == "gguf" and order == "after":  # GGUF swaps modules: refused at the call
        for case in _case(results, f"{quant}-{order}-{grid}"):
            assert "was replaced after enable_usp" in case["refused"], case
        return
    # int8 dynamic: exact per token, but a rounding to int8 is a step function: where the attention
    # before it sums in another order (ring merges, a cfg half batch: ~1e-7) a value at a rounding
    # boundary moves one step (1/127 of its token's max). Ulysses (2,1,1) keeps the arithmetic.
    tol = TOL_DYNAMIC if quant == "int8dyn" and grid != (2, 1, 1) else TOL
    for rank, case in enumerate(_case(results, f"{quant}-{order}-{grid}")):
        assert case["out"] <= tol, (rank, case)
        assert case["after_disable"] == 0.0, (rank, case)


def test_per_tensor_activation_scales_are_refused_in_both_orders(results):
    if not HAVE["torchao"]:
        pytest.skip("torchao is not installed (pip install torchao)")
    for case in _case(results, "per-tensor"):
        for where in ("at_enable", "at_call"):
            assert "PerTensor" in case[where] and "granularity=PerRow()" in case[where], case
        assert case["left_enabled"] == "False", case


def test_sharded_weights_with_offload_or_quantized_weights_are_refused(results):
    if not HAVE["torchao"]:
        pytest.skip("torchao is not installed (pip install torchao)")
    for case in _case(results, "shard"):
        assert "enable_model_cpu_offload" in case["model-first"] and "shard_weights=True" in case["model-first"], case
        assert "enable_group_offload" in case["block-first"], case
        assert case["model-first-left_enabled"] == case["block-first-left_enabled"] == "False", case
        assert "enable_model_cpu_offload" in case["model-after"] and "after enable_usp" in case["model-after"], case
        assert "torchao" in case["int8wo-first"] and "tensor subclasses" in case["int8wo-first"], case
        assert "shard_weights=True" in case["int8wo-after"], case
        assert "rank0" in case["rank0-block"] and "enable_group_offload" in case["rank0-block"], case
