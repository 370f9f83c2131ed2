"""Mochi adapter: ``MochiTransformer3DModel`` (MochiPipeline) on a USP grid.

Layout: video tokens (batch, seq, channels), ``seq = frames * (height / p) * (width / p)``, frame
major as the model flattens them; text tokens (batch, text_seq, text_channels) with the prompt
mask ``encoder_attention_mask`` (batch, text_seq), nonzero = real token; Q/K/V
(batch, seq, heads, head_dim); the RoPE table ``(cos, sin)`` the model builds, each
(seq, heads, head_dim // 2).

Where the tokens are split (``_token_sharding`` Note [where the sequence is split]): patch
embedding and the timestep/caption embedding run whole; block 0's input is sharded; ``proj_out``'s
output is gathered before unpatchify. The RoPE table reaches every processor whole and is sliced
there with the same ``shard_sequence`` as the tokens.

Text tokens: **replicated**. Mochi keeps text as its own stream with its own weights (the
``add_*_proj`` projections, ``ff_context``), and its processor drops each batch element's padded
prompt tokens before attention. Replicated, every rank picks the valid tokens exactly as the stock
processor does and hands them to ``usp_attention`` as joint tokens (their queries are still split
over the ring ranks there). Per-rank token count, Mochi 1 at 163 frames x 480 x 848 (28 latent
frames x 30 x 53 patches = 44520 video tokens, at most 256 prompt tokens): on 8 ranks 5565 video
tokens + the prompt's valid tokens (<= 256) each.

Note [Mochi's prompt mask, exactly as stock]
    ``MochiAttnProcessor2_0`` loops over the batch: element b attends over [video; prompt tokens
    where mask[b] != 0] (padded tokens are neither queries nor keys), and its text output holds
    the outputs of those valid tokens *first*, in order, followed by zeros, before ``to_add_out``.
    (For the usual prefix masks that is position for position; for a mask with holes the outputs
    are compacted to the front: we do the same.) We loop the same way, one ``usp_attention`` per
    batch element with its own joint length. With cfg parallel each rank's batch is 1 anyway.
    Under torch.compile the number of valid tokens cannot set a shape: there every prompt token
    stays, the padded ones masked as keys (``joint_mask``), and the outputs are compacted by a
    scatter (``_masked_keys_attention``): the same result in one graph.

Dropout: Mochi's config has none, but its text stream is replicated, so should a dropout be set
on it (``ff_context``'s dropout modules, e.g. for fine-tuning) it draws one mask on every rank of
the sequence group (``_replicated_dropout`` Note [dropout on replicated tokens]). The text passes
no other dropout (its attention output goes through ``to_add_out`` alone); video dropouts stay
each rank's own.

The adapter is a ``ModelPlan`` (``usp_dit.pipelines.plan``): every ``attn1`` processor is
replaced by ``USPMochiAttnProcessor`` and the original objects put back on ``disable``; any other
processor (LoRA-replaced, custom) is refused.
"""
from __future__ import annotations

import torch
from diffusers import MochiTransformer3DModel
from diffusers.models.attention_processor import MochiAttention, MochiAttnProcessor2_0

from usp_dit.attention.usp import usp_attention
from usp_dit.pipelines._replicated_dropout import ReplicaDropouts, ReplicatedDropoutHooks
from usp_dit.pipelines._token_sharding import ShardState, local_rope
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter


def _rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Mochi's RoPE: x (B, S, H, D), cos/sin (S, H, D/2); rotates each (even, odd) channel pair.

    Computed in float32 and cast back, as the stock processor does.
    """
    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    rotated = torch.stack([(even * cos - odd * sin).to(x.dtype), (even * sin + odd * cos).to(x.dtype)], dim=-1)
    return rotated.flatten(-2)


def _video_heads(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, S, C) -> q, k, v (B, S, H, D), q and k RMS-normed per head."""
    q, k, v = (proj(x).unflatten(2, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))
    return attn.norm_q(q), attn.norm_k(k), v


