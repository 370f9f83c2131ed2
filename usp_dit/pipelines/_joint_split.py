"""Splitting ``[text; image]`` as one sequence at a Flux-like transformer's forward arguments.

Layout: image tokens (batch, N, channels) and text tokens (batch, T, channels) as separate
arguments (``hidden_states``, ``encoder_hidden_states``); position ids (tokens, axes) or
(batch, tokens, axes) (the models read row 0 of the latter); the output (batch, N, channels_out).

Note [joint token split]
    Flux-like models (Flux.1, Flux.2, Chroma) run every per-token op on text and image alike and
    attend over ``[text; image]``, so their text is split with the image: the joint sequence is
    cut into ``split_sizes(T + N, P)`` contiguous pieces and each rank passes its text part and its
    image part (either may be empty) to the stock forward, with the ids of exactly those tokens.

        joint sequence    [ t_0 .. t_{T-1} | i_0 .. i_{N-1} ]      (the attention order)
        pieces            split_sizes(T + N, P): rank s holds [lo_s, hi_s)
        rank s passes     text [lo_s, hi_s) ∩ [0, T)  and  image ([lo_s, hi_s) ∩ [T, T+N)) - T
        Flux.1-dev 1024x1024 (4096 + 512 = 4608): P=8 576 each (rank 0: 512 text + 64 image),
        against 4096/8 + 512 = 1024 a rank were the text replicated (1.8x).

    The stock forward then runs unchanged on the pieces: RoPE built from this rank's ids rotates
    exactly its tokens; the blocks' ``[text; image]`` concatenations are this rank's piece of the
    joint sequence in global order, so attention is one plain sharded sequence (a routed call with
    ``text="none"``); the image rows of the output are all-gathered once, after the forward. The
    split cannot be a pre-hook of the first block: these forwards read the text length before it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from usp_dit.distributed.comm import all_gather_uneven
from usp_dit.distributed.mesh import USPMesh
from usp_dit.pipelines._token_sharding import ShardState, TokenShardHooks
from usp_dit.pipelines.base import MethodWrapper
from usp_dit.pipelines.composition import unwrap_forward, wrap_forward
from usp_dit.pipelines.plan import ModelPlan, PlanAdapter, PlanPatch, check_plan
from usp_dit.sharding.partition import offsets, split_sizes


@dataclass(frozen=True)
class FluxSplit:
    """Note [joint token split] for one call: this rank's text and image ranges, every rank's image count."""

    text: tuple[int, int]
    image: tuple[int, int]
    image_sizes: tuple[int, ...]


def flux_split(num_text: int, num_image: int, num_ranks: int, rank: int) -> FluxSplit:
    """Split the joint sequence ``[text (num_text), image (num_image)]`` into ``num_ranks`` pieces."""
    sizes = split_sizes(num_text + num_image, num_ranks)
    starts = offsets(sizes)
    bounds = [(lo, lo + n) for lo, n in zip(starts, sizes)]

    def clip(lo: int, hi: int, a: int, b: int) -> tuple[int, int]:
        lo = min(max(lo, a), b)  # an empty overlap becomes (x, x) with a <= x <= b
        return (lo, max(lo, min(hi, b)))

    text = [clip(lo, hi, 0, num_text) for lo, hi in bounds]
    image = [tuple(x - num_text for x in clip(lo, hi, num_text, num_text + num_image)) for lo, hi in bounds]
    return FluxSplit(text[rank], image[rank], tuple(hi - lo for lo, hi in image))


def rows(x: torch.Tensor, lo: int, hi: int, dim: int) -> torch.Tensor:
    """``x[lo:hi]`` along ``dim`` (a view)."""
    return x.narrow(dim, lo, hi - lo)


def ids_rows(ids: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows [lo, hi) of position ids (tokens, axes) or (batch, tokens, axes)."""
    return rows(ids, lo, hi, ids.dim() - 2)


def gather_image(out: Any, split: FluxSplit, mesh: USPMesh) -> Any:
    """(B, N_local, C_out) -> (B, N, C_out) on every rank, in the output's own type (tuple or output)."""
    sizes = list(split.image_sizes)
    if isinstance(out, tuple):
        return (all_gather_uneven(out[0], sizes, 1, mesh.seq_group),) + out[1:]
    out.sample = all_gather_uneven(out.sample, sizes, 1, mesh.seq_group)
    return out


