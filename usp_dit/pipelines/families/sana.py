"""Sana adapter: ``SanaTransformer2DModel`` (Sana 600M / 1600M, Sana 1.5, Sana-Sprint) on a USP grid.

Layout: latents (batch, channels, height, width); image tokens (batch, seq, channels), ``seq =
(height / p) * (width / p)`` row-major as ``PatchEmbed`` flattens them (p = 1 in every released
config: the DC-AE compresses 32x); text (batch, text_len, channels) with a padding mask
(batch, text_len), replicated on every rank.

Sana's blocks differ from every other family's in two places, and neither is softmax attention
over the tokens:

* ``attn1``: **linear** self-attention (ReLU kernels, ``SanaLinearAttnProcessor2_0``). A ring
  would be the wrong algorithm: the sum over keys factors into a per-head summary ``[V; 1] @ K``,
  which each rank sums over its own tokens and one all-reduce over the sequence group completes
  (``usp_dit.pipelines._linear_attention`` Note [linear attention on a grid]). The processor here
  is the stock one term by term (ReLU, the float32 upcast, the padded row of ones, the 1e-15 in the
  denominator, the float16 clip) with that all-reduce between the two matmuls.
* ``ff`` (``GLUMBConv``, Mix-FFN): 1x1 convs (per token) around a **depthwise 3x3 conv over the
  token grid**, which reads the rows above and below each token. The block reshapes its tokens to
  (height, width) before ``ff``; a block pre-hook tells it the grid is 1 x seq_local (a view of
  this rank's tokens), and hooks on ``ff.conv_depth`` hand the stock conv the whole rows this
  rank's tokens and one halo row either side span, fetched from the ranks that hold them, and keep
  this rank's tokens of its output (``usp_dit.pipelines._grid_conv`` Note [a conv over sharded
  tokens]). Exact: each output token is the same sum of the same products; the extra work is at
  most 4 rows of the depthwise conv per rank.

``attn2`` is ordinary cross-attention from this rank's image tokens to the replicated text (the
mask per element, as stock): local, its stock processor stays. The tokens are split at block 0's
input and gathered at ``proj_out``'s output (``_token_sharding`` Note [where the sequence is
split]); there is no RoPE (a sin-cos position table, where a config has one, is added in
``patch_embed`` before the split). Sana 1600M at 1024 x 1024: 32 x 32 = 1024 image tokens (128 a
rank on 8), 300 Gemma-2 text tokens replicated; 4096 x 4096: 16384 (2048 a rank on 8). The
summaries are B x 70 x 33 x 32 float32 a layer (296 KB a batch element), whatever the size.

The adapter is a ``ModelPlan`` (``usp_dit.pipelines.plan`` Note [a model is a plan]). ``SanaPipeline``
batches [uncond, cond] in one call: ``cfg_degree=2`` splits it. ``SanaSprintPipeline`` embeds the
guidance (one call a step). Ulysses and ring degrees both just split the tokens (the all-reduce
spans the whole sequence group): every grid of the same size runs the same maths.

Refused (NotImplementedError): at enable, a processor other than the stock ones (PAG's, custom,
LoRA-replaced), a block that is not a stock ``SanaTransformerBlock``, a ``GLUMBConv`` whose convs
are not 1x1 / depthwise 3x3 with stride 1 and zero padding 1 (the halo is one row), an unsupported
Diffusers cache, ``num_layers=0``; at the call, ``controlnet_block_samples`` (SanaControlNetPipeline:
full-sequence residuals) and a grid with fewer tokens than the sequence group has ranks (a rank with
no row of the conv). Only the contiguous token layout is used (the attention is not causal).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from diffusers import SanaTransformer2DModel
from diffusers.models.attention_processor import SanaLinearAttnProcessor2_0
from diffusers.models.transformers.sana_transformer import GLUMBConv, SanaAttnProcessor2_0, SanaTransformerBlock
from torch.utils.hooks import RemovableHandle

from usp_dit.pipelines._grid_conv import GridShards, own_tokens, window_tokens
from usp_dit.pipelines._linear_attention import summed_over_sequence
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter

HEIGHT_ARG, WIDTH_ARG = 5, 6  # SanaTransformerBlock.forward(hidden_states, ..., timestep, height, width)


class USPSanaLinearAttnProcessor:
    """``SanaLinearAttnProcessor2_0`` over this rank's tokens, its per-head summary summed over the
    sequence group (Note [linear attention on a grid] in ``usp_dit.pipelines._linear_attention``)."""

    def __init__(self, state: ShardState) -> None:
        self.state = state

    def __call__(
        self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, S_local, C) -> (B, S_local, C). The stock processor's maths, line for line; only the
        summary ``[V; 1] @ K`` (B, H, D + 1, D) is summed over the ranks before the queries read it.

        Raises:
            NotImplementedError: ``encoder_hidden_states`` given (stock Sana never does: linear
                cross-attention over replicated keys would need no sum; not written).
        """
        if encoder_hidden_states is not None:
            raise NotImplementedError("usp_dit's Sana adapter runs attn1 as self-attention over the image tokens only")
        original_dtype = hidden_states.dtype
        query = attn.to_q(hidden_states)
        key = attn.to_k(hidden_states)
        value = attn.to_v(hidden_states)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        query = query.transpose(1, 2).unflatten(1, (attn.heads, -1))  # (B, H, D, S_local)
        key = key.transpose(1, 2).unflatten(1, (attn.heads, -1)).transpose(2, 3)  # (B, H, S_local, D)
        value = value.transpose(1, 2).unflatten(1, (attn.heads, -1))  # (B, H, D, S_local)
        query, key = F.relu(query), F.relu(key)
        query, key, value = query.float(), key.float(), value.float()
        value = F.pad(value, (0, 0, 0, 1), mode="constant", value=1.0)  # (B, H, D + 1, S_local): a row of ones
        scores = summed_over_sequence(torch.matmul(value, key), self.state.mesh)  # (B, H, D + 1, D), all tokens
        hidden_states = torch.matmul(scores, query)  # (B, H, D + 1, S_local)
        hidden_states = hidden_states[:, :, :-1] / (hidden_states[:, :, -1:] + 1e-15)
        hidden_states = hidden_states.flatten(1, 2).transpose(1, 2).to(original_dtype)
        hidden_states = attn.to_out[0](hidden_states)
        hidden_states = attn.to_out[1](hidden_states)
        if original_dtype == torch.float16:
            hidden_states = hidden_states.clip(-65504, 65504)
        return hidden_states


