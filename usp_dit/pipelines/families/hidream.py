"""HiDream adapter: ``HiDreamImageTransformer2DModel`` (HiDream-I1 Full, Dev, Fast) on a USP grid.

Layout: latents (batch, channels, height, width), patch 2; image tokens (batch, S, channels),
row-major, S = (h / 2) * (w / 2) for a square latent, else ``max_seq`` (HiDream's ``patchify``
pads a non-square latent's tokens to it, with a (batch, S) 0/1 token mask ``hidden_states_masks``);
text tokens (batch, T, channels), T = t5_len + 2 * llama_len, no text mask (the pipeline's padded
prompts are attended whole, in stock too); the RoPE table ``pe_embedder(ids)`` is
(batch, S + T, 1, head_dim / 2, 2, 2): image rows, then text rows (all-zero ids: the identity);
Q/K/V inside ``HiDreamAttnProcessor`` (batch, heads, S + T, head_dim) after ``[image; text]``:
**image first, text last**. The Llama 3.1 hidden states arrive stacked (llama_layers, batch,
llama_len, channels): **the batch on dim 1**.

Where the tokens are split: the patch embedding ``x_embedder`` (a per-token linear) runs on the
full latent, and a forward hook on it hands the blocks this rank's image tokens
(``split="output"``: the token count, image or padded, is known before the RoPE table is made);
``final_layer``'s output (batch, S_local, p * p * channels) is gathered before ``unpatchify``.
Per-token inputs follow the tokens (Note [HiDream's per-token inputs]).

Text tokens: **replicated**. The double-stream blocks keep text in a stream of its own
(``to_*_t``, ``ff_t``): [T5; last Llama layer] carried from block to block, and this block's
Llama layer appended before and cut after each block. The single-stream blocks run one sequence
``[image; text]`` that the model's forward concatenates (its Llama layer again appended and cut):
with the image sharded, it is ``[image shard; text]``, and the processor's joint sequence is the
shard then all text, as in the double-stream blocks. Every rank holds all T text tokens;
``usp_attention`` attends them as joint tokens (``Route(state, text="last")``); the text queries'
outputs are equal on every rank, so the replicated text stream stays replicated. HiDream-I1 at
1024 x 1024: 4096 image tokens (512 per rank on 8 ranks) + 128 T5 + 2 x 128 Llama = 384 text.

Note [HiDream's attention call]
    ``HiDreamAttnProcessor`` calls ``F.scaled_dot_product_attention(q, k, v)`` on (B, H, L, D),
    like SD3's processor: the stock ``__call__``'s own code runs with its module global ``F``
    rebound to SD3's ``_RoutedFunctional`` (``usp_dit.pipelines.families.sd3`` Note [SD3's
    attention call]), which sends that one call to ``_routing.route_attention``. Projections, QK
    RMS norms, the token mask on the keys, RoPE and the output projections stay stock.

Note [HiDream's per-token inputs]
    * The RoPE table: ``pe_embedder``'s output covers [image; text]; a forward hook
      (``HiDreamTokenInputs``) keeps this rank's image rows and every text row, once per forward.
    * ``hidden_states_masks`` (non-square latents): (B, S) in the double-stream blocks,
      (B, S + T) (ones for the text) in the single-stream ones; a pre-hook on every block cuts the
      image part like the tokens and keeps the text part. The mask multiplies the *keys* (stock
      zeroes padded keys but still attends them, with score 0): a per-token operation, exact on
      any shard once its rows follow the tokens. **Sharded, not refused.** The hooks run again on
      a gradient-checkpointing recompute, on the same saved full inputs.

Note [HiDream's mixture of experts]
    ``MOEFeedForwardSwiGLU`` routes each token on its own: the gate's softmax and top-k are per
    token, there is no capacity limit and no token dropping, and each token's output is its
    experts' weighted sum plus the shared expert's. So it is exact on any shard of the tokens. The
    one sequence-level reduction is the gate's auxiliary load-balancing loss (training mode: the
    mean of the scores over all tokens); Diffusers 0.42.1 computes it and discards it (its
    ``AddAuxiliaryLoss`` line is commented out), so neither output nor gradients depend on it.
    ``_aux_loss_applied`` checks that by reading the MoE forward's code at enable: should a future
    Diffusers use the loss, enable refuses (a shard's mean is not the sequence's).

The adapter is a ``ModelPlan`` (``usp_dit.pipelines.plan`` Note [a model is a plan]): split at
``x_embedder``'s output, gather at ``final_layer``, every block's ``attn1`` parallel (text last),
the RoPE rows and token mask by ``HiDreamTokenInputs``.

Refused (NotImplementedError): at enable, processors other than the stock ``HiDreamAttnProcessor``
(LoRA-replaced, custom), attention modules the plan does not name, an unsupported Diffusers cache
(``usp_dit.pipelines.caches``), no blocks, an MoE whose auxiliary loss reaches the output
(Note [HiDream's mixture of experts]); at the call, a processor replaced after enable.
``HiDreamImagePipeline`` batches [uncond, cond] in one call (the Llama states concatenated on
dim 1), so ``cfg_degree=2`` splits them (``cfg_batch_dims``); ``img_sizes`` passed by the caller
(the pre-patchified form) must then be a (batch, 2) tensor, not a list. HiDream configs have no dropout.
"""
from __future__ import annotations

