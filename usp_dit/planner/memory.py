"""Bytes per rank: the weights by placement, the text encoders, one call's activations, the VAE's share.

Layout: no tensors; a model is a ``ModelSpec`` with its ``ModelMemory`` (``usp_dit.planner.models``
Note [model memory]); a grid is (ulysses U, ring R) sequence ranks, each a tensor group of T
ranks, inside a model replica of P = cfg x U x R x T ranks (the planner's grids use every GPU:
P = world size). Figures are GiB (2^30 bytes) of the worst rank.

Note [memory per rank]
    One generation on a rank passes three phases; the peak is the largest, plus a reserve:

        encode   = T_rest + E_encode + V_w + O            the prompt through the text encoders
        denoise  = T_peak + E_rest  + V_w + O + A         every transformer call of the loop
        decode   = T_rest + E_rest  + V_w + O + V_dec     the parallel VAE decode
        peak     = max(encode, denoise, decode) + reserve

    Transformer weights T (bytes by dtype as loaded: bf16, Diffusers' float32 modules at 4 bytes;
    every resident transformer: both Wan 2.2 experts):
        replicated   T_rest = T_peak = T
        sharded      (``enable_usp(..., shard_weights=True)``, Note [sharded weights]: FSDP2 units
                     over the P ranks, resharded after each, the next block prefetched)
                     T_rest = T / P                    between calls a rank holds its shards only
                     T_peak = T / P + 2 U_max + R      a block running, the next one gathered, the
                                                       transformer's own direct parameters
        U_max: the largest unit: the largest block, or an outer child (embedder, modulation, final
        layer; one unit each) where larger. Left out: FSDP2's padding of each shard to a multiple
        of P (under P elements a parameter).
        tensor parallel (``enable_usp(..., tensor_degree=T)``; the cuts: ``models`` Note [tensor
                     cuts]): C the bytes the blocks' cut Linears hold, C_T a tensor rank's share
                     (each cut part x ceil(n / T) / n of its heads or MLP columns: the padding of
                     an uneven split included), W = T - C the rest (modulation, norms, the
                     row-parallel biases, everything outside the blocks), whole on every rank:
                     replicated   T_rest = T_peak = W + C_T
                     sharded      (Note [sharded tensor-parallel weights] in usp_dit.pipelines.
                                  weights: the cut weights' tensor share over the P_s = P / T
                                  sequence ranks, the uncut ones over the whole replica)
                                  T_rest = C_T / P_s + W / P
                                  T_peak = T_rest + 2 G_max + R, G_max the largest gathered unit:
                                  a block's uncut part with its cut tensor share (the share alone
                                  when P_s = 1: it stays resident, not gathered), or an outer child
                     A block's cut fraction is its list's (a list's blocks are alike).
    Text encoders E (bf16; ``enable_usp(..., text_encoder=...)``, Note [text encoders on a grid]):
        "replicate"  E_rest = E_encode = E
        "rank0"      the replica's first rank holds every encoder, the others nothing: the worst
                     rank holds E, as with "replicate" (so "rank0" fits exactly where "replicate"
                     does; what it saves is the other ranks' memory)
        "shard"      E_rest = E / P; E_encode = E / P + the rest unit (embeddings, final norm,
                     lm_head: gathered for the whole encoder forward) + 2 of the largest layer
                     (the one running and the next, prefetched), the largest over the encoders
        The encoders' activations (prompts of at most ~1000 tokens) are left out: < 0.1 GiB.
    Activations A of one transformer call on the rank's n tokens (ceil(S / (U R)) of the split
    sequence, plus the replicated joint text tokens), call batch b, bf16 (2 bytes), counted in
    values per token from the block's widths (d hidden, m the MLP's intermediate, H heads, D
    head_dim) and the largest over the model's block kinds:
        attention   8d      x, its normed copy, q, k, v, the output, and q, k after their norm and
                            RoPE before their inputs are freed
                    + 3d    on U > 1: q, k, v in the heads layout beside the sequence layout
                    + 3d    on R > 1: the merge's float32 running output (2d) and a block's output
                    + 2H    the kernel's float32 LSE (n U tokens x H / U heads a rank)
        MLP         2d + m_in + m_act   x, its normed copy, the first projection's output (m;
                            gated: 2m) and the activation (m; gated: the gate's activation and the
                            product, 2m)
        sequential block     max(attention, MLP)
        parallel block       m + max(attention, 5d + m)   (single-stream: the MLP's activation
                             waits beside the attention for the concat [out; mlp] and the
                             projection out: x, normed, out, concat d + m, result)
        fused parallel       max(5d + m_in + m_act, the parallel figure)   (one q/k/v + MLP-in
                             projection, 3d + m_in, alive while the activation is made)
        float32 residual     at least 10d   (Wan: modulation and residual adds in float32: x, the
                             branch's output and four float32 copies of d)
        + 4D                 RoPE's cos and sin tables, float32
        tensor parallel (T > 1, a block list with cuts): every per-head width above (q, k, v, the
        attention output, their Ulysses and ring copies, a parallel block's attention output and
        concat) is a tensor rank's, d_T = d ceil(H / T) / H, the MLP's m_T = ceil(m / T), the LSE
        2 ceil(H / T); the residual stream (x, its normed copy, a row-parallel Linear's all-reduced
        output) stays d: attention 2d + 6 d_T (+ 3 d_T, + 3 d_T), MLP 2d + m_in,T + m_act,T,
        parallel m_T + max(attention, 3d + 2 d_T + m_T), fused 2d + 3 d_T + m_in,T + m_act,T (each
        the figure above at T = 1); the ring and cross K/V of ceil(H_kv / T) heads.
    A = slack x 2 b n (values per token) + ring K/V + cross K/V, with
        ring K/V (R > 1)     2 b B ceil(S / R) ceil(H_kv / U) D x 2 bytes; B = 2 blocks
                             streaming ("stream"), R blocks gathered (the gather schedules)
        cross K/V ("cross")  2 b T d x 2 bytes: one block's K and V of the T text tokens
        slack = 1.3          the count names the big tensors, not every one: against the peaks
                             measured at world size 1 for nine released transformers (docs/
                             PERFORMANCE.md "Whole transformers at world size 1": peak minus the
                             weights) it is 0.57-0.90 of the measured; x 1.3 brings the four whose
                             activations exceed 1 GiB (CogVideoX, Mochi, Wan, HunyuanVideo) to
                             0.97-1.17 (tests/test_planner_memory.py checks peak >= measured).
    Other modules O (``ModelMemory.others``: an image encoder, LTX-2's text connectors, an audio VAE
    and vocoder beside the video VAE, GLM-Image's autoregressive prior, an audio model's condition
    encoder or language model): their weights whole on every rank in every phase (``text_encoder=``
    places the text encoders only); their activations are left out (one pass a prompt or a
    decode, small beside a transformer call's).
    VAE: V_w its weights (bf16, on every rank); V_dec one rank's part of the parallel decode
    (``usp_dit.enable_parallel_vae``, split over the P ranks) plus the gathered output (the whole
    decoded image or video on every rank): the fractions of the stock decode's peak measured on
    one H200 at P = 2, 4, 8 (docs/PERFORMANCE.md "Parallel VAE decode", 2026-12-04); beyond the
    largest measured P, that fraction x P_measured / P; at a size other than the measured, the
    peak and output scaled by frames x height x width. A VAE without a parallel recipe decodes
    whole on every rank (fraction 1). The figures' source is ``VAEDecode.source`` (some are
    estimates from a like VAE by ``models`` Note [VAE estimates]: said there, and in explain()).
    An audio model's size is its samples: ``output_size`` (samples, 1, 1), scaled the same way.
    reserve = 1.0 GiB: the CUDA context and cuBLAS / cuDNN workspaces (outside torch's count),
    NCCL's buffers, a call's small inputs and the gathered output of the transformer.
    Not modelled: the caching allocator's fragmentation (``PYTORCH_CUDA_ALLOC_CONF=
    expandable_segments:True`` keeps it small), a step cache's stored hidden states, LoRA weights,
    DTensor's own buffers under tensor parallelism (a row-parallel output's all-reduce is in place).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from usp_dit.planner.models import BF16, BlockGroup, ModelMemory, ModelSpec, VAEDecode

GIB = 2**30
RESERVE_GIB = 1.0
ACTIVATION_SLACK = 1.3
ENCODER_PLACEMENTS = ("replicate", "shard", "rank0")
LSE_BYTES = 4
RING_SCHEDULES_GATHERING = ("gather_merge", "gather_one_call")


@dataclass(frozen=True)
class MemoryBreakdown:
    """One rank's memory in one placement (Note [memory per rank]); GiB, the worst rank's."""

    shard_weights: bool
    text_encoder: str  # "replicate", "shard" or "rank0"
    weights: float  # transformer(s) during a call (T_peak)
    weights_between_calls: float  # T_rest
    text_encoders: float  # during the denoising loop (E_rest)
    text_encoders_encoding: float  # while encoding the prompt (E_encode)
    activations: float  # one transformer call (A)
    vae_weights: float
    vae_decode: float  # one rank's share of the decode + the gathered output (V_dec)
    reserve: float = RESERVE_GIB
    tensor: int = 1  # the tensor degree T (``enable_usp(..., tensor_degree=T)``)
    others: float = 0.0  # the other modules held whole on every rank (O)

    @property
    def phases(self) -> dict[str, float]:
        """GiB of each phase of a generation, without the reserve."""
        held = self.vae_weights + self.others  # whole on every rank in every phase
        return {
            "encode": self.weights_between_calls + self.text_encoders_encoding + held,
            "denoise": self.weights + self.text_encoders + held + self.activations,
            "decode": self.weights_between_calls + self.text_encoders + held + self.vae_decode,
        }

    @property
    def peak_phase(self) -> str:
        phases = self.phases
        return max(phases, key=phases.__getitem__)

    @property
    def total(self) -> float:
        """The rank's peak: the largest phase plus the reserve."""
        return max(self.phases.values()) + self.reserve

    @property
    def vae(self) -> float:
        return self.vae_weights + self.vae_decode

    def placement(self) -> str:
        """``"weights sharded, text encoder 'shard'"``, ``"weights replicated, tensor parallel 2, ..."``."""
        tensor = f", tensor parallel {self.tensor}" if self.tensor > 1 else ""
        return f"weights {'sharded' if self.shard_weights else 'replicated'}{tensor}, text encoder {self.text_encoder!r}"


