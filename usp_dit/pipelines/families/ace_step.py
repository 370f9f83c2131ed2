"""ACE-Step adapter: ``AceStepTransformer1DModel`` (ACE-Step 1.5 text-to-music: turbo, base, SFT, XL) on a USP grid.

Layout: audio latents (batch, frames, acoustic_dim) and context latents (batch, frames,
context_dim), concatenated on channels and patchified by a strided ``Conv1d`` into audio tokens
(batch, seq, hidden), ``seq = ceil(frames / patch_size)``; the packed condition (text, lyrics,
timbre) ``encoder_hidden_states`` (batch, cond_seq, hidden), replicated; Q (batch, seq, heads,
head_dim), K/V (batch, seq, kv_heads, head_dim) (GQA); the RoPE table ``(cos, sin)``, each
(seq, head_dim), made in the forward and passed to every layer as ``position_embeddings``.

Where the tokens are split (``_token_sharding`` Note [where the sequence is split]): the patchify
conv (kernel = stride = patch_size: no token mixing, and the sequence does not exist before it),
the timestep embeddings and the condition embedder run whole on every rank; ``layers.0``'s input
is sharded; ``norm_out``'s output (RMSNorm, per token) is gathered, so the final modulation, the
``ConvTranspose1d`` de-patchify (kernel = stride) and the crop to the input's frame count run
whole, exactly as in one process. ``AceStepLayerHooks`` hands every layer this rank's rows of the
RoPE table (``local_rope``: a pre-hook on each layer, as Diffusers passes the table as an argument
of every layer) and checks the sliding-window layers (Note [ACE-Step's sliding window]).

The condition is a separate stream, read only as cross-attention keys (``layers.*.cross_attn``:
``Local``, its stock processor on this rank's audio queries; it has no mask: the model passes
``encoder_attention_mask=None``); self-attention (``layers.*.self_attn``) is over the audio tokens
alone: the stock processor's code with its ``dispatch_attention_fn`` call routed to
``usp_attention`` (GQA K/V heads as they are). Per-rank tokens, a 4-minute song at 48 kHz
(1920x VAE: 25 latent frames a second, patch 2): 3000 audio tokens, 375 a rank on 8.

Note [ACE-Step's sliding window]
    ACE-Step alternates ``sliding_attention`` and ``full_attention`` layers (``layer_types``). A
    sliding layer lets token i attend to token j only when ``|i - j| <= sliding_window`` (128 in
    the released configs): a band mask over the audio tokens, which ``usp_attention`` cannot express
    over a ring (its masks are a text key mask and causal / block-causal staircases; a band's rows
    see a window that starts and ends anywhere). A sliding layer runs through ``usp_attention`` only
    while its band covers the whole sequence, ``seq - 1 <= sliding_window`` (up to 129 tokens:
    10.3 s of audio), where the mask hides nothing and stock attends densely (the mask it builds is
    all zeros: it is dropped).
    Longer sequences (real songs) run exactly on grids without ring (``ring_degree=1``): a
    sliding layer then keeps the model's band mask (1, 1, S, S) and its attention is routed to
    ``ulysses_band_attention``: the Ulysses all-to-all hands each rank every token of its heads,
    where stock's ``scaled_dot_product_attention`` with that mask runs as in one process, and the
    all-to-all back returns its tokens (the full layers use ``usp_attention`` as before). On a
    ring grid the call is refused (NotImplementedError, at the first sliding layer, on every rank
    alike: the length is the same everywhere) rather than attending densely. Configs whose
    ``layer_types`` are all ``full_attention`` run at any length on any grid.

        sliding layer, seq - 1 > window:  ring_degree == 1  -> Ulysses band attention (exact)
                                          ring_degree > 1   -> refused
        otherwise (band covers, or full): usp_attention on any grid, the all-zero mask dropped

The CFG halves are batched in one call (``AceStepPipeline`` stacks [cond, null] inside the CFG
interval): ``cfg_batch_args`` split them over the "cfg" axis; outside the interval (and for the
guidance-distilled turbo checkpoints) a step is one call.

Refused (NotImplementedError): at enable, processors other than the stock
``AceStepAttnProcessor2_0`` (LoRA-replaced, custom, Diffusers' context parallelism), an unsupported
Diffusers cache, ``num_hidden_layers=0``; at the call, a sliding layer whose band does not cover
the sequence on a ring grid or under a flash backend (above), attention dropout in training (the routed call refuses ``dropout_p``) and a
flash backend's ``window_size`` (``attention_kwargs``, which the stock processor passes only for a
sequence longer than the window: refused above first).
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import AceStepTransformer1DModel
from diffusers.models.transformers.ace_step_transformer import AceStepAttention, AceStepAttnProcessor2_0
from torch.utils.hooks import RemovableHandle

from usp_dit.pipelines._routing import (
    ROUTED_NAME,
    RoutedProcessor,
    routed_processor_class,
    ulysses_whole_sequence,
    with_global,
)
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg, local_rope
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter

_RoutedAceStepProcessor = routed_processor_class(AceStepAttnProcessor2_0, "_RoutedAceStepProcessor")


def ulysses_band_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    attention_kwargs: dict[str, Any] | None = None,
    *,
    backend: Any = None,
    parallel_config: Any = None,
) -> torch.Tensor:
    """A sliding layer's attention on a grid without ring (Note [ACE-Step's sliding window]):
    ``dispatch_attention_fn``'s signature.

    Args:
        query: (B, S_local, H, D) this rank's tokens; key, value: (B, S_local, H_kv, D).
        attn_mask: the model's band mask over the whole sequence, (1, 1, S, S) additive.
        parallel_config: the processor's ``Route`` (its ``ShardState``: mesh, ``seq_len``).

    Returns:
        (B, S_local, H, D): the Ulysses all-to-all gives this rank every token of its heads, the
        band-masked attention of those heads is stock's (``scaled_dot_product_attention`` with the
        model's own mask), and the all-to-all back returns this rank's tokens of every head.

    Raises:
        NotImplementedError: dropout, causal attention or attention kwargs.
    """
    if dropout_p or is_causal or attention_kwargs:
        raise NotImplementedError(f"usp_dit's ACE-Step band attention got dropout_p={dropout_p}, "
                                  f"is_causal={is_causal}, attention_kwargs={attention_kwargs}")

    def band(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: tuple[int, int]) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=attn_mask, scale=scale,
            enable_gqa=q.shape[2] != k.shape[2],
        ).transpose(1, 2)

    return ulysses_whole_sequence(query, key, value, parallel_config.state, band)


# The stock code with its attention call bound to ``ulysses_band_attention`` (None exactly when
# ``_RoutedAceStepProcessor`` is: the same code object, refused at enable by ``_routed_call_missing``).
_BAND_CALL = with_global(AceStepAttnProcessor2_0.__call__, ROUTED_NAME, ulysses_band_attention)

# AceStepTransformerBlock.forward(hidden_states, position_embeddings, temb, attention_mask, ...): the
# model passes them by keyword, its gradient-checkpointing path by position.
_ROPE = ("position_embeddings", 1)
_MASK = ("attention_mask", 3)


class USPAceStepAttnProcessor(_RoutedAceStepProcessor or RoutedProcessor):
    """A layer's self-attention: this rank's audio tokens against every audio token of the grid.

    Inputs (as ``AceStepAttention.forward`` passes them): ``hidden_states`` (B, S_local, hidden);
    ``image_rotary_emb`` this rank's rows ``(cos, sin)``, each (S_local, head_dim) (cut by
    ``AceStepLayerHooks``); ``attention_mask`` ``None``, or a sliding layer's band mask over the whole
    sequence (1, 1, S, S) where the band is narrower than the sequence and the grid has no ring
    (Note [ACE-Step's sliding window]). Returns (B, S_local, hidden): the stock processor's code,
    its attention call routed (to ``usp_attention``, or for the band to ``ulysses_band_attention``).
    """

    def __call__(
        self,
        attn: AceStepAttention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if encoder_hidden_states is not None:
            raise NotImplementedError("USPAceStepAttnProcessor is for self-attention only; cross_attn runs locally")
        if attention_mask is not None:  # a band narrower than the sequence, on a grid without ring
            return _BAND_CALL(self, attn, hidden_states, None, attention_mask, image_rotary_emb)
        return super().__call__(attn, hidden_states, None, None, image_rotary_emb)


class AceStepLayerHooks:
    """A forward pre-hook on every layer: this rank's rows of ``position_embeddings`` (``local_rope``),
    and Note [ACE-Step's sliding window]: a band covering the sequence has its all-zero mask
    dropped; a narrower one keeps its mask on a grid without ring and is refused on a ring."""

    def __init__(self, transformer: AceStepTransformer1DModel, state: ShardState) -> None:
        self.state = state
        self.layers = list(transformer.layers)
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        for layer in self.layers:
            self.handles.append(layer.register_forward_pre_hook(functools.partial(self._cut, layer), with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _cut(self, layer: torch.nn.Module, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """Raises NotImplementedError for a sliding window narrower than the sequence on a ring grid or
        without its mask (a flash backend), ValueError for a RoPE table of another length than the
        tokens (``local_rope``)."""
        rope = local_rope(_get_arg(args, kwargs, *_ROPE), self.state, _ROPE[0])
        args, kwargs = _set_arg(args, kwargs, *_ROPE, rope)
        window = layer.self_attn.sliding_window
        if window is None or self.state.seq_len - 1 <= window:  # no band, or one hiding nothing: no mask
            return _set_arg(args, kwargs, *_MASK, None) if _get_arg(args, kwargs, *_MASK) is not None else (args, kwargs)
        where = (f"usp_dit's ACE-Step adapter: this layer's sliding-window attention (|i - j| <= {window}) does not "
                 f"cover the {self.state.seq_len} audio tokens of this call, a band mask over the audio tokens")
        if self.state.mesh.ring_degree > 1:
            raise NotImplementedError(
                f"{where}, which usp_attention's ring cannot express (ring_degree={self.state.mesh.ring_degree}): use "
                f"ring_degree=1 (Ulysses runs the band exactly), a song of at most {window + 1} tokens, or a config "
                f"whose layer_types are all full_attention"
            )
        if _get_arg(args, kwargs, *_MASK) is None:
            raise NotImplementedError(
                f"{where}, and no mask to apply it with: a flash attention backend (its window_size is not routed); "
                f"use the native backend"
            )
        return args, kwargs  # the band mask (1, 1, S, S) reaches USPAceStepAttnProcessor whole


def _routed_call_missing(transformer: AceStepTransformer1DModel) -> str | None:
    if _RoutedAceStepProcessor is None:
        return f"this diffusers' AceStepAttnProcessor2_0 does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="ACE-Step",
    model_class=AceStepTransformer1DModel,
    split_at="layers.0",
    gather_at="norm_out",  # then modulation, ConvTranspose1d (kernel = stride) and the crop, whole
    attention=(
        Parallel("layers.*.self_attn", USPAceStepAttnProcessor, stock=(AceStepAttnProcessor2_0,)),
        Local("layers.*.cross_attn", stock=(AceStepAttnProcessor2_0,)),  # to the replicated condition
    ),
    block_lists=("layers",),
    # AceStepPipeline's CFG batch: [cond, null] on dim 0 of each.
    cfg_batch_args=("hidden_states", "timestep", "timestep_r", "encoder_hidden_states", "context_latents"),
    hooks=(AceStepLayerHooks,),
    refuse=(_routed_call_missing,),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
