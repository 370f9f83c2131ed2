"""The planner's tensor parallelism (issue 28 item 5): cuts, memory, cost and choice.

No multi-rank job: the released configs are built on ``torch.device("meta")`` and the one real
cut runs in a single subprocess on torch's "fake" process group (a world of 4 ranks simulated
by one process: DTensor and FSDP2 shard for real, no collective moves data; its own process so
that no group outlives it in the test process).

What is checked, and against what:
- the cuts (``usp_dit.planner.models`` Note [tensor cuts]) written for the released Flux.1-dev, Flux.2-dev
  and Qwen-Image equal those ``tensor_cuts_of`` counts from the family plans' ``TensorPlan`` on
  the meta device (0.5 %, the memory tests' bound; they agree exactly); a spec is
  ``tensor_parallel`` exactly where its family's registered plan declares cuts;
- memory (Note [memory per rank]): the weights a rank holds with ``enable_usp(...,
  tensor_degree=2)`` on a tiny Flux (even and uneven heads), replicated and sharded, counted from
  the local tensors of the real cut model (DTensor / FSDP2 shards), against ``transformer_bytes``:
  equal replicated (the uneven split's padding included); sharded, the prediction is at most
  1 % under (Note [memory per rank] leaves out FSDP2's padding, and what stays whole inside a
  cut child, the per-head Q/K norms and row-parallel biases, is sharded over the sequence ranks
  only); the release-fraction cuts of an object spec within 1 % of the exact ones;
- activations: the per-head and MLP widths / T, the residual stream whole, by hand;
- time (Note [tensor parallel cost]): the all-reduce bytes by hand (a predicted figure only:
  ``usp_dit.distributed.traffic`` has no kind for DTensor's all-reduces, so nothing counts them);
- choice: TP where memory forces it, not where it only costs; explain() says why; a plan's
  tensor degree reaches ``enable_usp(degrees=plan)``;
- bad input: a tensor degree above the heads, TP on a family without cuts, Ulysses over a tensor
  rank's heads: ValueError naming the argument.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from usp_dit.distributed.traffic import all_reduce_bytes
from usp_dit.planner import memory as memory_model
from usp_dit.planner.cost import Grid, predict, tensor_all_reduce_bytes
from usp_dit.planner.hardware import check_gpu
from usp_dit.planner.models import CLASSES, SPECS, spec_for, tensor_cuts_of
from usp_dit.planner.plan import plan, priced

ROOT = Path(__file__).resolve().parents[1]
TOLERANCE = 0.005
GPU = check_gpu("h200")


def _family_plans() -> dict[str, object]:
    """Transformer class name -> its registered family plan (every adapter with a plan)."""
    import usp_dit.pipelines  # noqa: F401  (registers the families)
    from usp_dit.pipelines import base

    return {a.plan.model_class.__name__: a.plan for a in base._ADAPTERS if getattr(a, "plan", None) is not None}


@pytest.mark.parametrize("model", sorted(m for m in SPECS if spec_for(m).tensor_parallel))
def test_cuts_are_the_family_plans_on_the_released_config(model):
    from tests.test_planner_memory import TRANSFORMERS, _meta_transformer

    family = _family_plans()[TRANSFORMERS[model][0]]
    counted = tensor_cuts_of(_meta_transformer(model), family.tensor)
    for group in spec_for(model).memory.blocks:
        cut, want = group.cut, counted[group.name]
        for part in ("head_params", "head_bytes", "width_params", "width_bytes"):
            assert abs(getattr(cut, part) - getattr(want, part)) <= TOLERANCE * getattr(want, part), (group.name, part)
        assert (cut.reduces, cut.collectives) == (want.reduces, want.collectives), group.name


def test_tensor_parallel_flag_follows_the_family_plans():
    plans = _family_plans()
    for cls, model in CLASSES.items():
        assert spec_for(model).tensor_parallel == (plans[cls].tensor is not None), cls
    assert spec_for("flux").tensor_parallel and not spec_for("wan22").tensor_parallel


_CUT_JOB = r"""
import json, torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.tensor import DTensor
dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
from dataclasses import replace
import usp_dit
from usp_dit import disable_usp, enable_usp
from usp_dit.demo.tiny_flux import tiny_flux_transformer
from usp_dit.planner.plan import plan