def check_text_encoder(text_encoder: str) -> str:
    if text_encoder not in ENCODER_PLACEMENTS:
        raise ValueError(f"text_encoder={text_encoder!r}: choose one of {list(ENCODER_PLACEMENTS)}")
    return text_encoder


def model_memory(spec: ModelSpec) -> ModelMemory:
    """``spec.memory``, or for a spec built without it a stand-in: ``spec.params`` in bf16 as
    ``spec.layers`` equal blocks with a 4x MLP, no encoders, no VAE."""
    if spec.memory is not None:
        return spec.memory
    params = int(spec.params)
    block = params // max(spec.layers, 1)
    group = BlockGroup("blocks", spec.layers, block * spec.layers, BF16 * block * spec.layers, block, BF16 * block,
                       spec.hidden, 4 * spec.hidden)
    rest = params - block * spec.layers
    return ModelMemory((group,), rest, BF16 * rest, BF16 * rest, 0)


def split_share(units: int, tensor: int) -> float:
    """The fraction of ``units`` (heads, MLP columns) one of ``tensor`` ranks holds: ceil(n / T) / n
    (Note [uneven tensor splits] in usp_dit.pipelines.tensor: padded to a whole number each)."""
    return math.ceil(units / tensor) / units if units else 1.0


def cut_bytes(memory: ModelMemory, heads: int, tensor: int) -> tuple[float, float]:
    """``(C, C_T)``: the bytes tensor parallelism cuts in every resident transformer, and a tensor
    rank's share of them (Note [memory per rank], ``models`` Note [tensor cuts])."""
    whole = local = 0.0
    for g in memory.blocks:
        if g.cut is not None:
            whole += g.cut.nbytes
            local += g.cut.head_bytes * split_share(heads, tensor) + g.cut.width_bytes * split_share(g.mlp, tensor)
    return memory.experts * whole, memory.experts * local


