"""Wan Animate adapter: ``WanAnimateTransformer3DModel`` (Wan 2.2 Animate-14B) on a USP grid.

Layout: latents (batch, 2 * latent_channels + 4, frames, height, width): the noisy latents, the
reference image's latent frame first, with the conditioning latents and mask on channels; pose
latents (batch, latent_channels, frames - 1, height, width); face video in pixels
(batch, 3, face_frames, size, size); video tokens (batch, seq, channels), frame-major,
``seq = frames * (height / p_h) * (width / p_w)``; text and CLIP image tokens replicated; the RoPE
table ``(cos, sin)``, each (1, seq, 1, head_dim); face features ``motion_vec``
(batch, T, N, channels): T temporal positions (a zero one first, then the face encoder's
temporally downsampled frames), N = face_encoder_num_heads + 1 tokens each.

What Animate adds to Wan, and where each piece runs:

  * **pose**: ``pose_patch_embedding(pose)`` is added to the patch embedding of frames 1.. on the
    5-D embedding, *before* it is flattened into tokens. Patch embedding runs whole on every rank
    (``_token_sharding`` Note [where the sequence is split]), so the pose is in the tokens before
    block 0 cuts them: nothing to shard.
  * **face encoders**: the motion encoder (per face frame) and the face encoder (causal 1-D convs
    over the face frames) make ``motion_vec`` from the face pixels: no token is involved, so they
    run whole on every rank (replicated work: at the real size 77 frames of 512 x 512 through a
    small CNN, beside 40 blocks of 75600 / P tokens).
  * **face adapter**: after blocks 0, 5, 10, ... a temporally aligned cross-attention
    (``face_adapter[i]``): Note [face attention by frame].

Note [face attention by frame]
    Stock ``WanAnimateFaceBlockAttnProcessor`` cuts the S queries into T equal chunks
    (``query.unflatten(1, (T, -1))``, S divisible by T) and chunk t attends only the N face tokens
    of ``motion_vec[:, t]``: a per-token table (which face tokens a token reads) cut by frame,
    ``frame(j) = j // (S / T)`` for token j. On a grid a rank holds a contiguous run of tokens
    [start, start + S_local) that may begin and end mid-frame:

        tokens   |--- frame 0 ---|--- frame 1 ---|--- frame 2 ---|
        rank 0   [==========)                                        head of frame 0 ... part of 0
        rank 1              [===============)                        rest of 0, part of 1
        rank 2                              [===================]    rest of 1, all of 2

    ``USPFaceAdapterProcessor`` keeps the stock maths (pre-norms, projections, RMS norms, output
    projection) and makes the attention call per run of one frame: the rank's whole frames in one
    batched call shaped as stock's ((B * frames, S / T, H, D) queries against (B * frames, N, H, D)
    keys), a partial frame at either end as a call of its own against that frame's keys. Each query
    row meets the same keys as on one process; the K/V are computed from the replicated
    ``motion_vec`` on every rank (T * N tokens: 21 x 5 for the real model). No communication. The
    rank's token range is the "contiguous" layout's (``split_sizes`` / ``offsets``), the layout
    of every Wan plan.

Self-attention ``attn1`` of the blocks: Animate's own copy of ``WanAttnProcessor``
(``transformer_wan_animate.WanAttnProcessor``) with its attention call routed to ``usp_attention``;
``attn2`` (text and CLIP image tokens) local. CFG: ``WanAnimatePipeline`` calls the transformer
once per guidance branch; the unconditional call has the negative prompt's embeds **and** a
blanked face video (``face_pixel_values * 0 - 1``): both are ``cfg_branch_args``
(``usp_dit.pipelines.cfg_pair`` Note [two calls a step]).

Refused (NotImplementedError): as Wan's (a foreign processor at any attention site, Diffusers'
context parallelism, FasterCache, a diffusers' processor with no routable call, ``num_layers=0``,
an ``attention_mask`` in self-attention); at the call, a face-adapter ``attention_mask`` (the model
never passes one) and a layout other than "contiguous". ValueError at the call: a token count that
does not split into the face features' T frames (stock fails there too).

``WanAnimate2Transformer3DModel`` (Wan-Animate-2) is another model, not a variant of this one: its
own adapter is ``usp_dit.pipelines.families.wan_animate2`` (in-context reference attention).
"""
from __future__ import annotations

import torch
from diffusers import WanAnimateTransformer3DModel
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.transformers import transformer_wan_animate as stock
from diffusers.models.transformers.transformer_wan_animate import (
    WanAnimateFaceBlockAttnProcessor,
    WanAnimateFaceBlockCrossAttention,
    WanAttention,
    WanAttnProcessor,
)

import usp_dit.pipelines.families.wan as wan
from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines._token_sharding import ShardState
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter
from usp_dit.sharding.partition import offsets, split_sizes

# Animate's own copy of Wan's processor, its one dispatch_attention_fn call routed (_routing).
_RoutedAnimateProcessor = routed_processor_class(WanAttnProcessor, "_RoutedAnimateProcessor")


class USPWanAnimateAttnProcessor(_RoutedAnimateProcessor or RoutedProcessor):
    """Self-attention (``attn1``) of this rank's video shard against the whole sequence: Wan's
    (``wan.USPWanAttnProcessor``) on Animate's copy of the stock code. (B, S_local, C) -> same."""

    def __call__(
        self,
        attn: WanAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attn.add_k_proj is not None:
            raise NotImplementedError("USPWanAnimateAttnProcessor is for self-attention (attn1) only")
        if attention_mask is not None:
            raise NotImplementedError("usp_dit's Wan Animate adapter does not support an attention_mask in attn1")
        return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, rotary_emb)


