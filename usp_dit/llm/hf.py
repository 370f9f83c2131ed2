"""Hugging Face transformers: ``attn_implementation="usp"`` for models that dispatch attention by name.

Layout: transformers hands the attention function query (batch, heads, seq_local, head_dim) and
key/value (batch, kv_heads, seq_local, head_dim); it returns (batch, seq_local, heads, head_dim), as
transformers' own sdpa and flash functions do. ``seq_local`` is this rank's shard of the sequence
in the registered layout; position_ids (batch or 1, seq_local) are the GLOBAL positions of those
tokens (``usp_dit.llm.shard_lm_batch``).

Every decoder that calls ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation, ...)``
(Llama, Qwen2, Mistral, Gemma, ... in transformers 5) takes it, with no change to the model:

    register_transformers(mesh, layout="zigzag")                 # once, before the forward
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="usp")

Note [masks under usp]
    transformers 5 builds a model's mask (``create_causal_mask`` and its siblings) with the mask
    function registered in ``AttentionMaskInterface`` under the attention's name. For a name with
    none, ``_preprocess_mask_arguments`` returns early with ``None``: the caller's
    ``attention_mask`` is DROPPED without a word, and a padded batch would train on its pads. So
    ``register_transformers`` also registers ``usp_mask`` under the name. It builds no dense mask (a
    (S_local x S_local) mask would be wrong anyway: causality is over GLOBAL positions, which the
    core turns into kernel calls block by block, Note [staircase masks] in ``usp_dit.attention.masks``); it
    returns ``None`` for no mask or a mask of ones, and the caller's 2-D padding mask otherwise,
    which the attention then refuses (NotImplementedError, shared with the other ranks): right-pad
    instead and give the padded positions the label ``ignore_index`` (causal attention never lets a
    real token see a later pad). The mask function transformers composes beforehand (including the
    packed-sequence remapping it derives from zigzag or stripe position_ids, which do not grow by
    one) is ignored.

Note [positions are checked once per forward]
    A model given no position_ids makes ``arange(seq_local)`` on every rank, and RoPE then rotates
    every shard as if it started the sequence: a silent wrong answer. So, at the first attention
    call of a forward (a position_ids tensor not seen before; every layer of a forward, and a
    gradient-checkpointing recompute, get the same tensor), the ranks gather their shard lengths
    (the full length S is their sum) and agree, in a second small gather, on whether each rank's
    position_ids are the positions the layout gives it for S. Every rank raises the same
    ValueError otherwise. Later calls reuse S (passed to the core as ``seq_len``). Every rank of a
    sequence group must run the same forward code, as it must for the attention anyway; under
    ``torch.compile`` no check can run and the compiled core then needs a ``seq_len`` it does not
    get, so this path is eager only.

Refused (NotImplementedError, naming the case): attention dropout > 0 in training, sliding
windows, logit softcapping, attention sinks (``s_aux``), position biases, packed varlen kwargs
(``cu_seq_lens_*``), a padding or custom (4-D) ``attention_mask``, keys of another length than the
queries (a KV cache during generation, or cross-attention), and multimodal (3-D) position_ids.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any

import torch

from usp_dit.attention.usp import usp_attention
from usp_dit.distributed.handshake import agree
from usp_dit.distributed.mesh import USPMesh, resolve_mesh
from usp_dit.distributed.replica import comm_device
from usp_dit.sharding.layouts import check_layout, positions, shard_pieces

INSTALL = "pip install 'transformers>=5'"
# transformers special-cases names containing these (its own sdpa / flash / flex / paged checks).
_RESERVED_PARTS = ("sdpa", "flash", "flex", "paged", "eager")
# Keyword arguments whose non-None value asks for something the sharded attention does not do.
_REFUSED_KWARGS = {
    "sliding_window": "a sliding window (sliding_window={value}): the window would cut the ring's blocks; use a "
                      "config without sliding-window layers (e.g. Qwen2 use_sliding_window=False)",
    "softcap": "logit softcapping (softcap={value}): the kernels compute plain softmax(q k^T * scale)",
    "s_aux": "attention sinks (s_aux): the sink logits are not merged into the ring's log-sum-exp",
    "position_bias": "an additive position bias: the kernels take no bias",
    "cu_seq_lens_q": "packed varlen sequences (cu_seq_lens_q): give each sequence its own batch row",
    "cu_seq_lens_k": "packed varlen sequences (cu_seq_lens_k): give each sequence its own batch row",
}


def _refuse(query: torch.Tensor, key: torch.Tensor, attention_mask, dropout: float, kwargs: dict[str, Any]) -> None:
    """NotImplementedError naming the first thing this call asks for that USP attention cannot do."""
    def no(what: str) -> NotImplementedError:
        return NotImplementedError(f"attn_implementation='usp' does not support {what}")

    if dropout > 0:
        raise no(f"attention dropout (dropout={dropout} in training): set config.attention_dropout=0.0")
    for name, what in _REFUSED_KWARGS.items():
        value = kwargs.get(name)
        if value is not None:
            raise no(what.format(value=value))
    if key.shape[2] != query.shape[2]:
        raise no(f"keys of another length than the queries ({key.shape[2]} keys, {query.shape[2]} queries: a KV "
                 f"cache during generation, or cross-attention); call the model with use_cache=False")
    if attention_mask is not None:
        _refuse_mask(attention_mask, no)
    position_ids = kwargs.get("position_ids")
    if position_ids is not None and position_ids.dim() != 2:
        raise no(f"position_ids of shape {tuple(position_ids.shape)} (multimodal RoPE); expected (batch, seq_local)")


def usp_mask(batch_size: int, q_length: int, kv_length: int, q_offset: int = 0, kv_offset: int = 0,
             mask_function: Any = None, attention_mask: torch.Tensor | None = None,
             **kwargs: Any) -> torch.Tensor | None:
    """The mask function registered with the attention (Note [masks under usp]): ``None`` for no
    mask or a (batch, kv_length) mask of ones, else that 2-D padding mask, for the attention to refuse."""
    if attention_mask is None or bool(attention_mask.all()):
        return None
    return attention_mask


def _refuse_mask(mask, no) -> None:
    """A 2-D mask of ones (no padding) passes; padding and custom masks are refused (Note [masks under usp])."""
    if not torch.is_tensor(mask) or mask.dim() != 2:
        shape = tuple(mask.shape) if hasattr(mask, "shape") else type(mask).__name__
        raise no(f"a custom attention_mask of shape {shape}: the causal mask is built from global positions; "
                 f"pass attention_mask=None")
    if not bool(mask.bool().all()):
        raise no("a padding attention_mask (it has zeros): right-pad the sequences, pass attention_mask=None and "
                 "set the labels of the padded positions to ignore_index (-100); causal attention never lets a "
                 "real token see a later pad, so the loss of the real tokens is unchanged")


@dataclass
class _Checked:
    """The last position_ids tensor checked (Note [positions are checked once per forward])."""

    position_ids: weakref.ref
    mesh: USPMesh
    seq_len: int


@dataclass
class TransformersAttention:
    """The function registered in ``transformers.AttentionInterface`` (one per ``register_transformers``).

    Called as transformers calls every attention function:
    ``fn(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs)`` with
    query (batch, heads, seq_local, head_dim), key/value (batch, kv_heads, seq_local, head_dim);
    returns ``(out, None)``, out (batch, seq_local, heads, head_dim) (no attention weights).
    """

    mesh: USPMesh | None
    layout: str
    backend: str = "auto"
    _checked: _Checked | None = field(default=None, repr=False)

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, scaling: float | None = None, dropout: float = 0.0,
                 **kwargs: Any) -> tuple[torch.Tensor, None]:
        mesh = resolve_mesh(self.mesh)
        try:
            _refuse(query, key, attention_mask, dropout, kwargs)
        except NotImplementedError as exc:
            _share_refusal(exc, mesh, query)
            raise
        is_causal = kwargs.get("is_causal")
        causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
        seq_len = self._seq_len(kwargs.get("position_ids"), query, mesh)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))  # (B, S_local, H, D)
        out = usp_attention(q, k, v, mesh=mesh, causal=causal, layout=self.layout, seq_len=seq_len, scale=scaling,
                            backend=self.backend).out
        return out, None

    def _seq_len(self, position_ids: torch.Tensor | None, query: torch.Tensor, mesh: USPMesh) -> int | None:
        """The full sequence length, after checking this forward's position_ids once (Note [positions
        are checked once per forward]); ``None`` where nothing can be checked."""
        n_local = query.shape[2]
        if mesh.sequence_degree == 1:
            return n_local
        if position_ids is None or torch.compiler.is_compiling():
            return None
        last = self._checked
        if last is not None and last.position_ids() is position_ids and last.mesh is mesh:
            return last.seq_len
        device = comm_device(mesh, query)
        what = "the sharded positions of a transformers forward"
        sizes = agree({"layout": self.layout}, mesh.seq_group, device, varying=n_local, what=what)
        seq_len = sum(sizes)
        problem = _position_problem(position_ids, seq_len, mesh, self.layout)
        wrong = agree({"layout": self.layout}, mesh.seq_group, device, varying=int(problem is not None), what=what)
        if any(wrong):
            ranks = [i for i, bad in enumerate(wrong) if bad]
            raise ValueError(
                f"position_ids do not match layout={self.layout!r} on sequence rank(s) {ranks} of {len(sizes)} "
                f"(seq_len={seq_len}){': ' + problem if problem else ''}. Pass position_ids=batch.position_ids from "
                f"usp_dit.llm.shard_lm_batch(..., layout={self.layout!r}) (the layout given to register_transformers); "
                f"packed sequences (positions restarting inside a row) are not supported"
            )
        self._checked = _Checked(weakref.ref(position_ids), mesh, seq_len)
        return seq_len


def _share_refusal(exc: Exception, mesh: USPMesh, query: torch.Tensor) -> None:
    """A call this rank refused still joins one handshake, which the other ranks of the sequence
    group are in (the position check's or ``usp_attention``'s, Note [call handshake] in
    ``usp_dit.distributed.handshake``): they raise a ValueError naming this rank's refusal instead of waiting
    for it (a padding mask may reach one shard only). Returns for the caller to re-raise ``exc``."""
    if mesh.seq_group is None or torch.compiler.is_compiling():
        return
    with contextlib.suppress(ValueError):  # the disagreement is expected: this rank raises its own error
        agree({"input check": f"{type(exc).__name__}: {exc}"}, mesh.seq_group, comm_device(mesh, query),
              varying=-1, what="a usp_attention call")


def _position_problem(position_ids: torch.Tensor, seq_len: int, mesh: USPMesh, layout: str) -> str | None:
    """What is wrong with this rank's position_ids (batch or 1, seq_local), or ``None``."""
    rank = mesh.seq_rank
    want = positions(shard_pieces(seq_len, mesh.ring_degree, mesh.ulysses_degree, layout)[rank])
    if position_ids.shape[-1] != want.numel():
        return f"rank {rank} has {position_ids.shape[-1]} positions, the layout gives it {want.numel()}"
    if bool((position_ids != want.to(position_ids.device)).any()):
        got = position_ids[0, :6].tolist()
        return f"rank {rank} holds positions starting {got}, the layout gives it {want[:6].tolist()}"
    return None