def _gathered_unit(memory: ModelMemory, heads: int, tensor: int, sequence_ranks: int) -> float:
    """The largest unit a sharded tensor-parallel rank all-gathers: a block's uncut part (over the
    replica) with its cut part's tensor share (over the sequence ranks; resident when there are
    none), or an outer child (Note [memory per rank])."""
    units = [memory.largest_outer_bytes]
    for g in memory.blocks:
        cut = g.cut.nbytes / g.nbytes if g.cut is not None else 0.0
        local = 0.0
        if g.cut is not None and sequence_ranks > 1:
            local = (g.cut.head_bytes * split_share(heads, tensor) + g.cut.width_bytes * split_share(g.mlp, tensor)) \
                / g.nbytes
        units.append(g.largest_bytes * (1 - cut + local))
    return max(units)


def transformer_bytes(memory: ModelMemory, replica: int, shard_weights: bool, tensor: int = 1,
                      heads: int = 1) -> tuple[float, float]:
    """``(T_peak, T_rest)`` bytes on a replica of ``replica`` ranks, ``tensor`` of them a tensor group
    cutting ``heads`` heads (Note [memory per rank])."""
    total = memory.transformer_bytes
    if tensor > 1:
        whole, local = cut_bytes(memory, heads, tensor)
        uncut = total - whole
        if not shard_weights:
            return uncut + local, uncut + local
        sequence_ranks = replica // tensor
        rest = local / sequence_ranks + uncut / replica
        return rest + 2 * _gathered_unit(memory, heads, tensor, sequence_ranks) + memory.root_bytes, rest
    if not shard_weights or replica == 1:
        return total, total
    rest = total / replica
    return rest + 2 * memory.largest_unit_bytes + memory.root_bytes, rest


