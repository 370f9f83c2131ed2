"""Flux adapter: ``FluxTransformer2DModel`` (Flux.1 dev and schnell, ``FluxPipeline``) on a USP grid.

Layout: image tokens (batch, N, channels) in the pipeline's packed order, text tokens (batch, T,
channels); position ids (tokens, 3); Q/K/V (batch, seq, heads, head_dim); the RoPE table
``(cos, sin)``, each (tokens, head_dim), row i rotating token i.

Text tokens: **split** together with the image tokens. Flux attends over ``[text, image]`` in every
block and its 38 single-stream blocks run all per-token work (norms, projections, MLP) on that
concatenation, so a text token costs exactly what an image token costs. With 512 text tokens beside
4096 image tokens, replicating text would leave every rank 512 tokens of unshrunk work: on 8 ranks
1024 tokens per rank instead of 576 (1.8x). Split, every rank holds one contiguous piece of the
joint sequence, so the load is even to one token and the attention sees one plain sharded sequence
(no joint tokens, no padding mask: Flux has none).

Note [Flux token split]
    joint sequence    [ t_0 .. t_{T-1} | i_0 .. i_{N-1} ]      (the order of Flux's attention)
    pieces            split_sizes(T + N, P): rank s holds [lo_s, hi_s)
    rank s passes     text [lo_s, hi_s) ∩ [0, T)  and  image ([lo_s, hi_s) ∩ [T, T+N)) - T
    Per rank (batch 1):
      1024x1024 (4096 + 512 = 4608):  P=2 2304 each (rank 0: 512 text + 1792 image)
                                       P=4 1152 each (rank 0: 512 + 640), P=8 576 each (rank 0: 512 + 64)
      1008x1008 (3969 + 512 = 4481):  P=4 1121, 1120, 1120, 1120 (rank 0: 512 + 609)

Why the stock forward then runs unchanged on the pieces: the text and image streams are separate
arguments, so the local text part (possibly empty) and image part are passed as they are; Flux builds
its RoPE table from ``cat(txt_ids, img_ids)``, so slicing the ids like the tokens gives each rank
exactly the rows of its tokens; the double blocks concatenate ``[text_q, image_q]`` and the single
blocks ``[text, image]``, both the local piece of the joint sequence in global order. Only attention
needs the other ranks: ``USPFluxAttnProcessor`` sends the local piece to ``usp_attention``. The image
part of ``proj_out``'s output is all-gathered once, after the last block.

Unsupported (NotImplementedError): IP-Adapter (``ip_adapter_image_embeds``), an ``attention_mask``,
processors other than diffusers' ``FluxAttnProcessor`` (e.g. IP-Adapter or custom ones).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers import FluxTransformer2DModel
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

from usp_dit.comm import all_gather_uneven
from usp_dit.mesh import USPMesh
from usp_dit.partition import offsets, split_sizes
from usp_dit.pipelines.base import (
    MISSING,
    MethodWrapper,
    check_ulysses_degree,
    model_class_of,
    register_adapter,
    restore_instance_attr,
    saved_instance_attr,
)
from usp_dit.usp import usp_attention


@dataclass(eq=False)
class FluxCallState:
    """What the forward wrapper and the processors of one enabled transformer share.

    ``seq_len``: T + N of the call in progress (lets ``usp_attention`` skip an all-gather of shard
    lengths); ``None`` outside a call.
    """

    mesh: USPMesh
    backend: str
    seq_len: int | None = None


@dataclass(frozen=True)
class FluxSplit:
    """Note [Flux token split] for one call: this rank's text and image ranges, every rank's image count."""

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


def _heads(x: torch.Tensor, head_dim: int) -> torch.Tensor:
    """(B, S, H * D) -> (B, S, H, D)."""
    return x.unflatten(-1, (-1, head_dim))


def _image_qkv(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, S, C) -> q, k, v (B, S, H, D), q and k RMS-normalised per head."""
    if getattr(attn, "fused_projections", False):
        q, k, v = attn.to_qkv(x).chunk(3, dim=-1)
    else:
        q, k, v = attn.to_q(x), attn.to_k(x), attn.to_v(x)
    q, k, v = (_heads(t, attn.head_dim) for t in (q, k, v))
    return attn.norm_q(q), attn.norm_k(k), v


