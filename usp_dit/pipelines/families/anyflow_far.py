"""AnyFlow FAR: ``AnyFlowFARTransformer3DModel`` (frame-autoregressive, ``AnyFlowFARPipeline``) on a USP
grid: its two inference calls, the cache call and the cached (denoising) call.

Layout: latents (batch, **frames, channels**, height, width) (the pipeline's FAR order); tokens
(batch, seq, channels), frame-major; a cache call's sequence is [compressed chunks; full chunks]
(``far_patch_embedding``'s tokens, then ``patch_embedding``'s); text (batch, text_seq, channels)
replicated; in ``attn1`` Q/K/V (batch, heads, seq, head_dim) where they are rotated (stock's
layout), (batch, seq, heads, head_dim) at the kernels; the RoPE dict ``{"query", "key"}``, each
complex (1, 1, seq, head_dim / 2), **the sequence on dim 2**; the KV cache, per layer
``{"compressed_cache", "full_cache"}``, each (2, batch_cache, heads, rows, head_dim): [K; V],
pre-RoPE, allocated whole by the pipeline.

The backbone is AnyFlow's (``usp_dit.pipelines.families.anyflow``: tokens split at block 0's
input, ``attn2`` to the replicated text local, ``proj_out``'s output gathered, the dual-timestep
modulation ``condition_embedder`` cut like the tokens: Note [AnyFlow's per-token tables] there).
What differs is ``attn1``, its processor ``AnyFlowCausalAttnProcessor``, and what each call makes it
attend:

Note [what FAR inference computes]
    ``AnyFlowFARPipeline.__call__`` walks ``chunk_partition`` (frames per chunk; L =
    ``full_chunk_limit``; per frame ``ftpf`` full tokens and ``ctpf`` compressed ones). For chunk c:

    * **cached calls** (each denoising step; none for a V2V / I2V context chunk):
      ``transformer(chunk latents, chunk_partition[:c+1], kv_cache, {num_cached_chunks: c,
      is_cache_step: False})`` -> ``_forward_inference``. Its tokens are chunk c's alone, full
      patches: S = frames_c * ftpf. It sets ``attention_mask = None`` for every block (the pipeline
      passes none either). ``attn1`` reads keys [cached compressed (nc rows); cached full (nf
      rows); its S tokens], the cache pre-RoPE, the whole concatenation rotated with the table of
      every frame so far, the queries with its last S rows; then it pads queries, keys and values
      with Z = ceil(S / 128) * 128 - S zero rows (flex's block size) and calls flex with **no
      mask**: every key is attended, the Z zero keys too. Each scores exactly 0 and carries a
      zero value, so it adds Z to every query's softmax denominator:

          out_i = sum_j e^{s_ij} v_j / (sum_j e^{s_ij} + Z),   j over [cache; the S tokens]

      (measured on tiny models, 24 to 72 real keys beside Z = 104: leaving the zero keys out
      changes stock's output by 55-150 % of its largest value; at the 1.3B release's chunks of
      4680 tokens Z = 56, small beside ~10^4 keys but not nothing). Dense otherwise: no causality
      inside the chunk, none towards the cache.
    * **the cache call** (after each chunk but the last): ``transformer(output[:, :sum(cp[:c+1])],
      t = r = 0, attention_mask = build_attention_mask(mode="cache"), is_cache_step: True)`` ->
      ``_forward_cache``: the whole prefix, its last L - 1 chunks full and every earlier one
      compressed; every block runs, no sample comes out. Each ``attn1`` writes its pre-RoPE K/V
      (the first nc rows to ``compressed_cache``, the rest to ``full_cache``, from row 0: the
      whole cache is rewritten, a chunk's tokens change when it is demoted to compressed), then
      attends under the BlockMask: chunk-causal (``frame_idx[q] >= frame_idx[kv]``, frame_idx
      holding the chunk index) with the 128-padding keys masked. Its chunks have unequal token
      counts (compressed or full; 1, 3 or 2 frames).

    The training rollout (``kv_cache=None``, ``_forward_train``) is neither: it attends the whole
    rollout under the train-mode mask, whose clean-context form (noise -> its own chunk only, clean
    -> never noise) is no staircase. Refused (below).

Note [a cached call as a merge]
    A softmax over a union of key sets is the log-sum-exp merge of the softmaxes over each set. This
    rank's queries (its S / P current tokens) meet three:

        current   usp_attention(q, k, v, return_lse=True): every rank's current tokens (Ulysses x ring)
        cache     attend(q, K_cache, V_cache): local, every rank holds the whole cache (below)
        zeros     out 0, lse log Z (none when Z = 0)

    merged in float32 (``usp_dit.attention.merge.LSEMerger``, as Wan-Animate-2's generation pass and
    the SANA-WM refiner's cached prefix). The cache is rotated with the first nc + nf rows of the
    key table, the rank's current keys with its rows after them, its queries with its rows of the
    query table: stock's rows, stock's ``apply_rotary_emb``. Work per rank: 1/P of each part;
    communication: ``usp_attention``'s alone.

Note [the cache call on a grid]
    The prefix's tokens are split at block 0 like any call. Each ``attn1`` all-gathers its
    pre-RoPE K and V over the sequence group (one all-gather, (B, H, S, 2 head_dim)), which the
    cache needs whole anyway, writes them as stock does, rotates the whole K with the whole table
    and attends this rank's queries under the call's mask. The mask is read, not rebuilt: its
    ``mask_mod`` is evaluated on this rank's rows against every (padded) key position, in blocks of
    512 rows, once per call (the same BlockMask object reaches every layer); each row must see a
    prefix [0, c) of the keys (chunk-causal rows do: frame_idx never decreases along the sequence;
    the ranks agree on that verdict in one small all-gather before any transfer, so a refusal
    raises on every rank), and each run of rows with the same c is one kernel call against keys
    [0, c): one call per chunk the shard meets. (usp_attention's ``block_causal`` takes one frame length for all
    frames, Note [staircase masks] in ``usp_dit.attention.masks``: FAR's unequal chunks are not
    that.) Work: each rank its rows times the keys they see, so not balanced: the last rank's rows
    see every key. At the 1.3B release's last cache call (14430 tokens: 5070 compressed in chunks
    of 390 and 4 x 1170, two full chunks of 4680) the busiest of 8 ranks does 1.6x the average.
    Traffic: the layer's K and V, (P - 1) / P of B S H 2 head_dim elements received per rank.

Note [where the cache lives]
    Whole on every rank, as one process holds it: the pipeline allocates its buffers with stock
    code on every rank, and the cache call fills them as stock does (the all-gather above), so
    every rank's cache equals one process's (to rounding: layer 1's K/V follow layer 0's merged
    attention). With the batch split over cfg groups (``cfg_degree=2``, the pipeline's batched
    [negative; positive]) each group computes its rows, and the cache call also all-gathers them
    over the cfg group: every rank holds every row, as stock; a cached call reads its group's rows.
    Memory per rank is stock's: AnyFlow-FAR-Wan2.1-1.3B at 480 x 832, 81 frames (chunks
    (1, 3, 3, 3, 3, 3, 3, 2), L = 3: 14040 full rows + 7020 compressed rows a layer; 12 heads x
    128, bf16) holds 129 MB of K and V per layer and batch row, 3.9 GB over its 30 layers. A cached
    call reads all heads of its rows (local attention); holding only a rank's Ulysses heads would
    do, but the pipeline allocates the whole buffers. Transient per layer: the gathered K/V and the
    rotated K of a cache call (the whole prefix), the rotated cache keys of a cached call.

Per-rank token count at that release (21 latent frames of 30 x 52 patches; 512 replicated text
tokens): a cached call's chunk of 3 frames is 4680 tokens, 585 per rank on 8 ranks; the last
cache call's 14430 tokens, 1804 per rank.

Refused (NotImplementedError): the training rollout (``kv_cache=None``, at the call; see Note
[what FAR inference computes]: a chunk-causal mask of unequal chunks, in its clean-context form no
staircase); a gradient through either inference call (the log-sum-exp merges are not
differentiable: the pipeline runs under ``torch.no_grad``); a cache-call mask that is not a
BlockMask, is built per batch row or head, or gives a row keys that are not a prefix (e.g.
``build_attention_mask(has_clean_context=True)``); processors other than stock's
``AnyFlowCausalAttnProcessor`` on ``attn1`` and ``AnyFlowCrossAttnProcessor`` on ``attn2``; a
Diffusers cache that cannot run on a grid; ``num_layers=0``. ValueError: a RoPE table of another
length than the call's keys, a cache-call mask of another length than the call's padded tokens, a
KV cache whose batch is neither the call's nor ``cfg_degree`` times it. One rank: the same merges
(not stock's flex kernel), equal to stock within float32 rounding. Compile: Note [compiling FAR].

Note [compiling FAR]
    The cached call (the one the pipeline makes every denoising step) traces in one graph with
    ``fullgraph=True``: everything its ``attn1`` decides on is a Python int fixed by the call's
    shapes and flag (nc, nf, S, the rank's start, Z), the three parts are ``usp_attention``'s
    traced path, a kernel call and a constant, and the merge is tensor code. Tested on (2,1)
    (tests/test_compile_grid.py): two steps of the same shapes behind an eagerly filled cache, one
    graph, no recompile, output equal to one process. A new chunk (another ``chunk_partition``,
    ``num_cached_chunks``, cache length) is another graph, as in stock (its sizes are Python ints).
    The cache call does not trace in one graph: it reads its BlockMask's ``mask_mod`` on the host
    and runs one kernel call per run of rows (``prefix_runs``: ``tolist``), data-dependent sizes.
    Compile the transformer without ``fullgraph`` (the cache call, once per chunk, breaks into
    pieces; measured once on (2,1): the tiny rollout equal to one process, 45 graphs over 4
    chunks) or call the compiled module for the denoising steps and the plain one for the cache
    calls.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import Any

import torch
from diffusers import AnyFlowFARTransformer3DModel
from diffusers.models.transformers.transformer_anyflow_far import (
    AnyFlowAttention,
    AnyFlowCausalAttnProcessor,
    AnyFlowCrossAttnProcessor,
    apply_rotary_emb,
)
from torch.nn.attention.flex_attention import BlockMask

from usp_dit.attention.merge import LSEMerger
from usp_dit.attention.usp import usp_attention
from usp_dit.distributed.comm import all_gather_uneven
from usp_dit.distributed.handshake import agree
from usp_dit.distributed.replica import comm_device
from usp_dit.kernels import attend, select_backend
from usp_dit.kernels.autograd import needs_grad
from usp_dit.pipelines._token_sharding import ShardState, _get_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, Table, TransformerPreHook
from usp_dit.sharding.partition import offsets, split_sizes
from usp_dit.sharding.shard import gather_sequence

FLEX_BLOCK = 128  # stock pads every attn1 call's sequence to a multiple of it
MASK_ROWS = 512  # rows of a cache call's mask evaluated at once (memory: MASK_ROWS x padded keys)

Part = tuple[torch.Tensor, torch.Tensor]  # (out (B, n, H, D), lse (B, n, H)) of the same queries


# ---------------------------------------------------------------------------------------------
# Merging parts over disjoint key sets (Note [a cached call as a merge])


def zero_keys(like: Part, count: int) -> Part:
    """``count`` zero keys (score 0, value 0) as a part: out 0, lse log(count)."""
    out, lse = like
    return torch.zeros_like(out), torch.full_like(lse, math.log(count))


def merge_parts(parts: list[Part], dtype: torch.dtype) -> torch.Tensor:
    """The attention over the union of the parts' key sets, (B, n, H, D) in ``dtype``."""
    (out, lse), rest = parts[0], parts[1:]
    if not rest:
        return out.to(dtype)
    merger = LSEMerger()
    merger.add(out, lse)
    outs = torch.stack([o.to(out.dtype) for o, _ in rest])
    lses = torch.stack([l_.to(lse.dtype) for _, l_ in rest])
    return merger.finish(dtype, outs, lses)[0]


