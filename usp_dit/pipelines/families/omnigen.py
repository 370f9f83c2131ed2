"""OmniGen adapter: ``OmniGenTransformer2DModel`` (``OmniGenPipeline``) on a USP grid.

Layout: latents (batch, channels, height, width), 2x2 patches row-major: N = (height / 2) *
(width / 2) output image tokens; the model's sequence (batch, L, hidden), L = P + N, is
``[condition (T); time token (1); output image (N)]``: the prefix of P = T + 1 tokens holds the
prompt's text tokens, left-padded to the batch's longest, with the tokens of any input image spliced
in; ``attention_mask`` (batch, L, L) 0/1 (the stock forward makes it additive, (batch, 1, L, L):
0 = attend, ``finfo.min`` = masked); ``position_ids`` (batch, L); the RoPE table ``rope(...)`` is
``(cos, sin)``, each (L, head_dim) (Phi-3's su-scaled RoPE, from the *first* element's positions:
stock uses row 0 for the whole batch); Q/K/V inside the processor (batch, heads, L_local, head_dim).

Note [OmniGen's sequence]
    OmniGen is a Phi-3 decoder over ``[condition; time; image]`` with the collator's mask: the
    condition and time tokens attend causally among themselves (bidirectionally within an input
    image's tokens) and never to the output image; the output image's tokens attend to every valid
    prefix token and to each other; left padding is masked as a key. So the prefix is computed
    without the image (like an LLM prompt), and only the image tokens see everything. Each rank
    holds ``[the whole prefix; its shard of the N image tokens]``:

        layers.0 pre-hook: (B, P + N) -> (B, P + N_local): the prefix replicated, the image cut
        rope hook:         (L, D) rows -> [prefix rows; this rank's image rows]
        attention (the stock processor's code, its F.scaled_dot_product_attention routed):
            prefix queries   over prefix keys, the stock mask's prefix block: local, no communication
            image queries    over [valid prefix keys; every image key]: ``_routing.joint_attention``
                             with the prefix as replicated joint K/V (queries of zeros, outputs
                             dropped: as ``nucleus_moe`` Note [image queries over text keys]), the
                             prefix key mask read off the last image row, per element
        norm hook:         (B, P + N_local) -> (B, N_local): the stock forward's ``[:, -N:]`` then
                           keeps all of it (a slice longer than the tensor)
        proj_out hook:     gather (B, N_local, p*p*C) -> (B, N, p*p*C)

    Exact where the mask has that structure, which the layer-0 hook checks on every call
    (``require``: also under torch.compile): every image row attends every image key and the same
    prefix keys (the "live" prefix); a live prefix row attends no image key and no dead prefix key.
    Dead rows (the left padding: the collator lets them attend everything) are keys of no live row
    and the output reads only the image rows, so their values are never read; here they attend the
    prefix only. Anything else (no mask, a mask letting the prompt see the image, padded output
    images of a batch of mixed sizes) is refused by name.
    Cost: the prefix's per-token work is replicated on every rank (text-to-image: the instruction
    template and the prompt, tens to a few hundred tokens beside 64 x 64 = 4096 image tokens at
    1024 x 1024; an edit's input images add their own tokens to it), and the zero queries add P
    rows to the image attention (split over the ring ranks).

CFG: ``OmniGenPipeline`` batches ``[cond, uncond]`` (``[cond, uncond, image-cond]`` with input
images) in one call; ``cfg_degree=2`` splits hidden states, timestep, ``input_ids`` and the mask.
``position_ids`` stays whole: the stock RoPE reads the first element's positions for every element,
so each cfg group must see the first element's too. With input images, ``input_img_latents`` (a
list over images) and ``input_image_sizes`` (a dict keyed by batch row) cannot be split: a call
with input images whose batch is split over the cfg groups is refused (a cfg mesh that runs the
whole batch on each group, as data-parallel replicas, runs it).

Refused (NotImplementedError): at enable, processors other than the stock
``OmniGenAttnProcessor2_0`` (custom, LoRA-replaced, Diffusers' context parallelism), attention
modules the plan does not name, no layers; at the call, a processor replaced after enable, a
mask not of the structure above, input images in a batch split over the cfg groups. OmniGen has
no Diffusers cache support and no dropout. Tensor parallelism is refused (no ``TensorPlan``). The
stock model does not compile in one graph (its RoPE branches on ``max(position_ids)``), so neither
does the enabled one.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import OmniGenTransformer2DModel
from diffusers.models.transformers.transformer_omnigen import OmniGenAttnProcessor2_0
from torch.utils.hooks import RemovableHandle

from usp_dit.distributed.mesh import USPMesh
from usp_dit.pipelines._checks import require
from usp_dit.pipelines._routing import joint_attention, with_global
from usp_dit.pipelines._token_sharding import ShardState, TokenShardHooks, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter, PlanPatch, check_plan
from usp_dit.sharding.shard import gather_sequence, layout_sizes, shard_sequence

_ROUTED_GLOBAL = "F"  # OmniGenAttnProcessor2_0 calls F.scaled_dot_product_attention (torch.nn.functional as F)
_MASK_POS = 1  # OmniGenBlock.forward(hidden_states, attention_mask, image_rotary_emb): positional under checkpointing


def _attend(mask: torch.Tensor) -> torch.Tensor:
    """(B, 1, L, L) bool, True = attend, of a bool or additive (0 / very negative) float mask."""
    if mask.dtype == torch.bool:
        return mask
    return mask == 0


def _prefix_len(mask: torch.Tensor, state: ShardState) -> int:
    """P, the tokens before the N = ``state.seq_len`` image tokens in the (B, 1, L, L) mask."""
    return mask.shape[-1] - state.seq_len


def check_mask(mask: torch.Tensor | None, state: ShardState) -> None:
    """Note [OmniGen's sequence]: NotImplementedError unless the additive (B, 1, L, L) mask lets the
    prefix be computed without the image tokens (checked once a call, at layer 0)."""
    if mask is None:
        raise NotImplementedError("usp_dit's OmniGen adapter needs the attention mask (without one every condition "
                                  "token attends the output image, which a shard of the image cannot serve)")
    if mask.dim() != 4 or mask.shape[1] != 1 or mask.shape[2] != mask.shape[3]:
        raise NotImplementedError(f"usp_dit's OmniGen adapter takes a (batch, L, L) attention_mask; got "
                                  f"{tuple(mask.shape)} after the stock forward's conversion")
    if mask.dtype != torch.bool:
        require(((mask == 0) | (mask <= torch.finfo(mask.dtype).min / 2)).all(),
                "usp_dit's OmniGen adapter takes a 0/1 attention_mask (soft additive values are not a mask)")
    prefix = _prefix_len(mask, state)
    if prefix < 1:
        raise ValueError(f"attention_mask covers {mask.shape[-1]} tokens, not the {state.seq_len} image tokens "
                         f"after a condition and the time token")
    m = _attend(mask)[:, 0]  # (B, L, L)
    image_rows, live = m[:, prefix:], m[:, -1, :prefix]
    require(image_rows[:, :, prefix:].all(), "usp_dit's OmniGen adapter: an output image token does not attend "
            "every output image token (padded output images: a batch of mixed sizes); refused")
    require((image_rows[:, :, :prefix] == live[:, None]).all(), "usp_dit's OmniGen adapter: the output image "
            "tokens attend different condition tokens; refused")
    prefix_rows = m[:, :prefix] & live[:, :, None]  # the rows of live prefix tokens
    require(~prefix_rows[:, :, prefix:].any(), "usp_dit's OmniGen adapter: a condition token attends the output "
            "image (the prefix must not see the image to be computed on every rank alone); refused")
    require(~(prefix_rows[:, :, :prefix] & ~live[:, None]).any(), "usp_dit's OmniGen adapter: a condition token "
            "attends a token that the image does not (a padded key); refused")


class _SplitFunctional:
    """Stands in for ``torch.nn.functional`` in the stock processor's code: its one
    ``scaled_dot_product_attention`` call runs as Note [OmniGen's sequence] says; every other name is torch's."""

    def __init__(self, state: ShardState) -> None:
        self.state = state

    def scaled_dot_product_attention(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
    ) -> torch.Tensor:
        """(B, H, P + N_local, D) in and out: the prefix's rows, then this rank's image rows."""
        if attn_mask is None or dropout_p or is_causal or enable_gqa:
            raise NotImplementedError(
                f"usp_dit's OmniGen attention takes the stock call (a mask, no dropout, not is_causal, no GQA flag), "
                f"got attn_mask={'None' if attn_mask is None else 'given'}, dropout_p={dropout_p}, "
                f"is_causal={is_causal}, enable_gqa={enable_gqa}")
        prefix = _prefix_len(attn_mask, self.state)
        pre = slice(0, prefix)
        out_prefix = F.scaled_dot_product_attention(query[:, :, pre], key[:, :, pre], value[:, :, pre],
                                                    attn_mask=attn_mask[:, :, pre, pre], scale=scale)
        q, k, v = (t[:, :, prefix:].transpose(1, 2) for t in (query, key, value))  # (B, N_local, H, D)
        text_k, text_v = (t[:, :, pre].transpose(1, 2) for t in (key, value))  # (B, P, H, D)
        text_q = q.new_zeros(q.shape[0], prefix, *q.shape[2:])  # outputs dropped: keys and values only
        valid = _attend(attn_mask)[:, 0, -1, pre]  # (B, P): the prefix keys of the image rows
        if not torch.compiler.is_compiling() and bool(valid.all()):
            valid = None
        out_image, _ = joint_attention(q, k, v, text_q, text_k, text_v, valid, self.state, scale)
        return torch.cat([out_prefix, out_image.transpose(1, 2)], dim=2)

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.nn.functional, name)


def _routed_call(state: ShardState | None) -> Any:
    """``OmniGenAttnProcessor2_0.__call__``'s code with ``F`` bound to ``_SplitFunctional(state)``."""
    return with_global(OmniGenAttnProcessor2_0.__call__, _ROUTED_GLOBAL, _SplitFunctional(state))


class USPOmniGenAttnProcessor:
    """OmniGen attention of ``[the prefix; this rank's image shard]`` (Note [OmniGen's sequence]).

    Inputs as ``Attention.forward`` passes them: ``hidden_states`` = ``encoder_hidden_states``
    (B, P + N_local, C) (normed); ``attention_mask`` (B, 1, P + N, P + N) additive, whole;
    ``image_rotary_emb`` ``(cos, sin)`` (P + N_local, D), cut by ``OmniGenSeams``. Returns (B, P + N_local, C).
    """

    def __init__(self, state: ShardState) -> None:
        self.state = state
        self._call = _routed_call(state)

    def __deepcopy__(self, memo: dict) -> USPOmniGenAttnProcessor:
        # Rebuild the routed function around the copied state (sd3 Note [SD3's attention call]).
        clone = type(self)(copy.deepcopy(self.state, memo))
        memo[id(self)] = clone
        return clone

    def __call__(
        self, attn: torch.nn.Module, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None, image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return self._call(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


def _local_image_len(state: ShardState) -> int:
    return layout_sizes(state.seq_len, state.mesh, state.layout)[state.mesh.seq_rank]


class OmniGenSeams:
    """Note [OmniGen's sequence]: the cuts and the gather, in place of the plan's ``TokenShardHooks``."""

    def __init__(self, transformer: OmniGenTransformer2DModel, state: ShardState) -> None:
        self.transformer, self.state = transformer, state
        self.image_call_batch: int | None = None  # the batch of this call, when it has input images
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        model = self.transformer
        self.handles += [
            model.register_forward_pre_hook(self._check_call, with_kwargs=True),
            model.patch_embedding.register_forward_hook(self._count_image),
            model.rope.register_forward_hook(self._cut_table),
            model.layers[0].register_forward_pre_hook(self._cut_tokens, with_kwargs=True),
            model.norm.register_forward_hook(self._drop_prefix),
            model.proj_out.register_forward_hook(self._gather_image),
        ]

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _check_call(self, module, args: tuple, kwargs: dict) -> None:
        """Records the batch of a call with input images, as the caller passes it (before any cfg split)."""
        sizes = kwargs.get("input_image_sizes", args[4] if len(args) > 4 else None)
        ids = kwargs.get("input_ids", args[2] if len(args) > 2 else None)
        self.image_call_batch = ids.shape[0] if sizes and torch.is_tensor(ids) else None

    def _count_image(self, module, args: tuple, out: Any) -> None:
        """The output image's patch tokens (a tensor; input images come as a list): N = ``seq_len``.

        Raises:
            NotImplementedError: a call with input images whose batch was split (cfg parallel):
                their list and dict cannot follow it (module docstring).
        """
        if not torch.is_tensor(out):
            return
        if self.image_call_batch is not None and out.shape[0] != self.image_call_batch:
            raise NotImplementedError(
                "usp_dit's OmniGen adapter: input images with cfg_degree > 1: input_img_latents (a list over images) "
                "and input_image_sizes (a dict keyed by batch row) cannot be split over the cfg groups; use cfg_degree=1")
        self.state.seq_len = out.shape[1]
        self.state.text_len = None  # no dropout in this family (nothing reads it)

    def _split(self, t: torch.Tensor, dim: int, name: str) -> torch.Tensor:
        """[prefix; image] along ``dim`` -> [prefix; this rank's image rows].

        Raises:
            ValueError: ``t`` has no more rows than the call's N image tokens.
        """
        image = self.state.seq_len
        if image is None or t.shape[dim] <= image:
            raise ValueError(f"{name} has {t.shape[dim]} rows, not the call's {image} image tokens after a prefix")
        prefix = t.shape[dim] - image
        local = shard_sequence(t.narrow(dim, prefix, image), self.state.mesh, dim=dim, layout=self.state.layout)
        return torch.cat([t.narrow(dim, 0, prefix), local], dim=dim)

    def _cut_table(self, module, args: tuple, table: tuple) -> tuple:
        return tuple(self._split(t, 0, "the RoPE table (rope's output)") for t in table)

    def _cut_tokens(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        check_mask(_get_arg(args, kwargs, "attention_mask", _MASK_POS), self.state)
        hidden = _get_arg(args, kwargs, "hidden_states", 0)
        return _set_arg(args, kwargs, "hidden_states", 0, self._split(hidden, 1, "hidden_states"))

    def _drop_prefix(self, module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        """(B, P + N_local, C) -> (B, N_local, C): the stock forward's ``[:, -N:]`` keeps it whole."""
        return out[:, out.shape[1] - _local_image_len(self.state):]

    def _gather_image(self, module, args: tuple, out: torch.Tensor) -> torch.Tensor:
        return gather_sequence(out, self.state.mesh, dim=1, seq_len=self.state.seq_len, layout=self.state.layout)


class OmniGenPlanPatch(PlanPatch):
    """``PlanPatch`` with ``OmniGenSeams`` in place of the plan's ``TokenShardHooks``."""

    def __init__(self, plan: ModelPlan, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> None:
        super().__init__(plan, transformer, mesh, backend)
        tokens = [i for i, part in enumerate(self.parts) if isinstance(part, TokenShardHooks)]
        assert len(tokens) == 1, "PlanPatch installs one TokenShardHooks"
        self.parts[tokens[0]] = OmniGenSeams(transformer, self.state)


class OmniGenPlanAdapter(PlanAdapter):
    def make_patch(self, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> OmniGenPlanPatch:
        check_plan(self.plan, transformer)
        return OmniGenPlanPatch(self.plan, transformer, mesh, backend)


def _routed_call_missing(transformer: OmniGenTransformer2DModel) -> str | None:
    if _routed_call(None) is None:
        return (f"this diffusers' OmniGenAttnProcessor2_0 does not call {_ROUTED_GLOBAL}.scaled_dot_product_attention, "
                f"the call usp_dit routes")
    return None


PLAN = ModelPlan(
    name="OmniGen",
    model_class=OmniGenTransformer2DModel,
    split_at="layers.0",  # documents the seams; OmniGenSeams does the cutting (Note [OmniGen's sequence])
    gather_at="proj_out",
    attention=(Parallel("layers.*.self_attn", USPOmniGenAttnProcessor, stock=(OmniGenAttnProcessor2_0,)),),
    block_lists=("layers",),
    # OmniGenPipeline batches [cond, uncond(, image-cond)] in one call. position_ids stays whole (the
    # stock RoPE reads row 0 for every element).
    cfg_batch_args=("hidden_states", "timestep", "input_ids", "attention_mask"),
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(OmniGenPlanAdapter(PLAN, __name__))
