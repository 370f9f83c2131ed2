"""LTX-2 adapter: ``LTX2VideoTransformer3DModel`` (LTX2Pipeline, image-to-video, condition pipelines) on a USP grid.

Layout: the pipeline hands the transformer two token streams and two prompt streams:
video tokens ``hidden_states`` (batch, S_v, channels), frame-major (``LTX2Pipeline._pack_latents``);
audio tokens ``audio_hidden_states`` (batch, S_a, audio_channels), one per audio latent frame;
text for each stream, ``encoder_hidden_states`` / ``audio_encoder_hidden_states`` (batch, T, C)
with the prompt mask ``encoder_attention_mask`` (batch, T), 1 = real token (the connectors' output).
Q/K/V (batch, seq, heads, head_dim). RoPE tables ``(cos, sin)``: "interleaved" ones are
(batch, seq, dim), "split" ones (batch, heads, seq, dim // 2): **the sequence on dim -2** either way.
The video timestep is (batch,) or, in the image-to-video and condition pipelines, one per video
token (batch, S_v); the audio timestep and the sigmas are (batch,).

What each block attends (diffusers' ``LTX2VideoTransformerBlock``): the two streams are not
concatenated into one softmax; each block runs six attentions, and the audio stream reaches the
video (and back) through two cross-attentions:

    attention              queries  keys/values  RoPE (q / k)                 here
    attn1                  video    video        video 3-D table              parallel: usp_attention
    audio_attn1            audio    audio        audio 1-D table              local (audio replicated)
    attn2                  video    video text   none                         local (text replicated)
    audio_attn2            audio    audio text   none                         local
    audio_to_video_attn    video    audio        video time / audio time      local (audio replicated)
    video_to_audio_attn    audio    video        audio time / video time      parallel: Note [v2a]

Where the tokens are split (``_token_sharding`` Note [where the sequence is split]): the video
tokens, like LTX-Video's: ``proj_in``, the timestep embeddings and the caption projections run
before the first block; block 0's ``hidden_states`` are sharded; every block's video half, the
final norm and ``proj_out`` run on the shard; ``proj_out``'s output is gathered. Diffusers' own
``_cp_plan`` for this class splits the same video input, the same ``rope`` table and gathers at the
same ``proj_out`` (it leaves the cross-modal table, the audio stream and a per-token timestep
alone; here they are handled: Note [LTX-2's per-token tables], Note [v2a]).

The audio stream is **replicated**: every rank holds all audio tokens and runs the audio half of
every block on all of them, the same computation on every rank. Why: the audio is short beside the
video and its work is small (below); replicated, audio self-attention, audio-to-text and
audio-to-video (video queries of this rank against the whole audio K/V) need no communication at
all. The one attention that needs every rank is video-to-audio (audio queries against the whole
video): Note [v2a], one small all-reduce per layer. Per-rank token counts, LTX-2 (48 layers,
video 32 x 128 wide, audio 32 x 64) at 768 x 512 x 121 frames, 24 fps: 16 latent frames x 16 x 24
= 6144 video tokens and round(121 / 24 * 25) = 126 audio tokens (25 audio latents a second);
on 8 ranks each rank holds 768 video tokens and the 126 audio tokens. The replicated audio work
(126 tokens at 2048 wide) is about 8 % of the rank's video token work (768 at 4096), and the audio
self-attention 126 x 126 is negligible; splitting the audio would save that at the price of
collectives in four more attentions per layer.

Text tokens: **replicated** (each stream's own prompt, cross-attention only: local, no
communication), as in LTX-Video.

Note [v2a]
    ``video_to_audio_attn``: the audio queries (replicated, S_a rows) attend over the whole video
    (S_v keys), of which this rank holds S_v / P. Softmax attention over keys split in blocks is
    exact by a log-sum-exp merge (``usp_dit.attention.merge``), so each rank attends the audio
    queries to its own video keys and the P partial results are merged over the sequence group:

        rank r: (o_r, l_r) = attention(q_audio, k_video_r, v_video_r)     (B, S_a, H, D), (B, S_a, H)
        m = max_r l_r                                     one all-reduce (max), (B, S_a, H)
        (sum_r e^{l_r - m} o_r, sum_r e^{l_r - m})         one all-reduce (sum), (B, S_a, H, D + 1)
        o = first / second, l = m + log(second)           the same on every rank

    That is S_a x S_v / P of attention work per rank (1/P of the whole) and 2 all-reduces of
    B x S_a x H x (D + 1) floats per layer (126 x 32 x 65 x 4 bytes, about 1 MB, for LTX-2),
    where sharding the audio queries instead would all-to-all the video K/V. Backward (the
    sequence-group gradient convention: each rank's loss is L / P, gradients summed over ranks):
    the output is replicated, so its gradient is all-reduced first; then the kernel's own
    backward with the merged (o, l) gives this rank's video keys' dK, dV exactly and the dQ
    contribution of its keys (dQ of a replicated input is such a per-rank partial).

Note [LTX-2's per-token tables]
    Inputs of the blocks indexed by video token, cut like the tokens:

      * the video RoPE table (``rope``) and the video side of the cross-modal table
        (``cross_attn_rope``, the video tokens' time positions, the query table of
        audio-to-video and the key table of video-to-audio): ``Table``s on dim -2;
      * a per-token video timestep (image-to-video, condition pipelines): ``time_embed`` gives
        ``temb`` / ``embedded_timestep`` (B, S_v, ...) from it, and ``av_cross_attn_video_scale_shift``
        and ``av_cross_attn_video_a2v_gate`` the video cross-attention modulation: a pre-hook on
        each hands it this rank's entries (B * S_local instead of B * S_v), as LTX-Video's
        ``time_embed`` hook does. A timestep of one entry per batch element is left alone.

    The audio tables (``audio_rope``, ``cross_attn_audio_rope``) and every audio timestep stay
    whole (the audio is replicated).

Processors: the stock ``LTX2AudioVideoAttnProcessor`` or ``LTX2PerturbedAttnProcessor`` (configs
with ``perturbed_attn``: spatio-temporal guidance). The parallel sites run the stock code with its
attention call routed (``_routing``): a call the block makes with ``perturbation_mask`` (the
self-attention of a perturbed block) runs the perturbed processor's code, any other the plain
processor's (for calls without a perturbation mask the two compute the same thing).

Refused (NotImplementedError, at enable unless noted): processors other than those two stock ones,
an attention module the plan does not name, a Diffusers cache that cannot run on a grid,
``num_layers=0``; at the call: ``video_self_attention_mask`` (IC-LoRA's (B, S_v, S_v) mask over
video tokens), and any attention mask in the parallel sites (the model passes none). A video
timestep with neither B nor B * S_v entries raises ValueError. Dropout in attention outputs is 0
in the released configs. CFG: ``LTX2Pipeline`` batches [uncond, cond] in one call (cfg_degree=2
splits it); its spatio-temporal and modality-isolation guidance are extra calls of batch 1, which
cfg_degree=2 refuses (``replica_forward`` Note [cfg parallel]): use cfg_degree=1 with them, or
``stg_scale=0, audio_stg_scale=0, modality_scale=1, audio_modality_scale=1``.

VAEs: the video VAE, ``AutoencoderKLLTX2Video``, decodes (and for image-to-video encodes) split by
rows over the replica through its parallel-VAE recipe (``usp_dit.pipelines.vae.recipes``; equal
to one process, tests/test_parallel_vae.py): its ``LTX2Video*`` modules pad time themselves and
leave the rows to their ``nn.Conv3d`` (reflect-padded in the released decoder: the first and last
ranks reflect the image's border from their rows and the neighbour's, so a piece of one latent row
works), normalise per pixel (``PerChannelRMSNorm``) and up / downsample by depth-to-space reshapes
that keep rows apart; the decoder's timestep conditioning scales channels. A config with
``decoder_inject_noise`` decodes whole on every rank (the noise is drawn for the whole image:
``usp_dit.pipelines.vae.patch`` Note [parallel VAE fallback]). The audio VAE and the vocoder decode
a short mel spectrogram (about 500 frames for 5 s: 1-D, no rows to split) locally on every rank.

Compile: the transformer compiles in one graph on the grid (tests/test_compile_grid.py); a
perturbed (spatio-temporal guidance) call breaks the graph in the stock processor itself
(``if all_perturbed:`` on a tensor), with or without usp_dit.
"""
from __future__ import annotations