# ---------------------------------------------------------------------------------------------
# Note [the cache call on a grid]: the mask's rows as runs of key prefixes


@dataclass(eq=False)
class _Runs:
    """A cache call's runs of this rank's rows, memoised for the call's mask (every layer gets it)."""

    mask: weakref.ref
    key: tuple[int, int, int]  # (seq_len, start, rows) of the call
    runs: list[tuple[int, int, int]]  # (first row, end row, visible keys), rows local to the shard


def check_mask(mask: Any, padded: int) -> None:
    """What every rank can check alike about a cache call's mask.

    Raises:
        NotImplementedError: not a BlockMask, or one built per batch row or head.
        ValueError: its lengths are not ``padded``, the call's tokens padded as stock pads them
            (stock's flex call fails there too).
    """
    if not isinstance(mask, BlockMask):
        raise NotImplementedError(
            f"usp_dit's AnyFlow FAR adapter reads a cache call's flex BlockMask; got {type(mask).__name__}")
    if tuple(mask.shape[:2]) != (1, 1):
        raise NotImplementedError(
            f"usp_dit's AnyFlow FAR adapter: a cache-call BlockMask built per batch row or head (shape "
            f"{tuple(mask.shape)}); stock's has B = H = 1")
    if tuple(mask.seq_lengths) != (padded, padded):
        raise ValueError(
            f"the cache call's BlockMask is {tuple(mask.seq_lengths)} (queries, keys), but its tokens padded to a "
            f"multiple of {FLEX_BLOCK} are {padded}: build it for this call's chunk_partition, height and width")


