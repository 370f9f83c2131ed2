"""Qwen-Image adapter: ``QwenImageTransformer2DModel`` (Qwen-Image, -Edit, -Edit-2511, -Layered) on a USP grid.

Layout: packed latents / image tokens (batch, seq, channels), each sample's images in
``img_shapes`` order (the target image, then condition images or layers), each frame-major;
text tokens (batch, text_seq, channels) with the mask ``encoder_hidden_states_mask``
(batch, text_seq), True = a real token, **any pattern** (holes allowed: the model masks keys
element-wise); Q/K/V (batch, seq, heads, head_dim); the RoPE table ``pos_embed(img_shapes, ...)``
returns ``(img_freqs (seq, head_dim / 2), txt_freqs (text_seq, head_dim / 2))``, complex, **the
sequence on dim 0**; Edit-2511's ``modulate_index`` (batch, seq), one modulation choice per image token.

Where the tokens are split (``_token_sharding`` Note [where the sequence is split]): ``img_in``,
``txt_in`` and the timestep embedding run whole on every rank; block 0's input is sharded;
``proj_out``'s output is gathered. Per-token tables follow the tokens (Note [Qwen-Image's per-token tables]).

Text tokens: **replicated**. Qwen-Image is a double-stream (MMDiT) model: text keeps its own
stream (``add_*_proj``, ``txt_mlp``) and ``QwenDoubleStreamAttnProcessor2_0`` attends over
``[text; image]`` (text first) with a key mask built from ``encoder_hidden_states_mask``.
Replicated, every rank holds all text tokens and hands them to ``usp_attention`` as joint tokens
(``Route(state, text="first")``), each batch element with its own valid text keys
(``_routing`` Note [masked text tokens]: masks with holes included). Diffusers' own ``_cp_plan``
splits the text too; we do not, because the mask with holes would then have to be split and
padded per rank, and text (at most 1024 tokens, usually a few hundred) is small beside the image
(Qwen-Image at 1328 x 1328: 83 x 83 = 6889 image tokens; 861 per rank on 8 ranks, + the text).

Note [padded text rows]
    Where the mask is False, the routed attention returns zeros for that text *query* row, where
    stock returns its attention over the valid keys. The row differs from stock from then on, and
    nothing reads it: in every later block the padded token is masked as a key (so no image or
    valid text token attends to it), the text stream's modulation is per sample (``txt_mod(temb)``,
    not per token), and the model's output is ``proj_out(norm_out(hidden_states))``: the image
    stream alone (the text stream is dropped after the last block). So outputs and every
    parameter's gradient are stock's (tests/test_pipeline_qwen_image.py checks both with masks
    that have holes).

Note [Qwen-Image's per-token tables]
    * ``img_freqs``: the plan's ``Table("pos_embed", dim=0, items=(0,))``, a forward hook on
      ``pos_embed`` keeping this rank's rows (a view of Diffusers' cached table) once per forward;
      ``txt_freqs`` stays whole (the text is replicated). Block 0's sharding checks the table's
      length against the token count (``img_shapes`` that describe other tokens would otherwise
      misalign silently).
    * ``modulate_index`` (``zero_cond_t``, Qwen-Image-Edit-2511: 0 for the target image's tokens,
      1 for the condition images'): built inside the forward from ``img_shapes`` and passed to
      every block, so a pre-hook on every block (``ModulateIndexHooks``) takes this rank's
      columns (dim 1), like Diffusers' ``_cp_plan`` for ``transformer_blocks.*``. **Sharded, not
      refused.** It runs again on a gradient-checkpointing recompute, on the same saved full index.

The adapter is a ``ModelPlan`` (``usp_dit.pipelines.plan`` Note [a model is a plan]): split at
``transformer_blocks.0``, gather at ``proj_out``, every block's attention parallel (text first),
the image RoPE a ``Table``, ``modulate_index`` and the call-time checks (the plan's ``CallChecks``) hooks.

Attention keeps Diffusers' maths: ``USPQwenDoubleStreamAttnProcessor`` runs the stock
``QwenDoubleStreamAttnProcessor2_0.__call__``'s own code (projections, QK RMS norms, RoPE on
this rank's rows, ``[text; image]`` concatenation, mask, output projections) with its one
``dispatch_attention_fn`` call routed (``_routing`` Note [routing a stock processor's attention call]).

Refused (NotImplementedError): at enable, processors other than the stock
``QwenDoubleStreamAttnProcessor2_0`` (LoRA-replaced, custom, or Diffusers' context parallelism
already enabled), attention modules the plan does not name, a Diffusers cache that cannot run on a
grid (FasterCache; the others do: ``usp_dit.pipelines.caches``), ``num_layers=0``; at the call
(the plan's ``CallChecks``), ``controlnet_block_samples`` (Qwen-Image ControlNet: full-sequence residuals)
and a processor replaced after enable, and a ``modulate_index`` whose batch is not the tokens'
(with ``cfg_degree=2`` and ``zero_cond_t`` the cfg split halves the tokens but not
``img_shapes``, a plain Python list, from which the model builds the index).
``QwenImagePipeline`` calls the transformer once per guidance branch (true CFG): with
``cfg_degree=2`` the two calls of a step run on the two cfg groups at once (``cfg_branch_args``,
``usp_dit.pipelines.cfg_pair`` Note [two calls a step]); a call not run so (the first step) splits a
batch of prompts over the cfg groups like any batch (prompt masks included), or runs whole on both.
Qwen-Image configs have no dropout. ``QwenImage21Transformer2DModel`` is a different class and is not matched.
"""
from __future__ import annotations

