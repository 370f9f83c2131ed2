"""Diffusers' step caches (``transformer.enable_cache(config)``) on a USP grid.

Layout: the cache hooks see what the blocks see, this rank's shard of the tokens (batch, seq_local,
channels) and, with cfg parallel, its cfg group's rows of the batch.

Note [step caches under USP]
    Diffusers' caches skip work from one denoising step to the next. Under USP every rank of a
    model replica holds its own shard of the tokens (and with ``cfg_degree > 1`` its own rows of
    the batch), and the ranks must take every skip decision together: a rank that skips a block
    while another runs it leaves the other waiting in the block's attention collectives (a hang,
    or mixed bytes). Each cache falls in one of three kinds:

      FirstBlockCacheConfig   the decision reads the hidden states: made on the whole batch and
                              sequence, as one process takes it (below)
      MagCacheConfig          the decision follows the schedule (``mag_ratios``, step counters):
                              the same on every rank; calibration's ratio reduced like FBC's metric
      TaylorSeerCacheConfig,  the decision follows the schedule (step counters, timesteps):
      PyramidAttentionBroadcastConfig   the same on every rank; what they cache or predict is
                              per token (this rank's tokens), so nothing is reduced
      FasterCacheConfig,      refused (NotImplementedError): see ``_REFUSED`` for why; any config
      SeaCacheConfig, others  usp_dit has not checked is refused too

    First Block Cache compares block 0's residual r with the previous step's p:
        diff = mean|r - p| / mean|p|          over (batch, seq, channels)
    Both means have the same count, so diff = sum|r - p| / sum|p|: two partial sums per rank,
    all-reduced (float64) over the replica's cfg group (its batch rows) and sequence group (its
    tokens) give one process's metric up to float32 summation order (~1e-7 relative: a decision
    differs from one process's only for a metric that close to the threshold). Every rank then
    holds the same value, and one more all-reduce of one flag makes the decision the ranks'
    common one whatever the backend's rounding (no rank can go on alone). MagCache's calibration
    ratio is a mean over tokens of per-token norm ratios: a sum and a count, all-reduced alike.

    Where: the metric functions of the enabled model's hook objects (``FBCHeadBlockHook.
    _should_compute_remaining_blocks``, the tail ``MagCacheBlockHook._perform_calibration_step``)
    are replaced by instance attributes, only on that model, only at model degree > 1, and
    deleted again by ``disable_usp``. ``CacheGuard``, a part of the plan's patch, does it when
    the patch is installed (cache enabled first) and again before each call (cache enabled after
    ``enable_usp``, or re-enabled); the same check refuses an unsupported cache at
    ``enable_usp`` (``check_plan``) and at the first call after ``enable_cache``.

    Two more refusals. With ``cfg_degree=2`` on a pipeline that calls the transformer once per
    guidance branch (``usp_dit.pipelines.cfg_pair`` Note [two calls a step]), the two cfg groups
    compute both branches in the first call, under its cache context, and the second call
    computes nothing: a cache's per-call states would not be one process's; refused at the call
    where that would start. And a refused cache enabled after ``enable_usp`` (FasterCache's
    denoiser hook) wraps the forward usp_dit installed: ``disable_usp`` would cut it off, and its
    ``disable_cache`` would then put usp_dit's stale wrapper back, so ``disable_usp`` asks for
    ``disable_cache()`` first (``check_no_hook_over_usp``). The supported caches hook blocks and
    attention modules only, never the transformer's forward: either order of undoing works.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist
from torch.utils.hooks import RemovableHandle

from usp_dit.distributed.mesh import USPMesh
from usp_dit.distributed.replica import all_true_on_replica, comm_device, replica_groups
from usp_dit.pipelines.base import MethodWrapper

if TYPE_CHECKING:
    from usp_dit.pipelines._token_sharding import ShardState


class ModelPlan(Protocol):
    """What a cache check reads of a family's plan (``usp_dit.pipelines.plan.ModelPlan``, which
    imports this module: a protocol here rather than an import back up)."""

    name: str
    block_lists: tuple[str, ...]

_DECISION_ATTR = "_should_compute_remaining_blocks"  # FBCHeadBlockHook's metric and decision
_CALIBRATION_ATTR = "_perform_calibration_step"  # MagCacheBlockHook's (tail) calibration ratio

# Caches whose decisions follow the schedule alone (or are made consistent here): run under USP.
_SUPPORTED = ("FirstBlockCacheConfig", "MagCacheConfig", "TaylorSeerCacheConfig", "PyramidAttentionBroadcastConfig")

_REFUSED = {
    "FasterCacheConfig": (
        "its denoiser hook wraps the transformer's forward, drops the unconditional half of the batch by "
        "chunking keyword arguments and rebuilds it from a 2-D FFT of the whole output, and its attention hooks "
        "keep the second half of each batch as the conditional one; under usp_dit the cfg axis already splits "
        "that batch (each rank holds one half, so the chunks are the wrong rows) and, enabled before enable_usp, "
        "the hook runs inside usp_dit's wrappers, on positional arguments (it then chunks none) or on this rank's "
        "shard of the tokens (the FFT needs all of them)"
    ),
    "SeaCacheConfig": (
        "its root hook decides from spectral indicators of the whole latent and its own hooks wrap the "
        "transformer's forward; usp_dit has not made them consistent over a sharded sequence"
    ),
    "TextKVCacheConfig": (
        "it wraps the transformer's forward and caches text keys/values per block; usp_dit's attention takes "
        "its K/V from its own processors, which this cache does not know"
    ),
}


def _config_name(config: Any) -> str:
    return type(config).__name__


def cache_refusal(config: Any) -> str | None:
    """Why a diffusers cache ``config`` cannot run under USP, or ``None`` when it can."""
    name = _config_name(config)
    if name in _SUPPORTED:
        return None
    return _REFUSED.get(name, "usp_dit has not checked that its skip decisions agree between ranks holding "
                              "shards of the tokens")


def check_cache(transformer: torch.nn.Module, plan: ModelPlan, after_enable: bool = False) -> None:
    """NotImplementedError for a diffusers cache on ``transformer`` that usp_dit cannot run
    (Note [step caches under USP]); nothing when none is enabled.

    ``after_enable``: the cache was found at a call, i.e. enabled after ``enable_usp``.
    """
    config = getattr(transformer, "_cache_config", None)
    if config is None:
        return
    name, model = _config_name(config), type(transformer).__name__
    fix = ("call transformer.disable_cache() (before disable_usp) and call the transformer again" if after_enable
           else "call transformer.disable_cache() before enable_usp")
    supported = ", ".join(_SUPPORTED)
    reason = cache_refusal(config)
    if reason is None and name == "FirstBlockCacheConfig":
        reason = _first_block_outside_plan(transformer, plan)
    if reason is not None:
        raise NotImplementedError(
            f"{model} has a diffusers cache enabled ({name}) that usp_dit cannot run sequence-parallel: {reason}; "
            f"{fix} (supported under usp_dit: {supported})"
        )


def check_no_hook_over_usp(transformer: torch.nn.Module, ignore: tuple[str, ...] = ()) -> None:
    """For ``disable_usp``: ValueError when a diffusers hook on the transformer itself (a refused
    cache's, e.g. FasterCache's denoiser hook, enabled after ``enable_usp``) wraps the forward
    usp_dit installed. ``disable_usp`` puts back the forward usp_dit found, which would cut that
    hook off, and the cache's own ``disable_cache`` would later reinstall usp_dit's stale wrapper.
    Hooks named in ``ignore`` (group offloading's: ``usp_dit.pipelines.composition`` takes usp_dit's
    wrapper out of them) pass.
    """
    registry = transformer.__dict__.get("_diffusers_hook")
    for name, ref in zip(getattr(registry, "_hook_order", ()), getattr(registry, "_fn_refs", ())):
        if name not in ignore and any(isinstance(f, MethodWrapper) for f in (ref.forward, ref.original_forward)):
            config = getattr(transformer, "_cache_config", None)
            what = f"the {_config_name(config)} enabled" if config is not None else "a diffusers hook added"
            raise ValueError(
                f"{type(transformer).__name__}'s forward is wrapped by {what} after enable_usp: disable_usp would "
                f"cut that hook off; call transformer.disable_cache() first, then disable_usp()"
            )


def _block_hooks(transformer: torch.nn.Module):
    """``(list name, hook)`` for every diffusers hook on a block of the transformer's ModuleLists
    (where the caches hook their blocks)."""
    for list_name, child in transformer.named_children():
        if not isinstance(child, torch.nn.ModuleList):
            continue
        for block in child:
            registry = block.__dict__.get("_diffusers_hook")
            if registry is not None:
                for hook in list(registry.hooks.values()):
                    yield list_name, hook


def _is_fbc_head(hook: Any) -> bool:
    return type(hook).__name__ == "FBCHeadBlockHook" and hasattr(hook, "state_manager")


def _is_mag_tail(hook: Any) -> bool:
    return type(hook).__name__ == "MagCacheBlockHook" and getattr(hook, "is_tail", False)


def _first_block_outside_plan(transformer: torch.nn.Module, plan: ModelPlan) -> str | None:
    """The FBC head block must be one of the plan's blocks (which run on the sharded tokens): its
    residual's partial sums then add up over the sequence group to the whole sequence's."""
    for list_name, hook in _block_hooks(transformer):
        if _is_fbc_head(hook) and list_name not in plan.block_lists:
            return (f"its first block is in {list_name!r}, which usp_dit's {plan.name} plan does not run on shards "
                    f"of the tokens ({list(plan.block_lists)})")
    return None


# ---------------------------------------------------------------------------------------------
# The metrics, reduced over the replica


def _sum_over_replica(t: torch.Tensor, mesh: USPMesh) -> torch.Tensor:
    """``t`` summed over the replica's cfg group, then its sequence group (every rank: the total)."""
    buf = t.to(comm_device(mesh, t))
    for group in replica_groups(mesh):
        dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    return buf


