"""Krea 2 adapter: ``Krea2Transformer2DModel`` (``Krea2Pipeline``; base and distilled) on a USP grid.

Layout: packed image latents (batch, N, channels), 2x2 latent patches row-major as the pipeline
packs them; the text-encoder taps (batch, T, num_text_layers, text_dim) with their mask
``encoder_attention_mask`` (batch, T), True = real token (the pipeline pads in the middle of its
template: ``[prompt | padding | suffix]``, a mask with a hole); ``position_ids`` (T + N, 3), the
text's rows all zeros then the image's (0, h, w); the joint sequence (batch, T + N, hidden),
**text first**; Q/K/V (batch, seq, heads, head_dim) (K/V heads repeated to the query heads by the
stock processor before its attention call); the RoPE table ``rotary_emb(position_ids)`` ``(cos,
sin)``, each (T + N, head_dim).

Krea 2 is a single-stream MMDiT: the model fuses the text taps (``text_fusion``: self-attention
over the tapped-layer axis per token, then over the prompt with its key mask), projects text and
image to one width, concatenates ``[text; image]`` in its forward, runs every block on the joint
sequence with one key mask ``[that text mask; all image keys valid]`` (B, 1, 1, T + N), and keeps
the image rows for ``final_layer``.

Note [Krea 2's split]
    Text: **replicated**; the image tokens are split. The prompt is padded and masked per element
    (a key mask with a hole), and the core masks only replicated joint tokens (``usp_attention``'s
    ``joint_mask``, ``_routing`` Note [masked text tokens]): a key mask over tokens split among the
    ranks is not something it computes exactly. So every rank holds ``[all T text; its image
    shard]``, which is what the stock forward builds when ``img_in``'s output is cut:

        img_in (full) ─► [hook img_in: shard] ─► cat([text, image shard]) ─► rotary_emb
        ─► [hook rotary_emb: text rows whole, image rows cut] ─► blocks (text first, routed)
        ─► hidden[:, T:] = this rank's image shard ─► final_layer ─► [hook: gather]

    The forward's own ``hidden_states[:, text_seq_len:]`` then keeps exactly this rank's image
    rows; ``final_layer``'s output (the narrowest tensor) is gathered. The blocks' per-token work
    on the text is repeated on every rank: at 1024 x 1024 (64 x 64 = 4096 image tokens, 512 text
    tokens) a rank of 8 holds 512 image + 512 text tokens (a split text would give 576).
    The routed call reads the text part (the first T keys) of the model's mask, built over the
    whole joint sequence, and attends each element over its valid text tokens and every image
    token; padded text queries get zeros where stock gives them some output: nothing reads them
    (masked as keys in every later block; the text rows are dropped before ``final_layer``).

Attention keeps Diffusers' maths: ``Krea2AttnProcessor.__call__``'s own code (projections, QK
norms, RoPE on this rank's rows, the K/V head repeat, the sigmoid output gate) with its one
``dispatch_attention_fn`` call routed to ``usp_attention`` (``_routing`` Note [routing a stock
processor's attention call]). The text-fusion blocks' attention runs locally on the whole
(replicated) text, stock processor untouched.

Refused (NotImplementedError, at enable unless noted): block processors other than the stock
``Krea2AttnProcessor`` (custom, LoRA-replaced, Diffusers' context parallelism already enabled),
an attention module the plan does not name, a Diffusers cache that cannot run on a grid
(``usp_dit.pipelines.caches``), a model without blocks; at the call a RoPE table whose rows are
not ``T + N``, and a mask the router cannot read as a text key mask (the stock forward builds none
other), dropout or causal attention (the stock processor passes none).

CFG: ``Krea2Pipeline`` with ``guidance_scale > 0`` calls the transformer twice a step (the prompt,
then the negative prompt, each with its own taps and mask): with ``cfg_degree=2`` the two calls
of a step run on the two cfg groups at once (``cfg_branch_args``, ``usp_dit.pipelines.cfg_pair``
Note [two calls a step]). The distilled checkpoint runs at ``guidance_scale=0`` (one call a step):
``cfg_degree=2`` then splits a batch of prompts, or runs a batch of one whole on both groups.
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers import Krea2Transformer2DModel
from diffusers.models.transformers.transformer_krea2 import Krea2AttnProcessor
from torch.utils.hooks import RemovableHandle

from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines._token_sharding import ShardState
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter
from usp_dit.sharding.shard import shard_sequence

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_RoutedProcessor = routed_processor_class(Krea2AttnProcessor, "_RoutedKrea2Processor")


class USPKrea2AttnProcessor(_RoutedProcessor or RoutedProcessor):
    """Joint attention of ``[all text; this rank's image shard]`` over the whole sequence (Note
    [Krea 2's split]).

    Inputs: ``hidden_states`` (B, T + N_local, C); ``attention_mask`` the model's (B, 1, 1, T + N)
    key mask over the whole joint sequence, or ``None``; ``image_rotary_emb`` the rows of those
    tokens, each (T + N_local, head_dim) (cut by ``TextFirstRope``).
    Returns (B, T + N_local, C), the text rows equal on every rank.

    The signature is spelled out: ``Krea2Attention.forward`` passes a processor only the keyword
    arguments its ``__call__`` names.
    """

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        return super().__call__(attn, hidden_states, attention_mask, image_rotary_emb)


class TextFirstRope:
    """A forward hook on ``rotary_emb``: of its (T + N, head_dim) ``(cos, sin)``, the T text rows
    whole and this rank's rows of the N image rows, cut like ``img_in``'s output (whose hook ran
    before, in the same forward, and set this call's ``seq_len`` = N)."""

    def __init__(self, transformer: Krea2Transformer2DModel, state: ShardState) -> None:
        self.state = state
        self.module = transformer.rotary_emb
        self.handle: RemovableHandle | None = None

    def install(self) -> None:
        self.handle = self.module.register_forward_hook(self._cut)

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _cut(self, module: torch.nn.Module, args: tuple, table: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) each (T + N, D) -> each (T + N_local, D).

        Raises:
            ValueError: the table has fewer rows than this call's image tokens (``position_ids``
                must cover ``[text; image]``).
        """
        num_image = self.state.seq_len
        rows = table[0].shape[0]
        if num_image is None or rows < num_image:
            raise ValueError(
                f"position_ids has {rows} rows but the transformer has {num_image} image tokens: it must "
                f"hold a row per text token, then one per image token"
            )
        num_text = rows - num_image
        return tuple(torch.cat([t[:num_text], shard_sequence(t[num_text:], self.state.mesh, dim=0,
                                                             layout=self.state.layout)]) for t in table)


def _routed_call_missing(transformer: Krea2Transformer2DModel) -> str | None:
    if _RoutedProcessor is None:
        return f"this diffusers' Krea2AttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="Krea2",
    model_class=Krea2Transformer2DModel,
    # Note [Krea 2's split]: img_in's output (the image tokens alone) is cut; the forward's
    # cat([text, image shard]) is then each rank's block input.
    split_at="img_in",
    split="output",
    gather_at="final_layer",
    attention=(
        Parallel("transformer_blocks.*.attn", USPKrea2AttnProcessor, stock=(Krea2AttnProcessor,), text="first"),
        # the text fusion's self-attention (over the tapped layers, then the prompt), before the blocks
        Local("text_fusion.*.attn", stock=(Krea2AttnProcessor,)),
    ),
    block_lists=("transformer_blocks",),
    # Batched on dim 0, split over the "cfg" axis by enable_usp (position_ids are per token only;
    # a call cfg_branch_args does not run).
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask"),
    # Krea2Pipeline's CFG (guidance_scale > 0) calls the transformer once per branch: the prompt's
    # taps and mask, then the negative prompt's (usp_dit.pipelines.cfg_pair Note [two calls a step]).
    cfg_branch_args=("encoder_hidden_states", "encoder_attention_mask"),
    hooks=(TextFirstRope,),
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
