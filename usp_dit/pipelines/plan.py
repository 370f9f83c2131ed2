"""A model family as a declarative plan, applied and removed by one generic patcher.

Layout: the plan names modules by their dotted paths in the transformer (``"blocks.0"``,
``"rope"``; ``"blocks.-1"``: the last block of a list, whatever its length, ``submodule``) or by
``fnmatch`` patterns over those paths (``"blocks.*.attn1"``); tensors keep the
layouts of the modules they come from (the hidden states (batch, seq, channels)).

Note [a model is a plan]
    What differs between DiT families is *where* things happen, not *what* happens: the token
    sequence is split at one module's input and gathered at another's output; tables indexed by
    token (RoPE, per-token modulation) are cut like the tokens where a submodule produces them;
    each attention module is either sequence-parallel (its processor swapped: usually the stock
    one with its ``dispatch_attention_fn`` call routed, ``_routing``) or local (cross-attention
    to replicated text: its stock processor stays); some arguments are batched for CFG; some
    module lists are the FSDP2 units. A ``ModelPlan`` says these things, and ``PlanAdapter``
    does them, the same way for every family:

        ModelPlan ──PlanAdapter.enable──► checks (stock processors, cache, layers, heads, refusals)
                                         ► ShardState (mesh, backend, seq_len of the call)
                                         ► hooks: shard at split_at, gather at gather_at, tables
                                         ► processors of the parallel attention sites swapped
                  PlanAdapter.disable ──► everything put back (the original processor objects)

    Every attention module (anything with a ``processor``) must be named by the plan, as
    parallel or local: an attention module the plan does not know (a new block type, an
    IP-Adapter) is refused at enable instead of running local attention on a shard. What a
    family needs beyond this (Wan's per-token timestep, replicated dropout) is a ``hooks``
    factory returning an object with ``install()`` / ``remove()``.
"""
from __future__ import annotations

import fnmatch
import functools
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch
from torch.utils.hooks import RemovableHandle

from usp_dit.distributed.mesh import USPMesh
from usp_dit.pipelines._routing import Route, RoutedProcessor
from usp_dit.pipelines._token_sharding import PatchingAdapter, ShardState, TokenShardHooks
from usp_dit.pipelines.caches import CacheGuard, check_cache
from usp_dit.pipelines.tensor import TensorPlan
from usp_dit.sharding.shard import shard_sequence


class Installable(Protocol):
    """A set of hooks or patches a plan adds: ``install`` after the checks, ``remove`` on disable."""

    def install(self) -> None: ...

    def remove(self) -> None: ...


@dataclass(frozen=True)
class Table:
    """A submodule's output indexed by token, cut like the tokens (a forward hook on ``module``).

    ``items``: which entries of a tuple output are tables (``None``: the output is one tensor);
    entries not named pass through whole (e.g. Qwen-Image's text RoPE beside the image's).
    ``dim``: the sequence dimension of each table.
    """

    module: str
    dim: int
    items: tuple[int, ...] | None = None


@dataclass(frozen=True)
class Parallel:
    """Attention modules (paths matching ``pattern``) that attend over the whole sequence.

    ``processor``: a ``RoutedProcessor`` subclass (built with ``Route(state, text)``) or any class
    built with the ``ShardState``. ``stock``: the processor classes it may replace; any other is
    refused (its maths would be lost).
    """

    pattern: str
    processor: type
    stock: tuple[type, ...]
    text: Literal["none", "first", "last"] = "none"


@dataclass(frozen=True)
class Local:
    """Attention modules that run on this rank's tokens alone (cross-attention to replicated
    text): the stock processor stays, and must be one of ``stock``."""

    pattern: str
    stock: tuple[type, ...]


@dataclass(frozen=True)
class ModelPlan:
    """Note [a model is a plan]: one Diffusers transformer class, declared."""

    name: str
    model_class: type
    split_at: str  # module whose hidden_states (batch, seq, channels) are sharded: its first argument ...
    gather_at: str  # module whose output (batch, seq_local, channels) is gathered
    attention: tuple[Parallel | Local, ...]
    block_lists: tuple[str, ...]  # ModuleLists of blocks: FSDP2's units; empty ones have nothing to split
    tables: tuple[Table, ...] = ()
    cfg_batch_args: tuple[str, ...] = ()  # batched on dim 0, split over "cfg" by enable_usp
    # Python lists of one entry per batch row (Z-Image's latents and prompts), split by index over "cfg".
    cfg_list_args: tuple[str, ...] = ()
    # ... or on another dim, named here (HiDream's Llama states, (layers, B, L, C): {name: 1})
    cfg_batch_dims: dict[str, int] = field(default_factory=dict)
    # Two-call families (a pipeline calls the transformer once per guidance branch): the arguments in
    # which the branches differ (the text conditioning). Non-empty: cfg_degree=2 runs a step's two
    # calls on the two cfg groups at once (usp_dit.pipelines.cfg_pair Note [two calls a step]).
    cfg_branch_args: tuple[str, ...] = ()
    hooks: tuple[Callable[[torch.nn.Module, ShardState], Installable], ...] = ()
    refuse: tuple[Callable[[torch.nn.Module], str | None], ...] = ()  # a reason to refuse, or None
    heads: Callable[[torch.nn.Module], int] = lambda model: model.config.num_attention_heads
    split: Literal["input", "output"] = "input"  # ... or its output (a patch embedding's tokens)
    # Arguments of the transformer's forward the plan does not shard (e.g. ControlNet residuals,
    # (B, S, C) over the whole sequence): a call that passes one is refused (Note [checks at the call]).
    refuse_args: dict[str, str] = field(default_factory=dict)  # name -> what it is, for the message
    # Where the tokens sit on the ranks (Note [sequence layouts] in usp_dit.sharding.layouts): "zigzag" for a
    # family whose attention can be causal (its ring ranks then do equal work); the tables and
    # every routed call follow it. Only plans whose processors are routed (``_routing``) take one.
    layout: str = "contiguous"
    # Where tensor parallelism cuts the blocks (usp_dit.pipelines.tensor Note [tensor plans]); None:
    # the family refuses tensor_degree > 1.
    tensor: TensorPlan | None = None


