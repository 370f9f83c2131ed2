"""Causal-LM fine-tuning on a sharded sequence: Hugging Face models with attn_implementation="usp".

One spawned gloo group of 4 ranks runs every case on tiny Llama and Qwen2 models (2 layers, hidden
64, 4 heads, 2 K/V heads: GQA; vocab 128; built from configs in code), batch 2, 61 tokens (prime:
no layout divides it), on the grids (U, R) = (2,1), (1,2) (both leave a data-parallel axis of 2:
each dp index trains on its own batch) and (2,2), in the layouts zigzag, stripe and contiguous:
  * gradients: ``lm_loss`` on ``shard_lm_batch``'s shard, ``sync_lm_grads`` (sum over the sequence
    group, mean over dp); the loss equals the one-process loss of the replica's batch and EVERY
    parameter gradient equals the mean over dp indices of the one-process gradients. The reference
    is the stock model (attn_implementation="sdpa") on the whole sequence, with the textbook
    shifted cross-entropy; float64 on every grid and layout, float32 on every grid in zigzag, and
    float64 with gradient checkpointing once;
  * training: five AdamW steps on the grid (each dp index on its own batch) give the losses of
    the same five steps on one process (which averages the dp indices' losses), and the loss falls;
  * the guards: a forward without position_ids, or sharded in another layout than the registered
    one, raises the same ValueError on every rank; a padding mask on one shard only is refused
    there (NotImplementedError) and the other ranks raise a ValueError naming it instead of
    waiting; the group then carries on.
Without processes: USPAttention and the registered function at one rank against PyTorch's SDPA and
transformers' own sdpa function, a whole model at one rank against its stock attention (and
``lm_loss`` against the model's own loss), a model's padding mask reaching the refusal (and a mask
of ones changing nothing), the refusals, and ``shard_lm_batch``'s positions and labels in every
layout on several grids.

Tolerances, as max|err| / max|ref| per tensor (losses: |err| / |ref|): float64 1e-10 (sharding
reorders float64 sums only: ~1e-15 remains); float32 gradients 1e-5 (the issue's bar: the blocks'
log-sum-exp merges and the sums over ranks reorder float32 sums, a few 1e-7 on the loss, ~1e-6 on
the worst parameter); float32 losses after five AdamW steps 1e-5 relative (each step moves every
weight by about lr whatever its gradient's size, so rounding that differs between the runs shows up
in the loss at ~1e-7).
"""
from __future__ import annotations

import itertools
import re
import sys
import types
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config  # noqa: E402
from transformers.integrations.sdpa_attention import sdpa_attention_forward  # noqa: E402

from usp_dit import USPAttention, init_usp, single_rank_mesh  # noqa: E402
from usp_dit.llm import lm_loss, register_transformers, shard_lm_batch, sync_lm_grads  # noqa: E402
from usp_dit.llm.hf import TransformersAttention  # noqa: E402
from usp_dit.sharding.layouts import LAYOUTS, positions, shard_pieces  # noqa: E402
from usp_dit.testing import assert_no_crash, rel_err, run_spawned  # noqa: E402
from usp_dit.training import mean_over_data_parallel  # noqa: E402

WORLD = 4
SEQ = 61
BATCH = 2
VOCAB = 128
STEPS = 5
LR = 1e-2  # large enough that five steps on one batch visibly lower the loss
FAMILIES = ("llama", "qwen2")
GRIDS = [(2, 1), (1, 2), (2, 2)]  # (ulysses, ring); the first two leave dp = 2
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def build(family: str, dtype: torch.dtype, attn: str, **config) -> torch.nn.Module:
    """A tiny causal LM, seeded (the same weights for every attn_implementation and rank), train mode."""
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    cfg = (LlamaConfig if family == "llama" else Qwen2Config)(**common, **config)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn).to(dtype).train()


def tokens(seed: int) -> torch.Tensor:
    """(BATCH, SEQ) random token ids."""
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1000 + seed))