def register_transformers(mesh: USPMesh | None = None, *, layout: str = "zigzag", name: str = "usp",
                          backend: str = "auto") -> str:
    """Register USP attention with transformers as ``attn_implementation=name``; returns ``name``.

    Build (or switch) a model with ``attn_implementation="usp"`` afterwards; feed it this rank's
    shard of the batch from ``usp_dit.llm.shard_lm_batch(..., layout=layout)``: its input_ids and
    its position_ids (the GLOBAL positions of the rank's tokens), ``use_cache=False`` and no
    ``labels`` (the model's own loss would shift the labels inside the shard; use
    ``usp_dit.llm.lm_loss``). docs/LLM.md has the whole recipe.

    Causality comes from the attention module (``module.is_causal``, default True) or an
    ``is_causal`` keyword, over global positions. The mask function registered with it builds no
    dense mask and hands a padding mask on to be refused (Note [masks under usp]). What is refused
    is listed in this module's docstring.

    Args:
        mesh: the grid from ``usp_dit.init_usp``; ``None`` takes the default mesh at each call.
        layout: "zigzag" (default: balanced causal work), "stripe" or "contiguous"; the same as
            ``shard_lm_batch``'s.
        name: the ``attn_implementation`` name; registering it again replaces the function
            (transformers' registry is process-wide).
        backend: "auto" or a kernel name from ``usp_dit.kernels.list_backends()``.

    Raises:
        ValueError: a bad ``layout``, or a ``name`` transformers already gives a meaning to (or
            another mask function).
        RuntimeError: transformers is not installed (the message has the install line).
    """
    check_layout(layout)
    try:
        from transformers import AttentionInterface, AttentionMaskInterface
    except ImportError as exc:
        raise RuntimeError(f"register_transformers needs transformers: {INSTALL}") from exc
    if not isinstance(name, str) or not name or any(part in name for part in _RESERVED_PARTS):
        raise ValueError(f"name={name!r} must be a non-empty str without {list(_RESERVED_PARTS)} "
                         f"(transformers dispatches those names itself)")
    if AttentionMaskInterface._global_mapping.get(name, usp_mask) is not usp_mask:
        raise ValueError(f"name={name!r} already has another mask function in transformers' AttentionMaskInterface "
                         f"(Note [masks under usp] in usp_dit.llm.hf); choose another name")
    AttentionInterface.register(name, TransformersAttention(mesh, layout, backend))
    AttentionMaskInterface.register(name, usp_mask)
    return name
