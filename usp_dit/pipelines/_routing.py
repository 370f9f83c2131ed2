"""Routing a stock Diffusers processor's attention call to ``usp_attention``, its maths untouched.

Layout: Q/K/V as Diffusers' ``dispatch_attention_fn`` takes them, (batch, seq, heads, head_dim);
the sequence a routed call sees is this rank's video shard, alone or beside the (replicated) text
tokens: ``[text; shard]`` (text first) or ``[shard; text]`` (text last). Key masks are
(batch, keys) or (batch, 1, 1, keys), bool (True = attend) or additive float (0 / -inf).

Note [routing a stock processor's attention call]
    Most Diffusers processors compute their projections, norms and RoPE, then make one call:
    ``dispatch_attention_fn(q, k, v, attn_mask=..., parallel_config=self._parallel_config)``.
    An adapter keeps that maths by running the stock ``__call__``'s code object with one module
    global rebound (``with_global``): the name it calls resolves to a router of ours instead.

        StockProcessor.__call__'s code, unchanged, with its module's globals except
          dispatch_attention_fn(q, k, v, attn_mask, ..., parallel_config=self._parallel_config)
                 └─► route_attention ─► usp_attention(shard, joint=text, mesh, seq_len)

    The processor's ``_parallel_config`` (Diffusers' own seam for context parallelism) holds a
    ``Route``: the mesh and call lengths (``ShardState``) and where the text sits, so two enabled
    transformers (Wan 2.2's experts) route independently, with no global state. If a future
    Diffusers' processor stops making that call, ``with_global`` returns ``None`` and the adapter
    refuses at enable instead of running local attention on a shard.

Note [masked text tokens]
    A text key mask (padded prompts: HunyuanVideo, Qwen-Image's masks with holes) is honoured
    per batch element: element b attends over [its valid text tokens; every video token], as
    stock does with the mask. Video keys must all be valid (a mask over video tokens is refused).
    The rows of *padded* text queries are the one place we differ from stock: stock attends them
    to the valid keys, we return zeros there. Nothing downstream reads them: they are masked out
    as keys in every later layer, and these models' outputs are the video tokens alone (the text
    stream is dropped after the last block), so outputs and gradients are stock's. HunyuanVideo
    1.5's processor masks the padded tokens as queries too (a (B, 1, L, L) mask, the key mask's
    outer product with itself: ``_key_mask_of``); stock's rows for them are then zeros (PyTorch's
    attention gives a query with no key zeros), and ours equal them.
"""
from __future__ import annotations

import inspect
import itertools
import sys
import types
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from usp_dit.attention.ulysses import gather_heads, scatter_heads, ulysses_layout
from usp_dit.attention.usp import one_rank_attention, one_rank_masked_attention, usp_attention
from usp_dit.kernels.autograd import needs_grad
from usp_dit.kernels.policy import attention_flops, auto_uses_torch_dispatch
from usp_dit.pipelines._checks import require
from usp_dit.pipelines._token_sharding import ShardState
from usp_dit.sharding.shard import layout_sizes

ROUTED_NAME = "dispatch_attention_fn"  # what the stock processors call (diffusers.models.attention_dispatch)


_ROUTED_IDS = itertools.count()


def with_global(fn: types.FunctionType, name: str, value: Any) -> types.FunctionType | None:
    """``fn`` with the module global ``name`` it reads bound to ``value``: the same code object,
    defaults and closure, a copy of its module's globals. ``None`` when ``fn`` does not read ``name``."""
    if name not in fn.__code__.co_names:
        return None
    # The copy is the namespace of a module of its own, registered under a name of its own:
    # torch.compile keys the globals a function reads by its module's name (and imports it by
    # that name), and would otherwise take this copy's ``name`` for the stock module's, or the
    # reverse, in other code of that module traced into the same graph.
    module_name = f"{fn.__globals__.get('__name__', 'usp_dit')}._usp_dit_routed_{next(_ROUTED_IDS)}"
    module = types.ModuleType(module_name)
    scope = module.__dict__
    scope.update(fn.__globals__)
    scope["__name__"] = module_name  # (the update copied the stock module's name)
    scope[name] = value
    sys.modules[module_name] = module
    # A code object of its own too (same bytecode): torch.compile keeps what it learnt about a
    # function per code object, and the stock function may run in the same graph (Wan's attn2).
    code = fn.__code__.replace(co_name=f"{fn.__code__.co_name}_usp_routed")
    routed = types.FunctionType(code, scope, fn.__name__, fn.__defaults__, fn.__closure__)
    routed.__kwdefaults__ = fn.__kwdefaults__
    routed.__qualname__ = f"{fn.__qualname__}[{name} -> usp_attention]"
    weakref.finalize(routed, sys.modules.pop, module_name, None)  # the module goes with its function
    return routed


