"""Wan-Animate-2 adapter: ``WanAnimate2Transformer3DModel`` on a USP grid, both of its passes.

Layout: each call takes Python lists of per-sample latents (channels, frames, height, width);
tokens (batch, seq, channels), frame-major (``patch_embedding(x).flatten(2)``); Q/K/V
(batch, seq, heads, head_dim); text and CLIP image tokens replicated; the reference K/V cache
``WanAnimate2KVCache``, one ``WanAnimate2KVLayerCache`` per layer holding pre-RoPE key and value
(batch, seq_ref, heads, head_dim) in stock, **this rank's rows** (batch, seq_ref_local, heads,
head_dim) when the reference pass ran under this adapter.

The model runs twice per segment (Diffusers' ``transformer_wan_animate_2``):

  * ``kv_cache_mode="extract"``: dense self-attention over the reference tokens (RoPE on the
    reference grid with the ``refer_offset_*`` offsets and ``refer_stride``); each layer writes its
    pre-RoPE K/V to the cache.
  * ``kv_cache_mode="cached"`` (every denoising call): the generation tokens attend jointly over
    [all generation tokens | the cached reference tokens of the previous frame index] through a
    flex ``BlockMask`` over a packed, 128-aligned buffer built for the full video geometry
    (``origin_len``, ``origin_area``). Cross-attention to text / CLIP image is ordinary (local).

Where the tokens are split: block 0's input is sharded (contiguous layout), ``head``'s output
gathered (``_token_sharding`` Note [where the sequence is split]); each self-attention makes its
RoPE rows for the rank's own token range (Note [RoPE rows]).

Note [generation attention as a merge]
    Stock's mask, read off ``create_mask`` (F0 = ``origin_latent_frames``, HW0 =
    ``origin_latent_hw``, the generation grid (F, h, w), the reference grid (F_r, h_r, w_r)): the
    packed buffer holds generation frame f at positions f * HW0 + [0, h w) and reference frame r
    at packed_length + r * HW0 + [0, h_r w_r), zeros elsewhere. A generation query of frame f
    attends

      (1) every key at a position below (F0 + 1) HW0: the F h w generation keys, and
          (F0 + 1) HW0 - F h w zero keys of the buffer (when the grid is smaller than the video's);
      (2) the reference keys of reference frame f - 1 when 1 <= f <= F0: the h_r w_r real ones
          (when f - 1 < F_r) and HW0 - h_r w_r zero keys (all HW0 when f - 1 >= F_r).

    A zero key scores exactly 0 and carries a zero value. A softmax over a union of key sets is
    the log-sum-exp merge of the softmaxes over each set, so per query row:

        part 1   usp_attention(q, k, v, return_lse=True): the generation keys, sequence-parallel
        part 2   q against its frame's reference keys: local, a batched kernel call per run of
                 whole frames, one per partial frame at either end of the rank's tokens
                 (``wan_animate.frame_runs``), lse -inf where a frame has none (f = 0)
        part 3   the Z zero keys: out 0, lse log Z (Z = 0: -inf, nothing)

    merged in float32 (``usp_dit.attention.merge.LSEMerger``). Generation queries of frame f meet
    exactly the keys they meet in stock, with the same scale (head_dim ** -0.5). The BlockMask
    object the model passes is not read: its pattern is ``create_mask``'s, rebuilt above from the
    same numbers (the call's grids, ``origin_latent_frames``, ``origin_latent_hw``).

Note [where the reference cache lives]
    A rank's queries cover generation frames [f_lo, f_hi] (a contiguous shard, straddling frame
    boundaries at either end); part 2 needs reference frames [f_lo - 1, f_hi - 1], all heads. The
    reference pass shards the reference tokens like any sequence, so at its end each rank's layer
    cache holds the rank's own rows (pre-RoPE, as stock: 1 / P of stock's cache). The generation
    grid is not known then, so at the first generation call of a layer the ranks exchange rows
    once, in one all-to-all over the sequence group: each rank sends each other the rows of its
    shard that the other's window holds, and keeps its window (whole reference frames), memoised
    for every later call of the segment (same cache, same geometry; a new cache or geometry
    exchanges again). RoPE is applied to the window at each call with that call's reference grid,
    as stock re-applies it. Memory per rank and layer: the shard (seq_ref / P rows) plus the
    window (at most ceil(seq / P / (h w)) + 1 reference frames), against stock's seq_ref; traffic:
    the window's rows, once per layer and segment. The release at 800 x 640, 81 frames (21
    reference frames and 22 generation frames of 2000 tokens, 40 heads x 128, bf16) on 8 ranks: a
    shard of 5250 rows and a window of at most 4 frames (8000 rows), 271 MB of K and V per layer,
    10.9 GB over the 40 layers, against stock's 34.4 GB (860 MB a layer). A cache written by stock
    (the reference pass run before ``enable``), or one rank's own cache, holds every row: the
    window is a view of it (rows [lo, hi) of its key and value), no communication and no copy (a
    copy on one rank would double stock's 34.4 GB).

Note [RoPE rows]
    Stock's ``rope_apply`` rotates token j of a grid (f, h, w) by the product of the time, height
    and width frequencies of its (t, y, x), in float64 complex, then casts to float32.
    ``rope_rows`` builds the same per-token table and takes the rows of a token range, so a
    rank's shard (or a reference window) is rotated by exactly stock's numbers.

CFG: the pipelines call the transformer once per guidance branch; the unconditional call has the
negative prompt's embeds and ``is_uncondtion=True`` (it skips block 9): both are
``cfg_branch_args`` (``usp_dit.pipelines.cfg_pair`` Note [two calls a step]); the reference
pass, a call of its own, runs whole on both cfg groups, so each group's ranks hold their cache.

Note [generation gradient]
    Both passes train. The generation pass's merge is differentiable part by part: part 1's LSE
    (Note [LSE gradient] in ``usp_dit.kernels.lse_grad``), part 2's local kernel calls with theirs,
    part 3 constants, the merge in PyTorch. A gradient into the reference cache itself (a cache
    whose K/V require a gradient, the reference pass run with one) flows where the window is a
    slice of it: on one rank, or a cache written by stock (every row). A cache the reference pass
    wrote under this adapter on a grid reaches each window through a forward-only all-to-all,
    which would drop that gradient, so such a call is refused; run the reference pass under
    ``torch.no_grad()`` (or detach the cache) to train the generation pass alone. A window is
    memoised per cache and geometry, and made again where a gradient must flow into it but the
    memoised one carries none. (Stock cannot run the generation pass's backward on CPU: its flex
    attention has none there.)

Refused (NotImplementedError): as Wan's at enable (a foreign processor, Diffusers' context
parallelism, FasterCache, ``num_layers=0``); at the call, a gradient into a reference cache this
adapter wrote on a grid (Note [generation gradient]), a batch whose samples have different grids
(stock packs by sample 0's), generation frames beyond F0 + 1 (stock's rows there are masked out
whole), a layout other than "contiguous", and a cache written under another grid. ValueError:
grids that do not fit the packed buffer (stock fails there too), a reference grid of more tokens
than the cache holds.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass

import torch
from diffusers import WanAnimate2Transformer3DModel
from diffusers.models.transformers import transformer_wan_animate_2 as stock
from diffusers.models.transformers.transformer_wan_animate_2 import (
    WanAnimate2Attention,
    WanAnimate2AttnProcessor,
    WanAnimate2CrossAttnProcessor,
    WanAnimate2KVLayerCache,
)

from usp_dit.attention.merge import LSEMerger
from usp_dit.attention.usp import usp_attention
from usp_dit.distributed.comm import exchange
from usp_dit.kernels import attend, select_backend
from usp_dit.kernels.autograd import needs_grad
from usp_dit.kernels.protocol import lse_dtype
from usp_dit.pipelines._token_sharding import ShardState
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.families.wan_animate import frame_runs
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter
from usp_dit.sharding.partition import offsets, split_sizes


def rope_rows(x: torch.Tensor, grid: tuple[int, int, int], freqs: torch.Tensor, stride: int, start: int) -> torch.Tensor:
    """Note [RoPE rows]: stock ``rope_apply`` on rows [start, start + m) of a sequence on ``grid``.

    x: (B, m, H, D), the rows; freqs: (512, D / 2) complex, the model's table. Returns (B, m, H, D)
    float32, as stock's. Every row must lie in the grid (the model's token checks make it so).
    """
    heads, c = x.size(2), x.size(3) // 2
    f, h, w = grid
    parts = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    table = torch.cat(
        [
            parts[0][: f * stride : stride].view(f, 1, 1, -1).expand(f, h, w, -1),
            parts[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
            parts[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
        ],
        dim=-1,
    ).reshape(f * h * w, 1, -1)[start:start + x.size(1)]  # (m, 1, D / 2)
    rotated = torch.view_as_complex(x.to(torch.float64).reshape(*x.shape[:2], heads, c, 2)) * table
    return torch.view_as_real(rotated).flatten(3).float()


def _grid(sizes: torch.Tensor, name: str) -> tuple[int, int, int]:
    """The one grid of a batch's (B, 3) grid sizes; NotImplementedError if the samples differ."""
    rows = {tuple(r) for r in sizes.tolist()}
    if len(rows) != 1:
        raise NotImplementedError(
            f"usp_dit's Wan-Animate-2 adapter: {name} differ between samples ({sorted(rows)}); stock packs the "
            f"batch by sample 0's grid")
    return rows.pop()


