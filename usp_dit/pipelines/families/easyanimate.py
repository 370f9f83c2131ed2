"""EasyAnimate adapter: ``EasyAnimateTransformer3DModel`` (EasyAnimate V5.1; text-, inpaint- and control-to-video) on a USP grid.

Layout: latents (batch, channels, frames, height, width); video tokens (batch, seq, channels),
``seq = frames * (height / p) * (width / p)``, frame-major as the per-frame patch embedding
(``proj``, a Conv2d) flattens them; text tokens (batch, text_seq, channels) (the projected
Qwen2-VL states, then the projected T5 states where the config has ``text_embed_dim_t5``); inside
``EasyAnimateAttnProcessor2_0`` Q/K/V are (batch, heads, seq, head_dim) and the joint sequence is
``[text; video]``: **text first**; the RoPE table ``rope_embedding(latents)`` is ``(cos, sin)``,
each (seq, head_dim): **the sequence on dim 0**, frame-major like the tokens.

Where the tokens are split (``_token_sharding`` Note [where the sequence is split]): the timestep
embedding, the patch embedding (inpaint and control latents concatenated on channels first) and
the text projections run on every rank; block 0's input (``transformer_blocks.0``) is sharded;
``norm_final``, ``norm_out`` (per-token norms, modulated by the timestep alone) and ``proj_out``
run on the shard, and ``proj_out``'s output is gathered before unpatchify. The RoPE table is cut
like the tokens by a forward hook on ``rope_embedding`` (a ``Table``): every processor gets this
rank's rows and rotates its video rows with them, as stock rotates the video part of its sequence.

Text tokens: **replicated**. EasyAnimate's MMDiT blocks keep the text as a second stream with its
own modulation (``norm1``/``norm2``'s ``enc_*`` chunks), projections (``add_*_proj``,
``to_add_out``) and feed-forward (``txt_ff``); blocks past ``mmdit_layers`` run the text through
the video's weights, concatenating ``[text; video]`` inside attention. Either way the text is a
stream of its own from block to block, and every rank holds it whole: the processor sees
``[text; video shard]`` and the routed call gives the text to ``usp_attention`` as joint tokens
(``Route(state, text="first")``: the text length of a call is what the shard leaves of its
sequence). No text mask reaches the transformer (the pipeline computes one for the text encoder
alone; stock attends to every padded prompt token, and so does this). Per-rank tokens,
EasyAnimate V5.1 at 49 frames x 1024 x 1024 (13 latent frames x 64 x 64 patches = 53248 video
tokens, 256 prompt tokens): 13312 video + 256 text on 4 ranks, 6656 + 256 on 8.

Note [EasyAnimate's attention call]
    ``EasyAnimateAttnProcessor2_0`` calls ``F.scaled_dot_product_attention`` on (B, H, L, D)
    tensors, not ``dispatch_attention_fn``, as SD3's ``JointAttnProcessor2_0`` does: the processor
    here runs the stock ``__call__``'s own code with ``F`` rebound to SD3's routed namespace
    (``sd3._RoutedFunctional``, Note [SD3's attention call]), one per processor instance. The blocks
    never pass ``attention_mask``, so the call has none; a processor called with one by hand gets
    it routed as a text key mask or refused (``_routing`` Note [masked text tokens]).

Dropout (``dropout`` > 0 in the config, training): the replicated text must draw one mask on every
rank (``_replicated_dropout`` Note [dropout on replicated tokens]). In MMDiT blocks the text has its
own feed-forward, ``txt_ff``, whose dropouts see text alone: they draw the shared mask. A block past
``mmdit_layers`` runs the text through the video's ``ff``, the same dropout modules called once on
the video shard and once on the text: one module cannot tell the two calls apart, so that
combination is refused (no released config has dropout). Attention output dropout is 0 in every
block (``Attention``'s default).

Refused (NotImplementedError): at enable, processors other than the stock
``EasyAnimateAttnProcessor2_0`` (LoRA-replaced or custom ones), a Diffusers whose processor stops
calling ``F.scaled_dot_product_attention``, an unsupported Diffusers cache (``usp_dit.pipelines.caches``),
``num_layers=0``, and ``dropout`` > 0 with blocks past ``mmdit_layers`` (above). The pipelines
(``EasyAnimatePipeline``, ``-InpaintPipeline``, ``-ControlPipeline``) batch [uncond, cond] in one
call, which ``cfg_degree=2`` splits.
"""
from __future__ import annotations

import copy
import types

import torch
from diffusers import EasyAnimateTransformer3DModel
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_easyanimate import EasyAnimateAttnProcessor2_0