def _text_qkv(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Text stream of a double block: (B, T_local, C) -> q, k, v (B, T_local, H, D)."""
    if getattr(attn, "fused_projections", False) and hasattr(attn, "to_added_qkv"):
        q, k, v = attn.to_added_qkv(x).chunk(3, dim=-1)
    else:
        q, k, v = attn.add_q_proj(x), attn.add_k_proj(x), attn.add_v_proj(x)
    q, k, v = (_heads(t, attn.head_dim) for t in (q, k, v))
    return attn.norm_added_q(q), attn.norm_added_k(k), v


class USPFluxAttnProcessor:
    """Flux attention of this rank's piece of the joint sequence against the whole sequence.

    Double blocks: ``hidden_states`` (B, N_local, C) image part, ``encoder_hidden_states``
    (B, T_local, C) text part (may be empty); returns ``(image_out, text_out)`` of the same shapes.
    Single blocks: ``hidden_states`` (B, T_local + N_local, C); returns (B, T_local + N_local, C).
    ``image_rotary_emb``: ``(cos, sin)`` (T_local + N_local, D), this rank's rows.
    """

    def __init__(self, state: FluxCallState) -> None:
        self.state = state

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ):
        if attention_mask is not None:
            raise NotImplementedError("usp_dit's Flux processor does not support attention_mask (Flux pipelines pass none)")
        q, k, v = _image_qkv(attn, hidden_states)
        two_streams = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
        if two_streams:
            tq, tk, tv = _text_qkv(attn, encoder_hidden_states)
            q, k, v = torch.cat([tq, q], 1), torch.cat([tk, k], 1), torch.cat([tv, v], 1)
        if image_rotary_emb is not None:
            q = apply_rotary_emb(q, image_rotary_emb, sequence_dim=1)
            k = apply_rotary_emb(k, image_rotary_emb, sequence_dim=1)
        out = usp_attention(q, k, v, mesh=self.state.mesh, backend=self.state.backend, seq_len=self.state.seq_len).out
        out = out.flatten(2, 3).to(q.dtype)  # (B, S_local, H * D)
        if not two_streams:
            return out
        text_out, image_out = out.split_with_sizes([encoder_hidden_states.shape[1], hidden_states.shape[1]], dim=1)
        image_out = attn.to_out[1](attn.to_out[0](image_out.contiguous()))
        return image_out, attn.to_add_out(text_out.contiguous())


def _ids_2d(ids: torch.Tensor) -> torch.Tensor:
    """(tokens, 3), dropping the deprecated leading batch dim of (1, tokens, 3) as Flux does."""
    return ids[0] if ids.dim() == 3 else ids


def _slice_tokens(x: Any, lo: int, hi: int, dim: int) -> Any:
    """``x[lo:hi]`` along ``dim`` for a tensor or each tensor of a list/tuple; ``None`` stays."""
    if x is None:
        return None
    if isinstance(x, (list, tuple)):
        return type(x)(_slice_tokens(t, lo, hi, dim) for t in x)
    return x.narrow(dim, lo, hi - lo)


def _shard_arguments(args: dict[str, Any], split: FluxSplit) -> None:
    """Replace the token-carrying arguments of Flux's forward by this rank's parts, in place."""
    (tlo, thi), (ilo, ihi) = split.text, split.image
    args["hidden_states"] = _slice_tokens(args["hidden_states"], ilo, ihi, 1)
    args["encoder_hidden_states"] = _slice_tokens(args["encoder_hidden_states"], tlo, thi, 1)
    args["img_ids"] = _slice_tokens(_ids_2d(args["img_ids"]), ilo, ihi, 0)
    args["txt_ids"] = _slice_tokens(_ids_2d(args["txt_ids"]), tlo, thi, 0)
    for name in ("controlnet_block_samples", "controlnet_single_block_samples"):
        if args.get(name) is not None:  # residuals added to the image stream: (B, N, C) each
            args[name] = _slice_tokens(args[name], ilo, ihi, 1)


def _check_call(args: dict[str, Any]) -> None:
    jak = args.get("joint_attention_kwargs") or {}
    if "ip_adapter_image_embeds" in jak:
        raise NotImplementedError("usp_dit's Flux adapter does not support IP-Adapter (ip_adapter_image_embeds)")
    for name in ("hidden_states", "encoder_hidden_states", "img_ids", "txt_ids"):
        if args.get(name) is None:
            raise ValueError(f"FluxTransformer2DModel under usp_dit needs {name}, got None")


def _gather_sample(out: Any, split: FluxSplit, mesh: USPMesh) -> Any:
    """(B, N_local, C_out) image output -> (B, N, C_out) on every rank, in the output's own type."""
    if isinstance(out, tuple):
        return (all_gather_uneven(out[0], list(split.image_sizes), 1, mesh.seq_group),) + out[1:]
    out.sample = all_gather_uneven(out.sample, list(split.image_sizes), 1, mesh.seq_group)
    return out


class ShardedFluxForward(MethodWrapper):
    """Flux's forward on this rank's piece (Note [Flux token split]), the image output gathered.

    An object, not a closure, so that a deep copy of the transformer runs its own weights
    (``usp_dit.pipelines.base`` Note [deep copies]).
    """

    def __init__(self, inner, state: FluxCallState) -> None:
        super().__init__(inner)
        self.state = state

    def __call__(self, *args, **kwargs):
        bound = self.__signature__.bind(*args, **kwargs)
        call = bound.arguments
        _check_call(call)
        num_text, num_image = call["encoder_hidden_states"].shape[1], call["hidden_states"].shape[1]
        state = self.state
        mesh = state.mesh
        split = flux_split(num_text, num_image, mesh.sequence_degree, mesh.seq_rank)
        _shard_arguments(call, split)
        state.seq_len = num_text + num_image
        try:
            out = self.inner(*bound.args, **bound.kwargs)
        finally:
            state.seq_len = None
        return _gather_sample(out, split, mesh)


@dataclass(eq=False)
class _FluxPatch:
    """What ``enable`` changed on one transformer, to be put back by ``disable``."""

    processors: dict[str, Any]
    forward_attr: Any = MISSING  # the instance attribute ``forward`` before enable, if any
    wrapped: bool = False


class FluxAdapter:
    """``FluxTransformer2DModel``: tokens split per Note [Flux token split], attention by ``usp_attention``."""

    name = "Flux"
    model_class = FluxTransformer2DModel
    # Arguments that carry the batch dimension first (split over the "cfg" axis by enable_usp).
    cfg_batch_args = (
        "hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance",
        "controlnet_block_samples", "controlnet_single_block_samples",
    )
    _ATTR = "_usp_dit_flux_patch"

    def matches(self, transformer: torch.nn.Module) -> bool:
        # The exact class (or FSDP2's wrapper of it): a subclass may change what its forward does.
        return model_class_of(transformer) is self.model_class

    def __deepcopy__(self, memo: dict) -> FluxAdapter:
        return self  # the registered adapter is stateless: a copied model's state refers to the same one

    def enable(self, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> None:
        """Swap every attention processor; at P > 1 also wrap forward to split and gather tokens.

        Raises:
            ValueError: already enabled, or ``ulysses_degree`` above the model's head count.
            NotImplementedError: a processor other than diffusers' ``FluxAttnProcessor``.
        """
        if getattr(transformer, self._ATTR, None) is not None:
            raise ValueError(f"usp_dit is already enabled on this {type(transformer).__name__}")
        # Every block (double and single) has num_attention_heads heads, K/V included (no GQA).
        check_ulysses_degree(transformer.config.num_attention_heads, mesh, type(transformer).__name__)
        processors = transformer.attn_processors
        for name, proc in processors.items():
            if type(proc) is not FluxAttnProcessor:
                raise NotImplementedError(
                    f"usp_dit's Flux adapter replaces FluxAttnProcessor only; {name} has {type(proc).__name__}"
                )
        state = FluxCallState(mesh, backend)
        patch = _FluxPatch(processors=dict(processors), forward_attr=saved_instance_attr(transformer, "forward"))
        transformer.set_attn_processor(USPFluxAttnProcessor(state))
        if mesh.sequence_degree > 1:
            transformer.forward = ShardedFluxForward(transformer.forward, state)
            patch.wrapped = True
        setattr(transformer, self._ATTR, patch)

    def disable(self, transformer: torch.nn.Module) -> None:
        """Put back the original processor objects and forward."""
        patch = transformer.__dict__.pop(self._ATTR, None)
        if patch is None:
            return
        if patch.wrapped:
            restore_instance_attr(transformer, "forward", patch.forward_attr)
        transformer.set_attn_processor(dict(patch.processors))


register_adapter(FluxAdapter())
