"""Sana-Video adapter: ``SanaVideoTransformer3DModel`` (SANA-Video 2B, 480p / 720p) on a USP grid.

Layout: latents (batch, channels, frames, height, width); video tokens (batch, seq, channels),
``seq = frames/p_t * height/p_h * width/p_w`` frame-major, as ``patch_embedding(x).flatten(2)``
orders them (patch (1, 2, 2) released); text (batch, text_len, channels) with a padding mask
(batch, text_len), replicated on every rank; the RoPE table ``rope(latents)`` ``(cos, sin)``, each
(1, seq, 1, head_dim), **the sequence on dim 1** (Wan's ``WanRotaryPosEmbed``).

Sana-Video's blocks are Sana's (``usp_dit.pipelines.families.sana``) gone 3-D, and again neither
token mixer is softmax attention over the tokens:

* ``attn1``: **linear** self-attention with RoPE (``SanaLinearAttnProcessor3_0``): ReLU kernels,
  the queries and keys rotated for the numerator only, the normaliser from the unrotated ones:

      out[:, s] = (sum_t V[:, t] rot(K)[t, :]) rot(Q)[:, s] / ((sum_t K[t, :]) Q[:, s] + 1e-15)

  Both sums over tokens split over ranks: each rank sums its own tokens, one all-reduce over the
  sequence group of the two summaries (B, H, D, D) and (B, H, 1, D), concatenated, completes them
  (``usp_dit.pipelines._linear_attention`` Note [linear attention on a grid]); each rank reads
  them with its own (rotated) queries. The RoPE rows follow the tokens (the ``Table`` on ``rope``).
* ``ff`` (``GLUMBTempConv``): 1x1 convs (per token) around a **depthwise 3x3 conv over each
  frame's (height, width)**, then a **(3, 1) conv along time** (every token reads the same
  position one frame before and after), added to its input. A block pre-hook passes the block
  (frames, height, width) = (1, 1, seq_local), so its reshapes are views of this rank's tokens;
  hooks on ``ff.conv_depth`` hand the stock conv this rank's window of whole rows (one halo row
  either side, zero rows between frames: ``usp_dit.pipelines._grid_conv`` Note [a per-frame conv
  over sharded video tokens]) and keep this rank's tokens of its output; hooks on
  ``ff.conv_temp`` do the same over the (frames, height x width) grid, one halo frame either side.
  Exact: each output token is the same sum of the same products.

``attn2`` is ordinary cross-attention from this rank's video tokens to the replicated text (the
mask per element): local, its stock processor stays. The tokens are split at block 0's input and
gathered at ``proj_out``'s output (``_token_sharding`` Note [where the sequence is split]). SANA-
Video 2B at 480 x 832 x 81 frames: 21 x 30 x 52 = 32760 tokens (4095 a rank on 8), 300 Gemma-2
text tokens replicated; the summaries are B x 20 x 113 x 112 float32 a layer, whatever the length.
The halos, a rank and layer on 8 ranks: the spatial conv fetches 2-3 rows (about 150 tokens); the
temporal conv's window is whole frames (its tokens' frames and one either side: up to 6 frames,
about 5300 tokens fetched, where the conv reads 2 frames' worth, 3120: a token-exact window would
halve it, a possible refinement of ``_grid_conv``).

The adapter is a ``ModelPlan`` (``usp_dit.pipelines.plan`` Note [a model is a plan]).
``SanaVideoPipeline`` and ``SanaImageToVideoPipeline`` batch [uncond, cond] in one call:
``cfg_degree=2`` splits it. The I2V pipeline's timestep is per token (0 on the conditioning frame):
``SanaVideoTimestepHook`` cuts it like the tokens. Ulysses and
ring degrees both just split the tokens (the all-reduce spans the whole sequence group): every grid
of the same size runs the same maths.

Refused (NotImplementedError): at enable, a processor other than the stock ones (custom,
LoRA-replaced), a block that is not a stock ``SanaVideoTransformerBlock``, a ``GLUMBTempConv``
whose convs are not 1x1 / depthwise 3x3 / (3, 1) with stride 1 and zero padding of half the kernel,
or that has a norm or a residual the block does not build, an unsupported Diffusers cache,
``num_layers=0``; at the call, ``controlnet_block_samples`` (full-sequence residuals) and fewer
tokens than the sequence group has ranks (a rank with no row of the convs).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from diffusers import SanaVideoTransformer3DModel
from diffusers.models.transformers.transformer_sana_video import (
    GLUMBTempConv,
    SanaAttnProcessor2_0,
    SanaLinearAttnProcessor3_0,
    SanaVideoTransformerBlock,
)
from torch.utils.hooks import RemovableHandle

from usp_dit.pipelines._grid_conv import GridShards, own_tokens, window_tokens
from usp_dit.pipelines._linear_attention import summed_over_sequence
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, Table
from usp_dit.sharding.shard import shard_sequence

# SanaVideoTransformerBlock.forward(hidden_states, attention_mask, encoder_hidden_states,
# encoder_attention_mask, timestep, frames, height, width, rotary_emb)
FRAMES_ARG, HEIGHT_ARG, WIDTH_ARG = 5, 6, 7


def _rotated(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Stock ``SanaLinearAttnProcessor3_0``'s RoPE on interleaved pairs: x (B, S, H, D), cos / sin (1, S, 1, D)."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[..., 0::2], sin[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x1 * sin + x2 * cos
    return out.type_as(x)


_STOCK_LINEAR = SanaLinearAttnProcessor3_0()


class USPSanaVideoLinearAttnProcessor:
    """``SanaLinearAttnProcessor3_0`` over this rank's tokens, its two summaries summed over the
    sequence group (the module docstring; Note [linear attention on a grid])."""

    def __init__(self, state: ShardState) -> None:
        self.state = state

    def __call__(
        self, attn, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """(B, S_local, C) -> (B, S_local, C); ``rotary_emb`` this rank's rows, each (1, S_local, 1, D).
        The stock maths term by term; only ``V rot(K)^T`` (B, H, D, D) and ``sum K`` (B, H, 1, D)
        are summed over the ranks before the queries read them.

        Raises:
            NotImplementedError: ``encoder_hidden_states`` given, or no ``rotary_emb`` (the stock
                block passes neither way; the stock processor fails without RoPE).
        """
        if encoder_hidden_states is not None or rotary_emb is None:
            raise NotImplementedError("usp_dit's Sana-Video adapter runs attn1 as self-attention over the video "
                                      "tokens with the model's RoPE, as SanaVideoTransformerBlock calls it")
        if self.state.mesh.sequence_degree == 1:
            # Every token on this rank: nothing to sum over ranks, so stock's own code (its kernels,
            # its rotation) is the whole answer, at stock's speed.
            return _STOCK_LINEAR(attn, hidden_states, rotary_emb=rotary_emb)
        original_dtype = hidden_states.dtype
        query, key, value = attn.to_q(hidden_states), attn.to_k(hidden_states), attn.to_v(hidden_states)
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        query = F.relu(query.unflatten(2, (attn.heads, -1)))  # (B, S_local, H, D)
        key = F.relu(key.unflatten(2, (attn.heads, -1)))
        value = value.unflatten(2, (attn.heads, -1))
        query_rotate = _rotated(query, *rotary_emb).permute(0, 2, 3, 1).float()  # (B, H, D, S_local)
        key_rotate = _rotated(key, *rotary_emb).permute(0, 2, 3, 1).float()
        query, key = query.permute(0, 2, 3, 1), key.permute(0, 2, 3, 1)
        value = value.permute(0, 2, 3, 1).float()
        # One all-reduce for both sums over tokens: the numerator's (B, H, D, D) and the keys' (B, H, 1, D),
        # summed in float32 (the sum over a rank's keys, as torch.sum accumulates it) and cast back.
        partial = torch.cat([value @ key_rotate.transpose(-1, -2), key.float().sum(-1, keepdim=True).transpose(-2, -1)],
                            dim=2)
        summed = summed_over_sequence(partial, self.state.mesh)
        scores, key_sum = summed[:, :, :-1], summed[:, :, -1:].to(key.dtype)
        z = 1 / (key_sum @ query + 1e-15)  # (B, H, 1, S_local)
        hidden_states = torch.matmul(scores, query_rotate) * z
        hidden_states = hidden_states.flatten(1, 2).transpose(1, 2).to(original_dtype)
        hidden_states = attn.to_out[0](hidden_states)
        return attn.to_out[1](hidden_states)


@dataclass(eq=False)
class SanaVideoGridHooks:
    """The Mix-FFN's convs over sharded video tokens (the module docstring).

    A pre-hook on every block records the call's (frames, height, width) token grid and passes the
    block (1, 1, seq_local), so its reshapes before and inside ``ff`` are views of this rank's
    tokens; pre-hooks on ``ff.conv_depth`` and ``ff.conv_temp`` replace their (B, C, 1, seq_local)
    input by the rows of this rank's window (per frame rows, then whole frames), forward hooks
    keep this rank's tokens of their outputs (B, C, 1, seq_local).
    """

    transformer: torch.nn.Module
    state: ShardState
    spatial: GridShards | None = None  # (frames x height, width) rows, frame_rows = height
    temporal: GridShards | None = None  # (frames, height x width)
    handles: list[RemovableHandle] = field(default_factory=list)

    def install(self) -> None:
        if self.state.mesh.sequence_degree == 1:
            return  # every token on this rank: the stock convs over the whole grid are already right
        for block in self.transformer.transformer_blocks:
            self.handles.append(block.register_forward_pre_hook(self._enter_block, with_kwargs=True))
            for conv, grid in ((block.ff.conv_depth, "spatial"), (block.ff.conv_temp, "temporal")):
                self.handles.append(conv.register_forward_pre_hook(self._window_hook(grid)))
                self.handles.append(conv.register_forward_hook(self._own_hook(grid)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _enter_block(self, block, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """(frames, height, width) of the whole grid -> (1, 1, seq_local) for the block; the grids kept.

        Raises:
            NotImplementedError: fewer tokens than ranks (a rank would hold no row of the convs).
            ValueError: the block's tokens are not this rank's share of frames x height x width.
        """
        frames, height, width = (_get_arg(args, kwargs, name, i) for name, i in
                                 (("frames", FRAMES_ARG), ("height", HEIGHT_ARG), ("width", WIDTH_ARG)))
        mesh = self.state.mesh
        tokens = frames * height * width
        if tokens < mesh.sequence_degree:
            raise NotImplementedError(
                f"usp_dit's Sana-Video adapter: a {frames} x {height} x {width} token grid on {mesh.sequence_degree} "
                f"sequence ranks leaves a rank without tokens for the Mix-FFN's convs; use at most {tokens} ranks"
            )
        spatial = GridShards(frames * height, width, mesh.sequence_degree, halo=1, frame_rows=height)
        local = _get_arg(args, kwargs, "hidden_states", 0).shape[1]
        if local != spatial.sizes[mesh.seq_rank]:
            raise ValueError(f"block input has {local} tokens; rank {mesh.seq_rank}'s share of the {frames} x "
                             f"{height} x {width} grid is {spatial.sizes[mesh.seq_rank]}")
        self.spatial = spatial
        self.temporal = GridShards(frames, height * width, mesh.sequence_degree, halo=1)
        for name, i, value in (("frames", FRAMES_ARG, 1), ("height", HEIGHT_ARG, 1), ("width", WIDTH_ARG, local)):
            args, kwargs = _set_arg(args, kwargs, name, i, value)
        return args, kwargs

    def _window_hook(self, grid: str):
        def window(conv, args: tuple) -> tuple:
            """(B, C, 1, seq_local) -> (B, C, rows, width): the rows of this rank's window."""
            x, shards = args[0], getattr(self, grid)
            if shards is None or x.shape[2] != 1:
                raise NotImplementedError("usp_dit's Sana-Video adapter: a Mix-FFN conv called outside its block")
            return (window_tokens(x.flatten(2), shards, self.state.mesh), *args[1:])
        return window

    def _own_hook(self, grid: str):
        def own(conv, args: tuple, out: torch.Tensor) -> torch.Tensor:
            """(B, C, rows, width) -> (B, C, 1, seq_local): this rank's tokens of the conv's output."""
            return own_tokens(out, getattr(self, grid), self.state.mesh).unsqueeze(2)
        return own