def local_bytes(m):
    seen, n = set(), 0
    for p in m.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            t = p.data.to_local() if isinstance(p.data, DTensor) else p.data
            n += t.numel() * t.element_size()
    return n

out = {}
for heads in (3, 4):
    for shard in (False, True):
        m = tiny_flux_transformer(num_heads=heads)
        enable_usp(m, ulysses_degree=1, ring_degree=2, tensor_degree=2, shard_weights=shard)
        out[f"{heads} {shard}"] = local_bytes(m)
        disable_usp(m)
chosen = replace(plan("flux", world_size=4), ulysses_degree=1, ring_degree=2, cfg_degree=1, tensor_degree=2)
m = tiny_flux_transformer()
mesh = enable_usp(m, degrees=chosen)
out["auto"] = [mesh.ulysses_degree, mesh.ring_degree, mesh.cfg_degree, mesh.tensor_degree]
disable_usp(m)
print("RESULT " + json.dumps(out))
"""


@pytest.fixture(scope="module")
def cut_bytes() -> dict:
    """Local parameter bytes of a tiny Flux cut on a (ulysses 1, ring 2, tensor 2) grid, one process."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _CUT_JOB], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=False, timeout=300)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-3000:]
    return json.loads(lines[-1][len("RESULT "):])


def _tiny_memory(heads: int, exact: bool):
    """The planner's memory of the tiny Flux: counted from the object; ``exact``: its cuts counted
    from the family plan, else the release's fractions (what ``plan(pipe)`` uses)."""
    from usp_dit.demo.tiny_flux import tiny_flux_transformer
    from usp_dit.planner.models import memory_of

    model = tiny_flux_transformer(num_heads=heads)
    memory = memory_of(model, spec_for("flux").memory, heads * 16)
    if not exact:
        return memory
    cuts = tensor_cuts_of(model, _family_plans()["FluxTransformer2DModel"].tensor)
    return replace(memory, blocks=tuple(replace(g, cut=cuts[g.name]) for g in memory.blocks))


@pytest.mark.parametrize("heads", [3, 4])
def test_tensor_parallel_weights_are_the_counted_local_bytes(cut_bytes, heads):
    exact, estimated = _tiny_memory(heads, True), _tiny_memory(heads, False)
    replicated = cut_bytes[f"{heads} False"]
    assert memory_model.transformer_bytes(exact, 4, False, 2, heads) == (replicated, replicated)
    sharded = cut_bytes[f"{heads} True"]
    rest = memory_model.transformer_bytes(exact, 4, True, 2, heads)[1]
    assert rest <= sharded <= 1.01 * rest, (rest, sharded)
    for shard in (False, True):
        got = memory_model.transformer_bytes(estimated, 4, shard, 2, heads)[1]
        assert got == pytest.approx(cut_bytes[f"{heads} {shard}"], rel=0.01)
    # Half of the cut weights is gone: the counted cut is 2/3 of Flux's joint blocks.
    assert replicated < 0.8 * exact.transformer_bytes


def test_a_plan_s_tensor_degree_reaches_enable_usp(cut_bytes):
    assert cut_bytes["auto"] == [1, 2, 1, 2]


