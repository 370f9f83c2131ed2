"""NucleusMoE-Image adapter: ``NucleusMoEImageTransformer2DModel`` (``NucleusMoEImagePipeline``) on a USP grid.

Layout: packed latents / image tokens (batch, N, channels), 2x2 latent patches row-major; text
embeddings (batch, T, joint_attention_dim) and their mask ``encoder_hidden_states_mask`` (batch,
T), True = a real token (any pattern: keys are masked element-wise); Q (batch, N, heads,
head_dim), K/V (batch, N + T, heads, head_dim) after the processor's ``[image; text]``
concatenation (and its GQA repeat); the RoPE table ``pos_embed(img_shapes, ...)`` returns
``(img_freqs (N, head_dim / 2), txt_freqs (T, head_dim / 2))``, complex, the sequence on dim 0.

Where the tokens are split (``_token_sharding`` Note [where the sequence is split]): ``img_in``,
the text norm and the timestep embedding run whole on every rank; block 0's input is sharded;
``proj_out``'s output is gathered; ``img_freqs`` is a ``Table`` cut like the tokens.

Text: **replicated, keys and values only**. NucleusMoE-Image has no text stream: every block
projects the (fixed) text embeddings to K/V (``encoder_proj``, ``add_k_proj``, ``add_v_proj``)
and the image queries attend over ``[image; text]`` keys (Note [image queries over text keys]).
At 1024 x 1024: 64 x 64 = 4096 image tokens (512 a rank on 8 ranks) beside a Qwen3-VL prompt of
its system prompt and the user's, about 100-300 tokens, padded to a multiple of 8.

Note [image queries over text keys]
    ``NucleusMoEAttnProcessor2_0`` calls ``dispatch_attention_fn(img_query, [img_key; txt_key],
    ...)``: N queries, N + T keys, the (B, N + T) key mask all True on the image. ``usp_attention``
    takes joint tokens as queries *and* keys; so the routed call (``_route_image_queries``) gives
    the text positions queries of zeros, runs ``_routing.route_attention`` on ``[shard; text]``
    (``Route(text="last")``, the stock mask's text part read per element: ``_routing`` Note
    [masked text tokens]) and keeps the image rows. The text rows' outputs are dropped, so they
    carry no gradient: the image queries' outputs and every gradient are stock's. The price is T
    extra query rows (split over the ring ranks, their heads over Ulysses) and their gathered
    output, about T / (N / P) of this rank's attention work: 5 % for 200 text tokens beside 4096
    image tokens on one rank, more on many ranks. (A core ``usp_attention`` with key-only joint
    tokens would remove it.)

Note [expert-choice routing on a shard]
    ``NucleusMoELayer`` routes by *expert choice*: per sample, each expert takes the
    ``capacity = ceil(capacity_factor * N / num_experts)`` tokens of the highest router score
    (``topk`` over the sequence), the gate of a chosen token is renormalised over the experts that
    chose it, and the output is the shared expert plus the chosen experts' gated outputs. This
    couples tokens across the whole sequence: a shard's own top-k is not the sequence's (and its
    capacity, computed from N_local, is not either). Made exact so (``ShardedExpertChoice``,
    installed as each MoE layer's ``forward`` while enabled):

        router scores (B, N_local, E)  per token, on this rank ─┐
        all-gather (detached) over the sequence group → (B, N, E): the same bits on every rank
        topk over N with the sequence's capacity → every expert's chosen tokens, on every rank
        keep the choices this rank's tokens hold (their order kept: expert, sample, slot)
        gates: this rank's own scores at them (so the router's gradient flows as in stock),
               renormalised over the experts that chose each token
        experts on the kept tokens (grouped by expert, as stock) ─► scatter-added to the shared
        expert's output of this rank's tokens

    Each token's output is what stock computes for it: the same choices (the topk sees the whole
    sequence's scores), the same gates, the same per-token expert maths; the sums over a token's
    experts run in stock's order. The selection is a discrete function of the scores: the router
    runs on a shard (fewer rows in one matmul), so a score may differ from one process's in its
    last bit and flip a choice only where two tokens' scores tie to that bit (never met here; the
    same holds between two batch sizes on one process). Cost: one all-gather of B x N x E scores
    per MoE layer (E / hidden of a token's width: 64 / 2048 at release) and each rank's share of
    the expert work (the tokens it holds). The stock forward is reimplemented, so
    ``_moe_forward_changed`` refuses any Diffusers whose ``NucleusMoELayer.forward`` differs from
    the one this was written against (its source text's digest).

Refused (NotImplementedError): at enable, processors other than the stock
``NucleusMoEAttnProcessor2_0`` (LoRA-replaced, custom, Diffusers' context parallelism), attention
modules the plan does not name, a Diffusers cache that cannot run on a grid (FasterCache, and
``TextKVCacheConfig``, NucleusMoE's own text K/V cache: ``usp_dit.pipelines.caches``), no blocks,
a changed MoE forward (above); at the call, a processor replaced after enable.
``NucleusMoEImagePipeline`` calls the transformer once per guidance branch (prompt, then negative
prompt): with ``cfg_degree=2`` the two calls of a step run on the two cfg groups at once
(``cfg_branch_args``, ``usp_dit.pipelines.cfg_pair`` Note [two calls a step]). The MoE's expert
loop reads its token counts on the host (``tolist``, in stock too), so a model with MoE blocks does
not compile in one graph; its dense blocks do. NucleusMoE configs have no dropout. Tensor
parallelism is refused (no ``TensorPlan``).
"""
from __future__ import annotations