@dataclass(frozen=True)
class Geometry:
    """One generation call's grids (Note [generation attention as a merge])."""

    frames: int  # F, generation frames
    hw: int  # h w, generation tokens per frame
    ref_frames: int  # F_r
    ref_hw: int  # h_r w_r
    origin_frames: int  # F0
    origin_hw: int  # HW0

    def check(self) -> None:
        """ValueError where stock's packing fails; NotImplementedError for frames stock masks out whole."""
        packed_ref = math.ceil(self.origin_frames * self.origin_hw / 128) * 128
        if self.hw > self.origin_hw or self.ref_hw > self.origin_hw or self.ref_frames * self.origin_hw > packed_ref:
            raise ValueError(
                f"grids (frames, tokens per frame) = ({self.frames}, {self.hw}) and reference ({self.ref_frames}, "
                f"{self.ref_hw}) do not fit the packed buffer of the video geometry ({self.origin_frames} latent "
                f"frames of {self.origin_hw} tokens): origin_len / origin_area too small")
        if self.frames > self.origin_frames + 1:
            raise NotImplementedError(
                f"usp_dit's Wan-Animate-2 adapter: {self.frames} generation frames beyond origin_len's "
                f"{self.origin_frames} + 1 (stock's mask drops those queries whole)")

    def zero_keys(self, frame_of_row: torch.Tensor) -> torch.Tensor:
        """(n,) float count of zero keys each query row (of generation frame ``frame_of_row``) meets."""
        base = (self.origin_frames + 1) * self.origin_hw - self.frames * self.hw
        has_ref = (frame_of_row >= 1) & (frame_of_row <= self.origin_frames)
        real = (frame_of_row >= 1) & (frame_of_row <= self.ref_frames)
        ref_zeros = torch.where(real, self.origin_hw - self.ref_hw, torch.where(has_ref, self.origin_hw, 0))
        return (ref_zeros + base).to(torch.float64)