def first_block_sums(residual: torch.Tensor, previous: torch.Tensor) -> torch.Tensor:
    """``[sum|residual - previous|, sum|previous|]`` in float64: FBC's metric is their ratio
    (Note [step caches under USP]: the two means share one count), and the sums of any split of
    the batch and tokens add up to the whole's."""
    return torch.stack([
        (residual - previous).abs().sum(dtype=torch.float64), previous.abs().sum(dtype=torch.float64),
    ])


class ReducedFirstBlockDecision:
    """``FBCHeadBlockHook._should_compute_remaining_blocks`` on the whole replica's batch and
    sequence (Note [step caches under USP]). An object, not a closure: a deep copy of the model
    copies it with its hook (``usp_dit.pipelines.base`` Note [deep copies])."""

    def __init__(self, hook: Any, mesh: USPMesh) -> None:
        self.hook, self.mesh = hook, mesh

    @torch.compiler.disable
    def __call__(self, hidden_states_residual: torch.Tensor) -> bool:
        previous = self.hook.state_manager.get_state().head_block_residual
        if previous is None:  # the first step of a context, on every rank alike
            return True
        sums = _sum_over_replica(first_block_sums(hidden_states_residual, previous), self.mesh)
        diff = (sums[0] / sums[1]).item()
        # Every rank holds the same sums; the flag makes the decision common whatever the rounding.
        skip = all_true_on_replica(not diff > self.hook.threshold, self.mesh)
        return not skip