import hashlib
import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import NucleusMoEImageTransformer2DModel
from diffusers.models.attention_processor import Attention
from diffusers.models.transformers.transformer_nucleusmoe_image import NucleusMoEAttnProcessor2_0, NucleusMoELayer

from usp_dit.pipelines._routing import ROUTED_NAME, RoutedProcessor, one_rank_masked_call, route_attention, with_global
from usp_dit.pipelines._token_sharding import ShardState
from usp_dit.pipelines.base import MethodWrapper, register_adapter
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter, Table
from usp_dit.sharding.shard import gather_sequence, shard_sequence


def _route_image_queries(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
    attention_kwargs: dict[str, Any] | None = None, *, backend: Any = None, parallel_config: Any = None,
) -> torch.Tensor:
    """``dispatch_attention_fn``'s signature for image queries over ``[image shard; text]`` keys
    (Note [image queries over text keys]).

    Args:
        query: (B, N_local, H, D), this rank's image queries.
        key, value: (B, N_local + T, H, D), this rank's image keys then every text key.
        attn_mask: ``None`` or the stock (B, N + T) bool key mask (image part all True).

    Returns:
        (B, N_local, H, D): each image query attended over every image key and its valid text keys.
    """
    text_len = key.shape[1] - query.shape[1]
    if text_len < 0:
        raise ValueError(f"a routed NucleusMoE attention call got {query.shape[1]} queries but only {key.shape[1]} keys")
    one_rank = one_rank_masked_call(query, key, value, attn_mask, parallel_config, scale, dropout_p, is_causal,
                                    attention_kwargs)
    if one_rank is not None:  # one rank: the image queries alone over the masked keys, as stock
        return one_rank
    text_queries = query.new_zeros(query.shape[0], text_len, *query.shape[2:])  # outputs dropped below
    out = route_attention(torch.cat([query, text_queries], dim=1), key, value, attn_mask, dropout_p, is_causal,
                          scale, enable_gqa, attention_kwargs, backend=backend, parallel_config=parallel_config)
    return out[:, :query.shape[1]]


# The stock __call__'s code with its one dispatch_attention_fn call routed; None if it makes no such call.
_ROUTED_CALL = with_global(NucleusMoEAttnProcessor2_0.__call__, ROUTED_NAME, _route_image_queries)