_EXTRACTED_ATTR = "_usp_dit_extracted"  # set on a layer cache the reference pass wrote under this adapter


@dataclass(eq=False)
class _Extracted:
    """What the reference pass left in one layer cache on this rank (Note [where the reference cache lives])."""

    key: weakref.ref  # the stored key tensor: a cache cleared or rewritten since does not match
    seq_len: int  # reference tokens in all
    mesh: object


@dataclass(eq=False)
class _Window:
    """One layer's reference window on this rank, valid for ``key`` and ``geometry`` (the same on
    every rank, so every rank reuses or gathers together)."""

    key: weakref.ref
    geometry: Geometry
    first: int  # first reference frame held
    frames: int
    ref_hw: int
    k: torch.Tensor  # (B, frames * ref_hw, H, D), pre-RoPE
    v: torch.Tensor


class USPWanAnimate2AttnProcessor:
    """Self-attention of this rank's tokens, both passes (Notes above).

    ``hidden_states`` (B, S_local, C), this rank's rows of the reference (extract) or generation
    (cached) tokens; every other argument as stock's ``WanAnimate2AttnProcessor``, whole. Returns
    (B, S_local, C).
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, state: ShardState) -> None:
        self.state = state
        self.windows: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # layer cache -> _Window

    def __call__(
        self,
        attn: WanAnimate2Attention,
        hidden_states: torch.Tensor,
        rotary_emb: torch.Tensor,
        grid_sizes: torch.Tensor,
        kv_cache: WanAnimate2KVLayerCache,
        kv_cache_mode: str,
        rope_stride: int = 1,
        reference_rotary_emb: torch.Tensor | None = None,
        reference_grid_sizes: torch.Tensor | None = None,
        reference_rope_stride: int = 1,
        attention_mask=None,
        origin_latent_frames: int | None = None,
        origin_latent_hw: int | None = None,
    ) -> torch.Tensor:
        if self.state.layout != "contiguous":
            raise NotImplementedError(f"usp_dit's Wan-Animate-2 adapter needs the contiguous layout, not "
                                      f"{self.state.layout!r}")
        query, key, value = stock._get_qkv_projections(attn, hidden_states, None)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))  # (B, S_local, H, D)
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        start = self._start()
        grid = _grid(grid_sizes, "grid_sizes")
        if kv_cache_mode == "extract":
            self._store(kv_cache, key, value)
            query = rope_rows(query, grid, rotary_emb, rope_stride, start).type_as(value)
            key = rope_rows(key, grid, rotary_emb, rope_stride, start).type_as(value)
            out = self._attend(query, key, value, return_lse=False).out
        elif kv_cache_mode == "cached":
            geometry = Geometry(grid[0], grid[1] * grid[2], *self._ref_frames(reference_grid_sizes),
                                origin_latent_frames, origin_latent_hw)
            geometry.check()
            query = rope_rows(query, grid, rotary_emb, rope_stride, start).type_as(value)
            key = rope_rows(key, grid, rotary_emb, rope_stride, start).type_as(value)
            out = self._generation(query, key, value, kv_cache, geometry, start, reference_rotary_emb,
                                   _grid(reference_grid_sizes, "reference_grid_sizes"), reference_rope_stride)
        else:
            raise ValueError(f"`kv_cache_mode` must be either 'extract' or 'cached', got {kv_cache_mode}.")
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))

    def _start(self) -> int:
        mesh = self.state.mesh
        return offsets(split_sizes(self.state.seq_len, mesh.sequence_degree))[mesh.seq_rank]

    @staticmethod
    def _ref_frames(reference_grid_sizes: torch.Tensor) -> tuple[int, int]:
        f, h, w = _grid(reference_grid_sizes, "reference_grid_sizes")
        return f, h * w

    def _attend(self, q, k, v, return_lse: bool):
        return usp_attention(q, k, v, mesh=self.state.mesh, backend=self.state.backend, seq_len=self.state.seq_len,
                             layout=self.state.layout, return_lse=return_lse)

    def _store(self, kv_cache: WanAnimate2KVLayerCache, key: torch.Tensor, value: torch.Tensor) -> None:
        """Stock's ``store``, of this rank's rows, and what they are."""
        kv_cache.store(key, value)
        # On the cache object itself: any enabled processor (a later enable's too) knows its rows are a shard.
        setattr(kv_cache, _EXTRACTED_ATTR, _Extracted(weakref.ref(key), self.state.seq_len, self.state.mesh))

    def _generation(self, q, k, v, kv_cache, geometry: Geometry, start: int, ref_freqs, ref_grid, ref_stride):
        """Note [generation attention as a merge]: q/k/v (B, n, H, D) rotated -> out (B, n, H, D)."""
        self._check_cache_gradient(kv_cache)
        n = q.shape[1]
        out1, _, lse1, _ = self._attend(q, k, v, return_lse=True)
        window = self._window(kv_cache, geometry, start, n)
        k_ref = rope_rows(window.k, ref_grid, ref_freqs, ref_stride, window.first * geometry.ref_hw).type_as(v)
        out2, lse2 = self._reference_part(q, k_ref, window.v.type_as(v), window.first, geometry, start)
        merger = LSEMerger()
        merger.add(out1, lse1.to(lse2.dtype))
        frame_of_row = torch.arange(start, start + n, device=q.device) // geometry.hw
        zeros = geometry.zero_keys(frame_of_row)
        if bool((zeros > 0).any()):  # part 3: zero keys, out 0 and lse log Z, per row
            log_z = zeros.log().to(lse2.dtype).view(1, n, 1).expand_as(lse2)
            return merger.finish(q.dtype, torch.stack([out2, torch.zeros_like(out2)]), torch.stack([lse2, log_z]))[0]
        return merger.finish(q.dtype, out2.unsqueeze(0), lse2.unsqueeze(0))[0]

    def _check_cache_gradient(self, kv_cache: WanAnimate2KVLayerCache) -> None:
        """NotImplementedError (on every rank alike, before any transfer) where a gradient would
        have to flow into a cache this adapter wrote on a grid (Note [generation gradient])."""
        key, value = kv_cache.get()
        info = getattr(kv_cache, _EXTRACTED_ATTR, None)
        mine = info is not None and info.key() is key
        if mine and self.state.mesh.sequence_degree > 1 and needs_grad(key, value):
            raise NotImplementedError(
                "usp_dit's Wan-Animate-2 adapter: a gradient into the reference K/V cache written under the adapter "
                "on a grid (its window comes by a forward-only exchange); run the reference pass "
                "(kv_cache_mode='extract') under torch.no_grad(), or detach the cache, to train the generation pass")

    def _reference_part(self, q, k_ref, v_ref, first_ref: int, geometry: Geometry, start: int):
        """Part 2: q (B, n, H, D) against k_ref/v_ref (B, frames * ref_hw, H, D), reference frames from
        ``first_ref``. Returns out (B, n, H, D), lse (B, n, H) (-inf and 0 where a frame has no key)."""
        b, n, heads, head_dim = q.shape
        scale = head_dim ** -0.5
        kernel = select_backend(self.state.backend, q.device.type, q.dtype, head_dim, needs_grad(q, k_ref, v_ref))
        out = q.new_zeros(b, n, heads, head_dim)
        lse = torch.full((b, n, heads), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
        pos, hw, ref_hw = 0, geometry.hw, geometry.ref_hw
        for first, frames, tokens in frame_runs(start, start + n, hw):
            per = tokens // frames  # query rows per frame of this run
            lo, hi = max(first, 1), min(first + frames, geometry.ref_frames + 1)  # frames with reference keys
            if lo < hi:
                rows = slice(pos + (lo - first) * per, pos + (hi - first) * per)
                keys = slice((lo - 1 - first_ref) * ref_hw, (hi - 1 - first_ref) * ref_hw)
                fold = hi - lo
                qf = q[:, rows].unflatten(1, (fold, per)).flatten(0, 1)  # (B * frames, per, H, D)
                kf = k_ref[:, keys].unflatten(1, (fold, ref_hw)).flatten(0, 1)
                vf = v_ref[:, keys].unflatten(1, (fold, ref_hw)).flatten(0, 1)
                o, l_ = attend(qf.contiguous(), kf.contiguous(), vf.contiguous(), kernel, scale, lse_grad=True)
                out[:, rows] = o.unflatten(0, (b, fold)).flatten(1, 2)
                lse[:, rows] = l_.unflatten(0, (b, fold)).flatten(1, 2).to(lse.dtype)
            pos += tokens
        return out, lse

    # Run eagerly under torch.compile: a traced lookup guards on the memo's size, which grows by a
    # layer at each of the first call's layers, so every layer would compile its own graph.
    @torch.compiler.disable
    def _window(self, kv_cache: WanAnimate2KVLayerCache, geometry: Geometry, start: int, n: int) -> _Window:
        """Note [where the reference cache lives]: the pre-RoPE reference K/V of the frames this
        rank's queries [start, start + n) read, memoised per layer cache."""
        key, value = kv_cache.get()
        held = self.windows.get(kv_cache)
        stale = held is not None and needs_grad(key, value) and not held.k.requires_grad  # made without a graph
        if held is not None and held.key() is key and held.geometry == geometry and not stale:
            return held
        first, frames = frames_read(geometry, start, n)
        k_win, v_win = self._reference_rows(kv_cache, key, value, geometry)  # each (B, frames * ref_hw, H, D)
        window = _Window(weakref.ref(key), geometry, first, frames, geometry.ref_hw, k_win, v_win)
        self.windows[kv_cache] = window
        return window

    def _reference_rows(self, kv_cache, key: torch.Tensor, value: torch.Tensor,
                        geometry: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's window of pre-RoPE key and value rows, each (B, frames * ref_hw, H, D):
        exchanged over the sequence group when the reference pass ran here, else cut from the stock
        cache as views (no copy: on one rank the window is the whole cache, 34 GB at the release's
        size, Note [where the reference cache lives]).

        Raises:
            NotImplementedError: the cache was written under another grid.
            ValueError: the reference grid has more tokens than the cache.
        """
        info = getattr(kv_cache, _EXTRACTED_ATTR, None)
        mine = info is not None and info.key() is key
        if mine and info.mesh is not self.state.mesh:
            raise NotImplementedError("usp_dit's Wan-Animate-2 adapter: the reference cache was written under "
                                      "another grid; run the reference pass (kv_cache_mode='extract') again")
        total = info.seq_len if mine else key.shape[1]
        needed = geometry.ref_frames * geometry.ref_hw
        if total < needed:
            raise ValueError(f"reference_grid_sizes describe {needed} reference tokens but the cache holds {total}")
        mesh = self.state.mesh
        if not mine or mesh.sequence_degree == 1:  # the cache holds every row
            lo, hi = self._window_rows(geometry)[mesh.seq_rank]
            return key[:, lo:hi], value[:, lo:hi]
        return self._exchange(torch.cat([key, value], dim=-1), total, geometry).chunk(2, dim=-1)

    def _window_rows(self, geometry: Geometry) -> list[tuple[int, int]]:
        """Every sequence rank's window, as reference rows [lo, hi), from the generation split."""
        sizes = split_sizes(self.state.seq_len, self.state.mesh.sequence_degree)
        windows = [frames_read(geometry, start, n) for start, n in zip(offsets(sizes), sizes)]
        return [(first * geometry.ref_hw, (first + frames) * geometry.ref_hw) for first, frames in windows]

    def _exchange(self, shard: torch.Tensor, ref_len: int, geometry: Geometry) -> torch.Tensor:
        """shard (B, S_ref_local, H, 2 D), this rank's reference rows -> its window's rows: one
        all-to-all over the sequence group, each rank sending every other the rows of its shard
        that the other's window holds (shards and windows are contiguous, in rank order)."""
        mesh = self.state.mesh
        sizes = split_sizes(ref_len, mesh.sequence_degree)
        shards = [(a, a + n) for a, n in zip(offsets(sizes), sizes)]
        windows = self._window_rows(geometry)
        a, _ = own = shards[mesh.seq_rank]
        chunks = [shard[:, s - a:e - a] for s, e in (_overlap(rows, own) for rows in windows)]
        b, _, heads, width = shard.shape
        recv = [_overlap(windows[mesh.seq_rank], rows) for rows in shards]  # what each rank's shard gives this one
        pieces = exchange(chunks, [(b, e - s, heads, width) for s, e in recv], mesh.seq_group, kind="seq_gather")
        return torch.cat(pieces, dim=1)


def _overlap(x: tuple[int, int], y: tuple[int, int]) -> tuple[int, int]:
    """[s, e) = x ∩ y (e == s where they do not meet)."""
    s = max(x[0], y[0])
    return s, max(min(x[1], y[1]), s)


def frames_read(geometry: Geometry, start: int, n: int) -> tuple[int, int]:
    """(first, frames): the reference frames generation tokens [start, start + n) read (frame f
    reads f - 1, when it exists); frames 0 when none."""
    if n == 0:
        return 0, 0
    first = max(start // geometry.hw - 1, 0)
    last = min((start + n - 1) // geometry.hw - 1, geometry.ref_frames - 1)
    return first, max(last - first + 1, 0)


PLAN = ModelPlan(
    name="WanAnimate2",
    model_class=WanAnimate2Transformer3DModel,
    split_at="blocks.0",
    gather_at="head",
    attention=(
        Parallel("blocks.*.self_attn", USPWanAnimate2AttnProcessor, stock=(WanAnimate2AttnProcessor,)),
        Local("blocks.*.cross_attn", stock=(WanAnimate2CrossAttnProcessor,)),  # text and CLIP tokens, replicated
    ),
    block_lists=("blocks",),
    # The unconditional call: the negative prompt's embeds and is_uncondtion=True (block 9 skipped).
    cfg_branch_args=("encoder_hidden_states", "is_uncondtion"),
    # Each cfg group runs a whole call (the cache is per call sequence, not per batch row).
    cfg_batch_args=(),
    heads=lambda model: model.config.num_heads,
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
