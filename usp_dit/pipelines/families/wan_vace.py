"""Wan VACE adapter: ``WanVACETransformer3DModel`` (Wan 2.1 VACE 1.3B / 14B, Wan 2.2 VACE-Fun A14B) on a USP grid.

Layout: as Wan's (``usp_dit.pipelines.families.wan``): latents (batch, channels, frames, height,
width); video tokens (batch, seq, channels), frame-major; text (batch, text_seq, channels),
replicated; the RoPE table ``(cos, sin)``, each (1, seq, 1, head_dim). Besides them, the **control
latents** ``control_hidden_states`` (batch, vace_in_channels, frames_c, height, width) (the
pipeline's masked video latents, reference-image latents and mask, concatenated on channels),
patch-embedded by ``vace_patch_embedding`` into control tokens (batch, seq_c, channels) with the
video's patch and token order, then zero-padded at the end to (batch, seq, channels);
``control_hidden_states_scale`` (len(vace_layers),), one scale per hint, replicated.

What VACE adds to Wan: ``len(vace_layers)`` control blocks (``vace_blocks``) that run **before** the
main blocks, each a Wan block over the control tokens (self-attention ``attn1`` with the video's
RoPE, cross-attention ``attn2`` to the text, feed-forward, the main blocks' modulation). Control
block 0 adds the video tokens first (``proj_in(control) + hidden_states``); every control block
returns a **hint** ``proj_out(control)`` (batch, seq, channels). Main block ``vace_layers[i]``'s
output gets ``hint_i * scale_i`` added, token by token.

Note [VACE's control tokens are cut like the video tokens]
    Token j of the control stream and of every hint sits at the same latent position as video token
    j (same patch embedding geometry, same frame-major order; the zero padding covers the positions
    past the control latent's last frame). So one cut serves all: a forward pre-hook on
    ``vace_blocks.0`` hands it this rank's rows of both ``hidden_states`` (its argument 0, the
    whole video tokens) and ``control_hidden_states`` (argument 2), cut with the same
    ``shard_sequence`` (same layout) as block 0's input. Every control block then runs on the
    rank's shard; each hint comes out (batch, seq_local, channels) and is added to the main
    stream's rows of the same tokens, on the same rank, with no communication:

        patch embed (full) ─► rope table (cut: Table) ─► [pre-hook vace_blocks.0: cut video and control]
            ─► vace blocks (shard) ─► hints (shard) ─┐
        [pre-hook blocks.0: cut video] ─► blocks ─► + hint_i * scale_i after block vace_layers[i] ─► proj_out (gathered)

    Control blocks after 0 take ``hidden_states`` too but do not read it (only block 0 has
    ``proj_in``), so only block 0 is hooked: the later ones get the shard their predecessor made.
    The padding is made before the cut, at the full length, so a control latent shorter than the
    video's (fewer frames) pads exactly as on one process. Gradient checkpointing recomputes
    ``vace_blocks.0`` from its saved whole inputs: the hook cuts them again.

Attention: the control blocks' ``attn1`` is self-attention over the control tokens (the whole
control sequence: sequence-parallel, ``usp_attention``, the stock ``WanAttnProcessor`` with its
attention call routed, Wan's ``USPWanAttnProcessor``) with the video's RoPE rows; their ``attn2``
is cross-attention to the replicated text (local, stock processor). The main blocks are Wan's.
Per-rank tokens: Wan 2.1 VACE-14B at 720p x 81 frames, 75600 video tokens and as many control
tokens, 9450 of each per rank on 8 ranks; the 8 control blocks add 8/40 to a step's block work,
split like the rest.

CFG: ``WanVACEPipeline`` calls the transformer once per guidance branch (conditional, then
unconditional with the negative prompt's embeds; the same control latents and scales), like
Wan's: ``cfg_branch_args`` (``usp_dit.pipelines.cfg_pair`` Note [two calls a step]). Both Wan 2.2
experts (``transformer``, ``transformer_2``) are enabled on one mesh by ``pipe.enable_usp()``.

Refused (NotImplementedError, at enable): as Wan's (a foreign processor at any attention site,
Diffusers' context parallelism, FasterCache, this diffusers' processor making no routable call,
``num_layers=0``); an ``attention_mask`` at the call. Nothing VACE adds is refused: its control
tokens, hints and scales are per token or per layer and split exactly.
"""
from __future__ import annotations

import torch
from diffusers import WanVACETransformer3DModel
from diffusers.models.transformers.transformer_wan import WanAttnProcessor
from torch.utils.hooks import RemovableHandle

import usp_dit.pipelines.families.wan as wan
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter
from usp_dit.sharding.shard import shard_sequence


class VACEControlShardHook:
    """Note [VACE's control tokens are cut like the video tokens]: a pre-hook on ``vace_blocks.0``."""

    def __init__(self, transformer: WanVACETransformer3DModel, state: ShardState) -> None:
        self.state = state
        self.first_control_block = transformer.vace_blocks[0]
        self.handle: RemovableHandle | None = None

    def install(self) -> None:
        self.handle = self.first_control_block.register_forward_pre_hook(self._cut, with_kwargs=True)

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _cut(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """(B, S, C) video tokens and (B, S, C) padded control tokens -> this rank's (B, S_local, C) of each.

        Raises:
            ValueError: the video or control tokens are not as many as the RoPE table's rows (set
                by its ``Table`` hook earlier in this call): cut apart, they would not line up.
        """
        video = _get_arg(args, kwargs, "hidden_states", 0)
        control = _get_arg(args, kwargs, "control_hidden_states", 2)
        for name, tokens in (("hidden_states", video), ("control_hidden_states", control)):
            if tokens.shape[1] != self.state.seq_len:
                raise ValueError(
                    f"vace_blocks.0 got {name} of {tokens.shape[1]} tokens but the RoPE table has "
                    f"{self.state.seq_len} rows: they must match to be cut alike"
                )
        mesh, layout = self.state.mesh, self.state.layout
        args, kwargs = _set_arg(args, kwargs, "hidden_states", 0, shard_sequence(video, mesh, dim=1, layout=layout))
        control_local = shard_sequence(control, mesh, dim=1, layout=layout)
        return _set_arg(args, kwargs, "control_hidden_states", 2, control_local)


PLAN = ModelPlan(
    name="WanVACE",
    model_class=WanVACETransformer3DModel,
    split_at="blocks.0",
    gather_at="proj_out",
    attention=(
        # Self-attention over the video tokens (main blocks) and over the control tokens (control blocks).
        Parallel("blocks.*.attn1", wan.USPWanAttnProcessor, stock=(WanAttnProcessor,)),
        Parallel("vace_blocks.*.attn1", wan.USPWanAttnProcessor, stock=(WanAttnProcessor,)),
        # Cross-attention to the replicated text (and image) tokens.
        Local("blocks.*.attn2", stock=(WanAttnProcessor,)),
        Local("vace_blocks.*.attn2", stock=(WanAttnProcessor,)),
    ),
    block_lists=("vace_blocks", "blocks"),  # the order they run in: FSDP2 prefetches the next unit
    tables=wan.PLAN.tables,  # rope(latents) -> (cos, sin), each (1, seq, 1, head_dim); the control blocks use it too
    cfg_batch_args=(*wan.PLAN.cfg_batch_args, "control_hidden_states"),
    cfg_branch_args=wan.PLAN.cfg_branch_args,  # the text embeds: WanVACEPipeline calls once per branch
    hooks=(VACEControlShardHook,),
    refuse=wan.PLAN.refuse,
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
