"""Chroma adapter: ``ChromaTransformer2DModel`` (Chroma1-HD / -Base / -Flash; ``ChromaPipeline``) on a USP grid.

Layout: image tokens (batch, N, channels) in the pipeline's packed order (2x2 latent patches,
row-major); text tokens (batch, T, channels), the T5 prompt padded to ``max_sequence_length``;
position ids (tokens, 3) (Flux.1's (0, h, w) for the image, zeros for the text); the pipeline's
``attention_mask`` (batch, T + N) over the joint sequence ``[text; image]``: 1 for the prompt's
tokens and the first padding token, 0 for the rest of the padding, 1 for every image token;
Q/K/V (batch, seq, heads, head_dim); the RoPE table ``(cos, sin)`` each (T + N, head_dim).

Chroma is Flux.1-schnell's architecture (19 double-stream, 38 single-stream blocks; the modulation
comes from one "approximator" MLP, per sample, not per token) with a T5 prompt that is masked.

Text tokens: **split** together with the image tokens, exactly as Flux.1 and Flux.2
(``usp_dit.pipelines.families.flux`` Note [Flux token split], ``usp_dit.pipelines.families.flux2``): the joint
sequence ``[text; image]`` is cut into ``split_sizes(T + N, P)`` contiguous pieces at the forward's
arguments (``hidden_states`` / ``img_ids``, ``encoder_hidden_states`` / ``txt_ids`` and the mask's
columns), the stock forward runs on the pieces, and the image rows of ``proj_out``'s output are
gathered after it. The 38 single-stream blocks do all their per-token work on ``[text; image]``: at
1024 x 1024 (4096 image + 512 text tokens) a rank holds 4608 / P tokens (576 at P = 8) instead of
4096 / P + 512 replicated (1024 at P = 8). The mask does not argue for replicating: it factorises
per token (Note [Chroma's mask]), so each rank needs only its own tokens' flags.

Note [Chroma's mask]
    The blocks turn the (B, S) mask m into ``m[:, None, None, :] * m[:, None, :, None]`` (B, 1, S, S)
    and hand it to ``dispatch_attention_fn`` as ``attn_mask``. The pipeline's m is *float* (the
    text encoder's dtype; the image ones are concatenated to it), and a float mask is **added** to
    the attention scores: stock adds m_i * m_j, i.e. +1 where query i and key j are both unmasked,
    0 elsewhere; the "masked" padding keys are down-weighted by e^-1 for unmasked queries, not
    removed (padded queries attend uniformly). We keep that exactly. Per query i the bias
    m_i * m_j equals m_i * (m_j - 1) up to the constant m_i, which softmax ignores; and
    m_i * (m_j - 1) is a dot product of one extra coordinate of q and k:

        q'_i = [q_i, m_i, 0 ...]    k'_j = [k_j, (m_j - 1) / scale, 0 ...]    v'_j = [v_j, 0 ...]
        scale * q'_i . k'_j = scale * q_i . k_j + m_i (m_j - 1)

    So each rank extends its own tokens' Q/K/V (head_dim + 8: the extra coordinate, then zeros,
    keeping multiples of 8 for kernels) and attends with the stock scale ``head_dim ** -0.5``;
    the flags travel with their tokens through the all-to-alls and the ring. ``usp_attention``
    sees one plain sharded sequence (``Route(state, "none")``) and the output's first head_dim
    columns are stock's attention. Each rank reads its flags from the diagonal of the (B, 1, L, L)
    mask its blocks build from its own columns of m (m_i * m_i = m_i for 0 / 1).
    A bool mask would remove the masked keys and leave padded query rows with no key at all
    (NaN in stock's SDPA): refused, as are values other than 0 and 1.

The adapter is a ``ModelPlan`` (``usp_dit.pipelines.plan`` Note [a model is a plan]): double- and
single-stream attention parallel, both ``FluxAttnProcessor``'s own code with its
``dispatch_attention_fn`` call routed to ``chroma_attention`` (``_routing.with_global``), the tokens
split by ``ChromaSplitForward`` (``_joint_split.JointSplitForward`` plus the mask's columns).

Refused (NotImplementedError): processors other than the stock ``FluxAttnProcessor`` (IP-Adapter,
LoRA-replaced, custom, Diffusers' context parallelism already enabled), attention modules the plan
does not name, an unsupported Diffusers cache (``usp_dit.pipelines.caches``), a model without blocks (at enable); ControlNet residuals,
IP-Adapter embeddings, a bool mask with masked entries, mask values other than 0 / 1, a mask that
is not (B, T + N), processors swapped after enable (at the call). ``ChromaPipeline`` runs true CFG
with **two** transformer calls per step (the prompt, then the negative prompt, each with its own
mask): with ``cfg_degree=2`` the two calls of a step run on the two cfg groups at once
(``cfg_branch_args``, ``usp_dit.pipelines.cfg_pair`` Note [two calls a step]); a call not run so
(the first step) splits a batch of prompts over the cfg groups (masks included), or runs whole on
both. (Diffusers' quirk, kept: with gradient checkpointing the forward
calls the single-stream blocks without the mask.)
"""
from __future__ import annotations