class ReducedMagCalibration:
    """``MagCacheBlockHook._perform_calibration_step`` (the tail's): the mean over every token of
    the replica of ``|current| / |previous|`` (a sum and a count, reduced), as one process logs it."""

    def __init__(self, hook: Any, mesh: USPMesh) -> None:
        self.hook, self.mesh = hook, mesh

    @torch.compiler.disable
    def __call__(self, state: Any, current_residual: torch.Tensor) -> None:
        if state.previous_residual is None:
            ratio = 1.0
        else:
            current = torch.linalg.norm(current_residual.float(), dim=-1)
            previous = torch.linalg.norm(state.previous_residual.float(), dim=-1)
            per_token = current / (previous + 1e-8)
            count = torch.tensor(float(per_token.numel()), dtype=torch.float64, device=per_token.device)
            sums = _sum_over_replica(torch.stack([per_token.sum(dtype=torch.float64), count]), self.mesh)
            ratio = (sums[0] / sums[1]).item()
        state.calibration_ratios.append(ratio)


# ---------------------------------------------------------------------------------------------
# The plan part


class CacheGuard:
    """A part of a plan's patch (``plan.PlanPatch``): Note [step caches under USP].

    ``install``: the hooks of a cache enabled before ``enable_usp`` get their reduced metrics; a
    forward pre-hook then, before each call, refuses a cache usp_dit cannot run and gives the
    hooks of one enabled since their reduced metrics. ``remove``: the pre-hook and every metric
    installed go (the hooks' own methods are theirs again).
    """

    def __init__(self, plan: ModelPlan, transformer: torch.nn.Module, state: ShardState) -> None:
        self.plan, self.transformer, self.state = plan, transformer, state
        self.handle: RemovableHandle | None = None
        self.patched: list[tuple[Any, str, Any]] = []  # (hook, attribute, what was set)

    def install(self) -> None:
        self.handle = self.transformer.register_forward_pre_hook(self._before_call)
        self._patch()

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None
        for hook, attr, value in self.patched:
            if hook.__dict__.get(attr) is value:
                del hook.__dict__[attr]
        self.patched.clear()

    def _before_call(self, module: torch.nn.Module, args: tuple) -> None:
        check_cache(self.transformer, self.plan, after_enable=True)
        self._refuse_two_call_cfg()
        self._patch()

    def _refuse_two_call_cfg(self) -> None:
        """cfg_degree=2 on a pipeline calling the transformer once per guidance branch
        (``usp_dit.pipelines.cfg_pair`` Note [two calls a step]): once the pair of calls is learned,
        cfg group 1 computes the second branch during the first call, under the first call's cache
        context, and the second call computes nothing. A cache keeps one state per call (context):
        its states would no longer be one process's. Refused before that first speculated call."""
        config = getattr(self.transformer, "_cache_config", None)
        usp_state = self.transformer.__dict__.get("_usp_dit_state")
        if config is None or getattr(getattr(usp_state, "cfg_pair", None), "pair", None) is None:
            return
        raise NotImplementedError(
            f"{type(self.transformer).__name__} has a diffusers cache enabled ({_config_name(config)}) and runs with "
            f"cfg_degree=2 on a pipeline that calls it once per guidance branch: usp_dit computes the two branches on "
            f"the two cfg groups in one call, while the cache keeps one state per call; use cfg_degree=1 with the "
            f"cache, or call transformer.disable_cache()"
        )

    def _patch(self) -> None:
        name = _config_name(getattr(self.transformer, "_cache_config", None))
        if name not in ("FirstBlockCacheConfig", "MagCacheConfig") or not replica_groups(self.state.mesh):
            return  # schedule-only caches, or one rank: the stock metrics are the whole replica's already
        for _, hook in _block_hooks(self.transformer):
            if _is_fbc_head(hook):
                self._set(hook, _DECISION_ATTR, ReducedFirstBlockDecision)
            elif _is_mag_tail(hook):
                self._set(hook, _CALIBRATION_ATTR, ReducedMagCalibration)

    def _set(self, hook: Any, attr: str, cls: type) -> None:
        current = hook.__dict__.get(attr)
        if isinstance(current, cls) and current.mesh is self.state.mesh:
            return
        # A hook patched earlier for this attribute belongs to a cache disabled since: forget it.
        for old in [p for p in self.patched if p[1] == attr]:
            if old[0].__dict__.get(attr) is old[2]:
                del old[0].__dict__[attr]
            self.patched.remove(old)
        value = cls(hook, self.state.mesh)
        hook.__dict__[attr] = value
        self.patched.append((hook, attr, value))