class MaskRefusingJointProcessor:
    """A Flux-like routed processor's call (put before the routed class in the bases): attention of
    this rank's piece of the joint sequence against the whole sequence, an ``attention_mask``
    refused (``mask_refusal``: the family's pipelines pass none, and a mask over the sharded joint
    sequence is not split here).

    Double blocks: ``hidden_states`` (B, N_local, C) image part, ``encoder_hidden_states``
    (B, T_local, C) text part (may be empty); returns ``(image_out, text_out)`` of the same shapes.
    Single blocks: ``hidden_states`` (B, T_local + N_local, C); returns (B, T_local + N_local, C).
    ``image_rotary_emb``: ``(cos, sin)`` (T_local + N_local, D), this rank's rows (built from its ids).
    """

    mask_refusal = "usp_dit's processor does not support attention_mask"  # a family names itself

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> Any:
        if attention_mask is not None:
            raise NotImplementedError(self.mask_refusal)
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class JointSplitForward(MethodWrapper):
    """The forward on this rank's piece of ``[text; image]`` (Note [joint token split]), its image
    output gathered: (B, N, C_out) on every rank of the sequence group.

    Subclasses add a family's call checks (``check``) and cut its other per-token arguments
    (``split_more``: ControlNet residuals, masks). An object, not a closure, so that a deep copy of
    the transformer runs its own weights (``usp_dit.pipelines.base`` Note [deep copies]).
    """

    def __init__(self, inner, state: ShardState) -> None:
        super().__init__(inner)
        self.state = state

    def check(self, call: dict[str, Any]) -> None:
        """Refuse a call the split would not run exactly (none refused here)."""

    def split_more(self, call: dict[str, Any], split: FluxSplit, num_text: int) -> None:
        """Cut further per-token arguments of ``call`` in place (none here)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bound = self.__signature__.bind(*args, **kwargs)
        call = bound.arguments
        for name in ("hidden_states", "encoder_hidden_states", "img_ids", "txt_ids"):
            if call.get(name) is None:
                raise ValueError(f"{type(self).__name__} needs {name}, got None")
        for ids, tokens in (("txt_ids", "encoder_hidden_states"), ("img_ids", "hidden_states")):
            if call[ids].shape[-2] != call[tokens].shape[1]:
                raise ValueError(
                    f"{ids} has {call[ids].shape[-2]} rows but {tokens} has {call[tokens].shape[1]} tokens: they "
                    f"must match for the ids to be split like the tokens"
                )
        self.check(call)
        num_text, num_image = call["encoder_hidden_states"].shape[1], call["hidden_states"].shape[1]
        mesh = self.state.mesh
        split = flux_split(num_text, num_image, mesh.sequence_degree, mesh.seq_rank)
        (tlo, thi), (ilo, ihi) = split.text, split.image
        call["encoder_hidden_states"] = rows(call["encoder_hidden_states"], tlo, thi, 1)
        call["txt_ids"] = ids_rows(call["txt_ids"], tlo, thi)
        call["hidden_states"] = rows(call["hidden_states"], ilo, ihi, 1)
        call["img_ids"] = ids_rows(call["img_ids"], ilo, ihi)
        self.split_more(call, split, num_text)
        self.state.seq_len = num_text + num_image  # what every routed attention call covers
        self.state.text_len = None  # the text is not replicated (nothing joint)
        out = self.inner(*bound.args, **bound.kwargs)
        return gather_image(out, split, mesh)


class JointSplitHooks:
    """The plan part installing a ``JointSplitForward`` (``wrapper``) as the transformer's
    ``forward``, and removing it (the instance attribute it had, if any, put back)."""

    def __init__(self, transformer: torch.nn.Module, state: ShardState, wrapper: type[JointSplitForward]) -> None:
        self.transformer = transformer
        self.state = state
        self.wrapper = wrapper
        self.installed: JointSplitForward | None = None

    def install(self) -> None:  # beneath an offload hook (Note [wrappers beneath the hooks])
        self.installed = wrap_forward(self.transformer, lambda inner: self.wrapper(inner, self.state))

    def remove(self) -> None:
        if self.installed is not None:
            unwrap_forward(self.transformer, self.installed)
            self.installed = None


class JointSplitPlanPatch(PlanPatch):
    """``PlanPatch`` with the tokens split at the forward's arguments (``JointSplitHooks``)
    instead of at ``split_at``'s ``hidden_states`` input."""

    def __init__(self, plan: ModelPlan, transformer: torch.nn.Module, mesh: USPMesh, backend: str,
                 wrapper: type[JointSplitForward]) -> None:
        super().__init__(plan, transformer, mesh, backend)
        tokens = [i for i, part in enumerate(self.parts) if isinstance(part, TokenShardHooks)]
        assert len(tokens) == 1, "PlanPatch installs one TokenShardHooks"
        self.parts[tokens[0]] = JointSplitHooks(transformer, self.state, wrapper)


class JointSplitPlanAdapter(PlanAdapter):
    """A Flux-like ``ModelPlan``'s adapter: ``[text; image]`` split at the forward's arguments by
    ``wrapper`` (Note [joint token split]); the plan's ``split_at`` is ``""`` (the transformer)."""

    def __init__(self, plan: ModelPlan, module: str, wrapper: type[JointSplitForward] = JointSplitForward) -> None:
        super().__init__(plan, module)
        self.wrapper = wrapper

    def make_patch(self, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> JointSplitPlanPatch:
        check_plan(self.plan, transformer)
        return JointSplitPlanPatch(self.plan, transformer, mesh, backend, self.wrapper)
