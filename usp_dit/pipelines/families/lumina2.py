"""Lumina-Image 2.0 adapter: ``Lumina2Transformer2DModel`` (Lumina-Image-2.0, 2.6B) on a USP grid.

Layout: latents (batch, channels, height, width); image tokens (batch, S, channels),
``S = (height / p) * (width / p)``, row-major; caption tokens (batch, T_cap, channels) with the mask
``encoder_attention_mask`` (batch, T_cap), 1 for a real token; Q (batch, seq, heads, head_dim), K/V
(batch, seq, kv_heads, head_dim) (GQA: Lumina-Image 2.0 has 24 query heads, 8 key/value heads); RoPE
tables complex (batch, seq, head_dim / 2), 3-D positions (caption index, row, column).

What the model does (``Lumina2Transformer2DModel.forward``):

    captions ─► context_refiner (2 layers, caption tokens only, caption key mask)
    image    ─► noise_refiner   (2 layers, image tokens only, no mask)
    joint    = per element b: [its c_b valid caption tokens; S image tokens; padding to max_b c_b + S]
             ─► layers (26, joint self-attention, key mask over the padding when the c_b differ)
             ─► norm_out (per token, to p*p*channels) ─► element b's rows c_b .. c_b + S: the image

The image tokens sit at another offset in every element (after that element's caption), so the
joint sequence cannot be cut as it is; and its padding is a mask over the *tail* of the sequence,
which a split would scatter over ranks. Note [Lumina2's joint layout] rearranges it.

Note [Lumina2's joint layout]
    For ``layers``, each rank holds ``[caption; image shard]``: the caption part (B, T, C),
    ``T = max_b c_b``, replicated, element b's c_b tokens first then zero rows; the image part
    (B, S_local, C), this rank's rows of the S image tokens, which every element has at the same
    positions here. ``usp_attention`` takes the caption as joint tokens with a key mask of each
    element's c_b valid ones (``_routing`` Note [masked text tokens]). Element b attends over
    exactly stock's keys: its valid caption tokens and the image tokens (stock's padding is masked
    there, and absent here). Every op of a layer but attention is per token or per element, so
    the row order does not matter. The RoPE table of the joint sequence (``rope_embedder``'s
    ``freqs_cis``, (B, L, D/2)) is rearranged the same way, once per forward, and every layer
    gets it with the new mask (a pre-hook on each layer: the forward hands every layer the stock
    table and mask). Padded caption rows (zeros, rotated by zeros) are keys of no query, and as
    queries their rows are never read: the model keeps only element b's image rows. At
    ``norm_out``'s output (its width p*p*channels is the model's smallest) the image rows are
    gathered and the stock layout (B, L, p*p*channels) rebuilt (caption rows in place, padding
    rows zero: stock's padding rows hold values nobody reads), so the stock unpatchify runs.

    At sequence degree 1 with every element's caption of the same length (batch 1: one prompt, or
    each call of the pipeline's true CFG) stock's joint sequence already is ``[caption; image]`` with
    no mask: the layout is the identity, and the hooks change nothing (no copies: the tokens, table
    and output are stock's own). Only captions of different lengths are rearranged there, for the
    mask (stock's padding sits at each element's tail, among the image rows, where ``_routing`` takes
    no mask; rearranged, each element attends without a mask over its own keys).

    Per-rank tokens, Lumina-Image 2.0 at 1024 x 1024 (4096 image tokens) with a prompt of up to
    256 Gemma tokens (system prompt included): 512 image + <= 256 caption tokens on 8 ranks.

Where the tokens are split: the caption embedding, context refiner, RoPE and ``x_embedder`` run
whole on every rank (captions are replicated: short, masked, and a stream of their own until the
joint layers). ``noise_refiner.0``'s input is sharded and ``noise_refiner.-1``'s output gathered
(the plan's split and gather): the forward then joins the image to the captions with a per-element
Python loop, which needs every image token; ``layers.0`` takes this rank's rows again (Note
[Lumina2's joint layout]). That costs one all-gather of (B, S, C) per call, beside 26 layers of
attention. The image RoPE of the noise refiner is the plan's ``Table`` (``rope_embedder``'s
``img_freqs``, cut on dim 1).

Note [Lumina2's attention call]
    ``Lumina2AttnProcessor2_0`` calls ``F.scaled_dot_product_attention`` on (B, H, L, D) tensors
    with K/V already repeated from the kv heads to every query head (``n_rep = heads / kv_heads``,
    kv head j is repeated head ``j * n_rep``). As for SD3 (``sd3`` Note [SD3's attention call]) the
    stock ``__call__``'s code runs with ``F`` bound to a namespace of ours; its
    ``scaled_dot_product_attention`` takes every ``n_rep``-th head of K/V back (exact: they are
    copies) and routes the call with the kv heads, so Ulysses moves 8 K/V heads, not 24, and the
    core's GQA splits them (``usp_dit.attention`` handles head counts U does not divide, and fewer
    kv heads than U). At sequence degree 1 nothing moves K/V: the repeated heads go to the kernel as
    stock made them (taking the kv heads back would only make the kernel repeat them again, two
    copies of K/V a layer that stock does not make; the values are the same). The stock code's
    optional ``base_sequence_length`` (a scale from the local length) is never passed by the
    model; a call that passes one is refused.

Refused (NotImplementedError): at enable, processors other than the stock
``Lumina2AttnProcessor2_0`` (LoRA-replaced, custom, Diffusers' context parallelism), attention
modules the plan does not name, an unsupported Diffusers cache, a model without refiner layers or
without layers (the split points); at the call, a processor replaced after enable, and a layer
called with a RoPE table this adapter did not rearrange (a forward this adapter did not see).
``Lumina2Pipeline`` calls the transformer once per guidance branch (true CFG, truncated after
``cfg_trunc_ratio`` of the steps: those steps make one call): with ``cfg_degree=2`` a step's two
calls run on the two cfg groups at once (``cfg_branch_args``). Lumina2 configs have no dropout.
Not under ``torch.compile(fullgraph=True)``: the stock forward reads the caption lengths with
``.tolist()`` (a graph break, stock too).
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional
from diffusers import Lumina2Transformer2DModel
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_lumina2 import Lumina2AttnProcessor2_0
from torch.utils.hooks import RemovableHandle

from usp_dit.pipelines._routing import Route, route_sdpa, with_global
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, Table
from usp_dit.sharding.shard import gather_sequence, shard_sequence

_ROUTED_GLOBAL = "F"  # Lumina2AttnProcessor2_0 calls F.scaled_dot_product_attention
_KEPT = 4  # rearranged RoPE tables kept (gradient checkpointing recomputes a layer with its forward's table)


class _RoutedFunctional:
    """Stands in for ``torch.nn.functional`` in the stock processor's code (Note [Lumina2's attention
    call]): ``scaled_dot_product_attention`` is routed with the kv heads, every other name is torch's."""

    def __init__(self, route: Route) -> None:
        self.route = route
        self.n_rep = 1  # query heads per kv head of the call in progress (set by the processor)

    def use_heads_of(self, attn: Attention) -> None:
        """Take ``attn``'s query heads per kv head (GQA) for the calls that follow."""
        head_dim = attn.to_q.out_features // attn.heads
        n_rep = attn.heads // (attn.to_k.out_features // head_dim)
        if self.n_rep != n_rep:  # every layer of a model has the same: set once
            self.n_rep = n_rep

    def scaled_dot_product_attention(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
    ) -> torch.Tensor:
        """(B, H, L, D) in and out; K/V repeated to H heads (every ``n_rep``-th is a kv head)."""
        k, v = key, value  # sequence degree 1: no K/V moves, and the kernel takes stock's heads as they are
        if self.route.state.mesh.sequence_degree > 1:
            k, v = key[:, :: self.n_rep], value[:, :: self.n_rep]  # (B, H_kv, L, D): the copies dropped
        return route_sdpa(query, k, v, attn_mask, dropout_p, is_causal, scale, self.route)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.nn.functional, name)