def encoder_bytes(memory: ModelMemory, replica: int, text_encoder: str) -> tuple[float, float]:
    """``(E_rest, E_encode)`` bytes of the worst rank (Note [memory per rank])."""
    check_text_encoder(text_encoder)
    total = memory.encoder_bytes
    if text_encoder != "shard" or replica == 1:
        return total, total  # "rank0": the first rank holds them all
    rest = total / replica
    gathered = max((e.rest_bytes + 2 * e.largest_layer_bytes for e in memory.encoders), default=0)
    return rest, rest + gathered


def _block_values_per_token(group: BlockGroup, heads: int, head_dim: int, ulysses: int, ring: int,
                            tensor: int = 1) -> int:
    """Values (bf16 units) one token of the rank keeps alive at a block's peak (Note [memory per
    rank]); on ``tensor`` ranks the per-head widths (dh) and the MLP's (ml) are a tensor rank's."""
    d = group.hidden
    cut = tensor > 1 and group.cut is not None
    local_heads = math.ceil(heads / tensor) if cut else heads
    dh = d * local_heads // heads  # the attention's width on this rank: d uncut
    ml = math.ceil(group.mlp / tensor) if cut else group.mlp
    m_in = 2 * ml if group.gated else ml
    m_act = 2 * ml if group.gated else ml
    attention = 2 * d + 6 * dh + (3 * dh if ulysses > 1 else 0) + (3 * dh if ring > 1 else 0) \
        + local_heads * LSE_BYTES // BF16
    mlp = 2 * d + m_in + m_act
    if group.kind == "sequential":
        values = max(attention, mlp)
    else:
        values = ml + max(attention, 3 * d + 2 * dh + ml)
        if group.kind == "fused":
            values = max(values, 2 * d + 3 * dh + m_in + m_act)
    if group.fp32_residual:
        values = max(values, 10 * d)
    return values + 4 * head_dim


def rank_tokens(spec: ModelSpec, ulysses: int, ring: int) -> int:
    """Tokens one rank runs a block on: its piece of the split sequence and the joint text."""
    return math.ceil(spec.sequence / (ulysses * ring)) + spec.joint


def activation_bytes(spec: ModelSpec, ulysses: int, ring: int, schedule: str, batch: int, tensor: int = 1) -> float:
    """Bytes of one transformer call's activations on one rank (``A``, Note [memory per rank])."""
    memory = model_memory(spec)
    per_token = max(_block_values_per_token(g, spec.heads, spec.head_dim, ulysses, ring, tensor)
                    for g in memory.blocks)
    counted = ACTIVATION_SLACK * BF16 * batch * rank_tokens(spec, ulysses, ring) * per_token
    ring_kv = 0.0
    if ring > 1:
        blocks = ring if schedule in RING_SCHEDULES_GATHERING else 2
        kv_heads = math.ceil(math.ceil(spec.kv_heads / tensor) / ulysses)
        ring_kv = 2 * batch * blocks * math.ceil(spec.sequence / ring) * kv_heads * spec.head_dim * BF16
    cross = 2 * batch * spec.text * spec.head_dim * math.ceil(spec.heads / tensor) * BF16 \
        if spec.text_mode == "cross" else 0
    return counted + ring_kv + cross


