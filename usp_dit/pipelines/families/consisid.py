"""ConsisID adapter: ``ConsisIDTransformer3DModel`` (identity-preserving image-to-video, a CogVideoX-5B
I2V relative) on a USP grid.

Layout: video tokens (batch, seq, channels), ``seq = frames * (height / p) * (width / p)`` in the
order the patch embedding produces them; text tokens (batch, 226, channels), replicated; Q/K/V
(batch, seq, heads, head_dim); the RoPE table ``(cos, sin)``, each (seq, head_dim); the identity
inputs ``id_cond`` (batch or 1, LFE_id_dim) and ``id_vit_hidden`` (a list of LFE_num_scale tensors,
(batch or 1, vit_tokens, LFE_vit_dim)); the identity tokens the local facial extractor makes from
them (batch or 1, LFE_num_querie, LFE_output_dim), replicated.

The transformer is CogVideoX's (``usp_dit.pipelines.families.cogvideox``, whose plan this one is):
the same ``ConsisIDBlock`` = ``CogVideoXBlock`` maths with the stock ``CogVideoXAttnProcessor2_0``, the
same patch embedding, text stream, RoPE table and final norm over [text; video]. Tokens split at
block 0's input, gathered at ``proj_out``'s output; the text stream is replicated and joins
attention as joint tokens (cogvideox.py's module docstring; the same dropout sites).

What ConsisID adds, and why it needs no communication:

  * the local facial extractor (``local_facial_extractor``) runs before the split, on the identity
    inputs alone (no video token): every rank computes the same identity tokens.
  * every ``cross_attn_interval``-th block is followed by a ``PerceiverCrossAttention``: queries are
    the video tokens (LayerNorm, ``to_q``, softmax over the keys, ``to_out``: all per video token),
    keys and values the identity tokens. A rank's shard of queries against the whole (replicated)
    identity K/V gives exactly that shard's rows of the one-process output; the residual adds it to
    the same rows. No positional input enters it, so nothing else must follow the shard.

Per-rank token count, ConsisID-preview at 49 frames x 480 x 720 (13 latent frames x 30 x 45 patches =
17550 video tokens, 226 text, 32 identity tokens): on 4 ranks 4388, 4388, 4387, 4387 video tokens
each, + 226 text in joint attention; the perceiver cross-attention sees the rank's video tokens
against the 32 identity tokens.

Guidance: ConsisIDPipeline batches [uncond, cond] (latents, prompt embeddings, timestep) and passes
the identity inputs with batch 1 (shared by both halves); cfg_degree=2 splits the batched ones over
the "cfg" axis and keeps size-1 ones whole (``replica_forward`` Note [cfg parallel]), so both
``id_cond`` and ``id_vit_hidden`` are listed: split when they carry one row per batch row.

Refused (NotImplementedError): processors other than the stock (fused or not) CogVideoX ones, as
for CogVideoX (ConsisID's forward passes no ``attention_kwargs`` to its blocks, so no mask reaches them).
"""
from __future__ import annotations

import dataclasses

from diffusers import ConsisIDTransformer3DModel

import usp_dit.pipelines.families.cogvideox as cogvideox  # noqa: PLR0402  (the module, not the package: no import circle)
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, PlanAdapter

PLAN: ModelPlan = dataclasses.replace(
    cogvideox.PLAN,
    name="ConsisID",
    model_class=ConsisIDTransformer3DModel,
    # Batched on dim 0 (the identity inputs with batch 1 stay whole), split over "cfg" by enable_usp.
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep", "timestep_cond", "id_cond", "id_vit_hidden"),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