@dataclass(eq=False)
class SanaGridHooks:
    """The Mix-FFN's depthwise conv over sharded tokens (the module docstring; Note [a conv over
    sharded tokens] in ``usp_dit.pipelines._grid_conv``).

    A pre-hook on every block records the call's (height, width) token grid and passes the block
    (1, seq_local) instead, so its reshape before ``ff`` is a view of this rank's tokens; a pre-hook
    on ``ff.conv_depth`` replaces its (B, C, 1, seq_local) input by the rows of this rank's window,
    a forward hook keeps this rank's tokens of the output (B, C, 1, seq_local).
    """

    transformer: torch.nn.Module
    state: ShardState
    grid: GridShards | None = None
    handles: list[RemovableHandle] = field(default_factory=list)

    def install(self) -> None:
        if self.state.mesh.sequence_degree == 1:
            return  # every token on this rank: the stock conv over the whole grid is already right
        for block in self.transformer.transformer_blocks:
            self.handles.append(block.register_forward_pre_hook(self._enter_block, with_kwargs=True))
            conv = block.ff.conv_depth
            self.handles.append(conv.register_forward_pre_hook(self._window))
            self.handles.append(conv.register_forward_hook(self._own))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _enter_block(self, block, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """(height, width) of the whole grid -> (1, seq_local) for the block; the grid kept for its conv.

        Raises:
            NotImplementedError: fewer tokens than ranks (a rank would hold no row of the conv).
            ValueError: the block's tokens are not this rank's share of height x width.
        """
        height, width = _get_arg(args, kwargs, "height", HEIGHT_ARG), _get_arg(args, kwargs, "width", WIDTH_ARG)
        mesh = self.state.mesh
        if height * width < mesh.sequence_degree:
            raise NotImplementedError(
                f"usp_dit's Sana adapter: a {height} x {width} token grid on {mesh.sequence_degree} sequence ranks "
                f"leaves a rank without tokens for the Mix-FFN's conv; use at most {height * width} ranks"
            )
        grid = GridShards(height, width, mesh.sequence_degree, halo=1)
        local = _get_arg(args, kwargs, "hidden_states", 0).shape[1]
        if local != grid.sizes[mesh.seq_rank]:
            raise ValueError(f"block input has {local} tokens; rank {mesh.seq_rank}'s share of the {height} x {width} "
                             f"grid is {grid.sizes[mesh.seq_rank]}")
        self.grid = grid
        args, kwargs = _set_arg(args, kwargs, "height", HEIGHT_ARG, 1)
        return _set_arg(args, kwargs, "width", WIDTH_ARG, local)

    def _window(self, conv, args: tuple) -> tuple:
        """(B, C, 1, seq_local) -> (B, C, rows, width): the whole rows of this rank's window."""
        x = args[0]
        if self.grid is None or x.shape[2] != 1:
            raise NotImplementedError("usp_dit's Sana adapter: ff.conv_depth called outside its block's forward")
        return (window_tokens(x.flatten(2), self.grid, self.state.mesh), *args[1:])

    def _own(self, conv, args: tuple, out: torch.Tensor) -> torch.Tensor:
        """(B, C, rows, width) -> (B, C, 1, seq_local): this rank's tokens of the conv's output."""
        return own_tokens(out, self.grid, self.state.mesh).unsqueeze(2)


def _conv_reason(ff: torch.nn.Module, path: str) -> str | None:
    if type(ff) is not GLUMBConv:
        return f"{path} is {type(ff).__name__}, not Diffusers' GLUMBConv (its convs are what the halo is sized for)"
    for name, kernel in (("conv_inverted", 1), ("conv_point", 1), ("conv_depth", 3)):
        conv = getattr(ff, name)
        expected = ((kernel, kernel), (1, 1), (kernel // 2, kernel // 2), (1, 1), "zeros")
        got = (conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.padding_mode)
        if type(conv) is not torch.nn.Conv2d or got != expected:
            return (f"{path}.{name} has (kernel, stride, padding, dilation, padding_mode) = {got}; the sharded Mix-FFN "
                    f"is exact for {expected} only")
    return None


def _blocks_reason(model: torch.nn.Module) -> str | None:
    """A reason to refuse a block the hooks were not written for, or None."""
    for i, block in enumerate(model.transformer_blocks):
        if type(block) is not SanaTransformerBlock:
            return f"transformer_blocks.{i} is {type(block).__name__}, not SanaTransformerBlock"
        reason = _conv_reason(block.ff, f"transformer_blocks.{i}.ff")
        if reason:
            return reason
    return None


PLAN = ModelPlan(
    name="Sana",
    model_class=SanaTransformer2DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    attention=(
        Parallel("transformer_blocks.*.attn1", USPSanaLinearAttnProcessor, stock=(SanaLinearAttnProcessor2_0,)),
        Local("transformer_blocks.*.attn2", stock=(SanaAttnProcessor2_0,)),
    ),
    block_lists=("transformer_blocks",),
    # SanaPipeline batches [uncond, cond] in one call (Sprint's guidance is embedded: one call, its batch).
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask", "guidance"),
    hooks=(SanaGridHooks,),
    refuse=(_blocks_reason,),
    refuse_args={"controlnet_block_samples": "SanaControlNet's residuals, (B, S, C) over the whole sequence"},
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