@dataclass(eq=False)
class Route:
    """A routed processor's ``_parallel_config``: the shared call state and where the text sits.

    ``text``: "none" (self-attention over the video shard alone), "first" (``[text; shard]``) or
    "last" (``[shard; text]``). The text length of a call is what is left of the sequence once
    this rank's shard (``sharding.layout_sizes(state.seq_len, mesh, layout)[seq_rank]``) is taken out.
    """

    state: ShardState
    text: Literal["none", "first", "last"] = "none"
    # A frame length: the call is block-causal (``usp_attention(block_causal=...)``), set per call by
    # a processor that recognised the model's frame-causal mask (``usp_dit.pipelines.families.skyreels_v2``).
    block_causal: int | None = None

    def shard_len(self) -> int:
        mesh = self.state.mesh
        return layout_sizes(self.state.seq_len, mesh, self.state.layout)[mesh.seq_rank]


def _key_mask_of(mask: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """The (batch | 1, keys) bool key mask of a 4-d bool mask (Note [masked text tokens]).

    ``mask``: (batch | 1, 1, 1, keys), a key padding mask; or (batch | 1, 1, keys, keys) equal to
    ``m[:, :, None] & m[:, None, :]`` for a key mask ``m``: padded tokens masked as keys *and* as
    queries (HunyuanVideo 1.5 builds its mask so). ``m`` is read off the diagonal and the whole
    mask checked equal to that outer product (the caller checks that ``m`` keeps every video key).

    Raises:
        NotImplementedError: a mask that varies over heads, or over queries otherwise.
    """
    if mask.shape[1] == 1 and mask.shape[2] == 1:
        return mask[:, 0, 0]
    if mask.shape[1] != 1 or mask.shape[2] != mask.shape[3]:
        raise NotImplementedError(
            "usp_dit routes key-padding masks only ((batch, 1, 1, keys), or (batch, 1, keys, keys) masking "
            f"padded tokens as keys and queries); got attn_mask {tuple(shape)}"
        )
    keys = mask[:, 0].diagonal(dim1=-2, dim2=-1)  # m_j = m_j & m_j
    require((mask[:, 0] == (keys[:, :, None] & keys[:, None, :])).all(),
            "usp_dit routes key-padding masks only: this (batch, 1, keys, keys) attn_mask is not "
            "the outer product of a key mask with itself (a mask that varies over queries)")
    return keys


def _valid_text_keys(attn_mask: torch.Tensor | None, batch: int, text: slice, video: slice) -> torch.Tensor | None:
    """(batch, text_len) bool of the text keys to attend to, or ``None`` for all of them.

    Args:
        attn_mask: ``None``, or (batch | 1, keys) / (batch | 1, 1, 1, keys) / (batch | 1, 1, keys, keys)
            (``_key_mask_of``), bool (True = attend) or additive float (0 = attend, -inf = masked);
            keys = the routed call's text + video keys
            (the video part may cover this shard or the whole sequence: only the text part is read).

    Raises:
        NotImplementedError: a mask that varies over queries or heads, masks a video key, or has
            additive values other than 0 and -inf (Note [masked text tokens]).
    """
    if attn_mask is None:
        return None
    mask = attn_mask
    if mask.dtype != torch.bool:
        require(((mask == 0) | (mask == float("-inf"))).all(),
                "usp_dit routes additive masks of 0 and -inf only (a key padding mask)")
        mask = mask == 0
    if mask.dim() == 4:
        mask = _key_mask_of(mask, attn_mask.shape)
    if mask.dim() != 2:
        raise NotImplementedError(f"usp_dit cannot route an attn_mask of shape {tuple(attn_mask.shape)}")
    require(mask[:, video].all(), "usp_dit routes text key masks only: this attn_mask masks video tokens")
    valid = mask[:, text].expand(batch, -1)
    if torch.compiler.is_compiling():  # no branch on a value: an all-true mask is a mask too
        return valid
    return None if bool(valid.all()) else valid


def _one_rank_key_mask(attn_mask: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor,
                       value: torch.Tensor) -> torch.Tensor | None:
    """The (batch, keys) bool key mask of a routed call that one rank can hand its kernel whole, or
    ``None`` (no mask; another form: the general path checks it; a gradient or a trace: ditto).

    Only a bool key-padding mask of the call's own keys qualifies, (batch | 1, keys) or
    (batch | 1, 1, 1, keys): its meaning needs no check of values (an additive mask's could be
    other than 0 and -inf), and the kernel applies it to every key, text or video, as stock does.
    """
    if (attn_mask is None or attn_mask.dtype != torch.bool or torch.compiler.is_compiling()
            or needs_grad(query, key, value)):
        return None
    keys = key.shape[1]
    if attn_mask.dim() == 4 and attn_mask.shape[1:3] == (1, 1):
        attn_mask = attn_mask[:, 0, 0]
    if attn_mask.dim() != 2 or attn_mask.shape[1] != keys or attn_mask.shape[0] not in (1, query.shape[0]):
        return None
    return attn_mask.expand(query.shape[0], keys)


def one_rank_masked_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                         route: Any, scale: float | None, dropout_p: float = 0.0, is_causal: bool = False,
                         attention_kwargs: dict[str, Any] | None = None) -> torch.Tensor | None:
    """A routed call's result on one rank of the sequence under a bool key-padding mask, in one
    kernel call (Note [one rank under a key mask] in usp_dit.attention.usp), or ``None`` where that
    does not apply (a grid, block-causal attention, no mask or another form, a gradient, a trace;
    no ``Route``, dropout, causal or attention kwargs: ``route_attention`` refuses those).

    query (B, S_q, H, D) (any rows: the caller's queries), key/value (B, S_k, H_k, D), attn_mask
    over the S_k keys -> (B, S_q, H, D).
    """
    if not isinstance(route, Route) or dropout_p or is_causal or attention_kwargs or route.block_causal is not None:
        return None
    if attn_mask is None:
        return None
    return one_rank_call(query, key, value, attn_mask, route.state, scale)


