"""CogVideoX adapter: ``CogVideoXTransformer3DModel`` (2B, 5B, 1.5; text- and image-to-video) on a USP grid.

Layout: video tokens (batch, seq, channels), ``seq = frames * (height / p) * (width / p)`` in the
order the patch embedding produces them; text tokens (batch, text_seq, channels); Q/K/V
(batch, seq, heads, head_dim); the 5B RoPE table ``(cos, sin)``, each (seq, head_dim).

Where the tokens are split (``_token_sharding`` Note [where the sequence is split]): the patch
embedding (which also adds 2B's sin-cos positional table and prepends the projected text) runs on
the full latent; block 0's input is sharded; ``proj_out``'s output is gathered before unpatchify.
The RoPE table the pipeline passes as ``image_rotary_emb`` reaches every processor whole and is
sliced there with the same ``shard_sequence`` as the tokens (row i rotates token i; a view).

Text tokens: **replicated**. CogVideoX carries text as a separate stream (``encoder_hidden_states``)
through every block, with its own modulation gates, and concatenates it in front of the video
tokens only inside attention and the feed-forward. Splitting it would mean re-slicing that stream
in every block; replicated, it rides along unchanged and ``usp_attention`` takes it as joint tokens
(their queries are still split over the ring ranks inside attention, so attention work on text is
not repeated; only the small per-token text work of norms, projections and the MLP is). Per-rank
token count, CogVideoX-5B at 49 frames x 480 x 720 (13 latent frames x 30 x 45 patches = 17550
video tokens, 226 text tokens): on 4 ranks 4388, 4388, 4387, 4387 video + 226 text each (text is
5 % of a rank's tokens); on 8 ranks 2194 x 6, 2193 x 2 video + 226 text.

Dropout (``dropout`` > 0 in the config, training): the replicated text must draw one mask on
every rank (``_replicated_dropout`` Note [dropout on replicated tokens]). CogVideoX applies dropout
after the patch embedding to the full [text; video] sequence (``embedding_dropout``: replicated
entirely, so one mask for the whole sequence, each rank keeping its shard's rows), and in every
block's feed-forward over [text; video shard] (``ff.net``'s dropouts: the text rows take the
shared mask, the video rows the rank's own); its attention is built without output dropout, but
the text output's ``to_out[1]`` takes the shared mask too should one be set.

The adapter is a ``ModelPlan`` (``usp_dit.pipelines.plan``): attention processors are swapped
for ``USPCogVideoXAttnProcessor`` (same maths as diffusers' ``CogVideoXAttnProcessor2_0`` with attention done by ``usp_attention``);
the originals are kept and put back on ``disable``. Unsupported: ``attention_mask`` (no CogVideoX
pipeline passes one) and processors other than the stock (fused or not) ones, e.g. LoRA-replaced.
"""
from __future__ import annotations

import torch
from diffusers import CogVideoXTransformer3DModel
from diffusers.models.attention_processor import CogVideoXAttnProcessor2_0, FusedCogVideoXAttnProcessor2_0
from diffusers.models.embeddings import apply_rotary_emb

from usp_dit.attention.usp import usp_attention
from usp_dit.pipelines._replicated_dropout import ReplicaDropout, ReplicaDropouts, ReplicatedDropoutHooks
from usp_dit.pipelines._token_sharding import ShardState, local_rope
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter

_STOCK_PROCESSORS = (CogVideoXAttnProcessor2_0, FusedCogVideoXAttnProcessor2_0)


def _heads(attn, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(B, S, C) -> q, k, v each (B, S, H, D), after the per-head LayerNorms of q and k."""
    q, k, v = (proj(x).unflatten(2, (attn.heads, -1)) for proj in (attn.to_q, attn.to_k, attn.to_v))
    if attn.norm_q is not None:
        q = attn.norm_q(q)  # LayerNorm over head_dim: the same whichever dim holds heads
    if attn.norm_k is not None:
        k = attn.norm_k(k)
    return q, k, v


def _out_proj(attn, x: torch.Tensor, replicated: bool = False) -> torch.Tensor:
    """(B, S, H, D) -> (B, S, C) through the shared output projection and its dropout; the
    replicated text's dropout draws the sequence group's mask (Note [dropout on replicated tokens])."""
    out, dropout = attn.to_out[0](x.flatten(2)), attn.to_out[1]
    if replicated and isinstance(dropout, ReplicaDropout):
        return dropout.replicated(out)
    return dropout(out)


class USPCogVideoXAttnProcessor:
    """CogVideoX joint attention of this rank's video shard and the replicated text tokens.

    Inputs: ``hidden_states`` (B, S_local, C), ``encoder_hidden_states`` (B, T, C),
    ``image_rotary_emb`` the whole ``(cos, sin)`` table (S, D) or None.
    Returns ``(video_out (B, S_local, C), text_out (B, T, C))``; text_out is the same on every rank.
    """

    def __init__(self, state: ShardState) -> None:
        self.state = state

    def __call__(
        self,
        attn,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if attention_mask is not None:
            raise NotImplementedError("usp_dit's CogVideoX processor does not support attention_mask")
        if attn.is_cross_attention:
            raise NotImplementedError("usp_dit's CogVideoX processor supports self-attention layers only")
        q, k, v = _heads(attn, hidden_states)
        text_q, text_k, text_v = _heads(attn, encoder_hidden_states)
        rope = local_rope(image_rotary_emb, self.state, "image_rotary_emb")
        if rope is not None:  # RoPE rotates video tokens only, as in the stock processor
            q = apply_rotary_emb(q, rope, sequence_dim=1)
            k = apply_rotary_emb(k, rope, sequence_dim=1)
        res = usp_attention(
            q, k, v, joint_q=text_q, joint_k=text_k, joint_v=text_v,
            mesh=self.state.mesh, backend=self.state.backend, seq_len=self.state.seq_len,
        )
        return _out_proj(attn, res.out), _out_proj(attn, res.joint_out, replicated=True)


def _replicated_dropout_sites(transformer: CogVideoXTransformer3DModel, dropouts: ReplicaDropouts, state: ShardState) -> None:
    """The dropout sites that see replicated tokens (module docstring)."""
    dropouts.add(transformer, "embedding_dropout", "all")
    for block in transformer.transformer_blocks:
        dropouts.add(block.attn1.to_out, "1", "none")  # video rows own; the processor asks for the text's
        dropouts.add_all(block.ff.net, "text", state)  # input [text; video shard]


PLAN = ModelPlan(
    name="CogVideoX",
    model_class=CogVideoXTransformer3DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    # Joint attention over [text; video]: the stock processors' maths with usp_attention inside.
    attention=(Parallel("transformer_blocks.*.attn1", USPCogVideoXAttnProcessor, stock=_STOCK_PROCESSORS),),
    block_lists=("transformer_blocks",),
    # Batched on dim 0, split over the "cfg" axis by enable_usp (image_rotary_emb is not).
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep", "timestep_cond", "ofs"),
    hooks=(ReplicatedDropoutHooks.factory(_replicated_dropout_sites),),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
