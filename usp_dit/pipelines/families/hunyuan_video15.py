"""HunyuanVideo 1.5 adapter: ``HunyuanVideo15Transformer3DModel`` (T2V, I2V; MeanFlow variants) on a USP grid.

Layout: latents (batch, channels, frames, height, width), channels ``[noise; condition latents;
condition mask]``; video tokens (batch, seq, channels), ``seq = frames/p_t * height/p * width/p``
(patch 1 in every release), frame-major as ``x_embedder`` flattens them; the three conditioning
streams (batch, tokens, their width) with (batch, tokens) masks, nonzero = real token; Q/K/V
(batch, seq, heads, head_dim); the RoPE table ``self.rope(latents)`` ``(cos, sin)``, each
(seq, head_dim): **the sequence on dim 0**, frame-major like the tokens.

Where the tokens are split (``_token_sharding`` Note [where the sequence is split]): the patch
embedding, the condition embeddings and the token refiner run on every rank; block 0's input
(``transformer_blocks.0``) is sharded; ``proj_out``'s output is gathered before unpatchify. The
RoPE table is cut like the tokens by a forward hook on ``rope`` (a ``Table``), as in HunyuanVideo
(``usp_dit.pipelines.families.hunyuan_video``), whose machinery this plan shares (the routed
processor, text last).

Note [HunyuanVideo 1.5's condition tokens]
    Before the blocks, the model joins three conditioning streams into one replicated "text"
    stream of T = T_image + T_glyph + T_prompt tokens per batch element, each stream with its own
    embedder and a learned type embedding: the SigLIP image tokens (``image_embeds``, through
    ``image_embedder``; all zeros means text-to-video, and then, for the whole batch, they are
    zeroed and masked out), the ByT5 glyph tokens (``encoder_hidden_states_2``, the prompt's quoted
    text, through ``context_embedder_2``; none for a prompt without quoted text) and the
    Qwen2.5-VL prompt tokens (``encoder_hidden_states``, through the token refiner). Per element,
    ``[valid image; valid glyph; valid prompt; padding]``, and the mask likewise: each element's
    valid tokens a prefix of its own length. All of this runs on every rank, on the whole
    replicated streams, in the stock code: nothing here splits or reorders it.

    The dual-stream blocks keep that stream as a second stream with its own weights (text
    *last* in the joint sequence ``[video; text]``). The stock processor builds, per element,
    ``m = [all video valid; the stream's mask]`` and the (B, 1, L, L) mask ``m m^T``: valid
    tokens attend to valid keys, padded ones to nothing (zeros out). The routed call reads that
    mask as a key mask (``_routing._key_mask_of``: checked to be that outer product) and runs one
    ``usp_attention`` per element with its valid stream tokens as joint tokens; padded queries
    get zeros, as in stock, so every row equals stock's (``_routing`` Note [masked text tokens]).
    Per-rank token count at 720p x 121 frames (31 latent frames x 45 x 80 patches = 111600
    video tokens; 729 image + 256 glyph + 1000 prompt = 1985 stream tokens): 13950 video tokens
    + 1985 replicated on 8 ranks. Replicated, not split: the stream is padded and masked per
    element, and the token refiner's self-attention over the prompt (a query-dependent
    (B, 1, T, T) mask) runs before the blocks on the whole prompt, locally, stock processor
    untouched.

Note [HunyuanVideo 1.5's text-to-video test]
    ``is_t2v = torch.all(image_embeds == 0)`` is taken over the *whole* batch. Under
    ``cfg_degree=2`` a batch may be split over the two cfg groups (``cfg_batch_args``), and a batch
    whose one half has all-zero image embeddings and the other not would be decided per half:
    another result than one process's. Such a batch is refused (``MixedImageCheck``, at cfg
    degree 2: a read of ``image_embeds`` per call). The pipelines never
    make one: their image embeddings are zeros (T2V) or one image repeated (I2V) for every call.

Attention keeps Diffusers' maths: the stock ``HunyuanVideo15AttnProcessor2_0.__call__``'s own code
(projections, QK norms, RoPE on this rank's rows, added stream projections, output projections)
with its one ``dispatch_attention_fn`` call routed to ``usp_attention`` (``_routing`` Note
[routing a stock processor's attention call]).

Refused (NotImplementedError, at enable unless noted): block processors other than the stock
``HunyuanVideo15AttnProcessor2_0`` (custom ones, or Diffusers' context parallelism already
enabled), token refiner processors other than the stock ``AttnProcessor2_0`` / ``AttnProcessor``,
an attention module the plan does not name, a Diffusers cache that cannot run on a grid
(``usp_dit.pipelines.caches``), ``num_layers=0``; at the call, a mask the router cannot read as
a key mask of the stream (the stock processor builds none other), dropout or causal attention
(it passes none), and at cfg degree 2 a batch split into a text-to-video half and an
image-to-video half (Note [HunyuanVideo 1.5's text-to-video test]).

CFG: ``HunyuanVideo15Pipeline`` and ``HunyuanVideo15ImageToVideoPipeline`` guide through their
``ClassifierFreeGuidance`` guider, which calls the transformer once per branch (prompt, then
negative prompt; batch 1 each for one prompt): with ``cfg_degree=2`` the two calls of a step run
on the two cfg groups at once (``cfg_branch_args``, ``usp_dit.pipelines.cfg_pair`` Note [two calls
a step]). With the guider off (``guidance_scale <= 1``: one call a step) ``cfg_degree=2`` runs every
call whole on both groups: correct, no faster. No dropout is configurable in this model, so no
replicated-dropout handling is needed for the replicated stream.
"""
from __future__ import annotations