import torch
from diffusers import QwenImageTransformer2DModel
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_qwenimage import QwenDoubleStreamAttnProcessor2_0
from torch.utils.hooks import RemovableHandle

from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, routed_processor_class
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter, Table
from usp_dit.pipelines.tensor import BlockCuts, Split, TensorPlan
from usp_dit.sharding.shard import shard_sequence

# Note [routing a stock processor's attention call] (usp_dit.pipelines._routing): the stock code,
# its one dispatch_attention_fn call routed. None if this diffusers' processor makes no such call.
_RoutedQwenProcessor = routed_processor_class(QwenDoubleStreamAttnProcessor2_0, "_RoutedQwenProcessor")

# QwenImageTransformerBlock.forward(hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
# temb, image_rotary_emb, joint_attention_kwargs, modulate_index): the index of modulate_index when
# passed positionally (gradient checkpointing passes every argument so).
_MODULATE_INDEX_POS = 6


class USPQwenDoubleStreamAttnProcessor(_RoutedQwenProcessor or RoutedProcessor):
    """Qwen-Image joint attention of this rank's image shard and the replicated, masked text tokens.

    Inputs: ``hidden_states`` (B, S_local, C); ``encoder_hidden_states`` (B, T, C), replicated;
    ``encoder_hidden_states_mask`` (B, T) bool or ``None``; ``image_rotary_emb``
    ``(img_freqs (S_local, D/2), txt_freqs (T, D/2))`` (the image rows sliced by the hook on
    ``pos_embed``). Returns ``(image_out (B, S_local, C), text_out (B, T, C))``, text_out equal on
    every rank (Note [padded text rows] for its masked rows).

    The explicit signature matters: ``Attention.forward`` passes only the keyword arguments that
    the processor's ``__call__`` names.
    """

    def __call__(
        self,
        attn: Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_hidden_states_mask: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return super().__call__(
            attn, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, attention_mask, image_rotary_emb)


class ModulateIndexHooks:
    """Note [Qwen-Image's per-token tables]: ``modulate_index``, cut like the tokens at every block.

    A plan ``hooks`` factory: installed after the token hooks, so block 0's pre-hook here runs
    after its input is sharded, when ``state.seq_len`` is this call's token count.
    """

    def __init__(self, transformer: QwenImageTransformer2DModel, state: ShardState) -> None:
        self.state = state
        self.blocks = list(transformer.transformer_blocks)
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        for block in self.blocks:
            self.handles.append(block.register_forward_pre_hook(self._shard_modulate_index, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _shard_modulate_index(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """``modulate_index`` (B, S) -> (B, S_local); ``None`` (no ``zero_cond_t``) passes unchanged.

        Raises:
            ValueError: its length is not the token count.
            NotImplementedError: its batch is not the tokens' (cfg split with ``zero_cond_t``).
        """
        index = _get_arg(args, kwargs, "modulate_index", _MODULATE_INDEX_POS)
        if index is None:
            return None
        hidden = _get_arg(args, kwargs, "hidden_states", 0)
        if index.shape[1] != self.state.seq_len:
            raise ValueError(
                f"modulate_index has {index.shape[1]} entries per sample but hidden_states has {self.state.seq_len} "
                f"image tokens (img_shapes must describe the tokens)"
            )
        if index.shape[0] != hidden.shape[0]:
            raise NotImplementedError(
                f"modulate_index has {index.shape[0]} rows for a batch of {hidden.shape[0]}: with zero_cond_t the "
                f"model builds it from img_shapes, which enable_usp's cfg split cannot halve (a Python list); "
                f"use cfg_degree=1 with zero_cond_t"
            )
        index_local = shard_sequence(index, self.state.mesh, dim=1)  # (B, S_local)
        return _set_arg(args, kwargs, "modulate_index", _MODULATE_INDEX_POS, index_local)


def _routed_call_missing(transformer: QwenImageTransformer2DModel) -> str | None:
    if _RoutedQwenProcessor is None:
        return f"this diffusers' QwenDoubleStreamAttnProcessor2_0 does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


# Tensor parallelism (usp_dit.pipelines.tensor Note [tensor plans]), where Diffusers' own Qwen-Image
# ``_tp_plan`` cuts: the joint attention's heads (image and text projections, both outputs) and the
# two MLPs' hidden widths. Its QK norms are per head (RMSNorm over head_dim): exact on a rank's
# heads; the modulation (img_mod, txt_mod) stays whole.
_TENSOR = TensorPlan((BlockCuts("transformer_blocks", splits=(
    Split(columns=("attn.to_q", "attn.to_k", "attn.to_v", "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
          rows=("attn.to_out.0", "attn.to_add_out"), heads="attn"),
    Split(columns=("img_mlp.net.0.proj",), rows=("img_mlp.net.2",)),
    Split(columns=("txt_mlp.net.0.proj",), rows=("txt_mlp.net.2",)),
)),))

PLAN = ModelPlan(
    name="QwenImage",
    # Matched by exact class: QwenImage21Transformer2DModel is another class.
    model_class=QwenImageTransformer2DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    attention=(
        # joint [text; image shard] attention, text first and replicated, masked per element
        Parallel("transformer_blocks.*.attn", USPQwenDoubleStreamAttnProcessor,
                 stock=(QwenDoubleStreamAttnProcessor2_0,), text="first"),
    ),
    block_lists=("transformer_blocks",),
    # pos_embed(img_shapes, ...) -> (img_freqs (S, D/2), txt_freqs (T, D/2)): the image table is
    # cut on dim 0, the text table passes whole (Note [Qwen-Image's per-token tables]).
    tables=(Table("pos_embed", dim=0, items=(0,)),),
    # Batched on dim 0, split over the "cfg" axis by enable_usp. img_shapes (a list of per-sample
    # shapes, all equal as the model's RoPE requires) stays whole.
    cfg_batch_args=(
        "hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep", "guidance",
        "additional_t_cond",
    ),
    # QwenImagePipeline's true CFG: one call per branch, differing in these (cfg_pair Note [two calls a step]).
    cfg_branch_args=("encoder_hidden_states", "encoder_hidden_states_mask"),
    hooks=(ModulateIndexHooks,),
    refuse_args={"controlnet_block_samples": "Qwen-Image ControlNet's residuals, (B, S, C) over the whole sequence"},
    refuse=(_routed_call_missing,),
    tensor=_TENSOR,
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
