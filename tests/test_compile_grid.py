"""torch.compile(fullgraph=True) over the grid: usp_attention and the model adapters, on CPU gloo.

One spawned group of 4 ranks runs every case (the 2-rank grids as two data-parallel replicas)
but the families' adapters on 2-rank grids, which a group of 2 runs (Note [adapters on two ranks]).
Each case compiles with ``fullgraph=True``, so a single graph break fails it, through a
``CompileCounterWithBackend("aot_eager")``: it traces forward and backward exactly as inductor
would see them, without spending minutes compiling C++ on two cores, and counts the graphs.

- usp_attention: every grid of 2 and 4 ranks, every ring schedule forced on (2,2) (in CI the one the
  masked cases below do not trace, the others with --full; "stream" on
  (1,2), "gather_merge" on (1,4)); batch 2, 13 tokens
  (odd: uneven shards), GQA 4:2, 5 joint tokens; output, joint output and the gradients of q, k,
  v and the joint inputs, compiled vs eager. One graph per case. The same with the joint tokens
  masked (``joint_mask``: holes in one element, no key in the other) on one rank, Ulysses only,
  and each ring schedule.
- Causal and block-causal usp_attention (zigzag, stripe, contiguous; stream and gather_merge):
  one graph each, output and q/k/v gradients equal to eager; three lengths through one compiled
  causal function: one graph per length (the plan specialises it), outputs equal to eager.
- Dynamic shapes: four sequence lengths through one compiled ring call on (1,2): two graphs in
  all (the first static, the second dynamic, then no recompile), outputs equal to eager.
- Adapters (``enable_usp`` then ``torch.compile(model, fullgraph=True)``; through AOTAutograd for
  ``AOT_FAMILIES``, Dynamo alone for the rest unless ``--full``): tiny Flux (2 x 2 and
  the cfg grid (1,2,2)), CogVideoX, Flux.2, Wan, LTX-Video, SD3, and the prompt-masked families
  Mochi, HunyuanVideo, Qwen-Image and Chroma with padded prompts (Mochi's parameter gradients
  too, summed over the group), SkyReels-V2 diffusion forcing (block-causal), AnyFlow-FAR's cached
  (denoising) call on (2,1) (two steps behind an eagerly filled KV cache: one graph, no recompile,
  output vs one process; its cache call is not traced)
  (Wan's and LTX's attn2 run the stock processor beside the routed attn1: the two must not be
  mixed up by the tracer), output vs the eager enabled model. (docs/COMPILE.md lists the
  families that do not trace yet, and why.) CI traces 32 of the 52 families' adapters: each of
  the other 20 (``SLOW_ADAPTERS``) adds no routing or hook that a kept family's trace does not
  cover, and runs with ``--full``.
- Flux enabled and compiled, four image sizes: at most three graphs on a rank (two on ranks
  that hold text). PEFT LoRA with gradient
  checkpointing on (1,2): the LoRA gradients through the compiled model equal eager's.
- Composition without ``fullgraph`` (Diffusers' cache hooks and FSDP2's hooks break graphs in
  stock models too): First Block Cache on the tiny Flux pipeline at (2,2), latents equal to the
  one-process cached run; FSDP2 over (2,2), output and every parameter's full gradient equal
  the eager sharded run's.
- Refusals: a call without ``seq_len`` (its shards cannot be known without the handshake)
  raises. (``return_lse=True`` with gradients compiles and is exact: tests/test_lse_grad.py.)

Tolerance (max |err| / max |ref|): 1e-5, float32 rounding; the traced graph runs the same kernels
(``usp_dit::attention``) and collectives, and may reorder only the projections' sums
(measured: 0 on every case).
"""
from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist

from tests.adapter_parity import compiled_case
from tests.adapter_parity import record as record_case
from usp_dit import enable_usp, init_usp, shard_sequence, usp_attention
from usp_dit.testing import assert_no_crash, full_suite, rel_err, run_spawned

TOL = 1e-5
WORLD = 4
CORE_GRIDS = [(2, 1, None), (4, 1, None), (1, 2, "stream"), (1, 4, "gather_merge")] + [
    (2, 2, s) for s in ("stream", "gather_merge", "gather_one_call")
]
# Masked joint tokens (Note [masked joint tokens]): one rank, Ulysses only, and each ring schedule.
MASKED_GRIDS = [(1, 1, None), (2, 1, None), (1, 4, "gather_one_call"), (2, 2, "stream"), (2, 2, "gather_merge")]


def _counter():
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    return CompileCounterWithBackend("aot_eager")