import torch
from diffusers import HunyuanVideo15Transformer3DModel
from diffusers.models.attention_processor import Attention, AttnProcessor, AttnProcessor2_0
from diffusers.models.transformers.transformer_hunyuan_video15 import HunyuanVideo15AttnProcessor2_0

from usp_dit.pipelines._checks import require
from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines._token_sharding import ShardState, _get_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, Table, TransformerPreHook

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_RoutedProcessor = routed_processor_class(HunyuanVideo15AttnProcessor2_0, "_RoutedHunyuanVideo15Processor")

# image_embeds' position in HunyuanVideo15Transformer3DModel.forward(self, hidden_states, timestep,
# encoder_hidden_states, encoder_attention_mask, timestep_r, encoder_hidden_states_2, encoder_attention_mask_2,
# image_embeds, ...), counted without self (a forward pre-hook's args).
_IMAGE_EMBEDS_ARG = ("image_embeds", 7)


class USPHunyuanVideo15AttnProcessor(_RoutedProcessor or RoutedProcessor):
    """Joint attention of this rank's video shard and the replicated condition stream (Note
    [HunyuanVideo 1.5's condition tokens]).

    Inputs: ``hidden_states`` (B, S_local, C) this rank's video tokens; ``encoder_hidden_states``
    (B, T, C) every stream token; ``attention_mask`` (B, T) the stream's mask, from which the stock
    code builds its (B, 1, L, L) mask, L = S_local + T; ``image_rotary_emb`` this rank's rows of the
    RoPE table, each (S_local, head_dim) (cut by the ``rope`` table hook).
    Returns ``(video_out (B, S_local, C), stream_out (B, T, C))``, ``stream_out`` equal on every rank.

    The signature is spelled out: ``Attention.forward`` passes a processor only the keyword
    arguments its ``__call__`` names.
    """

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if encoder_hidden_states is None:
            raise NotImplementedError(
                "USPHunyuanVideo15AttnProcessor routes the blocks' joint [video; stream] attention; it got no stream"
            )
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb)


class MixedImageCheck(TransformerPreHook):
    """Note [HunyuanVideo 1.5's text-to-video test]: at cfg degree 2, a forward pre-hook of the
    transformer (it runs before ``enable_usp``'s wrapper splits the batch, so it sees the whole
    batch) refuses a batch whose cfg halves differ in ``all(image_embeds == 0)``. Every rank sees
    the same arguments, so every rank raises."""

    def wanted(self) -> bool:
        return self.state.mesh.cfg_degree > 1

    def _check(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Raises NotImplementedError when the batch's cfg halves differ in being text-to-video."""
        name, index = _IMAGE_EMBEDS_ARG
        image_embeds = _get_arg(args, kwargs, name, index)
        cfg = self.state.mesh.cfg_degree
        if not torch.is_tensor(image_embeds) or image_embeds.shape[0] % cfg:
            return  # not split over the cfg groups (or the stock forward fails on it by itself)
        t2v = (image_embeds.reshape(cfg, -1) == 0).all(dim=1)  # one flag per cfg group's rows
        require((t2v == t2v[0]).all(),
                "usp_dit's HunyuanVideo 1.5 adapter: at cfg_degree=2 this batch would be split into a half with "
                "all-zero image_embeds (text-to-video) and a half with image embeddings; the model decides "
                "text-to-video for the whole batch, so the halves would differ from one process. Pass a batch of "
                "one kind, or cfg_degree=1")


def _routed_call_missing(transformer: HunyuanVideo15Transformer3DModel) -> str | None:
    if _RoutedProcessor is None:
        return f"this diffusers' HunyuanVideo15AttnProcessor2_0 does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="HunyuanVideo15",
    model_class=HunyuanVideo15Transformer3DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    attention=(
        # joint [video shard; stream] attention, stream last (Note [HunyuanVideo 1.5's condition tokens])
        Parallel("transformer_blocks.*.attn", USPHunyuanVideo15AttnProcessor,
                 stock=(HunyuanVideo15AttnProcessor2_0,), text="last"),
        # the token refiner's self-attention over the whole (replicated) prompt, before the blocks
        Local("context_embedder.token_refiner.refiner_blocks.*.attn", stock=(AttnProcessor2_0, AttnProcessor)),
    ),
    block_lists=("transformer_blocks",),
    # rope(latents) -> (cos, sin), each (seq, head_dim): the sequence on dim 0.
    tables=(Table("rope", dim=0, items=(0, 1)),),
    # Batched on dim 0, split over the "cfg" axis by enable_usp (a call cfg_branch_args does not run).
    cfg_batch_args=(
        "hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask", "timestep_r",
        "encoder_hidden_states_2", "encoder_attention_mask_2", "image_embeds",
    ),
    # The pipelines' guider calls the transformer once per branch: the prompt's Qwen embeds, their
    # mask, the glyph (ByT5) embeds and theirs, then the negative prompt's; latents, timestep and
    # image embeds are the same (usp_dit.pipelines.cfg_pair Note [two calls a step]).
    cfg_branch_args=(
        "encoder_hidden_states", "encoder_attention_mask", "encoder_hidden_states_2", "encoder_attention_mask_2",
    ),
    hooks=(MixedImageCheck,),
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
