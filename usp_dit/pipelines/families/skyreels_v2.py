"""SkyReels-V2 adapter: ``SkyReelsV2Transformer3DModel`` (T2V / I2V, and the diffusion-forcing
(DF) models' block-causal attention) on a USP grid.

Layout: latents (batch, channels, frames, height, width); video tokens (batch, seq, channels),
frame-major (``patch_embedding(x).flatten(2)``); text (batch, text_seq, channels), replicated;
Q/K/V (batch, seq, heads, head_dim); the RoPE table ``(cos, sin)``, each (1, seq, 1, head_dim);
in diffusion forcing the blocks' modulation ``temb`` is per token, (batch, 6, seq, channels), and
the final norm's is (batch, seq, channels).

The family is Wan's (``usp_dit.pipelines.families.wan``: tokens split at block 0's input, RoPE cut like
the tokens, ``attn1`` self-attention routed to ``usp_attention``, ``attn2`` cross-attention local),
with two differences:

- **Block-causal attention** (``num_frame_per_block`` > 1, the DF checkpoints): the model builds
  a dense (S, S) frame-causal mask over its tokens and passes it to every ``attn1``.
  ``USPSkyReelsV2AttnProcessor`` runs the stock code with ``usp_attention(block_causal=F)``: the
  ring skips the blocks a rank's frames cannot see. Eagerly it reads the frame length F off the
  mask (checked in full once per forward: ``usp_dit.pipelines._frame_mask``, Note [dense
  frame-causal masks]) and checks it against the F that ``SkyReelsFrameHook`` derives from the
  latent's shape and the config (``num_frame_per_block`` x tokens per latent frame). Under
  torch.compile it takes the config's F and does not read the mask (reading it is a
  data-dependent value, a graph break); this is exact, not a guess: the stock forward takes no
  mask argument and builds this one itself from those same config values and shapes, so the
  config's F is the mask's F (the eager check confirms it on every forward). The tokens are
  sharded in the "zigzag" layout (``usp_dit.sharding.layouts``): each ring rank holds an early and a late
  chunk of the video, so every rank attends to the same number of keys (in
  the contiguous layout the rank holding the last frames would do about twice the mean work).
  The RoPE table and the per-token modulation are cut in the same layout, and the gather puts
  the tokens back in order.
- **Per-token modulation** (DF: a timestep per frame, expanded by the forward to every token):
  ``SkyReelsTembHook`` hands every block this rank's rows of its 4-D ``temb`` (cut like
  the tokens), and the tokens are gathered at ``norm_out``'s output instead of ``proj_out``'s, so
  the final per-token shift and scale meet the whole sequence (``proj_out`` then runs on every
  token on every rank: one linear layer).

Refused (NotImplementedError): processors other than the stock ``SkyReelsV2AttnProcessor``, a
mask on ``attn1`` that is not frame-causal over the whole sequence, a Diffusers cache that cannot
run on a grid (``usp_dit.pipelines.caches``), ``num_layers=0``.
"""
from __future__ import annotations

import dataclasses
import functools
import operator

import torch
from diffusers import SkyReelsV2Transformer3DModel
from diffusers.models.transformers.transformer_skyreels_v2 import SkyReelsV2Attention, SkyReelsV2AttnProcessor
from torch.utils.hooks import RemovableHandle

from usp_dit.pipelines._frame_mask import FrameMaskReader
from usp_dit.pipelines._routing import ROUTED_NAME, Route, RoutedProcessor, routed_processor_class
from usp_dit.pipelines._token_sharding import ShardState
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, Table
from usp_dit.sharding.shard import shard_sequence

_RoutedSkyReelsProcessor = routed_processor_class(SkyReelsV2AttnProcessor, "_RoutedSkyReelsV2Processor")