def vae_fraction(vae: VAEDecode, replica: int) -> float:
    """One rank's share of the stock decode's peak on ``replica`` ranks (Note [memory per rank])."""
    if replica == 1 or not vae.fractions:
        return 1.0
    if replica in vae.fractions:
        return vae.fractions[replica]
    below = [p for p in vae.fractions if p <= replica]
    if not below:
        return 1.0
    measured = max(below)
    return vae.fractions[measured] * measured / replica


def vae_decode_gib(spec: ModelSpec, replica: int) -> float:
    """GiB of one rank's decode share plus the gathered output, at ``spec``'s size."""
    vae = model_memory(spec).vae
    if vae is None:
        return 0.0
    scale = math.prod(spec.output_size) / math.prod(vae.reference)
    return scale * (vae.stock_peak_gib * vae_fraction(vae, replica) + vae.output_gib)


def breakdown(spec: ModelSpec, ulysses: int, ring: int, replica: int, schedule: str, batch: int, *,
              shard_weights: bool = False, text_encoder: str = "replicate", tensor: int = 1) -> MemoryBreakdown:
    """One rank's memory for ``spec`` on a (U, R) sequence grid inside a replica of ``replica``
    ranks (``tensor`` of them a tensor-parallel group: replica = cfg x U x R x T), ``batch``
    samples a call, in a placement (Note [memory per rank]). On a replica of one rank there is
    nothing to shard: every placement is "replicated, replicate".

    Raises:
        ValueError: ``tensor`` > 1 on a model whose family declares no cuts, or over its heads.
    """
    check_tensor(spec, tensor)
    if replica == 1:
        shard_weights, text_encoder = False, "replicate"
    memory = model_memory(spec)
    t_peak, t_rest = transformer_bytes(memory, replica, shard_weights, tensor, spec.heads)
    e_rest, e_encode = encoder_bytes(memory, replica, text_encoder)
    vae_weights = memory.vae.nbytes if memory.vae is not None else 0
    return MemoryBreakdown(
        shard_weights, text_encoder, t_peak / GIB, t_rest / GIB, e_rest / GIB, e_encode / GIB,
        activation_bytes(spec, ulysses, ring, schedule, batch, tensor) / GIB, vae_weights / GIB,
        vae_decode_gib(spec, replica), tensor=tensor, others=memory.other_bytes / GIB,
    )


def check_tensor(spec: ModelSpec, tensor: int) -> int:
    """``tensor`` if ``spec`` can run on that tensor degree.

    Raises:
        ValueError: not an int >= 1, above the model's heads, or > 1 on a family that declares no
            tensor-parallel cuts (``models`` Note [tensor cuts]).
    """
    if not isinstance(tensor, int) or isinstance(tensor, bool) or tensor < 1:
        raise ValueError(f"tensor_degree={tensor!r} must be an int >= 1")
    if tensor > 1 and not spec.tensor_parallel:
        raise ValueError(f"tensor_degree={tensor}: {spec.label or spec.name} declares no tensor-parallel cuts "
                         f"(its family plan has no TensorPlan); use tensor_degree=1")
    if tensor > spec.heads:
        raise ValueError(f"tensor_degree={tensor} exceeds {spec.label or spec.name}'s {spec.heads} attention heads")
    return tensor


def gathered_units(spec: ModelSpec) -> tuple[float, list[tuple[float, float]]]:
    """What one call of a sharded transformer all-gathers: ``(outer bytes, [(block bytes, block
    params)] in run order)``; a group's blocks are taken as equal (its mean)."""
    memory = model_memory(spec)
    blocks = [(g.nbytes / g.count, g.params / g.count) for g in memory.blocks for _ in range(g.count)]
    return memory.outer_bytes, blocks