import usp_dit.pipelines.families.sd3 as sd3  # noqa: PLR0402  (the module, not the package: no import circle)
from usp_dit.pipelines._replicated_dropout import ReplicaDropouts, ReplicatedDropoutHooks
from usp_dit.pipelines._routing import Route, with_global
from usp_dit.pipelines._token_sharding import ShardState
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter, Table

_ROUTED_GLOBAL = "F"  # EasyAnimateAttnProcessor2_0 calls F.scaled_dot_product_attention


def _routed_call(route: Route) -> types.FunctionType | None:
    """``EasyAnimateAttnProcessor2_0.__call__``'s code with ``F`` bound to SD3's routed namespace."""
    return with_global(EasyAnimateAttnProcessor2_0.__call__, _ROUTED_GLOBAL, sd3._RoutedFunctional(route))


class USPEasyAnimateAttnProcessor:
    """EasyAnimate joint attention of this rank's video shard with the replicated text first.

    Inputs: ``hidden_states`` (B, S_local, C) this rank's video tokens; ``encoder_hidden_states``
    (B, T, C) every text token; ``image_rotary_emb`` this rank's rows of the RoPE table, each
    (S_local, head_dim) (cut by the hook on ``rope_embedding``).
    Returns ``(video_out (B, S_local, C), text_out (B, T, C))``, ``text_out`` equal on every rank.
    The maths is the stock processor's own code (Note [EasyAnimate's attention call]).
    """

    def __init__(self, state: ShardState) -> None:
        self.route = Route(state, "first")
        self._call = _routed_call(self.route)

    def __deepcopy__(self, memo: dict) -> USPEasyAnimateAttnProcessor:
        # Rebuild the routed function around the copied state (Note [SD3's attention call]).
        clone = type(self)(copy.deepcopy(self.route.state, memo))
        memo[id(self)] = clone
        return clone

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # The stock signature, spelled out: Attention.forward passes a processor only the keyword
        # arguments its __call__ names (image_rotary_emb would be dropped otherwise).
        if encoder_hidden_states is None:
            raise NotImplementedError(
                "USPEasyAnimateAttnProcessor routes the blocks' joint [text; video] attention; it got no text"
            )
        return self._call(self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


def _routed_call_missing(transformer: EasyAnimateTransformer3DModel) -> str | None:
    if _routed_call(Route(None)) is None:
        return (f"this diffusers' EasyAnimateAttnProcessor2_0 does not call {_ROUTED_GLOBAL}.scaled_dot_product_attention, "
                f"the call usp_dit routes")
    return None


def _shared_ff_dropout(transformer: EasyAnimateTransformer3DModel) -> str | None:
    """Blocks past ``mmdit_layers`` run video and text through one ``ff`` (module docstring)."""
    shared = [i for i, block in enumerate(transformer.transformer_blocks) if block.txt_ff is None]
    if shared and transformer.config.dropout > 0:
        return (f"dropout={transformer.config.dropout} with blocks {shared} past mmdit_layers="
                f"{transformer.config.mmdit_layers}: their feed-forward dropout sees the replicated text and this "
                f"rank's video in two calls of one module, which cannot draw the shared mask for the text alone")
    return None


def _replicated_dropout_sites(transformer: EasyAnimateTransformer3DModel, dropouts: ReplicaDropouts,
                              state: ShardState) -> None:
    """The MMDiT blocks' text feed-forward (``txt_ff``): text rows alone, the group's mask."""
    for block in transformer.transformer_blocks:
        if block.txt_ff is not None:
            dropouts.add_all(block.txt_ff.net, "all")


_STOCK = (EasyAnimateAttnProcessor2_0,)

PLAN = ModelPlan(
    name="EasyAnimate",
    model_class=EasyAnimateTransformer3DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    # joint [text; video shard] attention, text first (Note [EasyAnimate's attention call])
    attention=(Parallel("transformer_blocks.*.attn1", USPEasyAnimateAttnProcessor, stock=_STOCK, text="first"),),
    block_lists=("transformer_blocks",),
    # rope_embedding(latents) -> (cos, sin), each (seq, head_dim): the sequence on dim 0.
    tables=(Table("rope_embedding", dim=0, items=(0, 1)),),
    # Batched on dim 0, split over the "cfg" axis by enable_usp: the pipelines batch [uncond, cond].
    cfg_batch_args=(
        "hidden_states", "timestep", "timestep_cond", "encoder_hidden_states", "encoder_hidden_states_t5",
        "inpaint_latents", "control_latents",
    ),
    hooks=(ReplicatedDropoutHooks.factory(_replicated_dropout_sites),),
    refuse=(_routed_call_missing, _shared_ff_dropout),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