import dis
from typing import Any

import torch
from diffusers import HiDreamImageTransformer2DModel
from diffusers.models.transformers.transformer_hidream_image import HiDreamAttnProcessor, MOEFeedForwardSwiGLU
from torch.utils.hooks import RemovableHandle

import usp_dit.pipelines.families.sd3 as sd3  # noqa: PLR0402  (the module, not the package: no import circle)
from usp_dit.pipelines._routing import Route, with_global
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter
from usp_dit.sharding.shard import shard_sequence

_ROUTED_GLOBAL = "F"  # HiDreamAttnProcessor calls F.scaled_dot_product_attention (torch.nn.functional as F)
_MASK_POS = 1  # HiDreamBlock.forward(hidden_states, hidden_states_masks, ...): positional under checkpointing


def _routed_call(route: Route) -> Any:
    """``HiDreamAttnProcessor.__call__``'s code with ``F`` bound to SD3's ``_RoutedFunctional(route)``."""
    return with_global(HiDreamAttnProcessor.__call__, _ROUTED_GLOBAL, sd3._RoutedFunctional(route))


class USPHiDreamAttnProcessor:
    """HiDream attention of this rank's image shard with the replicated text, text last.

    Inputs (as ``HiDreamAttention.forward`` passes them): ``hidden_states`` (B, S_local, C) in a
    double-stream block, (B, S_local + T, C) in a single-stream one; ``hidden_states_masks``
    ``None`` or (B, S_local) / (B, S_local + T); ``encoder_hidden_states`` (B, T, C) or ``None``;
    ``image_rotary_emb`` (B, S_local + T, 1, D / 2, 2, 2). Returns what stock returns, for this
    rank's image rows and every text row (Note [HiDream's attention call]).
    """

    def __init__(self, state: ShardState) -> None:
        self.route = Route(state, "last")
        self._call = _routed_call(self.route)

    def __deepcopy__(self, memo: dict) -> USPHiDreamAttnProcessor:
        # Rebuild the routed function around the copied state (sd3 Note [SD3's attention call]).
        import copy

        clone = type(self)(copy.deepcopy(self.route.state, memo))
        memo[id(self)] = clone
        return clone

    def __call__(
        self, attn: torch.nn.Module, hidden_states: torch.Tensor, hidden_states_masks: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None, image_rotary_emb: torch.Tensor | None = None,
        *args: Any, **kwargs: Any,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        return self._call(self, attn, hidden_states, hidden_states_masks, encoder_hidden_states, image_rotary_emb,
                          *args, **kwargs)


class HiDreamTokenInputs:
    """Note [HiDream's per-token inputs]: the RoPE table's image rows (a hook on ``pe_embedder``)
    and the token mask (a pre-hook on every block), cut like the image tokens.

    A plan ``hooks`` factory: installed after the token hooks, whose hook on ``x_embedder`` sets
    ``state.seq_len`` (this call's image tokens) before ``pe_embedder`` and the blocks run.
    """

    def __init__(self, transformer: HiDreamImageTransformer2DModel, state: ShardState) -> None:
        self.state = state
        self.rope = transformer.pe_embedder
        self.blocks = [*transformer.double_stream_blocks, *transformer.single_stream_blocks]
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        self.handles.append(self.rope.register_forward_hook(self._cut_rope))
        for block in self.blocks:
            self.handles.append(block.register_forward_pre_hook(self._cut_mask, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _image_then_text(self, t: torch.Tensor, name: str) -> torch.Tensor:
        """(B, S + T, ...) -> (B, S_local + T, ...): this rank's image rows, then every text row.

        Raises:
            ValueError: ``t`` has fewer rows than the call's S image tokens.
        """
        seq_len = self.state.seq_len
        if seq_len is None or t.shape[1] < seq_len:
            raise ValueError(f"{name} has {t.shape[1]} rows, fewer than the {seq_len} image tokens of this call")
        image = shard_sequence(t[:, :seq_len], self.state.mesh, dim=1, layout=self.state.layout)
        return torch.cat([image, t[:, seq_len:]], dim=1)

    def _cut_rope(self, module: torch.nn.Module, args: tuple, table: torch.Tensor) -> torch.Tensor:
        return self._image_then_text(table, "the RoPE table (pe_embedder's output)")

    def _cut_mask(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        mask = _get_arg(args, kwargs, "hidden_states_masks", _MASK_POS)
        if mask is None:
            return None
        return _set_arg(args, kwargs, "hidden_states_masks", _MASK_POS, self._image_then_text(mask, "hidden_states_masks"))


def _routed_call_missing(transformer: HiDreamImageTransformer2DModel) -> str | None:
    if _routed_call(Route(None)) is None:
        return (f"this diffusers' HiDreamAttnProcessor does not call {_ROUTED_GLOBAL}.scaled_dot_product_attention, "
                f"the call usp_dit routes")
    return None


def _reads_local(fn: Any, name: str) -> bool:
    """Whether ``fn``'s code loads the local variable ``name`` (any LOAD_FAST* instruction naming it)."""
    for ins in dis.get_instructions(fn):
        if ins.opname.startswith("LOAD_FAST") and name in (ins.argval if isinstance(ins.argval, tuple) else (ins.argval,)):
            return True
    return False


def _aux_loss_applied(transformer: HiDreamImageTransformer2DModel) -> str | None:
    """Note [HiDream's mixture of experts]: refuse if the MoE forward reads the gate's auxiliary loss."""
    if _reads_local(MOEFeedForwardSwiGLU.forward, "aux_loss"):
        return ("this diffusers' MOEFeedForwardSwiGLU uses its gate's auxiliary loss, a mean over the whole "
                "sequence's tokens that a shard cannot compute")
    return None


PLAN = ModelPlan(
    name="HiDream",
    model_class=HiDreamImageTransformer2DModel,
    # x_embedder's output: the patch tokens (image or padded to max_seq), before the RoPE table is made.
    split_at="x_embedder",
    split="output",
    gather_at="final_layer",
    attention=(
        Parallel("double_stream_blocks.*.block.attn1", USPHiDreamAttnProcessor, stock=(HiDreamAttnProcessor,),
                 text="last"),
        Parallel("single_stream_blocks.*.block.attn1", USPHiDreamAttnProcessor, stock=(HiDreamAttnProcessor,),
                 text="last"),
    ),
    block_lists=("double_stream_blocks", "single_stream_blocks"),
    # Split over the "cfg" axis by enable_usp: HiDreamImagePipeline batches [uncond, cond] in one call.
    cfg_batch_args=("hidden_states", "timesteps", "encoder_hidden_states_t5", "encoder_hidden_states_llama3",
                    "pooled_embeds", "img_ids", "img_sizes", "hidden_states_masks"),
    # (llama_layers, B, L, C): the pipeline stacks the Llama layers first.
    cfg_batch_dims={"encoder_hidden_states_llama3": 1},
    hooks=(HiDreamTokenInputs,),
    refuse=(_routed_call_missing, _aux_loss_applied),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