def one_rank_call(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
                  state: ShardState, scale: float | None) -> torch.Tensor | None:
    """Plain attention of ``query`` over every key on one rank of the sequence, without the grid's
    machinery: no mask (``one_rank_attention``), or a bool key-padding mask in inference
    (``one_rank_masked_attention``); ``None`` on a grid or for a mask of another form, a gradient
    or a trace under a mask (the caller's general path then checks and runs it).

    query (B, S_q, H, D), key/value (B, S_k, H_k, D), attn_mask ``None`` or over the S_k keys
    -> (B, S_q, H, D).
    """
    if state.mesh.sequence_degree != 1:
        return None
    if attn_mask is None:
        return one_rank_attention(query, key, value, scale=scale, backend=state.backend)
    key_mask = _one_rank_key_mask(attn_mask, query, key, value)
    if key_mask is None:
        return None
    return one_rank_masked_attention(query, key, value, key_mask, scale=scale, backend=state.backend)


def joint_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    text_q: torch.Tensor | None, text_k: torch.Tensor | None, text_v: torch.Tensor | None,
    valid: torch.Tensor | None, state: ShardState, scale: float | None = None, block_causal: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """This rank's video shard and the replicated text tokens, attended over the whole sequence.

    Args:
        q, k, v: (B, S_local, H | H_kv, D) this rank's video tokens.
        text_q, text_k, text_v: (B, T, H | H_kv, D) every text token (replicated), or ``None``.
        valid: (B, T) bool, the text keys each element attends to, or ``None`` for all
            (Note [masked text tokens]: one ``usp_attention`` per element then, each with its own
            joint length; under torch.compile one call with ``joint_mask``, Note [masked joint
            tokens] in ``usp_dit.attention.masked_joint``: the same result with static shapes).
        block_causal: a frame length for block-causal attention (no text tokens), or ``None``.

    Returns:
        ``(out (B, S_local, H, D), text_out (B, T, H, D) or None)``; with ``valid``, row b of
        ``text_out`` holds element b's valid tokens' outputs at their positions, zeros elsewhere.
    """
    def call(b: slice, idx: Any = slice(None), joint_mask: torch.Tensor | None = None):
        joint = (None,) * 3 if text_q is None else (text_q[b, idx], text_k[b, idx], text_v[b, idx])
        return usp_attention(q[b], k[b], v[b], joint_q=joint[0], joint_k=joint[1], joint_v=joint[2],
                             scale=scale, mesh=state.mesh, backend=state.backend, seq_len=state.seq_len,
                             block_causal=block_causal, layout=state.layout, joint_mask=joint_mask)

    if valid is None:
        res = call(slice(None))
        return res.out, res.joint_out
    if torch.compiler.is_compiling():
        res = call(slice(None), joint_mask=valid)
        return res.out, res.joint_out.masked_fill(~valid[:, :, None, None], 0)
    outs, text_outs = [], []
    for b in range(q.shape[0]):
        idx = torch.nonzero(valid[b], as_tuple=False).flatten()
        res = call(slice(b, b + 1), idx)
        outs.append(res.out)
        text_b = text_q.new_zeros(1, text_q.shape[1], *res.joint_out.shape[2:])
        text_outs.append(text_b.index_copy(1, idx, res.joint_out))
    return torch.cat(outs), torch.cat(text_outs)