@dataclass(eq=False)
class TableHooks:
    """``Table`` hooks: this rank's rows of each table, once per forward (every layer reuses them)."""

    state: ShardState
    modules: list[tuple[torch.nn.Module, Table]]
    handles: list[RemovableHandle] = field(default_factory=list)

    def install(self) -> None:
        for module, table in self.modules:
            # A partial of a bound method, not a closure: a deep copy of the enabled model copies it
            # with its TableHooks, so the copy's tables feed the copy's state (base Note [deep copies]).
            self.handles.append(module.register_forward_hook(functools.partial(self._cut_output, table)))

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()

    def _cut_output(self, table: Table, module: torch.nn.Module, args: tuple, out: Any) -> Any:
        if table.items is None:
            return self._cut(out, table)
        if not isinstance(out, (tuple, list)):
            raise NotImplementedError(f"{table.module} returned {type(out).__name__}, not a tuple of tables")
        return type(out)(self._cut(t, table) if i in table.items else t for i, t in enumerate(out))

    def _cut(self, t: Any, table: Table) -> torch.Tensor:
        if not torch.is_tensor(t):
            raise NotImplementedError(f"{table.module} returned {type(t).__name__} where a table was expected")
        # The table is made before block 0 shards the tokens: it fixes this call's token count,
        # which block 0's hook then checks against the tokens (TokenShardHooks).
        self.state.seq_len = self.state.table_len = t.shape[table.dim]
        return shard_sequence(t, self.state.mesh, dim=table.dim, layout=self.state.layout)


def submodule(root: torch.nn.Module, path: str) -> torch.nn.Module:
    """``root.get_submodule(path)``, where a part may also be a negative index into a ``ModuleList``
    (``"blocks.-1"``: the last block, for a plan that gathers after the blocks whatever their count).

    Raises:
        AttributeError: no such submodule (as ``get_submodule``).
    """
    module = root
    for part in path.split(".") if path else ():
        negative = part.startswith("-") and part[1:].isdigit()
        module = module[int(part)] if negative and isinstance(module, torch.nn.ModuleList) else module.get_submodule(part)
    return module


def _matches(path: str, pattern: str) -> bool:
    return fnmatch.fnmatchcase(path, pattern)


def _site(plan: ModelPlan, path: str) -> Parallel | Local | None:
    return next((s for s in plan.attention if _matches(path, s.pattern)), None)


def check_plan(plan: ModelPlan, transformer: torch.nn.Module) -> None:
    """NotImplementedError for a model the plan would not run exactly (Note [a model is a plan])."""
    name = type(transformer).__name__
    if sum(len(getattr(transformer, lst)) for lst in plan.block_lists) == 0:
        raise NotImplementedError(f"{name} has no transformer blocks (num_layers=0): nothing to parallelise")
    check_cache(transformer, plan)  # Note [step caches under USP] (usp_dit.pipelines.caches)
    for path, module in transformer.named_modules():
        proc = getattr(module, "processor", None)
        if proc is None:
            continue
        site = _site(plan, path)
        if site is None:
            raise NotImplementedError(
                f"usp_dit's {plan.name} plan does not say how to run {path} ({type(module).__name__}): refused rather "
                f"than running it on a shard of the tokens"
            )
        if type(proc) not in site.stock:
            raise NotImplementedError(
                f"{path}.processor is {type(proc).__name__}; usp_dit's {plan.name} adapter runs only "
                f"{[c.__name__ for c in site.stock]} there (its maths would be lost silently otherwise)"
            )
        if getattr(proc, "_parallel_config", None) is not None:
            raise NotImplementedError(
                f"{path} runs diffusers' own context parallelism (enable_parallelism); use one or the other"
            )
    for refuse in plan.refuse:
        reason = refuse(transformer)
        if reason:
            raise NotImplementedError(f"usp_dit's {plan.name} adapter: {reason}")


