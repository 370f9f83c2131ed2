"""CFG parallel for pipelines that call the transformer twice a step: learn the pair, speculate, verify.

Layout: a call is the transformer forward's arguments by name (``BoundArguments.arguments``) as
``ReplicaForward`` has them after the input sync; the batch dimension is dim 0 of every batched
argument; a "branch value" is a call's values of the family's ``cfg_branch_args``.

    call A ─► learn from (previous call, A) ─► A's branch values == first?
                 ├ yes: speculate: cfg group 0 runs A, cfg group 1 runs A with branch := second;
                 │      all-gather over "cfg": A's result returned, the other (B's) pending
                 └ no:  run A as any call
    call B ─► B == A with branch := second?
                 ├ yes: the pending result, no compute
                 └ no:  drop it (logged once on rank 0), go on as for A

Note [two calls a step]
    Pipelines with true classifier-free guidance (``FluxPipeline`` with ``true_cfg_scale > 1`` and
    a negative prompt, ``QwenImagePipeline``, ``WanPipeline`` with ``guidance_scale > 1``, both of
    Wan 2.2's experts, ``HunyuanVideoPipeline`` with ``true_cfg_scale > 1`` and a negative prompt,
    ``ChromaPipeline`` and ``Flux2KleinPipeline`` with ``guidance_scale > 1``) call the transformer
    twice per step, the conditional branch then the unconditional one, each on the batch of the
    prompts (1 for one prompt). There is no batch of
    two for Note [cfg parallel] to split, and no wrapper sees both calls at once. But the second
    call of a step differs from the first only in its text conditioning (the negative prompt's
    embeds, mask, pooled embeds, text ids: the same tensors at every step); hidden states,
    timestep, guidance, ids and every other argument are equal. So with ``cfg_degree=2`` on a
    family that declares those arguments (``ModelPlan.cfg_branch_args``):

      learn      two consecutive calls whose other arguments are equal and whose branch values
                 differ: the first's branch values are ``first``, the second's ``second``. Learned
                 again from any such pair that a speculation did not serve, so a callback that
                 changes the negative embeds is followed from the next step on.
      speculate  at a call A whose branch values equal ``first``: cfg group 0 runs A, cfg group 1
                 runs A with ``second`` substituted, each sequence-parallel on its own U*R ranks
                 (the adapter's forward, as any call); the outputs are all-gathered over "cfg",
                 so every rank holds both. A returns its own; the other is pending.
      verify     the transformer's next call B: if its arguments equal A's with ``second``
                 substituted, it returns the pending result without computing. Otherwise the
                 pending result is dropped (why: logged once, on rank 0) and B runs as any call.

    A pending result is returned only for a call whose inputs equal, value for value, those it was
    computed from: it is what computing the call would give (the same weights, inputs and grid).
    Values are compared by identity, else ``torch.equal`` (a tensor changed in place since it was
    recorded, by its version counter, is never equal); containers (``joint_attention_kwargs``,
    ``img_shapes``) by content, copied when recorded; the call's mode (grad, autocast, training)
    too. A comparison costs a read of the inputs, small beside a transformer call.

    Every rank takes the same decisions without communicating: they read only the call's
    arguments after the input sync (Note [same inputs everywhere]: the replica's first rank's
    values on every rank, in fresh copies, so identity holds for no synced tensor on any rank) and
    the sequence of calls, which the handshake makes equal (Note [model handshake]). So no rank
    enters the all-gather, or skips it, alone.

    Calls that are not speculated run as without this mode: the batch split over "cfg" when the
    batch divides by 2 (a batch of prompts: what ran before), else both cfg groups compute the
    whole call, as data-parallel replicas (correct, no faster). Those are the first step
    (learning), a call with no learned partner (a step with guidance off: its pending guess is
    dropped at the next call), a call after a changed negative prompt, and a call that needs a
    gradient (grad enabled and a parameter or an argument requires grad: the other group's graph
    cannot be handed over). A steady two-call pipeline computes ``steps + 1`` calls per rank per
    transformer instead of ``2 * steps`` (Wan 2.2's experts each keep their own state: it lives
    on the transformer's ``USPState``). The price: one all-gather of the output per speculated
    call (Flux at 1024^2: 4096 x 64 values), and group 1's work when a guess is dropped (done at
    the same time as group 0's, so no wall time beyond the exchange).

    Assumptions: the weights do not change between a call and the transformer's next call (a
    pending result lives that long; the last step's guess outlives a pipeline run, but the next
    run's first call has new latents and timestep, so it never matches), and the output's shapes
    do not depend on the branch arguments (the all-gather needs equal shapes on both cfg groups;
    true of these DiTs, whose output is the latent prediction). ``disable_usp`` drops all state.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from usp_dit.distributed.logs import get_logger
from usp_dit.distributed.mesh import USPMesh
from usp_dit.pipelines.replica_forward import batch_size, gather_cfg_output, split_cfg_batch

logger = get_logger("cfg_pair")

MISSING = object()  # an argument the call did not pass
_MODE = "(call mode)"  # a pseudo-argument: grad, autocast and training flags of the call


# ---------------------------------------------------------------------------------------------
# Recorded values: containers copied, tensors kept with their version


@dataclass(frozen=True, eq=False)
class _Leaf:
    """A tensor as recorded: the tensor and its version counter then (None: it has none, e.g. an
    inference tensor)."""

    tensor: torch.Tensor
    version: int | None

    def changed(self) -> bool:
        return self.version is not None and _version(self.tensor) != self.version


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


def freeze(value: Any, clone: bool = False) -> Any:
    """``value`` as recorded for later comparison: lists, tuples and dicts copied (their content
    may change in place after the call), tensors as ``_Leaf`` (cloned when ``clone``: the caller's
    own tensor, which it may change in place), anything else as it is."""
    if torch.is_tensor(value):
        t = value.detach().clone() if clone else value
        return _Leaf(t, _version(t))
    if isinstance(value, (list, tuple)):
        return type(value)(freeze(v, clone) for v in value) if type(value) in (list, tuple) else value
    if isinstance(value, dict):
        return {k: freeze(v, clone) for k, v in value.items()}
    return value


def thaw(frozen: Any) -> Any:
    """A recorded value as an argument again (the recorded tensors, fresh containers)."""
    if isinstance(frozen, _Leaf):
        return frozen.tensor
    if type(frozen) in (list, tuple):
        return type(frozen)(thaw(v) for v in frozen)
    if isinstance(frozen, dict):
        return {k: thaw(v) for k, v in frozen.items()}
    return frozen


def same(frozen: Any, value: Any) -> bool:
    """True when ``value`` equals the recorded ``frozen``: tensors by identity (unchanged since
    recorded), else ``torch.equal`` of equal shapes, dtypes and devices; containers item by item;
    None, bool, int, float, str by type and value; anything else by identity. ``value`` may be
    recorded too (two recorded calls compared)."""
    if isinstance(value, _Leaf):
        if value.changed():
            return False
        value = value.tensor
    if isinstance(frozen, _Leaf):
        if frozen.changed() or not torch.is_tensor(value):
            return False
        t = frozen.tensor
        if value is t:
            return True
        return (t.shape == value.shape and t.dtype == value.dtype and t.device == value.device
                and torch.equal(t, value))
    if type(frozen) in (list, tuple):
        return (type(value) is type(frozen) and len(value) == len(frozen)
                and all(same(f, v) for f, v in zip(frozen, value)))
    if isinstance(frozen, dict):
        return (isinstance(value, dict) and value.keys() == frozen.keys()
                and all(same(frozen[k], value[k]) for k in frozen))
    if frozen is value:
        return True
    if frozen is None or isinstance(frozen, (bool, int, float, str)):
        return type(frozen) is type(value) and frozen == value
    return False


def call_mode(module: torch.nn.Module) -> tuple:
    """What besides the arguments makes two calls compute different things: grad mode, autocast
    (CPU and CUDA) and the module's training flag."""
    autocast = tuple(
        (torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
        for d in ("cpu", "cuda") if torch.amp.is_autocast_available(d)
    )
    return (torch.is_grad_enabled(), autocast, module.training)


def record_call(arguments: dict[str, Any], mode: tuple, clone: bool = False) -> dict[str, Any]:
    """A call as recorded: each argument frozen, and its mode under ``_MODE``."""
    recorded = {name: freeze(value, clone) for name, value in arguments.items()}
    recorded[_MODE] = mode
    return recorded


def matches(recorded: dict[str, Any], arguments: dict[str, Any], mode: tuple,
            names: Iterable[str] | None = None) -> bool:
    """True when the call (``arguments``, ``mode``) equals ``recorded`` on ``names`` (default:
    every name either has; an argument one passes and the other does not differs)."""
    if names is None:
        if recorded.get(_MODE) != mode:
            return False
        names = (set(recorded) | set(arguments)) - {_MODE}
    for name in names:
        frozen, value = recorded.get(name, MISSING), arguments.get(name, MISSING)
        if frozen is MISSING or value is MISSING:
            if frozen is not value:
                return False
        elif not same(frozen, value):
            return False
    return True


# ---------------------------------------------------------------------------------------------
# Learning the pair


@dataclass(eq=False)
class BranchPair:
    """The two branch values of a step: ``first`` (the branch that comes first) and ``second``,
    each ``{name: recorded value or MISSING}`` over the family's branch arguments."""

    first: dict[str, Any]
    second: dict[str, Any]

    def starts(self, arguments: dict[str, Any]) -> bool:
        """True when a call with ``arguments`` is a first branch (its branch values are ``first``)."""
        return matches(self.first, arguments, (), self.first.keys())

    def other_of(self, recorded: dict[str, Any]) -> dict[str, Any]:
        """The recorded call ``recorded`` (a first branch) with ``second`` substituted: the call
        that should come next."""
        other = dict(recorded)
        for name, value in self.second.items():
            if value is MISSING:
                other.pop(name, None)
            else:
                other[name] = value
        return other


def learn_pair(previous: dict[str, Any] | None, current: dict[str, Any],
               branch_args: tuple[str, ...]) -> BranchPair | None:
    """The pair two consecutive recorded calls make, if they do: every argument outside
    ``branch_args`` (and the mode) equal, some branch value different; else None."""
    if previous is None:
        return None
    if previous[_MODE] != current[_MODE]:
        return None
    names = set(previous) | set(current)
    if not matches(previous, current, (), names - set(branch_args) - {_MODE}):
        return None
    branch = [n for n in branch_args if n in names]
    if matches(previous, current, (), branch):
        return None
    return BranchPair({n: previous.get(n, MISSING) for n in branch}, {n: current.get(n, MISSING) for n in branch})


# ---------------------------------------------------------------------------------------------
# The state of one transformer


def _needs_grad(module: torch.nn.Module, arguments: dict[str, Any]) -> bool:
    """True when this call would record a graph: grad enabled and an argument or a parameter
    requires grad (the parameters are looked at only with grad enabled: pipelines run without)."""
    if not torch.is_grad_enabled():
        return False
    leaves, _ = tree_flatten(list(arguments.values()))
    if any(torch.is_tensor(t) and t.requires_grad for t in leaves):
        return True
    return any(p.requires_grad for p in module.parameters())


def _exchange(out: Any, mesh: USPMesh) -> tuple[Any, Any]:
    """``(group 0's output, group 1's output)`` on every rank: each tensor of ``out`` (a tensor, a
    tuple, a ``BaseOutput``) all-gathered over the cfg group (2 ranks), the structure kept."""
    leaves, spec = tree_flatten(out)
    mine: list[Any] = []
    theirs: list[Any] = []
    for leaf in leaves:
        if torch.is_tensor(leaf):
            pieces = [torch.empty_like(leaf) for _ in range(2)]
            dist.all_gather(pieces, leaf.contiguous(), group=mesh.cfg_group)
            mine.append(pieces[0])
            theirs.append(pieces[1])
        else:
            mine.append(leaf)
            theirs.append(leaf)
    return tree_unflatten(mine, spec), tree_unflatten(theirs, spec)


@dataclass(eq=False)
class _Pending:
    """A speculated result and the call it answers (recorded)."""

    expected: dict[str, Any]
    output: Any


@dataclass(eq=False)
class CfgPair:
    """Note [two calls a step], for one transformer: what was learned, the pending result, counts.

    ``stats``: ``computed`` (calls this rank ran through the model: a speculated call counts
    once), ``speculated``, ``served`` (calls answered by a pending result), ``dropped`` (pending
    results that the next call did not match).
    """

    mesh: USPMesh
    branch_args: tuple[str, ...]
    batch_args: tuple[str, ...] | None = None  # the adapter's cfg_batch_args: _run's batch split
    clone: bool = False  # record copies of the arguments (inputs not synced: the caller's tensors)
    pair: BranchPair | None = None
    last: dict[str, Any] | None = None
    pending: _Pending | None = None
    stats: dict[str, int] = field(default_factory=lambda: dict(computed=0, speculated=0, served=0, dropped=0))
    _logged: set[str] = field(default_factory=set)

    def clear(self) -> None:
        """Forget everything learned and pending (``disable_usp``)."""
        self.pair = self.last = self.pending = None

    def __call__(self, inner: Callable[..., Any], module: torch.nn.Module, bound: inspect.BoundArguments) -> Any:
        """One transformer call (``ReplicaForward``'s, after the handshake and the input sync)."""
        arguments = bound.arguments
        mode = call_mode(module)
        pending, self.pending = self.pending, None
        if pending is not None:
            if matches(pending.expected, arguments, mode):
                self.stats["served"] += 1
                self.last = pending.expected
                return pending.output
            self.stats["dropped"] += 1
            if "dropped" not in self._logged:
                self._log_once("dropped", _why_dropped(pending.expected, arguments, mode, self.branch_args))
        if _needs_grad(module, arguments):
            self.last = None  # a graph's tensors are not kept, and nothing is learned from them
            return self._run(inner, bound)
        recorded = record_call(arguments, mode, self.clone)
        learned = learn_pair(self.last, recorded, self.branch_args)
        if learned is not None:
            self.pair = learned
        self.last = recorded
        if self.pair is not None and self.pair.starts(arguments):
            return self._speculate(inner, bound, recorded)
        if self.pair is None and self.stats["computed"] == 3:
            self._log_once("unpaired", "no two consecutive calls differing only in their guidance branch yet "
                           f"(branch arguments {list(self.branch_args)}): each call runs on both cfg groups, no faster "
                           "than cfg_degree=1 (a pipeline without true CFG?)")
        return self._run(inner, bound)

    def _run(self, inner: Callable[..., Any], bound: inspect.BoundArguments) -> Any:
        """A call as without speculation: the batch split over "cfg" when the batch divides,
        else the whole call on both cfg groups."""
        self.stats["computed"] += 1
        # A family with no batched argument (cfg_batch_args == (): Cosmos 3's one packed sequence)
        # has no batch to split: its call runs whole.
        if self.batch_args != () and batch_size(bound.arguments, default=1) % self.mesh.cfg_degree == 0:
            batch = split_cfg_batch(bound.arguments, self.mesh, self.batch_args)
            return gather_cfg_output(inner(*bound.args, **bound.kwargs), batch, self.mesh)
        return inner(*bound.args, **bound.kwargs)

    def _speculate(self, inner: Callable[..., Any], bound: inspect.BoundArguments, recorded: dict[str, Any]) -> Any:
        assert self.pair is not None
        self.stats["computed"] += 1
        self.stats["speculated"] += 1
        expected = self.pair.other_of(recorded)
        call = bound
        if self.mesh.cfg_rank == 1:
            arguments = dict(bound.arguments)
            for name in self.pair.second:
                if name in expected:
                    arguments[name] = thaw(expected[name])
                else:
                    arguments.pop(name, None)
            call = inspect.BoundArguments(bound.signature, arguments)
        first, second = _exchange(inner(*call.args, **call.kwargs), self.mesh)
        self.pending = _Pending(expected, second)
        return first

    def _log_once(self, key: str, message: str) -> None:
        if key in self._logged:
            return
        self._logged.add(key)
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info("usp_dit cfg_degree=2 (two calls a step): %s", message)


def _why_dropped(expected: dict[str, Any], arguments: dict[str, Any], mode: tuple,
                 branch_args: tuple[str, ...]) -> str:
    """Why a pending result did not answer the call, for the log: which arguments differ."""
    names = sorted(n for n in (set(expected) | set(arguments)) - {_MODE} if not matches(expected, arguments, (), [n]))
    if expected.get(_MODE) != mode:
        names.append("the call mode (grad, autocast or training)")
    if names and all(n in branch_args for n in names):
        why = f"its text conditioning changed ({', '.join(names)}: e.g. a callback replaced the negative embeds)"
    else:
        why = f"it was not the other guidance branch ({', '.join(names)} differ: e.g. a step with guidance off)"
    return (f"a speculated result was dropped and the call computed: {why}. Results stay exact; such calls are "
            f"no faster than on one cfg group (logged once)")


def cfg_pair_for(adapter: Any, mesh: USPMesh, sync_inputs: bool) -> CfgPair | None:
    """The state of Note [two calls a step] for a transformer enabled with ``adapter`` on ``mesh``:
    only at ``cfg_degree == 2`` on a family declaring ``cfg_branch_args``; else None (the batch
    split of Note [cfg parallel] alone)."""
    branch_args = tuple(getattr(adapter, "cfg_branch_args", ()) or ())
    if mesh.cfg_degree != 2 or not branch_args:
        return None
    return CfgPair(mesh, branch_args, getattr(adapter, "cfg_batch_args", None), clone=not sync_inputs)