def _attention_loss(q, k, v, jq, jk, jv, seq_len: int, joint_mask=None):
    res = usp_attention(q, k, v, joint_q=jq, joint_k=jk, joint_v=jv, seq_len=seq_len, backend="sdpa_cpu",
                        joint_mask=joint_mask)
    return res.out, res.joint_out


# Batch 2: element 0's prompt has holes, element 1's has no key at all.
_JOINT_MASK = torch.tensor([[1, 0, 1, 1, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)


def _masked_attention_loss(q, k, v, jq, jk, jv, seq_len: int):
    return _attention_loss(q, k, v, jq, jk, jv, seq_len, _JOINT_MASK)


def _core_inputs(mesh, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seq, 4, 16, generator=g)
    k, v = (torch.randn(2, seq, 2, 16, generator=g) for _ in range(2))
    jq = torch.randn(2, 5, 4, 16, generator=g)
    jk, jv = (torch.randn(2, 5, 2, 16, generator=g) for _ in range(2))
    local = [shard_sequence(t, mesh, dim=1).detach().requires_grad_() for t in (q, k, v)]
    return local + [t.requires_grad_() for t in (jq, jk, jv)]


def _run_and_grads(fn, inputs, seq: int):
    out, jout = fn(*inputs, seq)
    w = torch.linspace(-1, 1, out.numel()).view_as(out)  # a loss that weighs every output apart
    grads = torch.autograd.grad((out * w).sum() + jout.square().sum(), inputs)
    return [out, jout, *grads]


def _core_case(u: int, r: int, schedule: str | None, fn=_attention_loss) -> dict[str, float]:
    mesh = init_usp(ulysses_degree=u, ring_degree=r, ring_schedule=schedule or "auto")
    inputs = _core_inputs(mesh, 13, seed=u * 10 + r)
    counter = _counter()
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    got = _run_and_grads(compiled, inputs, 13)
    ref = _run_and_grads(fn, inputs, 13)
    return {"err": max(rel_err(a, b) for a, b in zip(got, ref)), "graphs_not_1": float(counter.frame_count != 1)}


CAUSAL_CASES = [  # (ulysses, ring, schedule, layout, frame): frame 1 is causal, 3 block-causal
    (2, 2, "stream", "zigzag", 1), (1, 4, "gather_merge", "stripe", 1), (4, 1, "auto", "contiguous", 3),
    (1, 4, "gather_merge", "zigzag", 3),  # 13 tokens on a ring of 4: zigzag's longest block is the last
]


def _causal_loss(q, k, v, seq_len: int, layout: str, frame: int):
    kw = {"causal": True} if frame == 1 else {"block_causal": frame}
    return usp_attention(q, k, v, seq_len=seq_len, backend="sdpa_cpu", layout=layout, **kw).out


def _causal_case(u: int, r: int, schedule: str, layout: str, frame: int) -> dict[str, float]:
    """Causal / block-causal calls: the plans are constants of the graph (masks.ring_plans)."""
    mesh = init_usp(ulysses_degree=u, ring_degree=r, ring_schedule=schedule)
    g = torch.Generator().manual_seed(u * 10 + r)
    full = [torch.randn(2, 13, h, 16, generator=g) for h in (4, 2, 2)]
    local = [shard_sequence(t, mesh, layout=layout).detach().requires_grad_() for t in full]
    counter = _counter()
    compiled = torch.compile(_causal_loss, backend=counter, fullgraph=True)
    results = []
    for fn in (compiled, _causal_loss):
        out = fn(*local, 13, layout, frame)
        w = torch.linspace(-1, 1, out.numel()).view_as(out)
        results.append([out, *torch.autograd.grad((out * w).sum(), local)])
    err = max(rel_err(a, b) for a, b in zip(*results))
    return {"err": err, "graphs_not_1": float(counter.frame_count != 1)}


def _causal_lengths_case() -> dict[str, float]:
    """Causal calls at three lengths through one compiled function: a graph per length (the plan
    specialises the length), no error once torch's automatic dynamic shapes make it symbolic."""
    mesh = init_usp(ulysses_degree=2, ring_degree=2)
    counter = _counter()
    compiled = torch.compile(_causal_loss, backend=counter, fullgraph=True)
    err = 0.0
    for seq in (13, 17, 23):
        g = torch.Generator().manual_seed(seq)
        local = [shard_sequence(torch.randn(1, seq, h, 16, generator=g), mesh, layout="zigzag") for h in (4, 2, 2)]
        err = max(err, rel_err(compiled(*local, seq, "zigzag", 1), _causal_loss(*local, seq, "zigzag", 1)))
    return {"err": err, "graphs_not_3": float(counter.frame_count != 3)}


def _dynamic_case() -> dict[str, float]:
    """Four lengths through one compiled ring call on (1,2) "stream" (a group of 2: Note [adapters on
    two ranks]; the lengths' shapes reach the trace the same way on any grid)."""
    mesh = init_usp(ulysses_degree=1, ring_degree=2, ring_schedule="stream")
    counter = _counter()
    compiled = torch.compile(_attention_loss, backend=counter, fullgraph=True)
    err = 0.0
    for seq in (13, 17, 23, 30):
        inputs = _core_inputs(mesh, seq, seed=seq)
        got, ref = compiled(*inputs, seq), _attention_loss(*inputs, seq)
        err = max(err, *(rel_err(a, b) for a, b in zip(got, ref)))
    return {"err": err, "graphs_above_2": float(counter.frame_count > 2)}


def _refusals() -> dict[str, float]:
    mesh = init_usp(ulysses_degree=2, ring_degree=2)
    q, k, v, jq, jk, jv = _core_inputs(mesh, 13, seed=0)

    def no_seq_len(q, k, v):
        return usp_attention(q, k, v, backend="sdpa_cpu").out

    torch._dynamo.reset()
    try:
        torch.compile(no_seq_len, backend="aot_eager", fullgraph=True)(q, k, v)
        return {"no_seq_len_not_refused": 1.0}
    except Exception as exc:  # noqa: BLE001 -- fullgraph wraps the user error; its text is what counts
        chain = f"{exc} {exc.__cause__} {exc.__context__}"
        return {"no_seq_len_not_refused": float("seq_len=None" not in chain)}


def _model(family: str, shape: int = 0):
    if family == "flux":
        from tests.test_pipeline_flux import SHAPES, _call_args
        from usp_dit.demo.tiny_flux import tiny_flux_transformer

        return tiny_flux_transformer(), _call_args(SHAPES[1])
    module = __import__(f"tests.test_pipeline_{family}", fromlist=["_build", "SHAPES"])
    return module._build(module.SHAPES[shape])


# Families traced through AOTAutograd too (as inductor sees them); the others through Dynamo alone,
# which catches every graph break (fullgraph) at about half the time: what AOT adds (fake tensors,
# functionalization) concerns usp_dit's own ops, which the core cases and these trace with aot_eager.
AOT_FAMILIES = {"flux"}


def _adapter_case(family: str, grid: tuple[int, int, int], shape: int = 0) -> dict[str, float]:
    u, r, c = grid
    backend = "aot_eager" if family in AOT_FAMILIES or full_suite() else "eager"
    return compiled_case(*_model(family, shape), init_usp(ulysses_degree=u, ring_degree=r, cfg_degree=c), backend)


def _param_grads(model, inputs) -> list[torch.Tensor]:
    out = model(**inputs.kwargs(), return_dict=False)[0]
    w = torch.linspace(-1, 1, out.numel()).view_as(out)
    params = [p for p in model.parameters() if p.requires_grad]
    return list(torch.autograd.grad((out * w).sum(), params, allow_unused=True))


def _summed(grads: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """Each rank's partial parameter gradients summed over the (2,2) sequence group (all 4 ranks):
    the full gradient. Per rank they need not agree: with masked prompts eager calls split the
    valid text tokens' queries over the ring, compiled calls every text token (usp_attention's
    gradient convention promises the sum)."""
    out = []
    for g in grads:
        if g is not None:
            g = g.contiguous()
            dist.all_reduce(g)
        out.append(g)
    return out


def _gradient_case(family: str, shape: int = 0) -> dict[str, float]:
    """Every parameter gradient through the compiled enabled model on (2,2) equals eager's."""
    mesh = init_usp(ulysses_degree=2, ring_degree=2)
    model, inputs = _model(family, shape)
    enable_usp(model, mesh=mesh)
    ref = _summed(_param_grads(model, inputs))
    got = _summed(_param_grads(torch.compile(model, backend="aot_eager", fullgraph=True), inputs))
    pairs = [(a, b) for a, b in zip(got, ref) if b is not None]
    return {"err": max(rel_err(a, b) for a, b in pairs), "missing": float(len(pairs) < len(ref) // 2)}


def _flux_dynamic_case() -> dict[str, float]:
    """Four image sizes through one compiled, enabled Flux: at most three graphs on any rank (the
    first static, then dynamic; ranks past the text specialise once more, on whether a slice of
    the [text; image] split is empty: measured 2 on ranks 0-1, 3 on ranks 2-3, none after)."""
    from usp_dit.demo.tiny_flux import flux_inputs, tiny_flux_transformer

    mesh = init_usp(ulysses_degree=2, ring_degree=2)
    model = tiny_flux_transformer(guidance_embeds=False)
    enable_usp(model, mesh=mesh)
    counter = _counter()
    compiled = torch.compile(model, backend=counter, fullgraph=True)
    err = 0.0
    with torch.no_grad():
        for h, w in ((5, 5), (6, 7), (7, 9), (9, 9)):
            inputs = flux_inputs(1, h, w, 7)
            err = max(err, rel_err(compiled(**inputs, return_dict=False)[0], model(**inputs, return_dict=False)[0]))
    return {"err": err, "graphs_above_3": float(counter.frame_count > 3), "graphs": float(counter.frame_count)}


def _lora_checkpointing_case() -> dict[str, float]:
    """PEFT LoRA on the attention projections, gradient checkpointing on: the LoRA gradients
    through the compiled model equal eager's. On (1,2), in the group of 2 (Note [adapters on two
    ranks]): the ring's backward, the compiled path a checkpoint region replays."""
    from peft import LoraConfig

    mesh = init_usp(ulysses_degree=1, ring_degree=2)
    model, inputs = _model("flux")
    model.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                 init_lora_weights="gaussian"))
    for name, p in model.named_parameters():
        p.requires_grad_("lora" in name)
    model.train()
    model.enable_gradient_checkpointing()
    enable_usp(model, mesh=mesh)
    ref = _param_grads(model, inputs)
    torch._dynamo.reset()
    got = _param_grads(torch.compile(model, backend="aot_eager", fullgraph=True), inputs)
    return {"err": max(rel_err(a, b) for a, b in zip(got, ref)), "no_lora": float(len(ref) == 0)}


def _fbc_pipeline_case() -> dict[str, float]:
    """Diffusers' First Block Cache on a grid under torch.compile (not fullgraph: the cache's
    hooks decide on values, a graph break in stock Diffusers too): the tiny Flux pipeline, 6 steps,
    (2, 2), its latents equal the one-process cached run's, and the cache moved them."""
    from diffusers.hooks import FirstBlockCacheConfig

    import usp_dit.pipelines  # noqa: F401  (pipelines gain enable_usp)
    from usp_dit.demo.tiny_flux import tiny_flux_pipeline

    def latents(pipe):
        last = {}

        def keep(p, step, t, tensors):
            last["latents"] = tensors["latents"]
            return {}

        pipe("a tiny red fox", height=32, width=32, num_inference_steps=6, guidance_scale=3.5, max_sequence_length=16,
             num_images_per_prompt=2, generator=torch.Generator().manual_seed(0), output_type="pt",
             callback_on_step_end=keep)
        return last["latents"]

    pipe = tiny_flux_pipeline()
    pipe.set_progress_bar_config(disable=True)
    plain = latents(pipe)
    pipe.transformer.enable_cache(FirstBlockCacheConfig(threshold=0.8))
    ref = latents(pipe)
    pipe.enable_usp(ulysses_degree=2, ring_degree=2)
    torch._dynamo.reset()
    pipe.transformer.compile(backend="aot_eager")
    try:
        got = latents(pipe)
    finally:
        pipe.disable_usp()
    return {"err": rel_err(got, ref), "cache_did_nothing": float(rel_err(ref, plain) < 1e-3)}


def _fsdp_case() -> dict[str, float]:
    """FSDP2 (every block its own unit) over (2, 2) with the model compiled (not fullgraph: FSDP2's
    hooks break the graph): output and every parameter's full gradient equal the eager sharded run's."""
    from usp_dit.training.fsdp import full_grads, shard_transformer

    mesh = init_usp(ulysses_degree=2, ring_degree=2)
    model, inputs = _model("flux")
    model.train()
    enable_usp(model, mesh=mesh)
    shard_transformer(model, mesh)

    def run(m):
        out = m(**inputs.kwargs(), return_dict=False)[0]
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        grads = full_grads(model)
        for p in model.parameters():
            p.grad = None
        return out.detach(), grads

    ref_out, ref = run(model)
    torch._dynamo.reset()
    model.compile(backend="aot_eager")
    out, got = run(model)
    errs = [rel_err(got[n], ref[n]) for n in ref if ref[n] is not None]
    return {"err": max([rel_err(out, ref_out), *errs]), "no_grads": float(not errs)}


def _skyreels_case() -> dict[str, float]:
    """SkyReels-V2 diffusion forcing (block-causal, zigzag) on (2,2): its frame length comes from
    the config under compile (``SkyReelsFrameHook``), one graph, output equal to eager."""
    from tests.test_pipeline_skyreels_v2 import compile_case

    return compile_case(init_usp(ulysses_degree=2, ring_degree=2))


def _anyflow_far_case() -> dict[str, float]:
    """AnyFlow-FAR's cached (denoising) call on (2,1): [current tokens by usp_attention; the whole
    cache attended locally; stock's zero padding keys] merged by log-sum-exp, one graph over two
    steps of the same shapes, output equal to one process (its cache calls run eagerly)."""
    from tests.test_pipeline_anyflow_far import compile_case

    return compile_case(init_usp(ulysses_degree=2, ring_degree=1))


def _run_all() -> dict[str, dict | str]:
    results: dict[str, dict | str] = {}
    seconds: dict[str, float] = {}  # per case, for whoever trims this file's CI time

    def record(key, fn):
        if key in SLOW and not full_suite():
            return  # an exhaustive case: bash scripts/test.sh --full (its test is marked slow)
        start = time.perf_counter()
        try:
            results[key] = fn()
        except Exception as exc:  # noqa: BLE001 -- a failed case is reported by its own test
            results[key] = f"{type(exc).__name__}: {str(exc)[:2000]}"
        seconds[key] = round(time.perf_counter() - start, 1)

    # First, as in a job that compiles one model: what earlier compiles in the process recorded
    # (other grids, other families through the same wrapper code) can keep torch's automatic
    # dynamic shapes from applying at once (seen: more graphs when run after the other cases).
    record("flux-dynamic", _flux_dynamic_case)
    for u, r, s in CORE_GRIDS:
        record(f"core-{u}x{r}-{s}", lambda: _core_case(u, r, s))
    for u, r, s in MASKED_GRIDS:
        record(f"masked-{u}x{r}-{s}", lambda: _core_case(u, r, s, _masked_attention_loss))
    for case in CAUSAL_CASES:
        record(f"causal-{case}", lambda: _causal_case(*case))
    record("causal-lengths", _causal_lengths_case)
    record("refusals", _refusals)
    for family, grid, shape in ADAPTER_CASES:
        if math.prod(grid) == WORLD:
            record(f"{family}-{grid}-{shape}", lambda: _adapter_case(family, grid, shape))
    record("mochi-gradients", lambda: _gradient_case("mochi", 1))  # padded prompts, different per element
    record("skyreels-df", _skyreels_case)
    record("fbc-pipeline", _fbc_pipeline_case)
    record("fsdp", _fsdp_case)
    torch._dynamo.reset()  # compiled graphs hold the process groups; the harness checks none outlives the job
    results["__seconds__"] = seconds
    return results


def _run_two_rank_adapters() -> dict[str, dict | str]:
    """The adapter cases of 2-rank grids, in a group of 2 (Note [adapters on two ranks])."""
    results: dict[str, dict | str] = {}
    # First, in a fresh Dynamo (the pool resets it between jobs): earlier compiles in the process
    # can keep automatic dynamic shapes from applying at once (Note in ``_run_all``).
    record_case(results, "dynamic", _dynamic_case)
    record_case(results, "lora-checkpointing", _lora_checkpointing_case)
    for family, grid, shape in ADAPTER_CASES:
        if math.prod(grid) == 2 and (family not in SLOW_ADAPTERS or full_suite()):  # a failed case: its error
            record_case(results, f"{family}-{grid}-{shape}", lambda: _adapter_case(family, grid, shape))
    record_case(results, "anyflow_far-cached", _anyflow_far_case)
    torch._dynamo.reset()
    return results


# What CI keeps, and the bug class each kept case guards (docs/TESTING.md); the rest run with --full.
#   core 4x1 (Ulysses alone, uneven heads), 2x2 under each ring schedule (each schedule's traced
#   path: functional all-to-all rotation, gathers, one-call); masked 2x1 (Ulysses-only masked
#   call), 1x4 gather_one_call and 2x2 stream (the masked joint call at ring step 0); causal 2x2
#   stream zigzag and 1x4 gather_merge zigzag f3 (the compiled zigzag padding bug: its longest
#   block is the last); every family's adapter; "dynamic" (recompiles across lengths);
#   lora-checkpointing (compiled backward through an adapter, checkpoint regions). Slow: grids
#   whose path a kept grid already traces, Flux's recompile bound across sizes (163 s), Mochi's
#   full parameter gradients (153 s; LoRA keeps a compiled model backward), First Block Cache
#   under compile (88 s; tests/test_caches.py keeps FBC on grids) and FSDP2 under compile (52 s;
#   tests/test_shard_weights.py and the training tests keep FSDP2 eager).
SLOW = {
    "core-2x1-None", "core-1x2-stream", "core-1x4-gather_merge", "masked-1x1-None", "masked-2x2-gather_merge",
    "causal-(1, 4, 'gather_merge', 'stripe', 1)", "causal-(4, 1, 'auto', 'contiguous', 3)",
    "flux-dynamic", "mochi-gradients", "fbc-pipeline", "fsdp",
    # the same schedule traced with masked joint tokens in CI: masked-2x2-stream, masked-1x4-gather_one_call
    "core-2x2-stream", "core-2x2-gather_one_call",
}


def sweep(cases: list, slow) -> list:
    """``cases`` as pytest parameters, those for which ``slow(case)`` marked ``slow`` (tests/conftest.py)."""
    return [pytest.param(case, marks=pytest.mark.slow) if slow(case) else case for case in cases]


def _slow_key(prefix: str):
    """For ``sweep``: a case is slow when its key ``prefix-...`` is in SLOW."""
    return lambda case: f"{prefix}-{case}" in SLOW


def _grid_key(g) -> str:
    return f"{g[0]}x{g[1]}-{g[2]}"


# Note [adapters on two ranks]
#   Tracing is per-rank Python work: four ranks on the two CI cores trace at half speed each, so a
#   family's fullgraph case on 2 ranks costs half the wall time of the same case on 4. What a
#   family's adapter adds to the traced graph (its hooks, routed processors, the shard's tables and
#   masks) is the same on any grid of a given kind; the kinds are Ulysses (all-to-all) and the
#   ring, so each family traces one of them on 2 ranks, ring where its comment says a rank's shard
#   has an edge (padded keys only, mid-frame starts), and the 4-rank grids (U x R together, the
#   cfg groups) are traced by the core cases and by Flux's two cases.
# Families whose traced mechanism another family's kept case traces already (Note [adapters on two
# ranks]: what a family adds to the graph is its routing and its hooks): their fullgraph case runs
# with --full (2026-12-07, for CI's budget: ~5 s of tracing each). family -> the kept case that
# traces the same mechanism.
SLOW_ADAPTERS = {
    "dit": "pixart", "hunyuan_dit": "pixart", "allegro": "pixart", "latte": "pixart", "lumina_next": "pixart",
    "stable_audio": "pixart", "sana_wm_refiner": "pixart",  # AttnProcessor2_0-style routed F.sdpa, RoPE cut per call
    "auraflow": "sd3", "easyanimate": "sd3",  # SD3's routed F namespace, text first
    "longcat_image": "flux", "ovis_image": "flux", "chroma": "mochi",  # Flux's joint split; masked padded prompts
    "glm_image": "cogview4",  # the text mask as a bias channel
    "dreamlite": "cosmos", "nucleus_moe": "prx",  # a routed dispatch call; image queries over [text; shard] keys
    "ernie_image": "zimage", "joyimage": "joyimage_plus",  # single stream [shard; masked text]; rolled joint RoPE
    "consisid": "cogvideox", "chronoedit": "wan", "sana_video": "sana",  # the base family's plan plus local parts
}

ADAPTER_CASES = [  # (family, (ulysses, ring, cfg), index into the family test's SHAPES)
    ("flux", (2, 2, 1), 0), ("flux", (1, 2, 2), 0), ("cogvideox", (2, 1, 1), 0), ("flux2", (1, 2, 1), 0),
    ("wan", (2, 1, 1), 0), ("ltx_video", (1, 2, 1), 0), ("sd3", (1, 2, 1), 0), ("ltx2", (2, 1, 1), 0),
    # The prompt-masked families (Note [masked joint tokens]): padded prompts that differ per element.
    ("mochi", (1, 2, 1), 2),  # padding in front for one element, no real prompt token in the other
    ("hunyuan_video", (1, 2, 1), 0), ("qwen_image", (2, 1, 1), 0), ("chroma", (2, 1, 1), 0),
    ("hunyuan_video_framepack", (1, 2, 1), 0),  # the packed RoPE table cut at every block; gathered before the crop
    ("chronoedit", (1, 2, 1), 0),  # the edit mode's RoPE (2 latent frames), ChronoEdit's own processor class
    ("helios", (1, 2, 1), 1),  # history tokens: per-shard context lengths, amplified history keys
    ("wan_vace", (2, 1, 1), 1),  # control blocks cut by their own hook, hints added on the shard
    ("wan_animate", (1, 2, 1), 1),  # face attention by frame: every rank's tokens start or end mid-frame
    ("kandinsky5", (2, 1, 1), 0),
    ("kandinsky6_sr", (2, 1, 1), 0),  # NABLA: the deferred estimate and stock's flex call inside the all-to-alls
    ("cosmos3", (1, 2, 1), 0),  # the packed two-stream call, cut at the model's seams; replicated text as joint K/V
    ("cogview4", (2, 1, 1), 0),  # the text mask as a bias channel (routed F.sdpa of the stock code)
    ("longcat_image", (1, 2, 1), 2), ("ovis_image", (2, 1, 1), 0),  # Flux-like joint split; 2: the edit call
    ("bria", (1, 2, 1), 2),  # FIBO: the key mask as an extra Q/K coordinate; rank 1 holds padded keys only
    ("bria_fibo2", (1, 2, 1), 0),  # [gist; piece] single stream, tables and noise flags cut per block, image rows gathered
    ("minimax_h3", (2, 1, 1), 0),  # one packed sequence: per-row vectors cut at each block, two heads gathered
    ("zimage", (1, 2, 1), 0),  # single stream [image shard; masked text], RoPE cut per layer, list inputs
    ("sana", (2, 1, 1), 1),  # linear attention's all-reduced summaries, the Mix-FFN conv's halo exchange
    ("sana_video", (1, 2, 1), 0),  # the same with RoPE, per-frame rows and a temporal conv's halo frames
    ("consisid", (2, 1, 1), 0),  # CogVideoX's plan + perceiver cross-attention of the shard to identity tokens
    ("auraflow", (1, 2, 1), 1),  # SD3's routed F namespace, text first; [text; shard] in the single-stream blocks
    ("hunyuan_dit", (2, 1, 1), 0),  # HunyuanAttnProcessor2_0's routed F.sdpa; the RoPE argument cut at each block
    ("pixart", (1, 2, 1), 1),  # AttnProcessor2_0's routed F.sdpa; masked cross-attention on the shard; Alpha's size conditions
    ("latte", (2, 1, 1), 0),  # frames as batch rows of the routed F.sdpa; temporal blocks' timestep cut per block
    ("allegro", (1, 2, 1), 0),  # AllegroAttnProcessor2_0's routed F.sdpa; RoPE positions cut at every block
    ("kandinsky6", (1, 2, 1), 0),  # the audio queries over the video merged by log-sum-exp; a (video, audio) gather
    ("sana_wm_refiner", (1, 2, 1), 0),  # the refiner's own attn1 processor routed; RoPE argument cut per call
    ("dit", (2, 1, 1), 0),  # PixArt's routed F.sdpa, class-conditional adaLN-zero; the square fold after the gather
    ("prx", (1, 2, 1), 0),  # image queries over [text; shard] keys (zero text queries), padded prompts masked per element
    ("ernie_image", (2, 1, 1), 0),  # sequence-first single stream [image shard; masked text], cut at its seams
    ("glm_image", (1, 2, 1), 0),  # CogView4's block: the text mask as a bias channel (routed dispatch call)
    ("easyanimate", (1, 2, 1), 2),  # SD3's routed F namespace, text first; an MMDiT block and a shared-weights one
    ("cosmos", (1, 2, 1), 1),  # dispatch call routed by a bound partial; per-frame timestep rows cut at every block
    ("nucleus_moe", (2, 1, 1), 2),  # image queries over [shard; masked text] keys (zero text queries); all-dense
    ("motif_video", (2, 1, 1), 2),  # masked joint text, local cross-attention, the decoder's two sharded streams
    ("joyimage", (1, 2, 1), 0),  # routed joint [image shard; text], the image RoPE cut at every block, rolled items
    ("anyflow", (1, 2, 1), 0),  # the dict RoPE table (complex) and per-token modulation cut; a shard starts mid-frame
    ("joyimage_plus", (1, 2, 1), 0),  # batched per-element RoPE cut per block; a text key mask over the whole sequence
    ("dreamlite", (1, 2, 1), 0),  # DreamLiteAttnProcessor2_0's routed dispatch call (GQA); gathered after the last block
    ("lumina_next", (2, 1, 1), 0),  # LuminaAttnProcessor2_0's routed F.sdpa (GQA, proportional scale); local masked attn2
    ("stable_audio", (1, 2, 1), 0),  # StableAudioAttnProcessor2_0's routed F.sdpa; the pipeline's RoPE cut in the processor
    ("stable_audio3", (2, 1, 1), 0),  # two routed dispatch calls (differential); inpainting rows cut at the memory boundary
    ("sana_wm", (2, 1, 1), 2),  # GDN per-frame sums all-reduced + replicated scan; bf16 SDPA over all-gathered K/V
]


@pytest.fixture(scope="module")
def results() -> list[dict]:
    # check_groups=False: torch's compile caches (functional collectives' graphs, AOT artifacts)
    # keep references to the process groups past the job, beyond what usp_dit can release.
    per_rank = run_spawned(_run_all, WORLD, check_groups=False)
    assert_no_crash(per_rank)
    two = run_spawned(_run_two_rank_adapters, 2, check_groups=False)
    assert_no_crash(two)
    # Ranks 2 and 3 carry ranks 0 and 1's 2-rank results (checked twice, harmlessly): one list per rank.
    return [{**res, **two[rank % 2]} for rank, res in enumerate(per_rank)]


def _case(results, key: str) -> list[dict]:
    per_rank = [res[key] for res in results]
    for rank, res in enumerate(per_rank):
        assert isinstance(res, dict), f"rank {rank}: {res}"
    return per_rank


def _assert_case(results, key: str, flag: str) -> None:
    """On every rank: ``flag`` (a failed count or bound) is 0 and the error within TOL."""
    for res in _case(results, key):
        assert res[flag] == 0.0, res
        assert res["err"] <= TOL, res


@pytest.mark.parametrize("grid", sweep(CORE_GRIDS, lambda g: f"core-{_grid_key(g)}" in SLOW), ids=_grid_key)
def test_usp_attention_compiles_in_one_graph_and_equals_eager(results, grid):
    _assert_case(results, f"core-{grid[0]}x{grid[1]}-{grid[2]}", "graphs_not_1")


@pytest.mark.parametrize("case", sweep(CAUSAL_CASES, _slow_key("causal")), ids=lambda c: f"{c[0]}x{c[1]}-{c[2]}-{c[3]}-f{c[4]}")
def test_causal_usp_attention_compiles_in_one_graph_and_equals_eager(results, case):
    _assert_case(results, f"causal-{case}", "graphs_not_1")


def test_causal_calls_compile_one_graph_per_length(results):
    _assert_case(results, "causal-lengths", "graphs_not_3")


def test_new_resolutions_recompile_once_at_most(results):
    _assert_case(results, "dynamic", "graphs_above_2")


def test_untraceable_calls_are_refused(results):
    for res in _case(results, "refusals"):
        assert all(v == 0.0 for v in res.values()), res


@pytest.mark.parametrize("case", sweep(ADAPTER_CASES, lambda c: c[0] in SLOW_ADAPTERS), ids=lambda c: f"{c[0]}-{'x'.join(map(str, c[1]))}-shape{c[2]}")
def test_adapter_compiles_fullgraph_and_equals_eager(results, case):
    _assert_case(results, f"{case[0]}-{case[1]}-{case[2]}", "graphs_not_1")


@pytest.mark.parametrize("grid", sweep(MASKED_GRIDS, lambda g: f"masked-{_grid_key(g)}" in SLOW), ids=_grid_key)
def test_masked_joint_usp_attention_compiles_in_one_graph_and_equals_eager(results, grid):
    _assert_case(results, f"masked-{grid[0]}x{grid[1]}-{grid[2]}", "graphs_not_1")


@pytest.mark.slow
def test_compiled_parameter_gradients_equal_eager(results):
    # Mochi with padded prompts: its joint text stream, the masked joint tokens and the video
    # tokens all carry gradients (Flux's path is the same without the mask; dropped for CI time).
    _assert_case(results, "mochi-gradients", "missing")


def test_anyflow_far_cached_call_compiles_fullgraph_without_recompiling_and_equals_one_process(results):
    _assert_case(results, "anyflow_far-cached", "graphs_not_1")


def test_block_causal_skyreels_compiles_fullgraph_and_equals_eager(results):
    _assert_case(results, "skyreels-df", "graphs_not_1")


@pytest.mark.slow
def test_enabled_flux_recompiles_a_bounded_number_of_times_across_sizes(results):
    _assert_case(results, "flux-dynamic", "graphs_above_3")


def test_lora_with_gradient_checkpointing_compiles_and_equals_eager(results):
    _assert_case(results, "lora-checkpointing", "no_lora")


@pytest.mark.slow
def test_first_block_cache_under_compile_equals_one_process(results):
    _assert_case(results, "fbc-pipeline", "cache_did_nothing")


@pytest.mark.slow
def test_fsdp2_under_compile_equals_eager(results):
    _assert_case(results, "fsdp", "no_grads")