def visible_prefixes(mask: BlockMask, start: int, rows: int) -> torch.Tensor | None:
    """(rows,) int64: how many keys each query row ``start + i`` sees under ``mask``'s
    ``mask_mod`` (evaluated at b = h = 0, ``MASK_ROWS`` rows at a time), each row's keys being a
    prefix [0, c) of the key positions; ``None`` if a row's keys are no prefix."""
    keys, device = mask.seq_lengths[1], mask.kv_num_blocks.device
    mod = torch.vmap(torch.vmap(mask.mask_mod, in_dims=(None, None, None, 0)), in_dims=(None, None, 0, None))
    zero = torch.zeros((), dtype=torch.int64, device=device)
    kv = torch.arange(keys, device=device)
    counts = [torch.zeros(0, dtype=torch.int64, device=device)]
    for lo in range(start, start + rows, MASK_ROWS):
        q = torch.arange(lo, min(lo + MASK_ROWS, start + rows), device=device)
        allowed = mod(zero, zero, q, kv).bool()  # (m, keys)
        c = allowed.sum(dim=1)
        if not torch.equal(allowed, kv[None, :] < c[:, None]):
            return None
        counts.append(c)
    return torch.cat(counts)


def prefix_runs(counts: torch.Tensor) -> list[tuple[int, int, int]]:
    """(first row, end row, c) runs of equal ``counts``."""
    values, sizes = torch.unique_consecutive(counts, return_counts=True)
    ends = torch.cumsum(sizes, 0).tolist()
    return [(end - n, end, c) for end, n, c in zip(ends, sizes.tolist(), values.tolist())]