import types
from typing import Any

import torch
from diffusers import ChromaTransformer2DModel
from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor

from usp_dit.attention.usp import usp_attention
from usp_dit.pipelines._checks import require
from usp_dit.pipelines._joint_split import FluxSplit, JointSplitForward, JointSplitPlanAdapter
from usp_dit.pipelines._routing import ROUTED_NAME, Route, RoutedProcessor, with_global
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel
from usp_dit.sharding.partition import offsets, split_sizes

_EXTRA_DIM = 8  # Note [Chroma's mask]: one flag coordinate, padded to keep head_dim a multiple of 8


def _token_flags(attn_mask: torch.Tensor, length: int) -> torch.Tensor:
    """(B, L) flags m_i of this rank's tokens from the blocks' (B, 1, L, L) float mask m_i * m_j.

    Raises:
        NotImplementedError: another shape (the mask was not built by Chroma's blocks from its columns).
    """
    if attn_mask.dim() != 4 or attn_mask.shape[1] != 1 or attn_mask.shape[2:] != (length, length):
        raise NotImplementedError(
            f"usp_dit's Chroma attention expects the blocks' (B, 1, {length}, {length}) mask, "
            f"got {tuple(attn_mask.shape)}"
        )
    return attn_mask[:, 0].diagonal(dim1=1, dim2=2)