class USPSkyReelsV2AttnProcessor(_RoutedSkyReelsProcessor or RoutedProcessor):
    """SkyReels-V2 self-attention (``attn1``) of this rank's video shard against the whole sequence.

    Inputs: ``hidden_states`` (B, S_local, C); ``attention_mask`` ``None`` or the model's (1, 1,
    S, S) frame-causal mask; ``rotary_emb`` this rank's rows of the RoPE table. Returns
    (B, S_local, C): the stock processor's code, its attention call routed (block-causal when masked).
    """

    def __init__(self, route: Route, stock=None) -> None:
        super().__init__(route, stock)
        self._frames = FrameMaskReader()
        # The frame length the model's mask has in the current forward, from the latent's shape and
        # the config (``SkyReelsFrameHook``, set before every forward); None: no mask expected.
        self.config_frame: int | None = None

    def __call__(
        self,
        attn: SkyReelsV2Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None or attn.add_k_proj is not None:
            raise NotImplementedError("USPSkyReelsV2AttnProcessor is for self-attention (attn1) only; attn2 runs locally")
        if attention_mask is None:
            return super().__call__(attn, hidden_states, None, None, rotary_emb)
        route = self._parallel_config
        frame = self._mask_frame(attention_mask, route.state.seq_len)
        # The stock code passes self._parallel_config to its attention call: this call's Route says
        # block-causal (restored after, so the processor holds no per-call state between calls).
        self._parallel_config = dataclasses.replace(route, block_causal=frame)
        try:
            return super().__call__(attn, hidden_states, None, None, rotary_emb)
        finally:
            self._parallel_config = route

    def _mask_frame(self, mask: torch.Tensor, seq_len: int) -> int:
        """The frame length of the model's frame-causal ``mask`` (module docstring).

        Raises:
            NotImplementedError: compiled, a mask with no config frame length (the mask's values
                cannot be read in a graph); eagerly, a mask that is not frame-causal, or whose
                frame length is not the config's.
        """
        known = self.config_frame
        if torch.compiler.is_compiling():
            if known is None:
                raise NotImplementedError(
                    "usp_dit: SkyReels-V2 attn1 got an attention mask under torch.compile, but the model's config "
                    "gives no frame length (num_frame_per_block <= 1, or the transformer's forward did not run "
                    "through usp_dit's hooks); its frame length cannot be read off the mask in a graph"
                )
            return known
        frame = self._frames.frame(mask, seq_len)
        if known is not None and frame != known:
            raise NotImplementedError(
                f"usp_dit: the attention mask's frame length is {frame} tokens, but the config gives {known} "
                f"(num_frame_per_block x tokens per latent frame); torch.compile would use the config's"
            )
        return frame


class SkyReelsFrameHook:
    """The frame length F of the model's own block-causal mask, from the latent and the config.

    The stock forward builds its (S, S) mask from ``config.num_frame_per_block`` and the latent's
    shape (no mask argument): F = num_frame_per_block x (height // p_h) x (width // p_w), ``None``
    when ``num_frame_per_block`` <= 1 (no mask). A forward pre-hook on the transformer hands it to
    every ``USPSkyReelsV2AttnProcessor`` of ``blocks.*.attn1`` as a plain int (each dimension
    ``operator.index``-ed: under dynamic shapes F specialises rather than staying symbolic, as a
    block-causal call's plan does anyway), so that compiled calls need not read the mask.
    """

    def __init__(self, transformer: SkyReelsV2Transformer3DModel, state: ShardState) -> None:
        self.transformer = transformer
        self.blocks = list(transformer.blocks)
        self.handle: RemovableHandle | None = None

    def install(self) -> None:
        self.handle = self.transformer.register_forward_pre_hook(self._set, with_kwargs=True)

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _processors(self) -> list[USPSkyReelsV2AttnProcessor]:
        # Looked up at each call: the processors are swapped in after this hook is installed.
        found = []
        for block in self.blocks:
            processor = getattr(block.attn1, "processor", None)
            if isinstance(processor, USPSkyReelsV2AttnProcessor) and not any(p is processor for p in found):
                found.append(processor)
        return found

    def frame(self, hidden_states: torch.Tensor) -> int | None:
        """F for a latent (B, C, frames, height, width); ``None`` without block-causal attention."""
        config = self.transformer.config
        if config.num_frame_per_block <= 1 or hidden_states.dim() != 5:
            return None
        _, p_h, p_w = config.patch_size
        height, width = operator.index(hidden_states.shape[3]), operator.index(hidden_states.shape[4])
        return int(config.num_frame_per_block) * (height // p_h) * (width // p_w)

    def _set(self, module, args: tuple, kwargs: dict):
        latent = kwargs["hidden_states"] if "hidden_states" in kwargs else (args[0] if args else None)
        frame = self.frame(latent) if torch.is_tensor(latent) else None
        for processor in self._processors():
            processor.config_frame = frame
        return None


class SkyReelsTembHook:
    """Diffusion forcing's per-token block modulation (B, 6, S, C): this rank's rows (dim 2) for
    every block, cut like the tokens (a view; a 3-D ``temb``, one per batch element, passes)."""

    def __init__(self, transformer: SkyReelsV2Transformer3DModel, state: ShardState) -> None:
        self.state = state
        self.blocks = list(transformer.blocks)
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        for block in self.blocks:
            self.handles.append(block.register_forward_pre_hook(functools.partial(self._cut, block), with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _cut(self, block, module, args: tuple, kwargs: dict):
        """Raises ValueError for a per-token ``temb`` whose length is not the token count."""
        if len(args) < 3 or args[2].dim() != 4:
            return None
        temb = args[2]
        if temb.shape[2] != self.state.seq_len:
            raise ValueError(
                f"the per-token modulation has {temb.shape[2]} tokens but the latent has {self.state.seq_len}"
            )
        local = shard_sequence(temb, self.state.mesh, dim=2, layout=self.state.layout)
        return (*args[:2], local, *args[3:]), kwargs


def _routed_call_missing(transformer: SkyReelsV2Transformer3DModel) -> str | None:
    if _RoutedSkyReelsProcessor is None:
        return f"this diffusers' SkyReelsV2AttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="SkyReels-V2",
    model_class=SkyReelsV2Transformer3DModel,
    split_at="blocks.0",
    gather_at="norm_out",  # before the per-token shift / scale of diffusion forcing (module docstring)
    attention=(
        Parallel("blocks.*.attn1", USPSkyReelsV2AttnProcessor, stock=(SkyReelsV2AttnProcessor,)),
        Local("blocks.*.attn2", stock=(SkyReelsV2AttnProcessor,)),  # to the replicated text (and image)
    ),
    block_lists=("blocks",),
    tables=(Table("rope", dim=1, items=(0, 1)),),  # (cos, sin), each (1, seq, 1, head_dim)
    cfg_batch_args=("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"),
    # The SkyReels-V2 pipelines call the transformer once per guidance branch (as Wan's do).
    cfg_branch_args=("encoder_hidden_states",),
    hooks=(SkyReelsTembHook, SkyReelsFrameHook),
    refuse=(_routed_call_missing,),
    layout="zigzag",  # block-causal attention: equal work on every ring rank (module docstring)
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
