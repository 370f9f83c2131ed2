"""Shared machinery of the video adapters: shard tokens at the first block, gather after ``proj_out``.

Layout: hidden states (batch, seq, channels); RoPE tables ``(cos, sin)`` have the sequence on dim 0
(CogVideoX (seq, head_dim), Mochi (seq, heads, head_dim // 2)).

Note [where the sequence is split]
    Patch embedding runs on the full latent on every rank (it is a cheap strided conv / linear and
    the token sequence does not exist before it). The first transformer block receives the full
    sequence and a forward pre-hook hands it this rank's shard; every block, the final norm and
    ``proj_out`` then run on the shard, and a forward hook on ``proj_out`` gathers the result
    (``proj_out``'s width, patch**2 * channels, is the smallest in the model: the cheapest gather).

        patch embed (full) ─► [pre-hook block 0: shard_sequence] ─► blocks ─► norm_out ─► proj_out
                              ─► [hook proj_out: gather_sequence] ─► unpatchify (full)

    The hooks are active whenever the patch is installed (not only inside one forward call), so a
    gradient-checkpointing recompute of block 0 during backward shards its saved full input again.

    RoPE tables reach the attention processors whole (CogVideoX's from the pipeline, Mochi's built
    in the model's forward) and each processor takes this rank's rows with ``local_rope``, the same
    ``shard_sequence`` as the tokens (a view: no copy per layer). Slicing there, not in a hook on the
    transformer's arguments, keeps it correct whatever wraps the forward (``enable_usp``'s input
    broadcast and cfg split see the full table).

Everything is installed with ``register_forward_*hook`` handles and processor swaps whose original
objects are kept, so ``remove`` leaves the model exactly as it was.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from usp_dit.distributed.mesh import USPMesh
from usp_dit.pipelines.base import check_ulysses_degree, model_class_of
from usp_dit.sharding.shard import gather_sequence, shard_sequence


@dataclass(eq=False)
class ShardState:
    """What the hooks and processors of one enabled transformer share.

    ``seq_len``: full token count of the sequence being processed, set when block 0's input is
    sharded; given to ``usp_attention`` and ``gather_sequence`` (no all-gather of shard lengths)
    and checked against the RoPE table's length. ``text_len``: the replicated text stream's token
    count of that call (block 0's ``encoder_hidden_states``), for dropout over [text; video shard]
    (``_replicated_dropout``). ``table_len``: the token count a per-token table cut before block 0
    in this call implied (``usp_dit.pipelines.plan.TableHooks``), checked against the tokens there.
    """

    mesh: USPMesh
    backend: str
    seq_len: int | None = None
    # Where each rank's tokens sit (Note [sequence layouts] in usp_dit.sharding.layouts): every cut of this
    # transformer's tokens and tables, its attention calls and the gather use it.
    layout: str = "contiguous"
    text_len: int | None = None
    table_len: int | None = None


def local_rope(table: Any, state: ShardState, name: str) -> Any:
    """This rank's rows of a ``(cos, sin)`` RoPE table, sliced on dim 0 exactly like the tokens.

    Args:
        table: ``None`` or a pair of tensors (seq, ...) rotating the whole (unsharded) video sequence.
        name: the argument's name, for error messages.

    Raises:
        ValueError: the table's length is not the token count (slicing it would misalign rows).
        NotImplementedError: the table is not a (cos, sin) pair of tensors with the sequence on dim 0.
    """
    if table is None:
        return None
    if not (isinstance(table, (tuple, list)) and len(table) == 2 and all(torch.is_tensor(t) for t in table)):
        raise NotImplementedError(f"{name} must be a (cos, sin) pair of tensors (seq, ...), got {type(table).__name__}")
    cos, sin = table
    if cos.dim() < 2 or cos.shape[0] != sin.shape[0]:
        raise NotImplementedError(
            f"{name} must be (cos, sin) tables with the sequence on dim 0, got {tuple(cos.shape)} and {tuple(sin.shape)}"
        )
    if cos.shape[0] != state.seq_len:
        raise ValueError(
            f"{name} has {cos.shape[0]} rows but the transformer has {state.seq_len} video tokens: "
            f"they must match for the table to be sliced like the tokens"
        )
    return tuple(shard_sequence(t, state.mesh, dim=0) for t in table)


def _get_arg(args: tuple, kwargs: dict, name: str, index: int) -> Any:
    if name in kwargs:
        return kwargs[name]
    return args[index] if index < len(args) else None


def _set_arg(args: tuple, kwargs: dict, name: str, index: int, value: Any) -> tuple[tuple, dict]:
    if name in kwargs:
        return args, {**kwargs, name: value}
    return args[:index] + (value,) + args[index + 1:], kwargs


@dataclass(eq=False)
class TokenShardHooks:
    """Note [where the sequence is split]: shard at ``first_block``'s input (or output), gather at
    ``out_proj``'s output.

    ``at="input"``: ``first_block`` takes ``hidden_states`` (batch, seq, channels) as its first
    argument, sharded by a forward pre-hook. ``at="output"``: ``first_block`` *returns* the tokens
    (batch, seq, channels), e.g. a patch embedding, sharded by a forward hook (SD3's ``pos_embed``:
    outside the blocks, so it holds when ``skip_layers`` skips block 0).
    """

    state: ShardState
    first_block: torch.nn.Module
    out_proj: torch.nn.Module
    at: str = "input"
    handles: list[RemovableHandle] = field(default_factory=list)

    def install(self) -> None:
        if self.at == "input":
            self.handles.append(self.first_block.register_forward_pre_hook(self._shard_input, with_kwargs=True))
        else:
            self.handles.append(self.first_block.register_forward_hook(self._shard_output))
        self.handles.append(self.out_proj.register_forward_hook(self._gather_output))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _shard_input(self, module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        """(B, S, C) full hidden states -> (B, S_local, C), this rank's contiguous piece."""
        x = _get_arg(args, kwargs, "hidden_states", 0)
        text = _get_arg(args, kwargs, "encoder_hidden_states", 1)
        self.state.text_len = text.shape[1] if torch.is_tensor(text) else None
        return _set_arg(args, kwargs, "hidden_states", 0, self._shard(x))

    def _shard_output(self, module, args: tuple, tokens: torch.Tensor) -> torch.Tensor:
        """(B, S, C) tokens ``first_block`` made -> (B, S_local, C)."""
        return self._shard(tokens)

    def _shard(self, x: torch.Tensor) -> torch.Tensor:
        """(B, S, C) -> this rank's (B, S_local, C); records S as the call's ``seq_len``.

        Raises:
            ValueError: a per-token table cut earlier in this call has another length than the
                tokens (its rows would not line up with the tokens they belong to).
        """
        table_len, self.state.table_len = self.state.table_len, None
        if table_len is not None and table_len != x.shape[1]:
            raise ValueError(
                f"a per-token table of this call has {table_len} rows but the transformer has {x.shape[1]} tokens: "
                f"they must match for the table to be cut like the tokens"
            )
        self.state.seq_len = x.shape[1]
        return shard_sequence(x, self.state.mesh, dim=1, layout=self.state.layout)

    def _gather_output(self, module, args: tuple, out_local: Any) -> Any:
        """(B, S_local, C_out) -> (B, S, C_out), identical on every rank of the sequence group. A
        tuple output (a block returning (tokens, another stream), Kandinsky 6's fused video / audio
        block): its first entry gathered, the others passed on as they are."""
        if isinstance(out_local, tuple):
            return (self._gather_output(module, args, out_local[0]), *out_local[1:])
        return gather_sequence(out_local, self.state.mesh, dim=1, seq_len=self.state.seq_len,
                               layout=self.state.layout)


class PatchingAdapter:
    """``ModelAdapter`` plumbing for adapters that install one patch object per transformer.

    Subclasses set ``name``, ``model_class`` and ``cfg_batch_args`` and implement ``make_patch``
    (check the model, return an object with ``install()`` / ``remove()``).
    """

    name: str = ""
    model_class: type = torch.nn.Module
    cfg_batch_args: tuple[str, ...] = ()

    # The patch lives on its transformer, not in a table of the adapter: a patch refers to its
    # transformer, so a table entry (even weakly keyed) would keep every patched model alive.
    _PATCH_ATTR = "_usp_dit_patch"

    def make_patch(self, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> Any:
        raise NotImplementedError

    def num_heads(self, transformer: torch.nn.Module) -> int:
        """Attention heads of every layer (query and K/V alike: these families have no GQA)."""
        return transformer.config.num_attention_heads

    def matches(self, transformer: torch.nn.Module) -> bool:
        # The exact class (or FSDP2's wrapper of it): a subclass may change what its forward does.
        return model_class_of(transformer) is self.model_class

    def __deepcopy__(self, memo: dict) -> PatchingAdapter:
        return self  # the registered adapter is stateless: a copied model's state refers to the same one

    def enable(self, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> None:
        """Shard tokens over ``mesh``'s sequence group, in place.

        Raises:
            ValueError: already enabled, or ``ulysses_degree`` above the model's head count.
        """
        if getattr(transformer, self._PATCH_ATTR, None) is not None:
            raise ValueError(f"this {self.model_class.__name__} is already sequence-parallel: call disable first")
        check_ulysses_degree(self.num_heads(transformer), mesh, self.model_class.__name__)
        patch = self.make_patch(transformer, mesh, backend)
        patch.install()
        setattr(transformer, self._PATCH_ATTR, patch)

    def disable(self, transformer: torch.nn.Module) -> None:
        """Put back the original processors and remove every hook. Raises ValueError if not enabled."""
        patch = transformer.__dict__.pop(self._PATCH_ATTR, None)
        if patch is None:
            raise ValueError(f"this {self.model_class.__name__} is not sequence-parallel (enable was not called)")
        patch.remove()