def ulysses_whole_sequence(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, state: ShardState,
    attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, tuple[int, int]], torch.Tensor],
) -> torch.Tensor:
    """Attention whose pattern one rank can build only from the whole sequence, on a grid without
    ring: the Ulysses all-to-all hands this rank every token of its heads, ``attend`` runs the
    stock attention over them, the all-to-all back returns this rank's tokens of every head.
    Used for ACE-Step's sliding-window band and Kandinsky's NABLA block-sparse masks.

    Args:
        query: (B, S_local, H, D) this rank's tokens; key, value: (B, S_local, H_kv, D).
        state: the call's ``ShardState`` (mesh with ``ring_degree == 1``, ``seq_len``, layout: with
            one ring block, every layout's block is the whole sequence in order).
        attend: ``(q (B, S, h, D), k, v (B, S, h_kv', D), heads (start, stop)) -> (B, S, h, D)``,
            this rank's query heads ``heads`` of the whole sequence in stock's token order (K/V as
            the kernel reads them for those heads, ``UlyssesLayout.local_kv``).

    Returns:
        (B, S_local, H, D).

    Raises:
        NotImplementedError: a grid with a ring (no rank then holds a head's whole sequence).
    """
    if state.mesh.ring_degree > 1:
        raise NotImplementedError(
            f"ulysses_whole_sequence needs every token of a head on one rank, which a ring "
            f"(ring_degree={state.mesh.ring_degree}) does not give: use ring_degree=1")
    plans = ulysses_layout(state.mesh, query.shape[2], key.shape[2], layout_sizes(state.seq_len, state.mesh, state.layout))
    q = scatter_heads(query, plans.q_plan)  # (B, S, h_local, D): every token, this rank's heads
    k = plans.local_kv(scatter_heads(key, plans.kv_plan))
    v = plans.local_kv(scatter_heads(value, plans.kv_plan))
    return gather_heads(attend(q, k, v, plans.q_range), plans.q_plan)