import inspect
import types
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from diffusers import LTX2VideoTransformer3DModel
from diffusers.models.transformers.transformer_ltx2 import (
    LTX2Attention,
    LTX2AudioVideoAttnProcessor,
    LTX2PerturbedAttnProcessor,
)
from torch.utils.hooks import RemovableHandle

from usp_dit.kernels import attend, select_backend
from usp_dit.kernels.autograd import kernel_backward, kernel_forward
from usp_dit.kernels.protocol import AttentionBackend, lse_dtype
from usp_dit.pipelines._routing import ROUTED_NAME, Route, RoutedProcessor, route_attention, with_global
from usp_dit.pipelines._token_sharding import ShardState, _get_arg, _set_arg
from usp_dit.pipelines.base import register_adapter
from usp_dit.pipelines.plan import Local, ModelPlan, Parallel, PlanAdapter, Table
from usp_dit.sharding.shard import shard_sequence

STOCK = (LTX2AudioVideoAttnProcessor, LTX2PerturbedAttnProcessor)


# ---------------------------------------------------------------------------------------------
# Note [v2a]


def _merge_over_ranks(out_r: torch.Tensor, lse_r: torch.Tensor, group: dist.ProcessGroup):
    """Partial results of the same queries over each rank's keys -> the whole result, every rank.

    Args:
        out_r: (B, Sq, H, D) this rank's partial output; lse_r: (B, Sq, H) its log-sum-exp
            (float32; -inf where the rank has no key).
    Returns:
        ``(out (B, Sq, H, D) in out_r's dtype, lse (B, Sq, H))``.
    """
    m = funcol.wait_tensor(funcol.all_reduce(lse_r.contiguous(), "max", group))
    m = torch.where(torch.isneginf(m), torch.zeros_like(m), m)  # no key anywhere: weights 0, never nan
    w = torch.exp(lse_r - m).unsqueeze(-1)  # (B, Sq, H, 1)
    packed = torch.cat([out_r.to(w.dtype) * w, w], dim=-1)  # one all-reduce for numerator and weights
    total = funcol.wait_tensor(funcol.all_reduce(packed, "sum", group))
    num, den = total[..., :-1], total[..., -1:]
    out = num / den.clamp_min(torch.finfo(den.dtype).tiny)
    return out.to(out_r.dtype), m + torch.log(den.squeeze(-1))