@dataclass(eq=False)
class SanaVideoTimestepHook:
    """``SanaImageToVideoPipeline``'s per-token timestep (B, 1, F, H, W) (0 on the conditioning
    frame): the model flattens it to (B * seq,) and embeds every token's into the blocks'
    modulation (B, seq, 6C) and the final norm's (B, seq, C). A pre-hook on ``time_embed`` hands it
    this rank's rows instead, so both come out (B, seq_local, ...) like the tokens (and the
    embedding is not computed P times over). One timestep per element (B,) passes unchanged.
    """

    transformer: torch.nn.Module
    state: ShardState
    handle: RemovableHandle | None = None

    def install(self) -> None:
        self.handle = self.transformer.time_embed.register_forward_pre_hook(self._shard_timestep, with_kwargs=True)

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _shard_timestep(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """(B * seq,) -> this rank's (B * seq_local,); (B,) unchanged. ``seq`` is this call's token
        count, fixed by the RoPE table's cut (made before ``time_embed``)."""
        timestep, seq = _get_arg(args, kwargs, "timestep", 0), self.state.seq_len
        batch = kwargs.get("batch_size")
        if batch is None:  # SanaCombinedTimestepGuidanceEmbeddings: one guidance per element
            batch = _get_arg(args, kwargs, "guidance", 1).shape[0]
        if seq is None or seq == 1 or timestep.numel() != batch * seq:
            return None
        local = shard_sequence(timestep.unflatten(0, (batch, seq)), self.state.mesh, dim=1, layout=self.state.layout)
        return _set_arg(args, kwargs, "timestep", 0, local.flatten())


_CONVS = (  # name, kernel, padding: what the halos are sized for (stride 1, dilation 1, zero padding)
    ("conv_inverted", (1, 1), (0, 0)), ("conv_point", (1, 1), (0, 0)),
    ("conv_depth", (3, 3), (1, 1)), ("conv_temp", (3, 1), (1, 0)),
)


def _ff_reason(ff: torch.nn.Module, path: str) -> str | None:
    if type(ff) is not GLUMBTempConv:
        return f"{path} is {type(ff).__name__}, not Diffusers' GLUMBTempConv (its convs are what the halos are sized for)"
    if ff.norm is not None or ff.residual_connection:
        return f"{path} has a norm or a residual connection (SanaVideoTransformerBlock builds it with neither)"
    for name, kernel, padding in _CONVS:
        conv = getattr(ff, name)
        expected = (kernel, (1, 1), padding, (1, 1), "zeros")
        got = (conv.kernel_size, conv.stride, conv.padding, conv.dilation, conv.padding_mode)
        if type(conv) is not torch.nn.Conv2d or got != expected:
            return (f"{path}.{name} has (kernel, stride, padding, dilation, padding_mode) = {got}; the sharded Mix-FFN "
                    f"is exact for {expected} only")
    return None


def _blocks_reason(model: torch.nn.Module) -> str | None:
    """A reason to refuse a block the hooks were not written for, or None."""
    for i, block in enumerate(model.transformer_blocks):
        if type(block) is not SanaVideoTransformerBlock:
            return f"transformer_blocks.{i} is {type(block).__name__}, not SanaVideoTransformerBlock"
        reason = _ff_reason(block.ff, f"transformer_blocks.{i}.ff")
        if reason:
            return reason
    return None


PLAN = ModelPlan(
    name="SanaVideo",
    model_class=SanaVideoTransformer3DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    attention=(
        Parallel("transformer_blocks.*.attn1", USPSanaVideoLinearAttnProcessor, stock=(SanaLinearAttnProcessor3_0,)),
        Local("transformer_blocks.*.attn2", stock=(SanaAttnProcessor2_0,)),
    ),
    block_lists=("transformer_blocks",),
    # rope(latents) -> (cos, sin), each (1, seq, 1, head_dim): cut like the tokens.
    tables=(Table("rope", dim=1, items=(0, 1)),),
    # SanaVideoPipeline batches [uncond, cond] in one call.
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask", "guidance"),
    hooks=(SanaVideoGridHooks, SanaVideoTimestepHook),
    refuse=(_blocks_reason,),
    refuse_args={"controlnet_block_samples": "ControlNet residuals, (B, S, C) over the whole sequence"},
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
