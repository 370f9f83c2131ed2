"""Bria FIBO 2.0 adapter: ``BriaFibo2Transformer2DModel`` (``BriaFibo2Pipeline``: text-to-image and
editing) on a USP grid.

Layout: the forward takes latents ``hidden_states`` (B, C, H, W) and patchifies them itself
(p x p patches, row-major: N = H/p * W/p image tokens); ``context_latents`` (edit): a list of
(B, C, h_k, w_k) latents, patchified the same way (N_c tokens in all); the stream of the
refiners is ``[image; context]`` (B, S = N + N_c, dim); ``encoder_hidden_states``
(B, 1 + injections, T, cap_feat_dim), the Qwen3-VL bundles, with ``encoder_attention_mask``
(B, T) bool when a prompt is padded; the G gist tokens (B, G, dim) the Perceiver makes of bundle 0;
the main stream ``[gist; image; context]`` (or ``[image; context; gist]`` with the key mask
(B, S + G) when the prompts' gist counts differ); RoPE tables ``freqs_cis`` (1, tokens, head_dim / 2)
complex, built by a plain (non-module) ``RopeEmbedder``; ``noise_mask`` (B, tokens) long, 1 on
the image tokens (per-token modulation: noisy vs clean); Q/K/V (B, seq, heads, head_dim).

FIBO 2.0 is not FIBO's (Flux-like) architecture but Z-Image's single stream
(``usp_dit.pipelines.families.zimage``) with a Perceiver over the prompt and gated
cross-attention injection blocks, so none of ``bria``'s FIBO machinery (the joint text split, the
key-flag coordinate) applies: its text is replicated. What each rank runs (Note [FIBO 2.0's streams]):

    latents ─► x_embedder ─► [shard S = image; context] ─► noise_refiner (self-attention, no text)
    prompt bundles ─► Perceiver (gists: replicated, local) ─┐
    main layers over [gist; shard] or [shard; gist] ◄───────┘ (+ injection cross-attention: local)
    ─► final_layer on this rank's image rows ─► gather the image rows ─► unpatchify

Note [FIBO 2.0's streams]
    * The tokens are cut at ``x_embedder``'s output, ``[image; context]`` as one sequence of S
      tokens (``split_sizes(S, P)``: contiguous pieces). Every block's ``freqs_cis`` (built whole
      by the forward) is cut to the same rows by a pre-hook on the block (``Fibo2TokenHooks``).
      Its ``noise_mask`` the forward builds over the rows the rank holds, marking the first N
      after the gists noisy as if the piece began the sequence: the pre-hook gives the piece's own
      flags (1 where a row is one of the N image tokens, 0 for an edit token or a gist).
    * ``noise_refiner`` attends over ``[image; context]`` alone: a routed call with no text.
    * The Perceiver (gists from the prompt) runs whole on every rank (``Local``): it reads no image.
    * Main layers: the forward concatenates the whole gist with this rank's piece, so a rank holds
      ``[gist; piece]`` (text first, unmasked) or, when the batch pads gists, ``[piece; gist]`` with the
      (B, S + G) key mask over the whole sequence (text last, masked per element). The routed
      processor picks the layout from the mask's presence, as the forward does
      (``USPBriaFibo2AttnProcessor``); padded gist query rows get zeros where stock attends them:
      they are masked as keys in every layer and never reach the output (``_routing`` Note [masked
      text tokens]). The injection blocks' cross-attention reads replicated text: local.
    * The forward hands ``final_layer`` the rows ``[image_start, image_start + N)`` of its local
      stream: this rank's piece from its start. The piece's image rows come first (image precedes
      context in S), so a pre-hook keeps its first k_r rows, k_r = |[lo_r, hi_r) ∩ [0, N)|, and the
      output's k_r rows are all-gathered into the N image rows ``unpatchify`` reads.

Text: replicated. The gists (256 to 512 at the released config, from the prompt's length) beside
4096 image tokens at 1024 x 1024: per rank 4096 / P + G (P = 8: 512 + up to 512). Splitting them
with the image would split a sequence whose padding (the gist mask) differs per element.

CFG: ``BriaFibo2Pipeline`` calls the transformer twice a step (prompt, then negative prompt, each
padded to its own length); ``cfg_degree=2`` runs the two calls on the two cfg groups at once
(``cfg_branch_args``; ``usp_dit.pipelines.cfg_pair``). The edit images' latents condition both calls.

Refused (NotImplementedError): processors other than the stock ``BriaFibo2AttnProcessor``
(custom, LoRA-replaced, Diffusers' context parallelism), attention modules the plan does not name,
an unsupported Diffusers cache, a mask over image tokens (the model builds none; ``_routing``
refuses one). Tensor parallelism: refused (no ``TensorPlan``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from diffusers import BriaFibo2Transformer2DModel
from diffusers.models.transformers.transformer_bria_fibo2 import BriaFibo2AttnProcessor

from usp_dit.distributed.comm import all_gather_uneven
from usp_dit.distributed.mesh import USPMesh
from usp_dit.pipelines._routing import ROUTED_NAME, Route, RoutedProcessor, routed_processor_class
from usp_dit.pipelines._token_sharding import TokenShardHooks, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, PlanPatch, check_plan
from usp_dit.sharding.partition import offsets
from usp_dit.sharding.shard import layout_sizes

# BriaFibo2TransformerBlock.forward(x, attn_mask, freqs_cis, adaln_input, noise_mask, ...): the
# positions gradient checkpointing passes them at.
_MASK_POS, _FREQS_POS, _NOISE_POS = 1, 2, 4

_RoutedFibo2Processor = routed_processor_class(BriaFibo2AttnProcessor, "_RoutedFibo2Processor")


class USPBriaFibo2AttnProcessor(_RoutedFibo2Processor or RoutedProcessor):
    """FIBO 2.0 self-attention, its ``dispatch_attention_fn`` call routed to ``usp_attention``.

    ``noise_refiner``: this rank's piece (B, L, dim), no text (the plan's ``text="none"``). Main
    layers: ``[gist; piece]`` (B, G + L, dim) without a mask, or ``[piece; gist]`` with the
    (B, S + G) key mask; ``freqs_cis`` (1, same rows, head_dim / 2) cut by ``Fibo2TokenHooks``.
    Returns the rows it was given.
    """

    def __init__(self, route: Route, stock: Any = None) -> None:
        super().__init__(route, stock)
        # Note [FIBO 2.0's streams]: the forward puts the gists last exactly when it builds a mask.
        self._layouts = {"none": route} if route.text == "none" else {
            "first": Route(route.state, "first"), "last": Route(route.state, "last")}

    def __call__(
        self, attn: Any, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, freqs_cis: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None:
            raise NotImplementedError("usp_dit's BriaFibo2 parallel sites run self-attention only")
        if "none" not in self._layouts:
            self._parallel_config = self._layouts["first" if attention_mask is None else "last"]
        return super().__call__(attn, hidden_states, None, attention_mask, freqs_cis)


@dataclass(frozen=True)
class Fibo2Split:
    """One call's pieces: this rank's rows [lo, hi) of S = [image; context], every rank's image rows."""

    lo: int
    hi: int
    image_sizes: tuple[int, ...]