class USPLumina2AttnProcessor:
    """Lumina2 self-attention of this rank's image shard (``noise_refiner``, text "none") or of
    ``[caption; image shard]`` (``layers``, text "first", Note [Lumina2's joint layout]).

    Inputs: ``hidden_states`` (B, L_local, C) (``encoder_hidden_states`` the same tensor, as stock
    passes it); ``attention_mask`` (B, L_local) bool or ``None``; ``image_rotary_emb`` (B, L_local,
    D/2) complex, already this rank's rows. Returns (B, L_local, C). The maths is the stock
    processor's own code (Note [Lumina2's attention call]).
    """

    text: str = "none"

    def __init__(self, state: ShardState) -> None:
        self.route = Route(state, self.text)
        self._functional = _RoutedFunctional(self.route)
        self._call = with_global(Lumina2AttnProcessor2_0.__call__, _ROUTED_GLOBAL, self._functional)

    def __deepcopy__(self, memo: dict) -> USPLumina2AttnProcessor:
        clone = type(self)(copy.deepcopy(self.route.state, memo))  # the routed function around the copy
        memo[id(self)] = clone
        return clone

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: torch.Tensor | None = None,
        base_sequence_length: int | None = None,
    ) -> torch.Tensor:
        if base_sequence_length is not None:
            raise NotImplementedError(
                "usp_dit's Lumina2 processor: base_sequence_length scales by the local sequence length; the model "
                "never passes it")
        self._functional.use_heads_of(attn)
        return self._call(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class USPLumina2ImageProcessor(USPLumina2AttnProcessor):
    """``noise_refiner``: self-attention over the image tokens alone."""

    text = "none"


class USPLumina2JointProcessor(USPLumina2AttnProcessor):
    """``layers``: attention over ``[caption; image shard]``, the caption replicated and first."""

    text = "first"


@dataclass(eq=False)
class JointLayout:
    """One forward's Note [Lumina2's joint layout]: ``source`` (B, L, D/2), the stock joint RoPE
    table it was made from; ``rotary`` (B, T + S_local, D/2); ``mask`` (B, T + S_local) bool, or
    ``None`` when every element's caption has T tokens (stock passes no mask then either);
    ``identity``: stock's own layout, nothing rearranged (sequence degree 1, captions of one length)."""

    source: torch.Tensor
    caption_lens: list[int]
    image_len: int
    rotary: torch.Tensor
    mask: torch.Tensor | None
    identity: bool = False  # stock's own layout (Note [Lumina2's joint layout], sequence degree 1)

    @property
    def text_len(self) -> int:
        return max(self.caption_lens)


def _caption_rows(x: torch.Tensor, caption_lens: list[int], text_len: int) -> torch.Tensor:
    """(B, L, ...) joint rows -> (B, T, ...): element b's first c_b rows, then zeros."""
    pad = [0, 0] * (x.dim() - 2)
    return torch.stack([
        torch.nn.functional.pad(x[b, :c], pad + [0, text_len - c]) for b, c in enumerate(caption_lens)])


def _image_rows(x: torch.Tensor, caption_lens: list[int], image_len: int) -> torch.Tensor:
    """(B, L, ...) joint rows -> (B, S, ...): element b's rows c_b .. c_b + S."""
    return torch.stack([x[b, c:c + image_len] for b, c in enumerate(caption_lens)])


class JointLayoutHooks:
    """Note [Lumina2's joint layout]: a plan ``hooks`` factory (installed after the table hooks, so
    ``rope_embedder``'s image table is already cut when this sees its output)."""

    def __init__(self, transformer: Lumina2Transformer2DModel, state: ShardState) -> None:
        self.state = state
        self.rope = transformer.rope_embedder
        self.layers = list(transformer.layers)
        self.norm_out = transformer.norm_out
        self.handles: list[RemovableHandle] = []
        self.kept: list[JointLayout] = []  # the latest forwards' layouts, newest last

    def install(self) -> None:
        self.handles.append(self.rope.register_forward_hook(self._new_layout))
        for i, layer in enumerate(self.layers):
            hook = self._first_layer if i == 0 else self._layer
            self.handles.append(layer.register_forward_pre_hook(hook, with_kwargs=True))
        self.handles.append(self.norm_out.register_forward_hook(self._gather))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.kept.clear()

    def _new_layout(self, module, args: tuple, out: tuple) -> None:
        """``rope_embedder``'s ``(tokens, cap_freqs, img_freqs, freqs_cis (B, L, D/2), cap_lens, seq_lens)``:
        this forward's layout, its RoPE rearranged."""
        source, caption_lens, seq_lens = out[3], list(out[4]), list(out[5])
        image_len = seq_lens[0] - caption_lens[0]
        text_len = max(caption_lens)
        if self.state.mesh.sequence_degree == 1 and min(caption_lens) == text_len:
            self._keep(JointLayout(source, caption_lens, image_len, source, None, identity=True))
            return
        image_rot = shard_sequence(_image_rows(source, caption_lens, image_len), self.state.mesh, dim=1)
        rotary = torch.cat([_caption_rows(source, caption_lens, text_len), image_rot], dim=1)
        mask = None
        if any(c != text_len for c in caption_lens):
            valid = torch.arange(text_len, device=source.device)[None, :] < torch.tensor(
                caption_lens, device=source.device)[:, None]
            mask = torch.cat([valid, valid.new_ones(len(caption_lens), image_rot.shape[1])], dim=1)
        self._keep(JointLayout(source, caption_lens, image_len, rotary, mask))

    def _keep(self, layout: JointLayout) -> None:
        self.kept = [*self.kept[-(_KEPT - 1):], layout]

    def _layout_of(self, rotary: torch.Tensor) -> JointLayout:
        for layout in reversed(self.kept):
            if layout.source is rotary:
                return layout
        raise NotImplementedError(
            "usp_dit's Lumina2 adapter: a layer was called with a RoPE table its rope_embedder did not make in one "
            "of the last forwards (Note [Lumina2's joint layout]); call the model, not its layers")

    def _layer(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """Every layer: the stock mask and table -> this layout's (B, T + S_local) ones."""
        layout = self._layout_of(_get_arg(args, kwargs, "image_rotary_emb", 2))
        if layout.identity:
            return None  # stock's table and mask (None) are the layout's
        args, kwargs = _set_arg(args, kwargs, "attention_mask", 1, layout.mask)
        return _set_arg(args, kwargs, "image_rotary_emb", 2, layout.rotary)

    def _first_layer(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """``layers.0``: also the joint tokens (B, L, C) -> (B, T + S_local, C).

        Raises:
            ValueError: the tokens are not the layout's L = T + S rows.
        """
        layout = self._layout_of(_get_arg(args, kwargs, "image_rotary_emb", 2))
        if layout.identity:
            return None
        x = _get_arg(args, kwargs, "hidden_states", 0)
        if x.shape[1] != layout.text_len + layout.image_len:
            raise ValueError(f"layers.0 got {x.shape[1]} tokens, the layout has {layout.text_len} caption + "
                             f"{layout.image_len} image tokens")
        image = shard_sequence(_image_rows(x, layout.caption_lens, layout.image_len), self.state.mesh, dim=1)
        x_local = torch.cat([_caption_rows(x, layout.caption_lens, layout.text_len), image], dim=1)
        args, kwargs = _set_arg(args, kwargs, "hidden_states", 0, x_local)
        return self._layer(module, args, kwargs)

    def _gather(self, module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        """``norm_out``'s (B, T + S_local, p*p*C) -> the stock layout (B, T + S, p*p*C)."""
        layout = self.kept[-1]
        if layout.identity:
            return None  # already stock's
        text_len, image_len = layout.text_len, layout.image_len
        image = gather_sequence(out[:, text_len:], self.state.mesh, dim=1, seq_len=image_len)
        rows = [torch.cat([out[b, :c], image[b], out.new_zeros(text_len - c, out.shape[2])])
                for b, c in enumerate(layout.caption_lens)]
        return torch.stack(rows)


def _split_points_missing(transformer: Lumina2Transformer2DModel) -> str | None:
    if len(transformer.noise_refiner) == 0 or len(transformer.layers) == 0:
        return (f"num_refiner_layers={len(transformer.noise_refiner)}, num_layers={len(transformer.layers)}: the "
                f"plan splits at noise_refiner.0 and rearranges at layers.0, both must exist")
    if with_global(Lumina2AttnProcessor2_0.__call__, _ROUTED_GLOBAL, None) is None:
        return (f"this diffusers' Lumina2AttnProcessor2_0 does not call {_ROUTED_GLOBAL}.scaled_dot_product_attention, "
                f"the call usp_dit routes")
    return None


PLAN = ModelPlan(
    name="Lumina2",
    model_class=Lumina2Transformer2DModel,
    split_at="noise_refiner.0",
    gather_at="noise_refiner.-1",
    attention=(
        Local("context_refiner.*.attn", stock=(Lumina2AttnProcessor2_0,)),  # captions alone, replicated
        Parallel("noise_refiner.*.attn", USPLumina2ImageProcessor, stock=(Lumina2AttnProcessor2_0,)),
        Parallel("layers.*.attn", USPLumina2JointProcessor, stock=(Lumina2AttnProcessor2_0,), text="first"),
    ),
    block_lists=("context_refiner", "noise_refiner", "layers"),
    # rope_embedder(...)[2]: the image tokens' table (B, S, D/2) of the noise refiner, cut on dim 1.
    tables=(Table("rope_embedder", dim=1, items=(2,)),),
    cfg_batch_args=("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask"),
    # Lumina2Pipeline's true CFG: one call per branch (cfg_pair Note [two calls a step]).
    cfg_branch_args=("encoder_hidden_states", "encoder_attention_mask"),
    hooks=(JointLayoutHooks,),
    refuse=(_split_points_missing,),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