# ---------------------------------------------------------------------------------------------
# attn1


def _rope_rows(table: torch.Tensor, start: int, rows: int) -> torch.Tensor:
    return table[:, :, start:start + rows]


def _check_rope(rotary_emb: dict[str, torch.Tensor], query_rows: int, key_rows: int) -> None:
    q_len, k_len = rotary_emb["query"].shape[2], rotary_emb["key"].shape[2]
    if (q_len, k_len) != (query_rows, key_rows):
        raise ValueError(
            f"the RoPE table has {q_len} query and {k_len} key rows (dim 2), but the call has {query_rows} query "
            f"tokens and {key_rows} keys: they must match for the table to be cut like the tokens")


class USPFARSelfAttnProcessor:
    """``attn1`` of this rank's tokens in both inference calls (the Notes above).

    ``hidden_states`` (B, n, C): this rank's rows of the call's tokens; ``rotary_emb``, ``kv_cache``
    and ``kv_cache_flag`` whole, as stock's ``AnyFlowCausalAttnProcessor`` gets them;
    ``attention_mask`` the cache call's BlockMask (a cached call's is None). Returns (B, n, C).
    """

    _attention_backend = None  # diffusers' set_attention_backend writes it; usp_dit's backend is used
    _parallel_config = None

    def __init__(self, state: ShardState) -> None:
        self.state = state
        self._runs: _Runs | None = None

    def __call__(
        self,
        attn: AnyFlowAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: Any | None = None,
        rotary_emb: dict[str, torch.Tensor] | None = None,
        kv_cache: dict[str, torch.Tensor] | None = None,
        kv_cache_flag: dict[str, Any] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None:
            raise NotImplementedError("USPFARSelfAttnProcessor is for self-attention (attn1) only; attn2 runs locally")
        if kv_cache is None or kv_cache_flag is None or rotary_emb is None:
            raise NotImplementedError(_TRAINING)
        # Stock's projections, norms and casts (AnyFlowCausalAttnProcessor), on this rank's rows.
        target_dtype = hidden_states.dtype
        query = attn.norm_q(attn.to_q(hidden_states)).to(target_dtype)
        key = attn.norm_k(attn.to_k(hidden_states)).to(target_dtype)
        value = attn.to_v(hidden_states)
        query, key, value = (x.unflatten(2, (attn.heads, -1)).transpose(1, 2) for x in (query, key, value))
        if needs_grad(query, key, value):
            raise NotImplementedError(
                "usp_dit's AnyFlow FAR adapter runs the inference calls forward only: their log-sum-exp merges are "
                "not differentiable (AnyFlowFARPipeline runs under torch.no_grad)")
        rows = self._cache_rows(kv_cache, query.shape[0])
        if kv_cache_flag["is_cache_step"]:
            out = self._cache_call(query, key, value, kv_cache, kv_cache_flag, rotary_emb, attention_mask, rows)
        else:
            out = self._cached_call(query, key, value, kv_cache, kv_cache_flag, rotary_emb, rows)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))

    # -- where this rank's rows sit ------------------------------------------------------------

    def _start(self) -> int:
        """This rank's first token (the plan's layout is contiguous)."""
        mesh = self.state.mesh
        return offsets(split_sizes(self.state.seq_len, mesh.sequence_degree))[mesh.seq_rank]

    def _cache_rows(self, kv_cache: dict[str, torch.Tensor], batch: int) -> slice:
        """The cache's batch rows of this call (Note [where the cache lives])."""
        mesh, cached = self.state.mesh, kv_cache["full_cache"].shape[1]
        if cached == batch:
            return slice(None)
        if cached == batch * mesh.cfg_degree:
            return slice(mesh.cfg_rank * batch, (mesh.cfg_rank + 1) * batch)
        raise ValueError(
            f"the KV cache holds {cached} batch rows, but the call has {batch} (cfg_degree={mesh.cfg_degree}): it "
            f"must be the call's batch, or cfg_degree times it when enable_usp splits the batch")

    def _kernel(self, q: torch.Tensor):
        kernel = select_backend(self.state.backend, q.device.type, q.dtype, q.shape[-1], False)
        if not kernel.caps.returns_lse:
            raise NotImplementedError(
                f"backend={kernel.name!r} returns no log-sum-exp, which AnyFlow FAR's attention is merged with")
        return kernel

    # -- Note [a cached call as a merge] -------------------------------------------------------

    def _cached_call(self, q, k, v, kv_cache, flag, rotary_emb, rows: slice) -> torch.Tensor:
        """q/k/v (B, H, n, D) this rank's current tokens -> (B, n, H, D)."""
        state, n = self.state, q.shape[2]
        nc, nf = flag["num_cached_compressed_tokens"], flag["num_cached_full_tokens"]
        cached = nc + nf
        _check_rope(rotary_emb, state.seq_len, cached + state.seq_len)
        start = self._start()
        q = apply_rotary_emb(q, _rope_rows(rotary_emb["query"], start, n)).transpose(1, 2).contiguous()
        k = apply_rotary_emb(k, _rope_rows(rotary_emb["key"], cached + start, n)).transpose(1, 2)
        current = usp_attention(q, k, v.transpose(1, 2), mesh=state.mesh, backend=state.backend,
                                seq_len=state.seq_len, layout=state.layout, return_lse=True)
        parts = [(current.out, current.lse)]
        if cached:
            comp, full = kv_cache["compressed_cache"][:, rows], kv_cache["full_cache"][:, rows]
            k_cache = torch.cat([comp[0, :, :, :nc], full[0, :, :, :nf]], dim=2)  # (B, H, cached, D)
            v_cache = torch.cat([comp[1, :, :, :nc], full[1, :, :, :nf]], dim=2)
            k_cache = apply_rotary_emb(k_cache, _rope_rows(rotary_emb["key"], 0, cached))
            parts.append(attend(q, k_cache.transpose(1, 2).contiguous(), v_cache.transpose(1, 2).contiguous(),
                                self._kernel(q), q.shape[-1] ** -0.5))
        zeros = math.ceil(state.seq_len / FLEX_BLOCK) * FLEX_BLOCK - state.seq_len
        if zeros:
            parts.append(zero_keys(parts[0], zeros))
        return merge_parts(parts, q.dtype)

    # -- Note [the cache call on a grid] -------------------------------------------------------

    def _cache_call(self, q, k, v, kv_cache, flag, rotary_emb, mask, rows: slice) -> torch.Tensor:
        """q/k/v (B, H, n, D) this rank's prefix tokens -> (B, n, H, D); writes the whole cache."""
        state, n = self.state, q.shape[2]
        seq = state.seq_len
        _check_rope(rotary_emb, seq, seq)
        start = self._start()
        runs = self._prefix_runs(mask, start, n)  # before any transfer: a refusal raises on every rank
        kv = gather_sequence(torch.cat([k, v], dim=-1), state.mesh, dim=2, seq_len=seq, layout=state.layout)
        k_all, v_all = kv.chunk(2, dim=-1)  # (B, H, S, D), pre-RoPE
        self._store(kv_cache, flag, kv, rows)
        q = apply_rotary_emb(q, _rope_rows(rotary_emb["query"], start, n)).transpose(1, 2)  # (B, n, H, D)
        k_all = apply_rotary_emb(k_all, rotary_emb["key"]).transpose(1, 2)
        v_all = v_all.transpose(1, 2)
        kernel, scale = self._kernel(q), q.shape[-1] ** -0.5
        out = torch.zeros_like(q)
        for r0, r1, c in runs:
            real = min(c, seq)  # keys past the real ones are stock's zero padding rows
            if c == 0:
                continue  # a row that sees nothing: zeros, as flex gives
            part = attend(q[:, r0:r1].contiguous(), k_all[:, :real].contiguous(), v_all[:, :real].contiguous(),
                          kernel, scale)
            out[:, r0:r1] = merge_parts([part, zero_keys(part, c - real)] if c > real else [part], q.dtype)
        return out

    def _store(self, kv_cache: dict[str, torch.Tensor], flag: dict[str, Any], kv: torch.Tensor, rows: slice) -> None:
        """Stock's cache writes of the whole sequence's [K | V] (B, H, S, 2 D); with the batch split
        over cfg groups, every group's rows (gathered over "cfg") first."""
        mesh = self.state.mesh
        if rows != slice(None):
            kv = all_gather_uneven(kv.contiguous(), [kv.shape[0]] * mesh.cfg_degree, 0, mesh.cfg_group)
        key, value = kv.chunk(2, dim=-1)
        nc, nf = flag["num_compressed_tokens"], flag["num_full_tokens"]
        kv_cache["compressed_cache"][0, :, :, :nc, :] = key[:, :, :nc]
        kv_cache["compressed_cache"][1, :, :, :nc, :] = value[:, :, :nc]
        kv_cache["full_cache"][0, :, :, :nf, :] = key[:, :, nc:]
        kv_cache["full_cache"][1, :, :, :nf, :] = value[:, :, nc:]

    def _prefix_runs(self, mask: Any, start: int, rows: int) -> list[tuple[int, int, int]]:
        """This rank's runs of rows (Note [the cache call on a grid]), memoised for the call's mask.

        Raises:
            NotImplementedError: on every rank of the sequence group alike (one small all-gather:
                each rank reads its own rows), when a row of any rank sees no prefix of the keys.
        """
        state, held = self.state, self._runs
        if held is not None and held.mask() is mask and held.key == (state.seq_len, start, rows):
            return held.runs
        check_mask(mask, math.ceil(state.seq_len / FLEX_BLOCK) * FLEX_BLOCK)
        counts = visible_prefixes(mask, start, rows)
        oks = [int(counts is not None)]
        if state.mesh.sequence_degree > 1:
            oks = agree({}, state.mesh.seq_group, comm_device(state.mesh), varying=oks[0], what="a FAR cache mask")
        if not all(oks):
            raise NotImplementedError(
                "usp_dit's AnyFlow FAR adapter runs a cache call whose mask gives each query a prefix of the keys "
                "(stock's chunk-causal cache mask); this mask does not (e.g. has_clean_context=True)")
        runs = prefix_runs(counts)
        self._runs = _Runs(weakref.ref(mask), (state.seq_len, start, rows), runs)
        return runs