def fibo2_split(num_tokens: int, num_image: int, mesh: USPMesh, layout: str) -> Fibo2Split:
    """Note [FIBO 2.0's streams]: the contiguous pieces of ``num_tokens`` and each piece's image rows."""
    sizes = layout_sizes(num_tokens, mesh, layout)
    starts = offsets(sizes)
    image = tuple(max(0, min(lo + n, num_image) - min(lo, num_image)) for lo, n in zip(starts, sizes))
    rank = mesh.seq_rank
    return Fibo2Split(starts[rank], starts[rank] + sizes[rank], image)


class Fibo2TokenHooks(TokenShardHooks):
    """Note [FIBO 2.0's streams]: ``TokenShardHooks`` cutting at ``x_embedder``'s output, plus the
    blocks' tables and noise masks cut, the final layer's image rows kept and gathered."""

    def __init__(self, transformer: BriaFibo2Transformer2DModel, base: TokenShardHooks) -> None:
        super().__init__(base.state, transformer.x_embedder, transformer.final_layer, at="output")
        self.transformer = transformer
        self.num_image: int | None = None

    def install(self) -> None:
        model = self.transformer
        self.handles.append(model.register_forward_pre_hook(self._record_image, with_kwargs=True))
        super().install()  # the shard at x_embedder's output, the gather (overridden) at final_layer's
        for block in model.noise_refiner:
            self.handles.append(block.register_forward_pre_hook(self._cut_refiner, with_kwargs=True))
        for block in model.layers:
            self.handles.append(block.register_forward_pre_hook(self._cut_layer, with_kwargs=True))
        self.handles.append(model.final_layer.register_forward_pre_hook(self._keep_image))

    def split(self) -> Fibo2Split:
        return fibo2_split(self.state.seq_len, self.num_image, self.state.mesh, self.state.layout)

    def _record_image(self, module: BriaFibo2Transformer2DModel, args: tuple, kwargs: dict) -> None:
        latents = _get_arg(args, kwargs, "hidden_states", 0)
        patch = module.config.patch_size
        self.num_image = (latents.shape[2] // patch) * (latents.shape[3] // patch)

    def _rows(self, x: torch.Tensor, lo: int) -> torch.Tensor:
        """Rows [lo + piece) of ``x`` (dim 1): this rank's piece of the S tokens starting at ``lo``."""
        split = self.split()
        return x.narrow(1, lo + split.lo, split.hi - split.lo)

    def _image_flags(self, like: torch.Tensor) -> torch.Tensor:
        """(B, L) long: 1 where this rank's piece holds an image token (noisy), 0 an edit token (clean)."""
        split = self.split()
        flags = torch.arange(split.lo, split.hi, device=like.device) < self.num_image
        return flags.to(like.dtype).expand(like.shape[0], -1)

    def _cut_refiner(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A refiner block's (1, S, D/2) table -> this rank's rows; its noise mask (B, L), which the
        forward builds over the rows it holds as if they began the sequence, -> the piece's own flags."""
        freqs = _get_arg(args, kwargs, "freqs_cis", _FREQS_POS)
        if freqs.shape[1] != self.state.seq_len:
            raise ValueError(f"a noise_refiner block got a RoPE table of {freqs.shape[1]} rows for "
                             f"{self.state.seq_len} tokens: they must match for the table to be cut like the tokens")
        args, kwargs = _set_arg(args, kwargs, "freqs_cis", _FREQS_POS, self._rows(freqs, 0))
        noise = _get_arg(args, kwargs, "noise_mask", _NOISE_POS)
        if noise is not None:  # edit images given (else every token is an image token)
            args, kwargs = _set_arg(args, kwargs, "noise_mask", _NOISE_POS, self._image_flags(noise))
        return args, kwargs

    def _cut_layer(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """A main layer's table over ``[gist; S]`` (no mask) or ``[S; gist]`` (a mask) -> ``[gist;
        piece]`` or ``[piece; gist]``, the rows its ``x`` holds; its noise mask (built by the forward
        over those rows, but marking the first N rows after the gists noisy) -> the pieces' own flags."""
        freqs = _get_arg(args, kwargs, "freqs_cis", _FREQS_POS)
        noise = _get_arg(args, kwargs, "noise_mask", _NOISE_POS)
        num_tokens = self.state.seq_len
        gists = freqs.shape[1] - num_tokens
        if gists < 0 or noise.shape[1] != gists + self.split().hi - self.split().lo:
            raise ValueError(f"a main layer got a RoPE table of {freqs.shape[1]} rows and a noise mask of "
                             f"{noise.shape[1]} for {num_tokens} tokens: not [gists; tokens] and [gists; this piece]")
        gist_first = _get_arg(args, kwargs, "attn_mask", _MASK_POS) is None
        flags, clean = self._image_flags(noise), noise.new_zeros(noise.shape[0], gists)
        if gist_first:
            freqs = torch.cat([freqs[:, :gists], self._rows(freqs, gists)], dim=1)
            noise = torch.cat([clean, flags], dim=1)
        else:
            freqs = torch.cat([self._rows(freqs, 0), freqs[:, num_tokens:]], dim=1)
            noise = torch.cat([flags, clean], dim=1)
        args, kwargs = _set_arg(args, kwargs, "freqs_cis", _FREQS_POS, freqs)
        return _set_arg(args, kwargs, "noise_mask", _NOISE_POS, noise)

    def _keep_image(self, module, args: tuple) -> tuple:
        """The final layer's input (B, >= k_r, dim), this rank's piece from its start -> its k_r image rows."""
        return (args[0][:, :self.split().image_sizes[self.state.mesh.seq_rank]],) + args[1:]

    def _gather_output(self, module, args: tuple, out_local: torch.Tensor) -> torch.Tensor:
        """(B, k_r, C_out) -> (B, N, C_out) on every rank of the sequence group."""
        return all_gather_uneven(out_local, list(self.split().image_sizes), 1, self.state.mesh.seq_group)


class Fibo2PlanPatch(PlanPatch):
    """``PlanPatch`` with its ``TokenShardHooks`` replaced by ``Fibo2TokenHooks``."""

    def __init__(self, plan: ModelPlan, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> None:
        super().__init__(plan, transformer, mesh, backend)
        tokens = [i for i, part in enumerate(self.parts) if type(part) is TokenShardHooks]
        assert len(tokens) == 1, "PlanPatch installs one TokenShardHooks"
        self.parts[tokens[0]] = Fibo2TokenHooks(transformer, self.parts[tokens[0]])


class Fibo2PlanAdapter(PlanAdapter):
    """The FIBO 2.0 plan's adapter (Note [FIBO 2.0's streams])."""

    def make_patch(self, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> Fibo2PlanPatch:
        check_plan(self.plan, transformer)
        return Fibo2PlanPatch(self.plan, transformer, mesh, backend)


def _routed_call_missing(transformer: BriaFibo2Transformer2DModel) -> str | None:
    if _RoutedFibo2Processor is None:
        return f"this diffusers' BriaFibo2AttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="BriaFibo2",
    model_class=BriaFibo2Transformer2DModel,
    split_at="x_embedder",  # its output: [image; context] tokens (Fibo2TokenHooks)
    split="output",
    gather_at="final_layer",  # this rank's image rows (Fibo2TokenHooks)
    attention=(
        Parallel("noise_refiner.*.attention", USPBriaFibo2AttnProcessor, stock=(BriaFibo2AttnProcessor,)),
        # [gist; piece] or [piece; gist]: the processor picks the layout per call
        Parallel("layers.*.attention", USPBriaFibo2AttnProcessor, stock=(BriaFibo2AttnProcessor,), text="first"),
        Local("layers.*.cross_attention", stock=(BriaFibo2AttnProcessor,)),  # to the replicated prompt
        Local("perceiver.layers.*", stock=(BriaFibo2AttnProcessor,)),  # gists and prompt: replicated
    ),
    block_lists=("noise_refiner", "layers"),
    # A batch in one call (guidance off) split over "cfg"; the edit latents a list of (B, C, h, w).
    cfg_batch_args=("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask", "context_latents"),
    # BriaFibo2Pipeline's two calls a step differ in the prompt (and its padding).
    cfg_branch_args=("encoder_hidden_states", "encoder_attention_mask"),
    refuse=(_routed_call_missing,),
    heads=lambda model: model.config.n_heads,
)

ADAPTER = register_adapter(Fibo2PlanAdapter(PLAN, __name__))