def frame_runs(start: int, stop: int, frame_len: int) -> list[tuple[int, int, int]]:
    """Tokens [start, stop) as runs ``(first_frame, frames, tokens)``: whole frames (of
    ``frame_len`` tokens) merged into one run, a partial frame at either end a run of its own
    (``frames`` 1). Note [face attention by frame]."""
    runs: list[tuple[int, int, int]] = []
    pos = start
    while pos < stop:
        frame = pos // frame_len
        end = min(stop, (frame + 1) * frame_len)
        whole = end - pos == frame_len
        if whole and runs and runs[-1][2] == runs[-1][1] * frame_len and runs[-1][0] + runs[-1][1] == frame:
            first, frames, tokens = runs.pop()
            runs.append((first, frames + 1, tokens + frame_len))
        else:
            runs.append((frame, 1, end - pos))
        pos = end
    return runs


class USPFaceAdapterProcessor:
    """Note [face attention by frame]: ``face_adapter[i]`` on this rank's tokens.

    Inputs: ``hidden_states`` (B, S_local, C), this rank's tokens; ``encoder_hidden_states``
    ``motion_vec`` (B, T, N, C), replicated. Returns (B, S_local, C).
    """

    _attention_backend = None
    _parallel_config = None

    def __init__(self, state: ShardState) -> None:
        self.state = state

    def __call__(
        self,
        attn: WanAnimateFaceBlockCrossAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise NotImplementedError("usp_dit's Wan Animate adapter does not shard a face adapter attention_mask")
        hidden_states = attn.pre_norm_q(hidden_states)
        encoder_hidden_states = attn.pre_norm_kv(encoder_hidden_states)
        batch, frames, face_tokens, _ = encoder_hidden_states.shape
        encoder_hidden_states = encoder_hidden_states.flatten(1, 2)  # (B, T * N, C), as stock
        query, key, value = stock._get_qkv_projections(attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query.unflatten(2, (attn.heads, -1)))  # (B, S_local, H, D)
        key = attn.norm_k(key.view(batch, frames, face_tokens, attn.heads, -1))  # (B, T, N, H, D)
        value = value.view(batch, frames, face_tokens, attn.heads, -1)
        out = self._attend_by_frame(query, key, value)
        out = out.flatten(2, 3).type_as(query)
        return attn.to_out(out)

    def _token_range(self, frames: int) -> tuple[int, int, int]:
        """(start, stop, frame_len): this rank's tokens [start, stop) and the tokens per face frame.

        Raises:
            NotImplementedError: a layout other than "contiguous".
            ValueError: the tokens do not split into ``frames`` equal chunks.
        """
        seq_len, mesh = self.state.seq_len, self.state.mesh
        if self.state.layout != "contiguous":
            raise NotImplementedError(f"the face adapter needs the contiguous layout, not {self.state.layout!r}")
        if seq_len % frames:
            raise ValueError(
                f"face_adapter: {seq_len} video tokens do not split into the {frames} frames of the face features "
                f"(the model attends frame t's tokens, S / T of them, to face frame t)"
            )
        sizes = split_sizes(seq_len, mesh.sequence_degree)
        start = offsets(sizes)[mesh.seq_rank]
        return start, start + sizes[mesh.seq_rank], seq_len // frames

    def _attend_by_frame(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """query (B, S_local, H, D), key/value (B, T, N, H, D) -> (B, S_local, H, D)."""
        batch = query.shape[0]
        start, stop, frame_len = self._token_range(key.shape[1])
        outs, pos = [], 0
        for first, frames, tokens in frame_runs(start, stop, frame_len):
            q = query[:, pos:pos + tokens].unflatten(1, (frames, -1)).flatten(0, 1)  # (B * frames, L, H, D)
            k = key[:, first:first + frames].flatten(0, 1)  # (B * frames, N, H, D)
            v = value[:, first:first + frames].flatten(0, 1)
            out = dispatch_attention_fn(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
                                        backend=self._attention_backend)
            outs.append(out.unflatten(0, (batch, frames)).flatten(1, 2))
            pos += tokens
        return torch.cat(outs, dim=1) if outs else query[:, :0]


def _routed_call_missing(transformer: WanAnimateTransformer3DModel) -> str | None:
    if _RoutedAnimateProcessor is None:
        return f"this diffusers' Animate WanAttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="WanAnimate",
    model_class=WanAnimateTransformer3DModel,
    split_at="blocks.0",
    gather_at="proj_out",
    attention=(
        Parallel("blocks.*.attn1", USPWanAnimateAttnProcessor, stock=(WanAttnProcessor,)),
        Local("blocks.*.attn2", stock=(WanAttnProcessor,)),  # text and CLIP image tokens, replicated
        Parallel("face_adapter.*", USPFaceAdapterProcessor, stock=(WanAnimateFaceBlockAttnProcessor,)),
    ),
    # face_adapter's attentions are units of their own (a ModuleList is never called: FSDP2 could
    # not gather it); they run interleaved with the blocks, so the forward prefetch chain (blocks,
    # then face adapters) gathers each face adapter early at worst.
    block_lists=("blocks", "face_adapter"),
    tables=wan.PLAN.tables,  # rope(latents) -> (cos, sin), each (1, seq, 1, head_dim)
    cfg_batch_args=(*wan.PLAN.cfg_batch_args, "pose_hidden_states", "face_pixel_values"),
    # The unconditional call: the negative prompt's embeds and the face video blanked to -1.
    cfg_branch_args=("encoder_hidden_states", "face_pixel_values"),
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