def ref_loss(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """One process, whole sequence: mean cross-entropy of token i+1 given tokens <= i."""
    logits = model(input_ids=ids, use_cache=False).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def usp_loss(model: torch.nn.Module, ids: torch.Tensor, mesh, layout: str) -> torch.Tensor:
    """The recipe of docs/LLM.md: shard, forward with global position_ids, lm_loss."""
    batch = shard_lm_batch(ids, mesh, layout)
    logits = model(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    return lm_loss(logits, batch.labels, mesh)


# ---- the spawned group ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    family: str
    grid: tuple[int, int]
    layout: str
    dtype: torch.dtype
    ckpt: bool = False

    @property
    def id(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return f"{self.family}-u{self.grid[0]}r{self.grid[1]}-{self.layout}-{dt}" + ("-ckpt" if self.ckpt else "")


GRAD_CASES = (
    [Case(f, g, lay, torch.float64) for f, g, lay in itertools.product(FAMILIES, GRIDS, LAYOUTS)]
    + [Case(f, g, "zigzag", torch.float32) for f, g in itertools.product(FAMILIES, GRIDS)]
    + [Case("llama", (2, 2), "zigzag", torch.float64, ckpt=True)]
)
TRAIN_CASES = [Case(f, g, "zigzag", torch.float32) for f, g in itertools.product(FAMILIES, GRIDS)] + [
    Case("qwen2", (1, 2), "stripe", torch.float64)]


def _one_process_grads(family: str, dtype: torch.dtype, seed: int) -> tuple[float, dict[str, torch.Tensor]]:
    model = build(family, dtype, "sdpa")
    loss = ref_loss(model, tokens(seed))
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def _grad_case(case: Case, mesh, refs) -> dict:
    register_transformers(mesh, layout=case.layout)
    model = build(case.family, case.dtype, "usp")
    if case.ckpt:
        model.gradient_checkpointing_enable()
    loss = usp_loss(model, tokens(mesh.dp_rank), mesh, case.layout)
    loss.backward()
    sync_lm_grads(model, mesh)
    ref = {d: refs[(case.family, case.dtype, d)] for d in range(mesh.dp_degree)}
    mean = {n: sum(ref[d][1][n] for d in ref) / len(ref) for n in ref[0][1]}
    grads = {n: p.grad for n, p in model.named_parameters()}
    worst, name = max((rel_err(grads[n], mean[n]), n) for n in mean)
    ref_value = ref[mesh.dp_rank][0]
    return {"loss": abs(loss.item() - ref_value) / abs(ref_value), "grad": worst, "worst": name,
            "params": len(grads)}


def _train(case: Case, mesh) -> list[float]:
    """STEPS AdamW steps on the grid, each dp index on its own batch. Losses averaged over dp."""
    register_transformers(mesh, layout=case.layout)
    model = build(case.family, case.dtype, "usp")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = usp_loss(model, tokens(mesh.dp_rank), mesh, case.layout)
        loss.backward()
        sync_lm_grads(model, mesh)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(mean_over_data_parallel(loss, mesh).item())
    return losses


def _train_one_process(family: str, dtype: torch.dtype, dp: int) -> list[float]:
    """The same STEPS steps on one process: the loss is the mean of the dp indices' losses."""
    model = build(family, dtype, "sdpa")
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for _ in range(STEPS):
        loss = sum(ref_loss(model, tokens(d)) for d in range(dp)) / dp
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _train_case(case: Case, mesh, refs) -> dict:
    got = _train(case, mesh)
    key = (case.family, case.dtype, mesh.dp_degree)
    if key not in refs:
        refs[key] = _train_one_process(*key)
    return {"losses": got, "ref": refs[key], "err": max(abs(a - b) / abs(b) for a, b in zip(got, refs[key]))}


def _guard_case(mesh, shard_layout: str, with_positions: bool) -> str:
    """The error of a forward whose position_ids do not fit the registered layout ("no error" else)."""
    register_transformers(mesh, layout="zigzag")
    model = build("llama", torch.float32, "usp")
    batch = shard_lm_batch(tokens(0), mesh, shard_layout)
    try:
        model(input_ids=batch.input_ids, position_ids=batch.position_ids if with_positions else None, use_cache=False)
    except ValueError as exc:
        return str(exc)
    return "no error"


def _padding_on_one_rank(mesh) -> str:
    """A padding mask that reaches the last shard only: that rank refuses it, the others must not wait."""
    register_transformers(mesh, layout="zigzag")
    model = build("llama", torch.float32, "usp")
    batch = shard_lm_batch(tokens(0), mesh, "zigzag")
    mask = torch.ones_like(batch.input_ids)
    if mesh.seq_rank == mesh.sequence_degree - 1:
        mask[:, -1] = 0
    try:
        model(input_ids=batch.input_ids, position_ids=batch.position_ids, attention_mask=mask, use_cache=False)
    except (NotImplementedError, ValueError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _record(results: dict, key: str, fn) -> None:
    try:
        results[key] = fn()
    except Exception as exc:  # recorded, asserted by the parent
        results[key] = f"{type(exc).__name__}: {exc}"


def run_group() -> dict:
    torch.set_num_threads(1)
    meshes = {grid: init_usp(ulysses_degree=grid[0], ring_degree=grid[1]) for grid in GRIDS}
    refs = {(f, dt, seed): _one_process_grads(f, dt, seed)
            for f, dt in {(c.family, c.dtype) for c in GRAD_CASES} for seed in (0, 1)}
    results: dict = {}
    for case in GRAD_CASES:
        _record(results, "grad-" + case.id, lambda: _grad_case(case, meshes[case.grid], refs))
    train_refs: dict = {}
    for case in TRAIN_CASES:
        _record(results, "train-" + case.id, lambda: _train_case(case, meshes[case.grid], train_refs))
    mesh = meshes[(2, 2)]
    _record(results, "guard-no-positions", lambda: _guard_case(mesh, "zigzag", with_positions=False))
    _record(results, "guard-other-layout", lambda: _guard_case(mesh, "contiguous", with_positions=True))
    _record(results, "guard-padding-one-rank", lambda: _padding_on_one_rank(mesh))
    _record(results, "guard-after", lambda: _grad_case(Case("llama", (2, 2), "zigzag", torch.float64), mesh, refs))
    return results


@pytest.fixture(scope="module")
def group_results() -> list[dict]:
    per_rank = run_spawned(run_group, WORLD)
    assert_no_crash(per_rank)
    return per_rank


def _per_rank(results: list[dict], key: str) -> list:
    for rank, res in enumerate(results):
        assert not isinstance(res[key], str), f"rank {rank}: {res[key]}"
    return [res[key] for res in results]


@pytest.mark.parametrize("case", GRAD_CASES, ids=[c.id for c in GRAD_CASES])
def test_loss_and_every_gradient_equal_one_process(group_results, case: Case):
    tol = TOL[case.dtype]
    for rank, r in enumerate(_per_rank(group_results, "grad-" + case.id)):
        assert r["params"] == 2 * 9 + 3 + (2 * 3 if case.family == "qwen2" else 0), r["params"]
        assert r["loss"] <= tol, f"rank {rank}: loss off by {r['loss']:.2e}"
        assert r["grad"] <= tol, f"rank {rank}: {r['worst']} off by {r['grad']:.2e}"


@pytest.mark.parametrize("case", TRAIN_CASES, ids=[c.id for c in TRAIN_CASES])
def test_adamw_steps_give_one_process_losses(group_results, case: Case):
    for rank, r in enumerate(_per_rank(group_results, "train-" + case.id)):
        assert len(r["losses"]) == STEPS
        assert r["err"] <= TOL[case.dtype], f"rank {rank}: {r['losses']} vs one process {r['ref']}"
        assert r["ref"][-1] < r["ref"][0], "the steps must train (the loss falls)"


def test_positions_that_do_not_fit_the_layout_and_a_refusal_on_one_rank_raise_on_every_rank(group_results):
    for rank, res in enumerate(group_results):
        missing, other = res["guard-no-positions"], res["guard-other-layout"]
        assert "position_ids do not match layout='zigzag'" in missing, f"rank {rank}: {missing}"
        assert "shard_lm_batch" in missing, f"rank {rank}: {missing}"
        assert "position_ids do not match layout='zigzag'" in other, f"rank {rank}: {other}"
        padding = res["guard-padding-one-rank"]
        kind = "NotImplementedError" if rank == WORLD - 1 else "ValueError"  # the (2,2) grid: seq rank = rank
        assert padding.startswith(kind), f"rank {rank}: {padding}"
        assert "a padding attention_mask (it has zeros)" in padding, f"rank {rank}: {padding}"
    for rank, r in enumerate(_per_rank(group_results, "guard-after")):  # the group carries on
        assert r["grad"] <= TOL[torch.float64], f"rank {rank}: {r}"


# ---- one rank, no processes ----------------------------------------------------------------------

def _qkv(seed: int, seq: int = 23, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(2, seq, 4, 16, generator=g, dtype=dtype), torch.randn(2, seq, 2, 16, generator=g, dtype=dtype),
            torch.randn(2, seq, 2, 16, generator=g, dtype=dtype))


@pytest.mark.parametrize("causal", [True, False])
def test_usp_attention_module_at_one_rank_is_sdpa(causal):
    q, k, v = _qkv(0)
    out = USPAttention(single_rank_mesh(), causal=causal, layout="zigzag")(q, k, v)
    ref = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=causal,
                                         enable_gqa=True).transpose(1, 2)
    assert out.shape == q.shape
    assert rel_err(out, ref) <= 1e-12


def test_usp_attention_module_refuses_bad_arguments():
    with pytest.raises(ValueError, match="layout='diagonal'"):
        USPAttention(layout="diagonal")
    with pytest.raises(ValueError, match="not both"):
        USPAttention(causal=True, block_causal=4)


@pytest.mark.parametrize("is_causal", [True, False])
def test_registered_function_at_one_rank_is_transformers_sdpa(is_causal):
    """transformers' layout in and out: the same as its own sdpa function, causal or not (module.is_causal)."""
    q, k, v = (t.transpose(1, 2) for t in _qkv(1))  # (B, H, S, D)
    module = types.SimpleNamespace(is_causal=is_causal, num_key_value_groups=2, training=False)
    fn = TransformersAttention(single_rank_mesh(), "zigzag")
    out, weights = fn(module, q, k, v, None, scaling=0.3, dropout=0.0)
    ref, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.3)
    assert weights is None and out.shape == (2, 23, 4, 16)
    assert rel_err(out, ref) <= 1e-12


@pytest.mark.parametrize("family", FAMILIES)
def test_whole_model_at_one_rank_matches_stock_attention_and_its_own_loss(family):
    register_transformers(single_rank_mesh())
    ids = tokens(3)
    usp, stock = build(family, torch.float64, "usp"), build(family, torch.float64, "sdpa")
    assert usp.config._attn_implementation == "usp"
    batch = shard_lm_batch(ids, single_rank_mesh())
    assert torch.equal(batch.position_ids, torch.arange(SEQ).expand(BATCH, SEQ))
    logits = usp(input_ids=batch.input_ids, position_ids=batch.position_ids, use_cache=False).logits
    assert rel_err(logits, stock(input_ids=ids, use_cache=False).logits) <= 1e-12
    # lm_loss with the globally shifted labels is the model's own loss (transformers shifts inside
    # the model and computes it in float32, hence 1e-6).
    own = build(family, torch.float32, "sdpa")(input_ids=ids, labels=ids, use_cache=False).loss
    assert abs(lm_loss(logits, batch.labels, single_rank_mesh()).item() - own.item()) <= 1e-6 * own.item()


def _call(**overrides):
    q, k, v = (t.transpose(1, 2) for t in _qkv(2, dtype=torch.float32))
    args = dict(module=types.SimpleNamespace(is_causal=True), query=q, key=k, value=v, attention_mask=None)
    args.update(overrides)
    return TransformersAttention(single_rank_mesh(), "zigzag")(**args)


@pytest.mark.parametrize("overrides, message", [
    (dict(attention_mask=torch.ones(2, 23, dtype=torch.long).index_fill_(1, torch.tensor([20, 21, 22]), 0)),
     "a padding attention_mask (it has zeros): right-pad the sequences, pass attention_mask=None"),
    (dict(attention_mask=torch.zeros(2, 1, 23, 23)), "a custom attention_mask of shape (2, 1, 23, 23)"),
    (dict(dropout=0.1), "attention dropout (dropout=0.1 in training): set config.attention_dropout=0.0"),
    (dict(sliding_window=8), "a sliding window (sliding_window=8)"),
    (dict(softcap=30.0), "logit softcapping (softcap=30.0)"),
    (dict(s_aux=torch.zeros(4)), "attention sinks (s_aux)"),
    (dict(cu_seq_lens_q=torch.tensor([0, 23])), "packed varlen sequences (cu_seq_lens_q)"),
    (dict(position_ids=torch.zeros(3, 2, 23, dtype=torch.long)), "position_ids of shape (3, 2, 23) (multimodal RoPE)"),
], ids=["padding-mask", "4d-mask", "dropout", "sliding-window", "softcap", "sinks", "varlen", "mrope"])
def test_refusals_name_the_combination(overrides, message):
    with pytest.raises(NotImplementedError, match="attn_implementation='usp' does not support " + re.escape(message)):
        _call(**overrides)


def test_kv_cache_is_refused_and_a_mask_of_ones_is_accepted():
    q, k, v = (t.transpose(1, 2) for t in _qkv(2, dtype=torch.float32))
    with pytest.raises(NotImplementedError, match=r"keys of another length than the queries \(23 keys, 1 queries"):
        _call(query=q[:, :, -1:])
    out, _ = _call(attention_mask=torch.ones(2, 23, dtype=torch.long))
    assert rel_err(out, _call()[0]) == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_a_models_padding_mask_reaches_the_refusal(family):
    """transformers drops the attention_mask of a name without a mask function; usp_mask hands a
    padding mask on (refused) and drops a mask of ones (the same logits as no mask)."""
    register_transformers(single_rank_mesh())
    model, ids = build(family, torch.float64, "usp"), tokens(4)
    mask = torch.ones_like(ids)
    plain = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(model(input_ids=ids, attention_mask=mask, use_cache=False).logits, plain)
    mask[0, -3:] = 0
    with pytest.raises(NotImplementedError, match=r"a padding attention_mask \(it has zeros\)"):
        model(input_ids=ids, attention_mask=mask, use_cache=False)


def test_sliding_window_model_is_refused_at_its_first_attention():
    register_transformers(single_rank_mesh())
    model = build("qwen2", torch.float32, "usp", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    with pytest.raises(NotImplementedError, match=r"a sliding window \(sliding_window=16\)"):
        model(input_ids=tokens(0), use_cache=False)


def test_registration_refuses_bad_names_and_layouts(monkeypatch):
    import usp_dit
    import usp_dit.llm.hf

    assert usp_dit.register_transformers is usp_dit.llm.hf.register_transformers  # resolved on first access
    for name in ("sdpa", "usp_flash", "eager"):
        with pytest.raises(ValueError, match=f"name={name!r} must be a non-empty str without"):
            register_transformers(name=name)
    with pytest.raises(ValueError, match="layout='spiral' is not a sequence layout"):
        register_transformers(layout="spiral")
    from transformers import AttentionMaskInterface

    monkeypatch.setitem(AttentionMaskInterface._global_mapping, "usp_taken", lambda **kwargs: None)
    with pytest.raises(ValueError, match="name='usp_taken' already has another mask function"):
        register_transformers(name="usp_taken")
    monkeypatch.setitem(sys.modules, "transformers", None)  # as if not installed
    with pytest.raises(RuntimeError, match=r"pip install 'transformers>=5'"):
        register_transformers()


def _stand_in_mesh(ring: int, ulysses: int, seq_rank: int):
    """What shard_sequence reads of a mesh, for one rank of a (ring, ulysses) grid without processes."""
    return types.SimpleNamespace(ring_degree=ring, ulysses_degree=ulysses, sequence_degree=ring * ulysses,
                                 seq_rank=seq_rank, cfg_degree=1)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_lm_batch_positions_and_labels(layout):
    """Every rank's tokens, global positions and globally shifted labels; together they tile the batch."""
    for seq, (ring, ulysses) in itertools.product((1, 2, 7, 13, 61), ((1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (3, 2))):
        if seq < ring * ulysses:
            continue  # refused: a rank would hold no token (test_shard_lm_batch_and_lm_loss_refuse_bad_inputs)
        ids = torch.randint(0, VOCAB, (BATCH, seq), generator=torch.Generator().manual_seed(seq))
        labels = ids.clone()
        labels[1, seq // 2] = -100  # an ignored label stays ignored, at its own (shifted) place
        seen = []
        for rank in range(ring * ulysses):
            b = shard_lm_batch(ids, _stand_in_mesh(ring, ulysses, rank), layout, labels=labels)
            pos = positions(shard_pieces(seq, ring, ulysses, layout)[rank])
            assert b.seq_len == seq and b.position_ids.shape == b.input_ids.shape == b.labels.shape == (BATCH, len(pos))
            assert torch.equal(b.position_ids, pos.expand(BATCH, -1))
            assert torch.equal(b.input_ids, ids[:, pos])
            nxt = torch.cat([labels[:, 1:], torch.full((BATCH, 1), -100)], 1)  # label of i: token i + 1
            assert torch.equal(b.labels, nxt[:, pos]), (seq, ring, ulysses, rank)
            seen += pos.tolist()
        assert sorted(seen) == list(range(seq))


def test_shard_lm_batch_and_lm_loss_refuse_bad_inputs():
    mesh = single_rank_mesh()
    with pytest.raises(ValueError, match=r"input_ids must be \(batch, seq\) integer token ids"):
        shard_lm_batch(torch.zeros(2, 5), mesh)
    with pytest.raises(ValueError, match=r"labels \(2, 4\) must have input_ids' shape \(2, 5\)"):
        shard_lm_batch(torch.zeros(2, 5, dtype=torch.long), mesh, labels=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="seq_len=3 tokens for 4 ranks of the sequence group: a rank would hold no"):
        shard_lm_batch(torch.zeros(2, 3, dtype=torch.long), _stand_in_mesh(2, 2, 0))
    with pytest.raises(ValueError, match="cfg_degree=2"):
        shard_lm_batch(torch.zeros(2, 5, dtype=torch.long), types.SimpleNamespace(cfg_degree=2))
    with pytest.raises(ValueError, match=r"logits_local \(2, 5, 8\) must be \(batch, seq_local, vocab\)"):
        lm_loss(torch.zeros(2, 5, 8), torch.zeros(2, 4, dtype=torch.long), mesh)