class TransformerPreHook:
    """A plan ``hooks`` entry (or part of one) whose work is one forward pre-hook of the transformer,
    run at each call before any token is split: subclasses write ``_check(module, args, kwargs)``
    (raise to refuse the call) and may narrow ``wanted`` (install only on some grids)."""

    def __init__(self, transformer: torch.nn.Module, state: Any = None) -> None:
        self.transformer, self.state = transformer, state
        self.handle: RemovableHandle | None = None

    def wanted(self) -> bool:
        return True

    def install(self) -> None:
        if self.wanted():
            self.handle = self.transformer.register_forward_pre_hook(self._check, with_kwargs=True)

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _check(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        raise NotImplementedError(f"{type(self).__name__} must define _check")


class CallChecks(TransformerPreHook):
    """Note [checks at the call]: a forward pre-hook of the transformer, raising NotImplementedError
    for what would otherwise run wrongly on a shard:

    * an argument in ``plan.refuse_args`` that is not ``None``;
    * a parallel attention module whose processor is no longer the one installed at enable (a PAG
      pipeline swaps processors at each call with ``set_attn_processor``): it would attend over this
      rank's shard alone.

    Note [checks at the call]
        ``check_plan`` runs once, at enable; what a pipeline changes between calls is checked here,
        once per forward, before any token is split (a loop over the parallel sites: microseconds).
    """

    def __init__(
        self, plan: ModelPlan, transformer: torch.nn.Module, swaps: list[tuple[str, torch.nn.Module, Any]],
    ) -> None:
        super().__init__(transformer)
        self.plan, self.swaps = plan, swaps
        self.signature = inspect.signature(type(transformer).forward)

    def _check(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if self.plan.refuse_args:
            given = self.signature.bind_partial(module, *args, **kwargs).arguments
            for name, what in self.plan.refuse_args.items():
                if given.get(name) is not None:
                    raise NotImplementedError(
                        f"usp_dit's {self.plan.name} adapter does not shard {name} ({what}): call disable_usp() "
                        f"for this pipeline"
                    )
        for path, attn, installed in self.swaps:
            if attn.processor is not installed:
                raise NotImplementedError(
                    f"{path}.processor became {type(attn.processor).__name__} after enable_usp (e.g. a PAG pipeline's "
                    f"set_attn_processor): it would attend over this rank's shard alone; call disable_usp() first"
                )


class PlanPatch:
    """Everything ``enable`` changed on one transformer, and how to undo it."""

    def __init__(self, plan: ModelPlan, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> None:
        self.state = ShardState(mesh, backend, layout=plan.layout)
        get = functools.partial(submodule, transformer)
        self.swaps: list[tuple[torch.nn.Module, Any, Any]] = []  # (module, original, replacement)
        paths: list[str] = []
        processors: dict[Parallel, Any] = {}  # one processor object per site, shared by its modules
        for path, module in transformer.named_modules():
            site = _site(plan, path) if getattr(module, "processor", None) is not None else None
            if isinstance(site, Parallel):
                if site not in processors:
                    processors[site] = self._processor(site)
                self.swaps.append((module, module.processor, processors[site]))
                paths.append(path)
        tables = TableHooks(self.state, [(get(t.module), t) for t in plan.tables])
        tokens = TokenShardHooks(self.state, get(plan.split_at), get(plan.gather_at), at=plan.split)
        checks = CallChecks(plan, transformer, [(p, m, new) for p, (m, _, new) in zip(paths, self.swaps)])
        extra = [make(transformer, self.state) for make in plan.hooks]
        caches = CacheGuard(plan, transformer, self.state)  # diffusers' step caches: Note [step caches under USP]
        self.parts: list[Installable] = [checks, caches, tables, tokens, *extra]

    def _processor(self, site: Parallel) -> Any:
        if issubclass(site.processor, RoutedProcessor):
            return site.processor(Route(self.state, site.text))
        return site.processor(self.state)

    def install(self) -> None:
        for part in self.parts:
            part.install()
        for module, _, replacement in self.swaps:
            module.processor = replacement

    def remove(self) -> None:
        for module, original, _ in self.swaps:
            module.processor = original
        for part in reversed(self.parts):
            part.remove()


class PlanAdapter(PatchingAdapter):
    """The ``ModelAdapter`` of a ``ModelPlan`` (Note [a model is a plan])."""

    def __init__(self, plan: ModelPlan, module: str) -> None:
        """``module``: the family's module (``__name__``): its tests are ``tests/test_pipeline_<module>.py``."""
        self.plan = plan
        self.family_module = module
        self.name = plan.name
        self.model_class = plan.model_class
        self.cfg_batch_args = plan.cfg_batch_args
        self.cfg_list_args = plan.cfg_list_args
        self.cfg_batch_dims = plan.cfg_batch_dims
        self.cfg_branch_args = plan.cfg_branch_args

    def num_heads(self, transformer: torch.nn.Module) -> int:
        return self.plan.heads(transformer)

    def make_patch(self, transformer: torch.nn.Module, mesh: USPMesh, backend: str) -> PlanPatch:
        check_plan(self.plan, transformer)
        return PlanPatch(self.plan, transformer, mesh, backend)