def _local_forward(q, k, v, backend: AttentionBackend, scale: float):
    """(out, lse) of the queries against this rank's keys; an empty shard gives (0, -inf)."""
    if k.shape[1]:
        return kernel_forward(backend, q, k, v, scale)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    return torch.zeros_like(q), lse


class ReplicatedQueryAttention(torch.autograd.Function):
    """Note [v2a]: replicated queries (B, Sq, H, D) against keys/values (B, Sk_local, H, D)
    sharded over ``group``; returns (B, Sq, H, D), the same on every rank."""

    @staticmethod
    def forward(ctx, q, k, v, group: dist.ProcessGroup, backend: AttentionBackend, scale: float):
        out_r, lse_r = _local_forward(q, k, v, backend, scale)
        out, lse = _merge_over_ranks(out_r, lse_r, group)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.backend, ctx.scale = group, backend, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        # Every rank's loss reads the replicated output: the gradient of their sum.
        total = funcol.wait_tensor(funcol.all_reduce(dout.contiguous(), "sum", ctx.group))
        if not k.shape[1]:
            return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v), None, None, None
        dq, dk, dv = kernel_backward(ctx.backend, total, q, k, v, out, lse, ctx.scale)
        return dq, dk, dv, None, None, None


def _replicated_query_call(q, k, v, group, backend, scale):
    return ReplicatedQueryAttention.apply(q, k, v, group, backend, scale)


# Eagerly outside Dynamo, as usp_attention's sharded calls (usp_dit.attention.usp, _sharded):
# traced into the graph under torch.compile.
_replicated_query_eager = torch.compiler.disable(_replicated_query_call)