class USPNucleusMoEAttnProcessor(RoutedProcessor):
    """NucleusMoE attention of this rank's image queries over every image key and the replicated,
    masked text keys (Note [image queries over text keys]).

    Inputs as ``Attention.forward`` passes them: ``hidden_states`` (B, N_local, C) (modulated);
    ``encoder_hidden_states`` (B, T, C) (projected text) or ``None`` with the cached text K/V;
    ``attention_mask`` (B, N + T) bool or ``None``; ``image_rotary_emb`` ``(img_freqs (N_local,
    D/2), txt_freqs (T, D/2))``. Returns (B, N_local, C). The explicit signature matters:
    ``Attention.forward`` passes only the keyword arguments ``__call__`` names.
    """

    _stock_call = _ROUTED_CALL

    def __call__(
        self, attn: Attention, hidden_states: torch.Tensor, encoder_hidden_states: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None, image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None = None,
        cached_txt_key: torch.Tensor | None = None, cached_txt_value: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return type(self)._stock_call(self, attn, hidden_states, encoder_hidden_states, attention_mask,
                                      image_rotary_emb, cached_txt_key, cached_txt_value)


class ShardedExpertChoice(MethodWrapper):
    """Note [expert-choice routing on a shard]: a ``NucleusMoELayer``'s forward on this rank's tokens.

    Installed as the layer's ``forward`` (an object: Note [deep copies] in ``usp_dit.pipelines.base``);
    ``inner`` is the stock bound forward, run as it is on one rank.
    """

    def __init__(self, inner: Any, layer: NucleusMoELayer, state: ShardState) -> None:
        super().__init__(inner)
        self.layer, self.state = layer, state

    def __call__(
        self, hidden_states: torch.Tensor, hidden_states_unmodulated: torch.Tensor, timestep: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(B, N_local, C) modulated and unmodulated tokens, ``timestep`` (B, C) -> (B, N_local, C)."""
        if self.state.mesh.sequence_degree == 1:
            return self.inner(hidden_states, hidden_states_unmodulated, timestep)
        scores = self._scores(hidden_states_unmodulated, timestep)  # (B, N_local, E)
        batch_ids, local_pos, expert_ids = self._choices(scores)
        return self._combine(hidden_states, scores, batch_ids, local_pos, expert_ids)

    def _scores(self, unmodulated: torch.Tensor, timestep: torch.Tensor | None) -> torch.Tensor:
        """The router's per-token scores (B, N_local, E), as stock computes them for these tokens."""
        router_input = unmodulated
        if timestep is not None:
            router_input = torch.cat([timestep.unsqueeze(1).expand(-1, unmodulated.shape[1], -1), unmodulated], dim=-1)
        logits = self.layer.gate(router_input)
        if self.layer.use_sigmoid:
            return torch.sigmoid(logits.float()).to(logits.dtype)
        return F.softmax(logits.float(), dim=-1).to(logits.dtype)

    def _choices(self, scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every expert's top-``capacity`` tokens over the whole sequence, those this rank holds:
        (sample, local position, expert) per choice, in stock's order (expert, sample, slot)."""
        state, layer = self.state, self.layer
        seq_len, num_experts = state.seq_len, layer.num_experts
        full = gather_sequence(scores.detach(), state.mesh, dim=1, seq_len=seq_len, layout=state.layout)
        capacity = max(1, math.ceil(layer.capacity_factor * seq_len / num_experts))
        chosen = torch.topk(full.transpose(1, 2), k=capacity, dim=-1).indices  # (B, E, capacity), positions in N
        batch, device = scores.shape[0], scores.device
        # Global position -> this rank's row (-1: another rank's), in the call's layout.
        mine = shard_sequence(torch.arange(seq_len, device=device), state.mesh, dim=0, layout=state.layout)
        local_of = torch.full((seq_len,), -1, dtype=torch.long, device=device)
        local_of[mine] = torch.arange(mine.numel(), device=device)
        local_pos = local_of[chosen.transpose(0, 1).reshape(-1)]  # (E * B * capacity,)
        batch_ids = torch.arange(batch, device=device).view(1, batch, 1).expand(num_experts, batch, capacity).reshape(-1)
        expert_ids = torch.arange(num_experts, device=device).view(-1, 1, 1).expand(-1, batch, capacity).reshape(-1)
        held = local_pos >= 0
        return batch_ids[held], local_pos[held], expert_ids[held]

    def _combine(
        self, hidden_states: torch.Tensor, scores: torch.Tensor, batch_ids: torch.Tensor, local_pos: torch.Tensor,
        expert_ids: torch.Tensor,
    ) -> torch.Tensor:
        """The shared expert's output of this rank's tokens plus their chosen experts' gated outputs."""
        layer = self.layer
        batch, n_local, dim = hidden_states.shape
        rows = batch_ids * n_local + local_pos  # into the (B * N_local) flattened tokens
        gates = scores[batch_ids, local_pos, expert_ids]  # this rank's own scores: differentiable
        totals = torch.zeros(batch * n_local, device=gates.device, dtype=gates.dtype).scatter_add(0, rows, gates)
        gates = gates / (totals[rows] + 1e-12) * layer.route_scale  # stock's renormalisation
        counts = torch.bincount(expert_ids, minlength=layer.num_experts)
        routed = layer.experts(hidden_states.reshape(batch * n_local, dim)[rows], counts)
        routed = (routed.float() * gates.unsqueeze(-1)).to(hidden_states.dtype)
        out = layer.shared_expert(hidden_states).reshape(batch * n_local, dim)
        out = out.scatter_add(0, rows.view(-1, 1).expand(-1, dim), routed)
        return out.reshape(batch, n_local, dim)


class ExpertChoiceHooks:
    """Installs ``ShardedExpertChoice`` as the ``forward`` of every ``NucleusMoELayer`` (a plan
    ``hooks`` factory); ``remove`` deletes the instance attributes (the class's forward again)."""

    def __init__(self, transformer: NucleusMoEImageTransformer2DModel, state: ShardState) -> None:
        self.state = state
        self.layers = [m for m in transformer.modules() if isinstance(m, NucleusMoELayer)]

    def install(self) -> None:
        for layer in self.layers:
            layer.forward = ShardedExpertChoice(layer.forward, layer, self.state)

    def remove(self) -> None:
        for layer in self.layers:
            layer.__dict__.pop("forward", None)


# The digest of the NucleusMoELayer.forward source that ShardedExpertChoice reimplements (Diffusers
# 0.42.1): Note [expert-choice routing on a shard].
_MOE_FORWARD_SHA256 = "bf9932d01499743b290e88bedb464b90c708eabde6fb2aa72d6f1516723ac39d"


def _source_digest(fn: Any) -> str | None:
    try:
        source = inspect.getsource(fn)
    except (OSError, TypeError):
        return None
    return hashlib.sha256(inspect.cleandoc(source).encode()).hexdigest()


def _moe_forward_changed(transformer: NucleusMoEImageTransformer2DModel) -> str | None:
    """A reason to refuse when the model has MoE layers and this Diffusers' ``NucleusMoELayer.forward``
    is not the one ``ShardedExpertChoice`` computes."""
    if not any(isinstance(m, NucleusMoELayer) for m in transformer.modules()):
        return None
    if _source_digest(NucleusMoELayer.forward) != _MOE_FORWARD_SHA256:
        return ("this diffusers' NucleusMoELayer.forward differs from the expert-choice routing usp_dit computes "
                "exactly over a sharded sequence (each expert's top-k over the whole sequence); refused rather than "
                "routing a shard's tokens alone")
    return None


def _routed_call_missing(transformer: NucleusMoEImageTransformer2DModel) -> str | None:
    if _ROUTED_CALL is None:
        return f"this diffusers' NucleusMoEAttnProcessor2_0 does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


PLAN = ModelPlan(
    name="NucleusMoE",
    model_class=NucleusMoEImageTransformer2DModel,
    split_at="transformer_blocks.0",
    gather_at="proj_out",
    attention=(
        # image queries over [image shard; text] keys, text last, replicated, masked per element
        Parallel("transformer_blocks.*.attn", USPNucleusMoEAttnProcessor, stock=(NucleusMoEAttnProcessor2_0,),
                 text="last"),
    ),
    block_lists=("transformer_blocks",),
    # pos_embed(img_shapes, ...) -> (img_freqs (N, D/2), txt_freqs (T, D/2)): the image table cut on dim 0.
    tables=(Table("pos_embed", dim=0, items=(0,)),),
    cfg_batch_args=("hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep"),
    # NucleusMoEImagePipeline's CFG: one call per branch, differing in these (cfg_pair Note [two calls a step]).
    cfg_branch_args=("encoder_hidden_states", "encoder_hidden_states_mask"),
    hooks=(ExpertChoiceHooks,),
    refuse=(_routed_call_missing, _moe_forward_changed),
)

ADAPTER = register_adapter(PlanAdapter(PLAN, __name__))