def _text_heads(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, T, C_text) -> q, k, v (B, T, H, D) through the added projections and norms."""
    q, k, v = (proj(x).unflatten(2, (attn.heads, -1)) for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
    return attn.norm_added_q(q), attn.norm_added_k(k), v


def masked_joint_attention(q, k, v, text_q, text_k, text_v, mask: torch.Tensor, state: ShardState):
    """Note [Mochi's prompt mask, exactly as stock].

    Args:
        q, k, v: (B, S_local, H, D) this rank's video tokens.
        text_q, text_k, text_v: (B, T, H, D) all prompt tokens (replicated).
        mask: (B, T), nonzero marks a real prompt token.

    Returns:
        ``(out (B, S_local, H, D), text_out (B, T, H, D))``; row b of ``text_out`` holds the
        outputs of element b's valid tokens first, then zeros.
    """
    if torch.compiler.is_compiling():
        return _masked_keys_attention(q, k, v, text_q, text_k, text_v, mask, state)
    outs, text_outs = [], []
    for b in range(q.shape[0]):
        valid = torch.nonzero(mask[b].flatten(), as_tuple=False).flatten()
        res = usp_attention(
            q[b:b + 1], k[b:b + 1], v[b:b + 1],
            joint_q=text_q[b:b + 1, valid], joint_k=text_k[b:b + 1, valid], joint_v=text_v[b:b + 1, valid],
            mesh=state.mesh, backend=state.backend, seq_len=state.seq_len,
        )
        outs.append(res.out)
        text_b = res.joint_out
        padding = text_q.shape[1] - text_b.shape[1]
        text_outs.append(torch.cat([text_b, text_b.new_zeros(1, padding, *text_b.shape[2:])], dim=1))
    return torch.cat(outs), torch.cat(text_outs)


def _masked_keys_attention(q, k, v, text_q, text_k, text_v, mask: torch.Tensor, state: ShardState):
    """``masked_joint_attention`` with static shapes (under torch.compile): every prompt token
    stays, the padded ones masked as keys (Note [masked joint tokens] in ``usp_dit.attention.masked_joint``),
    one call for the whole batch; the valid tokens' outputs are then moved to the front of their
    row and the rest zeroed, as stock leaves them (a scatter to positions cumsum(mask) - 1, the
    padded rows to a spare slot that is cut off)."""
    valid = (mask != 0).reshape(q.shape[0], -1)
    res = usp_attention(q, k, v, joint_q=text_q, joint_k=text_k, joint_v=text_v, joint_mask=valid,
                        mesh=state.mesh, backend=state.backend, seq_len=state.seq_len)
    b, t = valid.shape
    slot = torch.where(valid, valid.long().cumsum(dim=1) - 1, t)  # (B, T): target row of each output
    index = slot[:, :, None, None].expand_as(res.joint_out)
    packed = res.joint_out.new_zeros(b, t + 1, *res.joint_out.shape[2:]).scatter(1, index, res.joint_out)
    return res.out, packed[:, :t]


class USPMochiAttnProcessor:
    """Mochi joint attention of this rank's video shard and the replicated, masked prompt tokens.

    Inputs: ``hidden_states`` (B, S_local, C), ``encoder_hidden_states`` (B, T, C_text),
    ``attention_mask`` (B, T), ``image_rotary_emb`` the whole ``(cos, sin)`` (S, H, D/2).
    Returns ``(video_out (B, S_local, C), text_out (B, T, C_text))``, text_out equal on every rank.
    """

    def __init__(self, state: ShardState) -> None:
        self.state = state

    def __call__(
        self,
        attn: MochiAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if attention_mask is None:
            raise ValueError("encoder_attention_mask must be given (batch, text_seq); Mochi's processor needs it")
        q, k, v = _video_heads(attn, hidden_states)
        text_q, text_k, text_v = _text_heads(attn, encoder_hidden_states)
        rope = local_rope(image_rotary_emb, self.state, "image_rotary_emb")
        if rope is not None:
            q, k = _rotate_pairs(q, *rope), _rotate_pairs(k, *rope)
        out, text_out = masked_joint_attention(q, k, v, text_q, text_k, text_v, attention_mask, self.state)
        out = attn.to_out[1](attn.to_out[0](out.flatten(2)))
        text_out = text_out.flatten(2)
        if hasattr(attn, "to_add_out"):  # the last block (context_pre_only) has none, as in stock
            text_out = attn.to_add_out(text_out)
        return out, text_out


def _replicated_dropout_sites(transformer: MochiTransformer3DModel, dropouts: ReplicaDropouts, state: ShardState) -> None:
    """The text stream's feed-forward dropouts (module docstring); the last block has no ff_context."""
    for block in transformer.transformer_blocks:
        dropouts.add_all(getattr(block.ff_context, "net", None), "all")


PLAN = ModelPlan(
    name="Mochi",
    model_class=MochiTransformer3DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    # Joint attention over [video; valid prompt tokens] (Note [Mochi's prompt mask, exactly as stock]).
    attention=(Parallel("transformer_blocks.*.attn1", USPMochiAttnProcessor, stock=(MochiAttnProcessor2_0,)),),
    block_lists=("transformer_blocks",),
    # Batched on dim 0, split over the "cfg" axis by enable_usp.
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask"),
    hooks=(ReplicatedDropoutHooks.factory(_replicated_dropout_sites),),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
