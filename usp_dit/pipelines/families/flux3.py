"""FLUX.3 adapter: ``Flux3Transformer2DModel`` (``Flux3ModularPipeline``, ``Flux3DistilledModularPipeline``) on a USP grid.

Layout: image tokens ``hidden_states`` (batch, N, channels), optional reference-image tokens
``image_cond_hidden_states`` (batch, M, channels), text tokens ``encoder_hidden_states`` (batch, T,
channels); position ids ``img_ids`` (N, 4), ``image_cond_ids`` (M, 4), ``txt_ids`` (T, 4) shared by
the batch; the RoPE tables ``(cos, sin)`` (tokens, head_dim) built from the ids; Q/K/V (batch,
seq, heads, head_dim); the output (batch, N, channels) (the image tokens alone).

Note [FLUX.3's per-mode split]
    FLUX.3 runs three token modes through their own blocks first, each attending **within its own
    mode** (``txt_mode_blocks`` over the text, ``mode_blocks["image"]`` over the image,
    ``mode_blocks["image_cond"]`` over the references), then the joint single blocks over
    ``cat([text, image, references])``. Every per-token op (norms, modulation, projections, MLP)
    is the same for every token of a mode, there is no mask, and the attention is plain, so each
    mode is **split on its own**, at the forward's arguments, into ``split_sizes(n, P)`` contiguous
    pieces (tokens and ids alike), and the stock forward runs on the pieces:

        rank s passes   text rows   split_sizes(T, P)[s]  (and their txt_ids)
                        image rows  split_sizes(N, P)[s]  (img_ids)
                        ref rows    split_sizes(M, P)[s]  (image_cond_ids)
        FLUX.3 at 1024 x 1024 (N = 4096, T = 512): P = 8: 64 text + 512 image rows a rank.

    A mode block's attention is then one sharded sequence of that mode (its length T, N or M); a
    single block's attention is one sharded sequence of T + N + M tokens whose piece on rank s is
    ``[text_s, image_s, ref_s]``. That piece is not a contiguous run of the stock concatenation,
    and need not be: unmasked attention does not depend on where a key sits (RoPE rotates each
    token by its own ids, cut with it), so every query meets every key exactly once. Each
    attention is ``Flux3AttnProcessor``'s own code, its one ``dispatch_attention_fn`` call routed
    to ``usp_attention`` (``_route_plain``) with the full length of its mode. The joint pieces'
    lengths are the sums of the modes' (e.g. T = 7, N = 35 on 2 ranks: 4 + 18, 3 + 17), in general
    not ``split_sizes(T + N + M, P)``; the single blocks' calls then pass no length and
    ``usp_attention`` gathers the pieces' lengths (one small all-gather a call), which also keeps
    such a grid out of ``torch.compile`` (it needs the length: refused by ``usp_attention`` there). The forward's slice
    ``content[:, :image_seq_len]`` reads this rank's image rows (its first ``N_s`` content rows);
    the output's image rows are all-gathered once.

Text: **split** like the image (as Flux.1's, ``_joint_split`` Note [joint token split]): FLUX.3's
text runs its own mode blocks and every single block's per-token work, so it costs what an image
token costs; replicated it would leave 512 unshrunk tokens on every rank.

CFG: ``Flux3ModularPipeline``'s ``ClassifierFreeGuidance`` guider calls the transformer once per
branch, differing in ``encoder_hidden_states`` and ``txt_ids`` (the negative prompt's): with
``cfg_degree=2`` the two calls of a step run on the two cfg groups at once (``cfg_branch_args``,
``usp_dit.pipelines.cfg_pair``); the step-distilled flow-map checkpoint (``Flux3DistilledModularPipeline``)
makes one call a step.

Refused (NotImplementedError): at enable, processors other than the stock ``Flux3AttnProcessor``,
attention modules the plan does not name, a Diffusers cache that cannot run on a grid,
``num_layers=0``; at the call, an ``attention_mask`` reaching a processor (the stock model passes
none) and a processor replaced after enable. Tensor parallelism: refused (the generic refusal):
the per-mode blocks live in a ``ModuleDict`` of lists (``mode_blocks.image``), which the tensor
plan's block lists (top-level attributes) cannot name yet. FSDP2 units (``shard_weights``): the
text mode blocks and the single blocks; the image mode blocks stay whole for the same reason.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers import Flux3Transformer2DModel
from diffusers.models.transformers.transformer_flux3 import Flux3Attention, Flux3AttnProcessor

from usp_dit.attention.usp import usp_attention
from usp_dit.pipelines._joint_split import (
    FluxSplit,
    JointSplitForward,
    JointSplitPlanAdapter,
    gather_image,
    ids_rows,
    rows,
)
from usp_dit.pipelines._routing import ROUTED_NAME, Route, RoutedProcessor, with_global
from usp_dit.pipelines._token_sharding import ShardState
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel
from usp_dit.sharding.partition import offsets, split_sizes


def _route_plain(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
    attention_kwargs: dict[str, Any] | None = None, *, backend: Any = None, parallel_config: Any = None,
) -> torch.Tensor:
    """``dispatch_attention_fn``'s signature: this rank's piece (B, n_local, H, D) of one mode's
    tokens (or of the joint ones) attended over the whole of them (``usp_attention``).

    ``parallel_config``: the processor's ``ModeRoute``; its ``seq_len`` is the mode's full length
    when every rank holds the standard ``split_sizes`` piece of it (the mode blocks), else None: the
    joint pieces ``[text_s, image_s, ref_s]`` are uneven otherwise, and ``usp_attention`` then
    gathers the piece lengths (a small all-gather a call; dense attention takes any split).
    """
    route = parallel_config
    if not isinstance(route, ModeRoute):
        raise TypeError(f"usp_dit's FLUX.3 processor got parallel_config={type(route).__name__}")
    if attn_mask is not None or dropout_p or is_causal or attention_kwargs:
        raise NotImplementedError(
            f"usp_dit routes plain attention only, got attn_mask={None if attn_mask is None else 'a mask'}, "
            f"dropout_p={dropout_p}, is_causal={is_causal}, attention_kwargs={attention_kwargs}"
        )
    state = route.state
    return usp_attention(query, key, value, scale=scale, mesh=state.mesh, backend=state.backend,
                         seq_len=route.seq_len).out


@dataclass(eq=False)
class ModeRoute:
    """A FLUX.3 processor's ``_parallel_config``: the shared state, and its mode's full length in the
    call in progress (None where the ranks' pieces are not the standard split)."""

    state: ShardState
    seq_len: int | None = None


# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing), with our own routed
# function: None if this diffusers' processor makes no dispatch_attention_fn call.
_ROUTED_CALL = with_global(Flux3AttnProcessor.__call__, ROUTED_NAME, _route_plain)

# The arguments split per mode: (tokens, their ids, the mode's name in ModeLengths).
_MODES = (("encoder_hidden_states", "txt_ids", "txt"), ("hidden_states", "img_ids", "image"),
          ("image_cond_hidden_states", "image_cond_ids", "image_cond"))


class _Flux3ModeAttn(RoutedProcessor):
    """``Flux3AttnProcessor``'s own code on this rank's piece of one mode's tokens (``mode``: "txt",
    "image", "image_cond") or of the joint ``[text, image, references]`` ("joint").

    Inputs: ``hidden_states`` (B, n_local, C), ``image_rotary_emb`` ``(cos, sin)`` each (n_local,
    head_dim), this rank's rows. Returns (B, n_local, C). Each routed call covers the whole length of
    its mode (Note [FLUX.3's per-mode split]), which the forward's split records in the shared
    state's ``mode_lengths``; this processor's own state carries it to ``usp_attention``.
    """

    mode = "joint"
    _stock_call = _ROUTED_CALL

    def __init__(self, route: Route) -> None:
        super().__init__(ModeRoute(route.state))

    def __call__(
        self, attn: Flux3Attention, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise NotImplementedError("usp_dit's FLUX.3 processor does not route an attention_mask (the model passes none)")
        self._parallel_config.seq_len = self._parallel_config.state.mode_lengths[self.mode]
        return type(self)._stock_call(self, attn, hidden_states, attention_mask, image_rotary_emb)


class USPFlux3TextAttn(_Flux3ModeAttn):
    """The text mode blocks' attention (over the text alone)."""

    mode = "txt"


class USPFlux3ImageAttn(_Flux3ModeAttn):
    """The image mode blocks' attention (over the image alone)."""

    mode = "image"


class USPFlux3ReferenceAttn(_Flux3ModeAttn):
    """The reference-image mode blocks' attention (over the references alone)."""

    mode = "image_cond"


class Flux3SplitForward(JointSplitForward):
    """The forward on this rank's piece of each mode (Note [FLUX.3's per-mode split]), the image
    output gathered: (B, N, C_out) on every rank of the sequence group."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = self.__signature__.bind(*args, **kwargs)
        call = bound.arguments
        mesh = self.state.mesh
        lengths: dict[str, int | None] = {}
        pieces: dict[str, tuple[int, int, list[int]]] = {}
        for tokens, ids, mode in _MODES:
            if call.get(tokens) is None:
                if mode != "image_cond":
                    raise ValueError(f"{type(self).__name__} needs {tokens}, got None")
                continue
            if call.get(ids) is None or call[ids].shape[-2] != call[tokens].shape[1]:
                got = None if call.get(ids) is None else call[ids].shape[-2]
                raise ValueError(f"{ids} has {got} rows but {tokens} has {call[tokens].shape[1]} tokens: they must "
                                 f"match for the ids to be split like the tokens")
            n = call[tokens].shape[1]
            if n < mesh.sequence_degree:  # the stock code cannot run on an empty piece (its reshapes)
                raise NotImplementedError(
                    f"usp_dit's FLUX.3 adapter splits each mode over the {mesh.sequence_degree} sequence ranks, but "
                    f"{tokens} has {n} tokens (Note [FLUX.3's per-mode split]): use a smaller grid"
                )
            sizes = split_sizes(n, mesh.sequence_degree)
            lo = offsets(sizes)[mesh.seq_rank]
            hi = lo + sizes[mesh.seq_rank]
            call[tokens], call[ids] = rows(call[tokens], lo, hi, 1), ids_rows(call[ids], lo, hi)
            lengths[mode], pieces[mode] = n, (lo, hi, sizes)
        total = sum(lengths.values())
        standard = split_sizes(total, mesh.sequence_degree)[mesh.seq_rank]
        mine = sum(hi - lo for lo, hi, _ in pieces.values())
        # The joint pieces are the standard split of T + N + M only where every rank's sum is; the
        # ranks compute the same sizes, so they agree on passing the length or not.
        uniform = all(sum(split_sizes(n, mesh.sequence_degree)[r] for n in lengths.values())
                      == split_sizes(total, mesh.sequence_degree)[r] for r in range(mesh.sequence_degree))
        lengths["joint"] = total if uniform and mine == standard else None
        self.state.mode_lengths = lengths  # read by every _Flux3ModeAttn of this transformer
        self.state.seq_len, self.state.text_len = total, None
        out = self.inner(*bound.args, **bound.kwargs)
        tlo, thi, _ = pieces["txt"]
        ilo, ihi, image_sizes = pieces["image"]
        return gather_image(out, FluxSplit((tlo, thi), (ilo, ihi), tuple(image_sizes)), mesh)


def _routed_call_missing(transformer: Flux3Transformer2DModel) -> str | None:
    if _ROUTED_CALL is None:
        return f"this diffusers' Flux3AttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="Flux3",
    model_class=Flux3Transformer2DModel,
    split_at="",  # the forward's own arguments, per mode (Flux3SplitForward); the image rows gathered after it
    gather_at="proj_out",
    attention=(
        Parallel("txt_mode_blocks.*.attn", USPFlux3TextAttn, stock=(Flux3AttnProcessor,)),
        Parallel("mode_blocks.image.*.attn", USPFlux3ImageAttn, stock=(Flux3AttnProcessor,)),
        Parallel("mode_blocks.image_cond.*.attn", USPFlux3ReferenceAttn, stock=(Flux3AttnProcessor,)),
        Parallel("single_transformer_blocks.*.attn", _Flux3ModeAttn, stock=(Flux3AttnProcessor,)),
    ),
    block_lists=("txt_mode_blocks", "single_transformer_blocks"),
    # Batched on dim 0, split over the "cfg" axis by enable_usp (a call cfg_branch_args does not run).
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep", "image_cond_hidden_states",
                    "target_timestep"),
    # The ClassifierFreeGuidance guider's two calls a step differ in these (cfg_pair Note [two calls a step]).
    cfg_branch_args=("encoder_hidden_states", "txt_ids"),
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(JointSplitPlanAdapter(PLAN, __name__, Flux3SplitForward))