def test_activations_divide_the_heads_and_mlp_not_the_residual():
    spec = spec_for("qwen_image")
    (group,) = spec.memory.blocks
    d, m = group.hidden, group.mlp
    one = memory_model._block_values_per_token(group, spec.heads, spec.head_dim, 2, 1)
    two = memory_model._block_values_per_token(group, spec.heads, spec.head_dim, 2, 1, tensor=2)
    assert one == max(8 * d + 3 * d + 2 * spec.heads, 2 * d + 2 * m) + 4 * spec.head_dim
    assert two == max(2 * d + 6 * d // 2 + 3 * d // 2 + spec.heads, 2 * d + m) + 4 * spec.head_dim
    # 24 heads on T = 5: 5 a rank (padded), the MLP's 12288 columns 2458 a rank.
    five = memory_model._block_values_per_token(group, spec.heads, spec.head_dim, 1, 1, tensor=5)
    assert five == max(2 * d + 6 * 5 * spec.head_dim + 2 * 5, 2 * d + 2 * math.ceil(m / 5)) + 4 * spec.head_dim


def test_all_reduces_are_priced_from_the_plan():
    spec = spec_for("flux")
    grid = Grid(2, 1, 1, 2)
    nbytes, calls = tensor_all_reduce_bytes(spec, grid, 1)
    tokens = math.ceil(spec.sequence / 2)  # Flux's text is split with the image
    row = tokens * 3072 * 2
    assert nbytes == 19 * 2 * all_reduce_bytes(row, 2) + 38 * 1 * all_reduce_bytes(row, 2)
    assert calls == 19 * 4 + 38 * 1
    tp, plain = predict(spec, grid, "stream", gpu=GPU), predict(spec, Grid(4, 1), "stream", gpu=GPU)
    assert tp.parts["tensor_all_reduce"] > 0 and plain.parts["tensor_all_reduce"] == 0
    assert tp.comm_bytes_per_rank - 2 * nbytes < plain.comm_bytes_per_rank  # the rest moves less: half the heads
    # The cut compute: a tensor rank runs half the cut Linears on twice the tokens of Ulysses 4.
    assert tp.parts["rest_of_model"] == pytest.approx(plain.parts["rest_of_model"], rel=0.05)


def test_tp_where_memory_forces_it_not_where_it_only_costs():
    # Flux.1 on 2 GPUs: the least memory without TP, then a limit only a TP placement meets.
    every = priced(spec_for("flux"), 2, cfg=False, gpu=GPU, tensor=True,
                   placements=[(s, e) for s in (False, True) for e in ("replicate", "shard", "rank0")])
    without = min(p.memory_per_rank_gib for p in every if p.tensor == 1)
    with_tp = min(p.memory_per_rank_gib for p in every if p.tensor > 1)
    assert with_tp < without
    forced = plan("flux", world_size=2, gpu_memory_gib=(with_tp + without) / 2)
    assert forced.tensor_degree == 2 and all(c.tensor == 2 for c in forced.candidates)
    text = forced.explain()
    assert "tensor 2" in text and "TP 2 cuts the blocks' heads and MLP columns" in text
    assert "without it no placement fits" in text and "all-reduces cost" in text
    # Room for everything: TP fits too but only costs (its all-reduces): not chosen, and said so.
    roomy = plan("flux", world_size=8, gpu_memory_gib=141)
    assert roomy.tensor_degree == 1 and any(c.tensor > 1 for c in roomy.candidates)
    assert "tensor parallelism fits too but costs more" in roomy.explain()
    # No limit: the grids enable_usp makes unasked, no tensor axis (as with shard_weights).
    assert all(c.tensor == 1 for c in plan("flux", world_size=8).candidates)
    # A family without cuts never gets one.
    assert all(c.tensor == 1 for c in plan("wan22", world_size=8, gpu_memory_gib=24).candidates)


def test_sharded_tensor_parallel_memory():
    """Note [memory per rank], sharded + TP on Qwen-Image at U 2 x T 4: the cut share over the
    sequence ranks, the rest over the replica; with no sequence ranks the cut share stays."""
    spec = spec_for("qwen_image")
    memory = spec.memory
    whole, local = memory_model.cut_bytes(memory, spec.heads, 4)
    assert local == pytest.approx(whole / 4)  # 24 heads and 12288 columns divide by 4
    uncut = memory.transformer_bytes - whole
    _, rest = memory_model.transformer_bytes(memory, 8, True, 4, spec.heads)
    assert rest == pytest.approx(local / 2 + uncut / 8)
    _, alone = memory_model.transformer_bytes(memory, 4, True, 4, spec.heads)
    assert alone == pytest.approx(local + uncut / 4)
    repl = memory_model.breakdown(spec, 2, 1, 8, "none", 1, tensor=4)
    assert repl.weights * memory_model.GIB == pytest.approx(uncut + local)
    assert "tensor parallel 4" in repl.placement()


@pytest.mark.parametrize("model, grid, match", [
    ("flux", Grid(1, 1, 1, 32), "tensor_degree=32 exceeds Flux.1-dev's 24 attention heads"),
    ("wan", Grid(1, 1, 1, 2), "tensor_degree=2: Wan 2.1-14B declares no tensor-parallel cuts"),
    ("flux", Grid(16, 1, 1, 2), "ulysses_degree=16 exceeds flux's 12 heads of a tensor rank"),
    ("flux", Grid(1, 1, 1, 0), "tensor_degree=0 must be an int >= 1"),
])
def test_bad_tensor_degrees_are_refused(model, grid, match):
    with pytest.raises(ValueError, match=match):
        predict(spec_for(model), grid, "stream", gpu=GPU)
