"""Cosmos 3 adapter: ``Cosmos3OmniTransformer`` (Cosmos 3 Omni: text-to-video, image-to-video,
video-to-video, with optional sound and action streams; ``Cosmos3OmniPipeline``) on a USP grid.

Layout: one packed sequence, no batch dimension. ``hidden_states`` (N, C) is
``[und (und_len, C) ; gen (N - und_len, C)]``: the understanding stream ``und`` is the prompt's
text tokens (input ids embedded), the generation stream ``gen`` the vision patches of every
vision item (``(T, ceil(H/2), ceil(W/2))`` patches of 2x2 latent pixels each, frame-major), then
the sound tokens (one per sound latent frame) and the action tokens, when present. The mRoPE
table is ``(cos, sin)``, each (N, head_dim), cut by the model into the und rows and the gen rows;
Q/K/V (1, tokens, heads | kv_heads, head_dim) in the attention calls (GQA: ``num_key_value_heads``
<= heads).

The model (a mixture of transformers: every decoder layer has one set of weights per stream):

    und: input_layernorm, to_q/k/v, norm_q/k, mlp ...   causal self-attention over und alone
    gen: input_layernorm_moe_gen, add_q/k/v_proj, ...   full attention over [und keys ; gen keys]

Nothing is generated autoregressively inside the call: the text is given (``input_ids``), the
``und`` stream only conditions (its causal attention never reads a gen token, so its output does
not depend on the video), and the velocity of every gen token comes out of one forward.

Which tokens are split (Note [Cosmos 3's two streams])
    ``gen`` is **split** (every vision, sound and action token alike: they run through the same
    per-token gen weights and full attention); ``und`` is **replicated**: every rank runs the whole
    text stream (its causal attention locally, with the stock call: no communication) and hands
    its keys and values to the gen attention as joint tokens, attended once by every gen query
    (``usp_attention``'s ``joint_k/joint_v``). Per rank at the real size, 720 x 1280 x 189 frames
    (Wan 2.2's VAE: 48 x 45 x 80 latents, 48 x 23 x 40 = 44160 vision tokens, + ~197 sound tokens
    with ``enable_sound``): 5520 (+ 25) gen tokens per rank on 8 ranks, 11040 on 4, beside the
    replicated prompt (system prompt, prompt and templates: a few hundred tokens), whose text
    stream costs every rank what it costs one process (~1-2 % of a step at these sizes).

    The cut is the model's own seam: ``forward`` calls ``self._cp_shard_fn(und, gen, rotary)``
    before the decoder layers and ``self._cp_gather_fn(und_out, gen_out)`` after the final norms
    (None by default, "set by an external helper"). Enable sets both as instance attributes
    (objects, for Note [deep copies]): the first keeps this rank's contiguous rows of ``gen`` and
    of the gen RoPE rows (``shard_sequence``, dim 0), the second all-gathers the gen rows. So the
    packing (``*_sequence_indexes``, per-token timesteps added to the noisy frames) and the
    decoding (``*_mse_loss_indexes``, unpatchify) run whole, on every rank, as stock: they index the
    whole packed sequence, and whatever they index, the decoder layers see it cut at one place.
    The gather is of the normed hidden states (hidden_size wide), not of ``proj_out``'s smaller
    output: the decode reads rows of the whole sequence by index.

Attention (``USPCosmos3AttnProcessor``): the stock ``Cosmos3AttnProcessor.__call__``'s own code
(projections, q/k norms, mRoPE on this rank's rows, output projections) with its two
``dispatch_attention_fn`` calls routed (``usp_dit.pipelines._routing``, Note [routing a stock
processor's attention call]) to ``route_cosmos3_attention``: the causal call (``is_causal=True``,
the und stream, whole on every rank) goes to the stock ``dispatch_attention_fn`` unchanged; the
full call (gen queries of this rank against ``[und keys ; gen keys of this rank]``) goes to
``usp_attention`` with the und keys and values as joint tokens. ``usp_attention`` takes joint
queries with joint keys; the gen call has none, so it passes zeros there and drops their output:
exact for the gen queries, at the cost of und_len extra query rows (shared over the ring ranks).

Two calls a step: ``Cosmos3OmniPipeline`` calls the transformer once for the prompt and once for
the negative prompt, which differ in the text (ids, length, positions, and so where the gen
tokens sit): ``cfg_branch_args``. With ``cfg_degree=2`` the two calls of a step run on the two cfg
groups at once (``usp_dit.pipelines.cfg_pair``). There is no batch to split (``cfg_batch_args``
is empty): a call that is not paired runs whole on both cfg groups.

Refused (NotImplementedError): processors other than the stock ``Cosmos3AttnProcessor``; a model
whose ``_cp_shard_fn`` / ``_cp_gather_fn`` is already set (another context parallelism: at
enable); a Diffusers cache that cannot run on a grid; a routed call with a mask, dropout or
attention kwargs (the stock processor passes none), or a full call whose query length is not this
rank's gen shard (at the call); ``num_hidden_layers=0``.
"""
from __future__ import annotations