_TRAINING = (
    "usp_dit's AnyFlow FAR adapter runs the inference calls (a KV cache passed: the cache call and the cached "
    "calls); the training rollout (kv_cache=None, _forward_train) is refused: its chunk-causal flex mask has "
    "chunks of unequal token counts (usp_attention's block_causal takes one frame length), and with clean "
    "context (noise attends its own chunk only, clean never noise) it is no staircase")


class TrainingRolloutCheck(TransformerPreHook):
    """Refuses the training rollout at the call (a transformer pre-hook, before any token is split)."""

    def _check(self, module, args: tuple, kwargs: dict) -> None:
        if _get_arg(args, kwargs, "kv_cache", 8) is None:
            raise NotImplementedError(_TRAINING)


PLAN = ModelPlan(
    name="AnyFlowFAR",
    model_class=AnyFlowFARTransformer3DModel,
    split_at="blocks.0",
    gather_at="proj_out",  # a cached call's output; a cache call ends after the blocks (no sample)
    attention=(
        # [cache; current; zero keys] or the chunk-causal prefix: the Notes above
        Parallel("blocks.*.attn1", USPFARSelfAttnProcessor, stock=(AnyFlowCausalAttnProcessor,)),
        Local("blocks.*.attn2", stock=(AnyFlowCrossAttnProcessor,)),  # to the replicated text (and image)
    ),
    block_lists=("blocks",),
    # (temb (B, seq, C), timestep_proj (B, seq, 6C), text, image): per-token, like AnyFlow's.
    tables=(Table("condition_embedder", dim=1, items=(0, 1)),),
    # AnyFlowFARPipeline batches [negative; positive] in one call when guidance_scale > 1; the
    # cache stays whole (Note [where the cache lives]).
    cfg_batch_args=("hidden_states", "timestep", "r_timestep", "encoder_hidden_states",
                    "encoder_hidden_states_image"),
    hooks=(TrainingRolloutCheck,),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