def attend_replicated_queries(
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
    """``dispatch_attention_fn``'s signature, for ``video_to_audio_attn`` (Note [v2a]).

    Args:
        query: (B, S_a, H, D) every audio token (replicated).
        key, value: (B, S_v_local, H, D) this rank's video tokens.
        parallel_config: the processor's ``Route``.
    Returns:
        (B, S_a, H, D), each audio query attended over the whole video, the same on every rank.
    Raises:
        NotImplementedError: a mask, dropout, causal attention or attention kwargs; a backend
            without a log-sum-exp.
    """
    route = parallel_config
    if not isinstance(route, Route):
        raise TypeError(f"usp_dit's LTX-2 video-to-audio processor got parallel_config={type(route).__name__}")
    if attn_mask is not None or dropout_p or is_causal or attention_kwargs:
        raise NotImplementedError(
            "usp_dit's LTX-2 adapter runs video_to_audio_attn without a mask, dropout or causal attention")
    state = route.state
    scale = query.shape[-1] ** -0.5 if scale is None else float(scale)
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
    kernel = select_backend(state.backend, query.device.type, query.dtype, query.shape[-1], needs_grad)
    group = state.mesh.seq_group
    if group is None:  # one rank holds the whole video
        return attend(query, key, value, kernel, scale)[0]
    if not kernel.caps.returns_lse:
        raise NotImplementedError(
            f"backend={kernel.name!r} returns no log-sum-exp, which LTX-2's video-to-audio attention merges over ranks")
    call = _replicated_query_call if torch.compiler.is_compiling() else _replicated_query_eager
    return call(query, key, value, group, kernel, scale)


# ---------------------------------------------------------------------------------------------
# Processors


def _routed(stock: type, fn: Any) -> types.FunctionType | None:
    """``stock.__call__`` with its attention call bound to ``fn`` (``_routing.with_global``)."""
    return with_global(stock.__call__, ROUTED_NAME, fn)


class USPLTX2AttnProcessor(RoutedProcessor):
    """A parallel site's processor: the stock code of the processor the call belongs to, its
    attention call routed (``attend`` below: ``route_attention`` for video self-attention).

    Inputs as the stock processors take them: ``hidden_states`` (B, S_q, C) (this rank's video
    rows, or every audio row for video-to-audio), ``encoder_hidden_states`` (B, S_kv, C) or
    ``None``, RoPE tables cut like their tokens (Note [LTX-2's per-token tables]). The signature is
    spelled out: ``LTX2Attention.forward`` passes a processor only the keyword arguments its
    ``__call__`` names, and a perturbed block's self-attention passes ``perturbation_mask``.
    """

    attend: Any = staticmethod(route_attention)
    _plain: types.FunctionType | None = None
    _perturbed: types.FunctionType | None = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._plain = _routed(LTX2AudioVideoAttnProcessor, cls.attend)
        cls._perturbed = _routed(LTX2PerturbedAttnProcessor, cls.attend)

    def __call__(
        self,
        attn: LTX2Attention,
        hidden_states: torch.Tensor,
        encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        query_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        key_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        **perturbation: Any,
    ) -> torch.Tensor:
        if attention_mask is not None:
            raise NotImplementedError(
                "usp_dit's LTX-2 adapter does not take an attention mask in a parallel attention "
                "(video self-attention, video-to-audio): it would mask video tokens")
        args = (self, attn, hidden_states, encoder_hidden_states, attention_mask, query_rotary_emb, key_rotary_emb)
        if perturbation:  # a perturbed block's self-attention (spatio-temporal guidance)
            return type(self)._perturbed(*args, **perturbation)
        return type(self)._plain(*args)


# ``LTX2Attention.forward`` filters the keywords it passes by the processor's signature: show the
# perturbed processor's names (``**perturbation`` alone would receive none). The block passes them
# to a perturbed block's self-attention only.
USPLTX2AttnProcessor.__call__.__signature__ = inspect.signature(LTX2PerturbedAttnProcessor.__call__)


class USPLTX2SelfAttnProcessor(USPLTX2AttnProcessor):
    """``attn1``: this rank's video shard attended over the whole video (``usp_attention``)."""

    attend = staticmethod(route_attention)


class USPLTX2VideoToAudioProcessor(USPLTX2AttnProcessor):
    """``video_to_audio_attn``: every audio query over the whole video (Note [v2a])."""

    attend = staticmethod(attend_replicated_queries)


# ---------------------------------------------------------------------------------------------
# Note [LTX-2's per-token tables]: the per-token video timestep

VIDEO_TIMESTEP_MODULES = ("time_embed", "av_cross_attn_video_scale_shift", "av_cross_attn_video_a2v_gate")


class LTX2TimestepHook:
    """Pre-hooks on the video timestep embeddings: a per-token timestep (B * S_v entries) becomes
    this rank's (B * S_local); the RoPE ``Table`` hook runs first in the forward and sets S_v."""

    def __init__(self, transformer: LTX2VideoTransformer3DModel, state: ShardState) -> None:
        self.state = state
        self.modules = [transformer.get_submodule(name) for name in VIDEO_TIMESTEP_MODULES]
        self.handles: list[RemovableHandle] = []

    def install(self) -> None:
        for module in self.modules:
            self.handles.append(module.register_forward_pre_hook(self._shard_timestep, with_kwargs=True))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _shard_timestep(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        """(B * S_v,) -> this rank's (B * S_local,); (B,) is left alone.

        Raises:
            ValueError: the timestep has neither B nor B * S_v entries.
        """
        timestep = _get_arg(args, kwargs, "timestep", 0)
        batch = _get_arg(args, kwargs, "batch_size", 2)
        seq = self.state.seq_len
        if batch is None or timestep.numel() == batch:
            return None
        if timestep.numel() != batch * seq:
            raise ValueError(
                f"the video timestep has {timestep.numel()} entries for a batch of {batch} and {seq} video tokens: "
                f"usp_dit's LTX-2 adapter takes one per batch element or one per video token"
            )
        local = shard_sequence(timestep.reshape(batch, seq), self.state.mesh, dim=1)  # (B, S_local)
        return _set_arg(args, kwargs, "timestep", 0, local.flatten())


def _routed_call_missing(transformer: LTX2VideoTransformer3DModel) -> str | None:
    for cls in (USPLTX2SelfAttnProcessor, USPLTX2VideoToAudioProcessor):
        if cls._plain is None or cls._perturbed is None:
            return f"this diffusers' LTX-2 attention processors do not call {ROUTED_NAME}, the call usp_dit routes"
    return None


_BLOCKS = "transformer_blocks.*."

PLAN = ModelPlan(
    name="LTX-2",
    model_class=LTX2VideoTransformer3DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    attention=(
        Parallel(_BLOCKS + "attn1", USPLTX2SelfAttnProcessor, stock=STOCK),  # video self-attention
        Parallel(_BLOCKS + "video_to_audio_attn", USPLTX2VideoToAudioProcessor, stock=STOCK),  # Note [v2a]
        Local(_BLOCKS + "audio_attn1", stock=STOCK),  # audio self-attention, audio replicated
        Local(_BLOCKS + "attn2", stock=STOCK),  # video queries -> replicated text
        Local(_BLOCKS + "audio_attn2", stock=STOCK),  # audio queries -> replicated text
        Local(_BLOCKS + "audio_to_video_attn", stock=STOCK),  # video queries -> replicated audio
    ),
    block_lists=("transformer_blocks",),
    # Note [LTX-2's per-token tables]: (cos, sin) with the sequence on dim -2 (both rope types).
    tables=(Table("rope", dim=-2, items=(0, 1)), Table("cross_attn_rope", dim=-2, items=(0, 1))),
    # Batched on dim 0, split over "cfg" by enable_usp (LTX2Pipeline batches [uncond, cond]).
    cfg_batch_args=(
        "hidden_states", "audio_hidden_states", "encoder_hidden_states", "audio_encoder_hidden_states",
        "timestep", "audio_timestep", "sigma", "audio_sigma", "encoder_attention_mask",
        "audio_encoder_attention_mask", "video_coords", "audio_coords", "perturbation_mask", "video_keyframes_mask",
    ),
    hooks=(LTX2TimestepHook,),
    refuse=(_routed_call_missing,),
    refuse_args={"video_self_attention_mask": "a (batch, video tokens, video tokens) mask over the video tokens"},
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