def _one_rank_unmasked(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, route: Route,
                       scale: float | None) -> torch.Tensor:
    """``route_attention`` on one rank of the sequence with no mask: attention over the whole
    sequence the stock code concatenated, in one kernel call.

    The general path's work (the shard length from the layout, the text and video slices, the
    mask checks) decides nothing here: with one rank the shard is the whole sequence
    (``state.seq_len`` tokens) and ``[text; shard]`` is attended as it is. Only the length check
    is kept. Host-bound models (PixArt, DiT: a few ms of GPU work a forward) make 20-60 such
    calls a forward, and pay every microsecond of Python in their step time.

    query (B, L, H, D), key/value (B, L_k, H_k, D) -> (B, L, H, D).
    """
    _check_one_rank_length(query.shape[1], route)
    return one_rank_attention(query, key, value, scale=scale, backend=route.state.backend)


def _check_one_rank_length(length: int, route: Route) -> None:
    """Raises ValueError unless a one-rank routed call's ``length`` tokens are the shard's (plus text)."""
    seq_len = route.state.seq_len
    if (route.text == "none" and length != seq_len) or length < seq_len:
        what = "self-attention" if route.text == "none" else "joint attention"
        raise ValueError(f"a routed {what} call got {length} tokens, but this rank's shard has {seq_len}")


def route_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None,
               dropout_p: float, is_causal: bool, scale: float | None, route: Route) -> torch.Tensor:
    """``F.scaled_dot_product_attention``'s call routed, for a stock processor whose code calls it
    (the ``F`` stand-ins of SD3, PixArt, DiT, Lumina 2, CogView4 ...): ``route_attention`` on
    (B, L, H, D) views.

    A small plain call on one rank with ``backend="auto"`` is stock's own call, on stock's tensors
    (Note [small calls on one rank go to PyTorch's dispatcher] in ``usp_dit.kernels.policy``): no
    layout views, no backend choice; the length check is kept.

    query (B, H, L, D), key/value (B, H_k, L_k, D) -> (B, H, L, D).
    """
    state = route.state
    if (attn_mask is None and state.mesh.sequence_degree == 1 and state.backend == "auto" and not dropout_p
            and not is_causal and route.block_causal is None and not torch.compiler.is_compiling()):
        batch, heads, length, head_dim = query.shape
        _check_one_rank_length(length, route)
        if auto_uses_torch_dispatch(attention_flops(batch, length, key.shape[2], heads, head_dim)):
            return F.scaled_dot_product_attention(query, key, value, scale=scale, enable_gqa=key.shape[1] != heads)
    out = route_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), attn_mask, dropout_p,
                          is_causal, scale, parallel_config=route)
    return out.transpose(1, 2)