from typing import Any

import torch
from diffusers.models.transformers import transformer_cosmos3
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3AttnProcessor, Cosmos3OmniTransformer

from usp_dit.attention.usp import usp_attention
from usp_dit.distributed.mesh import USPMesh
from usp_dit.pipelines._routing import ROUTED_NAME, Route, RoutedProcessor, with_global
from usp_dit.pipelines._token_sharding import ShardState, TokenShardHooks
from usp_dit.pipelines.base import MISSING, register_adapter, restore_instance_attr, saved_instance_attr
from usp_dit.pipelines.plan import ModelPlan, Parallel, PlanAdapter, PlanPatch, check_plan
from usp_dit.sharding.shard import gather_sequence, shard_sequence

# The stock dispatcher, for the und stream's causal call (replicated: no communication).
_stock_dispatch = transformer_cosmos3.dispatch_attention_fn


def route_cosmos3_attention(
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
    """``dispatch_attention_fn``'s signature, for ``Cosmos3AttnProcessor``'s two calls.

    Args:
        query: (1, und_len, H, D) for the causal (und) call; (1, S_local, H, D), this rank's gen
            tokens, for the full call.
        key, value: (1, und_len, H_kv, D) for the causal call; (1, und_len + S_local, H_kv, D),
            ``[und ; this rank's gen]``, for the full call.
        parallel_config: the processor's ``Route``.

    Returns:
        (1, und_len or S_local, H, D), laid out like ``query``.

    Raises:
        NotImplementedError: a mask, dropout or attention kwargs.
        ValueError: a full call whose query length is not this rank's gen shard.
    """
    route = parallel_config
    if not isinstance(route, Route):
        raise RuntimeError(f"usp_dit's Cosmos 3 processor got parallel_config={type(route).__name__}, not its Route")
    if attn_mask is not None or dropout_p or attention_kwargs:
        raise NotImplementedError(
            f"usp_dit's Cosmos 3 adapter routes unmasked attention only, got attn_mask="
            f"{None if attn_mask is None else tuple(attn_mask.shape)}, dropout_p={dropout_p}, "
            f"attention_kwargs={attention_kwargs}"
        )
    if is_causal:  # the und (text) stream: whole on every rank, attends to itself alone
        return _stock_dispatch(query, key, value, is_causal=True, scale=scale, enable_gqa=enable_gqa,
                               backend=backend, parallel_config=None)
    shard = route.shard_len()
    und_len = key.shape[1] - shard
    if query.shape[1] != shard or und_len < 0:
        raise ValueError(
            f"a routed Cosmos 3 gen attention call got {query.shape[1]} queries and {key.shape[1]} keys, but this "
            f"rank's gen shard has {shard} tokens (keys must be [und ; shard])"
        )
    # Note [Cosmos 3's two streams]: the und keys are joint tokens; their (zero) queries' rows are dropped.
    joint_q = query.new_zeros(query.shape[0], und_len, *query.shape[2:])
    state = route.state
    res = usp_attention(query, key[:, und_len:], value[:, und_len:], joint_q=joint_q, joint_k=key[:, :und_len],
                        joint_v=value[:, :und_len], scale=scale, mesh=state.mesh, backend=state.backend,
                        seq_len=state.seq_len)
    return res.out


_routed_call = with_global(Cosmos3AttnProcessor.__call__, ROUTED_NAME, route_cosmos3_attention)


class USPCosmos3AttnProcessor(RoutedProcessor):
    """Cosmos 3's dual-pathway attention: the und stream whole, this rank's gen tokens against
    ``[und ; every gen token]``. Inputs: ``und_seq`` (und_len, C), ``gen_seq`` (S_local, C), the
    rotary rows ``(cos_und, sin_und, cos_gen_local, sin_gen_local)``. Returns ``(und_out, gen_out)``
    like them. The maths is the stock ``Cosmos3AttnProcessor``'s own code, its calls routed."""

    _stock_call = _routed_call


class Cosmos3Shard:
    """The model's ``_cp_shard_fn`` (Note [Cosmos 3's two streams]): this rank's gen rows and gen RoPE rows."""

    def __init__(self, state: ShardState) -> None:
        self.state = state

    def __call__(self, und_seq: torch.Tensor, gen_seq: torch.Tensor, rotary_emb: tuple) -> tuple:
        """(und_len, C), (S, C), (cos_und, sin_und, cos_gen (S, D), sin_gen (S, D)) -> the same
        with gen and its RoPE rows cut to this rank's (S_local, ...).

        Raises:
            ValueError: the gen RoPE rows are not one per gen token.
        """
        cos_und, sin_und, cos_gen, sin_gen = rotary_emb
        if cos_gen.shape[0] != gen_seq.shape[0] or sin_gen.shape[0] != gen_seq.shape[0]:
            raise ValueError(
                f"the gen RoPE table has {cos_gen.shape[0]} rows but the gen stream has {gen_seq.shape[0]} tokens: "
                f"they must match for the table to be cut like the tokens"
            )
        mesh = self.state.mesh
        self.state.seq_len = gen_seq.shape[0]
        self.state.text_len = und_seq.shape[0]

        def cut(t: torch.Tensor) -> torch.Tensor:
            return shard_sequence(t, mesh, dim=0)

        return und_seq, cut(gen_seq), (cos_und, sin_und, cut(cos_gen), cut(sin_gen))


class Cosmos3Gather:
    """The model's ``_cp_gather_fn``: the gen rows (S_local, C) of every rank, gathered to (S, C)."""

    def __init__(self, state: ShardState) -> None:
        self.state = state

    def __call__(self, und_out: torch.Tensor, gen_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return und_out, gather_sequence(gen_out, self.state.mesh, dim=0, seq_len=self.state.seq_len)


class Cosmos3Seams:
    """The plan part setting the model's two context-parallel seams (instance attributes), and
    putting back what was there on remove."""

    NAMES = ("_cp_shard_fn", "_cp_gather_fn")

    def __init__(self, transformer: Cosmos3OmniTransformer, state: ShardState) -> None:
        self.transformer, self.state = transformer, state
        self.saved: dict[str, Any] = {name: MISSING for name in self.NAMES}

    def install(self) -> None:
        for name, fn in zip(self.NAMES, (Cosmos3Shard(self.state), Cosmos3Gather(self.state))):
            self.saved[name] = saved_instance_attr(self.transformer, name)
            setattr(self.transformer, name, fn)

    def remove(self) -> None:
        for name in self.NAMES:
            restore_instance_attr(self.transformer, name, self.saved[name])


class Cosmos3PlanPatch(PlanPatch):
    """``PlanPatch`` with the tokens cut at the model's seams (``Cosmos3Seams``) instead of at
    ``split_at``'s ``hidden_states``: the layers take two streams, not one (batch, seq, C) tensor."""

    def __init__(self, plan: ModelPlan, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> None:
        super().__init__(plan, transformer, mesh, backend)
        tokens = [i for i, part in enumerate(self.parts) if isinstance(part, TokenShardHooks)]
        assert len(tokens) == 1, "PlanPatch installs one TokenShardHooks"
        self.parts[tokens[0]] = Cosmos3Seams(transformer, self.state)


class Cosmos3PlanAdapter(PlanAdapter):
    def make_patch(self, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> Cosmos3PlanPatch:
        check_plan(self.plan, transformer)
        return Cosmos3PlanPatch(self.plan, transformer, mesh, backend)


def _routed_call_missing(transformer: Cosmos3OmniTransformer) -> str | None:
    if _routed_call is None:
        return f"this diffusers' Cosmos3AttnProcessor does not call {ROUTED_NAME}, the call usp_dit routes"
    return None


def _seams_taken(transformer: Cosmos3OmniTransformer) -> str | None:
    taken = [n for n in Cosmos3Seams.NAMES if getattr(transformer, n, None) is not None]
    if taken:
        return (f"{' and '.join(taken)} already set (another context parallelism, e.g. diffusers' "
                f"examples/cosmos3/cosmos_parallel.py): use one or the other")
    return None


PLAN = ModelPlan(
    name="Cosmos3",
    model_class=Cosmos3OmniTransformer,
    split_at="",  # the model's seams (Cosmos3Seams), not a module's input
    gather_at="",
    attention=(Parallel("layers.*.self_attn", USPCosmos3AttnProcessor, stock=(Cosmos3AttnProcessor,)),),
    block_lists=("layers",),
    cfg_batch_args=(),  # one packed sequence: no batch to split
    # The prompt and the negative prompt's calls differ in the text and so in where the gen tokens sit.
    cfg_branch_args=(
        "input_ids", "text_indexes", "position_ids", "und_len", "sequence_length",
        "vision_sequence_indexes", "vision_mse_loss_indexes", "sound_sequence_indexes", "sound_mse_loss_indexes",
        "action_sequence_indexes", "action_mse_loss_indexes",
    ),
    refuse=(_routed_call_missing, _seams_taken),
)

ADAPTER = register_adapter(Cosmos3PlanAdapter(PLAN, __name__))