def chroma_attention(
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
    """``dispatch_attention_fn``'s signature: this rank's piece of ``[text; image]`` attended over
    the whole sequence, with stock's additive mask m_i * m_j (Note [Chroma's mask]).

    Args:
        query, key, value: (B, L, H, D), L = this rank's piece (``split_sizes(T + N, P)[rank]``).
        attn_mask: ``None`` or the blocks' (B, 1, L, L) float mask built from this rank's flags.
        parallel_config: the processor's ``Route``.

    Returns:
        (B, L, H, D).
    """
    route = parallel_config
    if not isinstance(route, Route):
        raise RuntimeError(f"usp_dit's Chroma processor got parallel_config={type(route).__name__}, not its Route")
    if dropout_p or is_causal or attention_kwargs:
        raise NotImplementedError(
            f"usp_dit routes plain attention only, got dropout_p={dropout_p}, is_causal={is_causal}, "
            f"attention_kwargs={attention_kwargs}"
        )
    if query.shape[1] != route.shard_len():
        raise ValueError(
            f"a routed Chroma attention call got {query.shape[1]} tokens, but this rank's piece has {route.shard_len()}"
        )
    state = route.state
    head_dim = query.shape[-1]
    scale = head_dim ** -0.5 if scale is None else scale
    if attn_mask is not None:
        flags = _token_flags(attn_mask, query.shape[1]).to(query.dtype)[:, :, None, None]  # (B, L, 1, 1)

        def extend(x: torch.Tensor, flag: torch.Tensor | None) -> torch.Tensor:
            extra = x.new_zeros(*x.shape[:-1], _EXTRA_DIM)
            if flag is not None:
                extra[..., :1] = flag.expand(*x.shape[:-1], 1)
            return torch.cat([x, extra], dim=-1)

        query, key, value = extend(query, flags), extend(key, (flags - 1) / scale), extend(value, None)
    out = usp_attention(
        query, key, value, scale=scale, mesh=state.mesh, backend=state.backend, seq_len=state.seq_len).out
    return out[..., :head_dim]


# FluxAttnProcessor's own code, its dispatch_attention_fn call bound to chroma_attention
# (Note [routing a stock processor's attention call] in usp_dit.pipelines._routing).
_ROUTED_CALL: types.FunctionType | None = with_global(FluxAttnProcessor.__call__, ROUTED_NAME, chroma_attention)


class USPChromaAttnProcessor(RoutedProcessor):
    """Chroma attention (double- and single-stream) of this rank's piece of ``[text; image]``.

    Double-stream: ``hidden_states`` (B, N_local, C), ``encoder_hidden_states`` (B, T_local, C)
    (possibly none), returns ``(image_out, text_out)`` of those shapes; single-stream:
    ``hidden_states`` (B, T_local + N_local, C), returns the same shape. ``attention_mask`` the
    blocks' (B, 1, L, L) mask or ``None``; ``image_rotary_emb`` this rank's rows, each (L, head_dim).
    The maths is ``FluxAttnProcessor``'s own code (Note [Chroma's mask] for the attention call).
    """

    _stock_call = _ROUTED_CALL

    def __call__(
        self,
        attn: FluxAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return type(self)._stock_call(
            self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class ChromaSplitForward(JointSplitForward):
    """``JointSplitForward`` for Chroma: the mask's columns cut like the tokens; IP-Adapter
    and masks other than stock's float 0 / 1 refused (ControlNet residuals: the plan's ``refuse_args``)."""

    def check(self, call: dict[str, Any]) -> None:
        if "ip_adapter_image_embeds" in (call.get("joint_attention_kwargs") or {}):
            raise NotImplementedError("usp_dit's Chroma adapter does not support IP-Adapter (ip_adapter_image_embeds)")
        mask = call.get("attention_mask")
        if mask is None:
            return
        batch, num_image = call["hidden_states"].shape[:2]
        joint = call["encoder_hidden_states"].shape[1] + num_image
        if mask.dim() != 2 or mask.shape[1] != joint or mask.shape[0] not in (1, batch):
            raise ValueError(
                f"attention_mask must be (batch, text + image tokens) = ({batch}, {joint}), got {tuple(mask.shape)}"
            )
        if mask.dtype == torch.bool:
            require(mask.all(),
                    "usp_dit's Chroma adapter does not run a bool attention_mask with masked tokens (stock attention "
                    "leaves padded query rows no key: NaN); pass ChromaPipeline's float 0 / 1 mask")
        else:
            require(((mask == 0) | (mask == 1)).all(),
                    "usp_dit's Chroma adapter runs attention_mask values 0 and 1 only (Note [Chroma's mask])")

    def split_more(self, call: dict[str, Any], split: FluxSplit, num_text: int) -> None:
        """The mask's columns [lo, hi) of the joint sequence: this rank's text then image tokens."""
        mask = call.get("attention_mask")
        if mask is not None:
            mesh = self.state.mesh
            sizes = split_sizes(num_text + sum(split.image_sizes), mesh.sequence_degree)
            lo = offsets(sizes)[mesh.seq_rank]
            call["attention_mask"] = mask.narrow(1, lo, sizes[mesh.seq_rank])


def _routed_call_missing(transformer: ChromaTransformer2DModel) -> str | None:
    if _ROUTED_CALL is None:
        return f"this diffusers' FluxAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="Chroma",
    model_class=ChromaTransformer2DModel,
    # The forward's own arguments ("": the transformer), split by ChromaSplitForward; the image
    # rows of proj_out's output gathered after it.
    split_at="",
    gather_at="proj_out",
    attention=(
        Parallel("transformer_blocks.*.attn", USPChromaAttnProcessor, stock=(FluxAttnProcessor,)),
        Parallel("single_transformer_blocks.*.attn", USPChromaAttnProcessor, stock=(FluxAttnProcessor,)),
    ),
    block_lists=("transformer_blocks", "single_transformer_blocks"),
    # Batched on dim 0, split over the "cfg" axis by enable_usp (img_ids / txt_ids are per token only;
    # a call cfg_branch_args does not run).
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep", "attention_mask"),
    # ChromaPipeline's CFG (guidance_scale > 1; img2img and inpainting alike) calls the transformer
    # once per branch: the prompt's T5 embeds, text ids and joint mask, then the negative prompt's
    # (usp_dit.pipelines.cfg_pair Note [two calls a step]).
    cfg_branch_args=("encoder_hidden_states", "txt_ids", "attention_mask"),
    refuse=(_routed_call_missing,),
    refuse_args={
        "controlnet_block_samples": "ControlNet residuals, (B, N, C) over the whole image",
        "controlnet_single_block_samples": "ControlNet residuals, (B, N, C) over the whole image",
    },
)

ADAPTER = register_adapter(JointSplitPlanAdapter(PLAN, __name__, ChromaSplitForward))