def route_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    attention_kwargs: dict[str, Any] | None = None,
    *,
    backend: Any = None,
    parallel_config: Any = None,
) -> torch.Tensor:
    """``dispatch_attention_fn``'s signature (Note [routing a stock processor's attention call]).

    Args:
        query, key, value: (B, L, H | H_kv, D): this rank's shard, with the text before or after
            it as ``parallel_config.text`` says; L = T + S_local.
        attn_mask: a text key mask or ``None`` (Note [masked text tokens]).
        parallel_config: the processor's ``Route``.
        backend: Diffusers' backend name (``set_attention_backend``); ignored: usp_dit's is used.

    Returns:
        (B, L, H, D), laid out like ``query``: each token attended over the whole sequence.

    Raises:
        NotImplementedError: dropout, causal attention, attention kwargs, or a mask other than a
            text key mask.
    """
    route = parallel_config
    if not isinstance(route, Route):
        raise RuntimeError(
            f"usp_dit's routed processor got parallel_config={type(route).__name__}, not its Route: this "
            f"diffusers' processor no longer passes _parallel_config to its attention call"
        )
    if dropout_p or is_causal or attention_kwargs:
        raise NotImplementedError(
            f"usp_dit routes plain attention only, got dropout_p={dropout_p}, is_causal={is_causal}, "
            f"attention_kwargs={attention_kwargs}"
        )
    state = route.state
    if attn_mask is None and route.block_causal is None and state.mesh.sequence_degree == 1:
        return _one_rank_unmasked(query, key, value, route, scale)
    length, shard = query.shape[1], route.shard_len()
    text_len = length - shard
    if route.text == "none" and text_len:
        raise ValueError(f"a routed self-attention call got {length} tokens, but this rank's shard has {shard}")
    if text_len < 0:
        raise ValueError(f"a routed joint attention call got {length} tokens, fewer than this rank's {shard} video tokens")
    text, video = (slice(0, text_len), slice(text_len, None)) if route.text == "first" else (
        slice(length - text_len, length), slice(0, length - text_len))
    if attn_mask is not None and attn_mask.shape[-1] != length:
        # a mask built over the whole sequence (e.g. HunyuanVideo's, before the tokens are split)
        full = attn_mask.shape[-1]
        text = slice(0, text_len) if route.text == "first" else slice(full - text_len, full)
        video = slice(text_len, None) if route.text == "first" else slice(0, full - text_len)
    masked = one_rank_masked_call(query, key, value, attn_mask, route, scale)  # checked above
    if masked is not None:
        return masked
    valid = _valid_text_keys(attn_mask, query.shape[0], text, video)
    if route.state.mesh.sequence_degree == 1 and valid is None:
        # One rank: attention over [text; shard] is plain attention over the sequence the stock
        # code concatenated; taking it apart and joining it again would copy q, k, v and the output.
        state = route.state
        if route.block_causal is None:
            return one_rank_attention(query, key, value, scale=scale, backend=state.backend)
        return usp_attention(query, key, value, scale=scale, mesh=state.mesh, backend=state.backend,
                             block_causal=route.block_causal).out
    split = (lambda x: (x[:, text_len:], x[:, :text_len])) if route.text == "first" else (
        lambda x: (x[:, :shard], x[:, shard:]))
    (q, tq), (k, tk), (v, tv) = split(query), split(key), split(value)
    joint = (tq, tk, tv) if text_len else (None, None, None)
    out, text_out = joint_attention(q, k, v, *joint, valid, route.state, scale, route.block_causal)
    if text_out is None:
        return out
    return torch.cat([text_out, out] if route.text == "first" else [out, text_out], dim=1)


class RoutedProcessor:
    """A stock processor's ``__call__`` run with its attention call routed (see the module Note).

    Subclasses (or ``routed_processor_class``) set ``_stock_call``. The instance is the object
    the stock code sees as ``self``: ``_attention_backend`` and ``_parallel_config`` are read by
    it; any other attribute it reads must be copied from the stock processor (``copy_from``).
    """

    _attention_backend = None  # read by the stock code (and set by diffusers' set_attention_backend)
    _stock_call: types.FunctionType | None = None

    def __init__(self, route: Route, stock: Any = None) -> None:
        self._parallel_config = route
        if stock is not None:
            for name, value in vars(stock).items():
                if name not in ("_parallel_config", "_attention_backend"):
                    setattr(self, name, value)

    @property
    def route(self) -> Route:
        return self._parallel_config

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return type(self)._stock_call(self, *args, **kwargs)


def routed_processor_class(stock_class: type, name: str | None = None) -> type[RoutedProcessor] | None:
    """A ``RoutedProcessor`` subclass running ``stock_class.__call__`` with ``dispatch_attention_fn``
    routed, or ``None`` when that code makes no such call (the adapter must then refuse)."""
    routed = with_global(stock_class.__call__, ROUTED_NAME, route_attention)
    if routed is None:
        return None

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return routed(self, *args, **kwargs)

    # Diffusers' Attention.forward passes a processor only the keyword arguments its __call__'s
    # signature names (dropping the others, e.g. image_rotary_emb, with a warning at most): the
    # routed class must show the stock signature, not (*args, **kwargs).
    __call__.__signature__ = inspect.signature(stock_class.__call__)
    return type(name or f"USP{stock_class.__name__}", (RoutedProcessor,), {
        "_stock_call": routed, "__call__": __call__,
        "__doc__": f"``{stock_class.__name__}``'s own code with its attention call routed to usp_attention.",
    })
