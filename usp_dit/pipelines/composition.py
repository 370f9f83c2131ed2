"""``enable_usp`` beside what users already use for memory: Diffusers' offloading and quantized weights.

Layout: no tensors of its own; it reads the hooks (accelerate's ``_hf_hook``, Diffusers'
``_diffusers_hook`` registry) and the parameter types on modules, and places usp_dit's forward
wrappers in their chain.

Note [offload and quantization under USP]
    What composes with ``enable_usp`` (either order unless said; docs/USAGE.md has the table):

      enable_model_cpu_offload      works: accelerate's ``CpuOffload`` hook moves the whole model in
                                    before its forward; the maths is untouched
      enable_sequential_cpu_offload works: per-submodule ``AlignDevicesHook`` s load each weight in
                                    just before its module runs (usp_dit only calls submodules)
      enable_group_offload          works, block_level and leaf_level, with or without streams:
                                    Diffusers' hooks onload groups of modules; usp_dit's token hooks
                                    and processors are beside them, every rank runs the same
                                    modules in the same order
      torchao weight-only (int8,    works: a quantized ``Linear`` computes each token's row from
        float8) and dynamic with    that row alone (per-row activation scales), so a shard of the
        per-row/per-token scales    tokens gives the same rows as the whole sequence
      torchao dynamic activation    refused: one scale for the whole activation tensor (float8
        with a per-tensor scale     dynamic's default) is the max over *this rank's* tokens (and
                                    cfg rows) under USP, not over all of them: not one process's
                                    numbers. Quantize with ``granularity=PerRow()`` instead.
      GGUF (GGUFParameter)          works: ``GGUFLinear`` dequantizes the weight and multiplies
      bitsandbytes 4-bit            works (GPU only: Diffusers' bnb quantizer needs one)
      shard_weights=True (FSDP2)    refused beside any offload (FSDP2 owns where a parameter lives
        or text_encoder="shard"     and gathers it itself; an offload hook moves or replaces the
                                    same parameters) and beside quantized weights (FSDP2 shards
                                    plain tensors; it does not promise the chunk / all-gather of a
                                    torchao, GGUF or bitsandbytes tensor subclass). Quantized
                                    weights already take 1/2 to 1/4 of the memory: use the grid
                                    without ``shard_weights``, or shard the unquantized model.
      text_encoder="rank0"          refused beside sequential or group offload or quantized
                                    weights of that encoder: it drops and later re-broadcasts the
                                    encoder's ``param.data``, which those hooks keep elsewhere (on
                                    "meta", in a weights map) or which is a tensor subclass.

    The refusals are NotImplementedError at ``enable_usp`` (``check_enable``), made from the state
    of the modules, which every rank built the same way, so every rank raises at that call. What is
    added after ``enable_usp`` (an offload, ``torchao.quantize_``) is checked before each call of
    the transformer (``CallGuard``, a forward pre-hook run before any collective): again on every
    rank, at the same call.

Note [wrappers beneath the hooks]
    usp_dit installs callables as a module's ``forward`` (the replica wrapper, the joint split of
    Flux-like families, "rank0" encoders). accelerate's hooks also live in ``forward``: they keep
    the forward they found in ``module._old_forward`` and put it back on removal. Diffusers'
    ``maybe_free_model_hooks`` removes and re-adds every model-offload hook at the end of every
    pipeline call (Diffusers issue 12533: context parallelism's hooks lost after the first call when
    offload was enabled first). So, when an accelerate hook is on the module, ``wrap_forward``
    puts usp_dit's wrapper *under* it, in ``_old_forward``: a removal then leaves usp_dit's wrapper
    as the forward, and the re-added hook wraps it again. Enabled the other way round, the hook
    finds usp_dit's wrapper as the forward and keeps it in ``_old_forward`` by itself: the same
    chain in both orders.

        offload, then enable_usp:   forward = hook ─► _old_forward = usp wrapper ─► model forward
        enable_usp, then offload:   forward = hook ─► _old_forward = usp wrapper ─► model forward

    ``unwrap_forward`` (``disable_usp``) takes usp_dit's wrapper out of the chain wherever it is
    now (the forward, accelerate's ``_old_forward``, a Diffusers hook's reference, another
    wrapper's ``inner``), so the offload hooks keep working on the plain model.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.utils.hooks import RemovableHandle

from usp_dit.pipelines.base import MethodWrapper

# Diffusers' group-offloading hook names (diffusers.hooks.group_offloading): a hook of one of these
# names on the transformer itself may hold usp_dit's wrapper; disable_usp takes it out of that hook.
GROUP_OFFLOAD_HOOKS = ("group_offloading", "layer_execution_tracker", "lazy_prefetch_group_offloading")

MODEL_OFFLOAD = "enable_model_cpu_offload"
SEQUENTIAL_OFFLOAD = "enable_sequential_cpu_offload"
GROUP_OFFLOAD = "enable_group_offload"


# ---------------------------------------------------------------------------------------------
# What is on a module


def _accelerate_hooks(hook: Any) -> Iterator[Any]:
    """``hook`` and, for accelerate's ``SequentialHook``, the hooks it chains."""
    yield hook
    for inner in getattr(hook, "hooks", ()) or ():
        yield from _accelerate_hooks(inner)


def offloads(module: torch.nn.Module) -> list[str]:
    """The Diffusers offloading methods whose hooks are on ``module`` or its submodules, by the
    hooks themselves: accelerate's ``CpuOffload`` (model offload), an ``AlignDevicesHook`` that
    offloads (sequential offload), a group-offloading hook in a Diffusers registry."""
    found: set[str] = set()
    for sub in module.modules():
        hook = sub.__dict__.get("_hf_hook")
        for h in _accelerate_hooks(hook) if hook is not None else ():
            name = type(h).__name__
            if name == "CpuOffload":
                found.add(MODEL_OFFLOAD)
            elif name == "AlignDevicesHook" and (getattr(h, "offload", False)
                                                 or getattr(h, "weights_map", None) is not None):
                found.add(SEQUENTIAL_OFFLOAD)
        registry = sub.__dict__.get("_diffusers_hook")
        if registry is not None and any(n in GROUP_OFFLOAD_HOOKS for n in getattr(registry, "hooks", {})):
            found.add(GROUP_OFFLOAD)
    return sorted(found)


def _local(param: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (what ``quantize_`` after ``shard_weights`` would have replaced)."""
    local = getattr(param, "_local_tensor", None)
    return local if isinstance(local, torch.Tensor) else param


def quantization(param: torch.Tensor) -> str | None:
    """"torchao", "gguf" or "bitsandbytes" for a quantized parameter (by its class), else None."""
    cls = type(_local(param))
    if cls.__module__.startswith("torchao"):
        return "torchao"
    if cls.__name__ == "GGUFParameter":
        return "gguf"
    if cls.__module__.startswith("bitsandbytes"):
        return "bitsandbytes"
    return None


def quantized(module: torch.nn.Module) -> list[str]:
    """The quantization libraries whose weights ``module`` holds."""
    return sorted({q for p in module.parameters() if (q := quantization(p)) is not None})


def activation_scale_refusal(param: torch.Tensor) -> str | None:
    """Why a torchao weight's dynamic activation quantization is not exact on a token shard, or
    None (Note [offload and quantization under USP]): its activation scale must be per token."""
    local = _local(param)
    if type(local).__name__ == "LinearActivationQuantizedTensor":  # torchao's older dynamic format
        return ("torchao's LinearActivationQuantizedTensor (an older dynamic-quantization format usp_dit has "
                "not checked)")
    kwargs = getattr(local, "act_quant_kwargs", None)
    if kwargs is None:
        return None  # weight-only, or a static activation scale: the same constant on every rank
    granularity = getattr(kwargs, "granularity", None)
    name = type(granularity).__name__
    per_token = name in ("PerToken", "PerGroup") or (name == "PerRow" and getattr(granularity, "dim", -1) == -1)
    if per_token:
        return None
    return (f"dynamic activation quantization with granularity {granularity!r}: its scale is computed over the "
            f"whole activation tensor, which under USP holds only this rank's tokens (and cfg rows), so the "
            f"numbers would not be one process's; quantize with granularity=PerRow() (per-token scales) instead")


# ---------------------------------------------------------------------------------------------
# Refusals


def _refuse_dynamic_per_tensor(name: str, module: torch.nn.Module) -> None:
    for pname, param in module.named_parameters():
        reason = activation_scale_refusal(param)
        if reason is not None:
            raise NotImplementedError(f"enable_usp with a torchao-quantized {name} ({pname}): {reason}")


def _refuse_shard(name: str, module: torch.nn.Module, what: str) -> None:
    """``what`` (shard_weights=True, text_encoder="shard") shards ``module`` with FSDP2."""
    offloaded, quant = offloads(module), quantized(module)
    if offloaded:
        raise NotImplementedError(
            f"enable_usp({what}) with {', '.join(offloaded)} on the {name}: FSDP2 and the offload hooks both "
            f"decide where its weights live; use one: shard the weights over the ranks (drop the offload: call "
            f"pipe.remove_all_hooks() or build the pipeline again), or offload without {what}")
    if quant:
        raise NotImplementedError(
            f"enable_usp({what}) with {', '.join(quant)}-quantized weights in the {name}: FSDP2 shards plain "
            f"tensors and does not promise to split and all-gather these tensor subclasses; run the quantized "
            f"model without {what} (its weights already take a fraction of the memory), or shard the unquantized one")


def _refuse_rank0(name: str, module: torch.nn.Module) -> None:
    moved = [o for o in offloads(module) if o != MODEL_OFFLOAD]
    quant = quantized(module)
    if moved or quant:
        what = ", ".join(moved) if moved else f"{', '.join(quant)}-quantized weights"
        raise NotImplementedError(
            f"enable_usp(text_encoder='rank0') with {what} on the {name}: 'rank0' drops the other ranks' "
            f"param.data and broadcasts it back on disable, and these keep the weights elsewhere or as tensor "
            f"subclasses; use text_encoder='replicate' (the default without shard_weights)")


def check_enable(transformers: Iterable[torch.nn.Module], encoders: Iterable[tuple[str, torch.nn.Module]],
                 shard_weights: bool, encoder_mode: str, model_degree: int) -> None:
    """Note [offload and quantization under USP]: NotImplementedError, before anything is patched,
    for a composition usp_dit cannot run exactly. ``encoders``: the pipeline's ``(name, encoder)``;
    ``model_degree``: ranks of one model replica (at 1 nothing is split: nothing to refuse).
    """
    if model_degree <= 1:
        return
    for transformer in transformers:
        name = type(transformer).__name__
        _refuse_dynamic_per_tensor(name, transformer)
        if shard_weights:
            _refuse_shard(name, transformer, "shard_weights=True")
    for name, encoder in encoders:
        if encoder_mode == "shard":
            _refuse_shard(name, encoder, "text_encoder='shard'")
        elif encoder_mode == "rank0":
            _refuse_rank0(name, encoder)


def _from_usp(fn: Any) -> bool:
    """A hook function usp_dit installed (a method of one of its objects, or one of its functions)."""
    owner = getattr(fn, "__self__", None) or getattr(getattr(fn, "func", None), "__self__", None)
    return (type(owner).__module__ if owner is not None else getattr(fn, "__module__", "") or "").startswith("usp_dit")


def usp_modules(module: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """``{path: submodule}`` of the submodules carrying usp_dit's hooks or attention processors."""
    out = {}
    for name, sub in module.named_modules():
        hooks = [*sub._forward_pre_hooks.values(), *sub._forward_hooks.values()]
        processor = getattr(sub, "processor", None)
        if any(_from_usp(h) for h in hooks) or type(processor).__module__.startswith("usp_dit"):
            out[name] = sub
    return out


class CallGuard:
    """Before each call of a module ``enable_usp`` changed: ``check(name, module)`` (the refusals of
    ``check_enable``) for what was added after ``enable_usp`` (an offload, ``torchao.quantize_``),
    and none of the submodules usp_dit hooked replaced since (GGUF's or a library's module swap
    would leave usp_dit's token hooks on the old module: the output unsharded or wrong). A forward
    pre-hook put first, so it raises before any hook's collective (FSDP2's all-gather); every rank
    raises at the same call."""

    def __init__(self, module: torch.nn.Module, name: str, check: Callable[[str, torch.nn.Module], None]) -> None:
        self.name, self.check = name, check
        self.hooked = usp_modules(module)
        self.handle: RemovableHandle | None = module.register_forward_pre_hook(self, prepend=True)

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():  # a compiled call: checked at enable_usp and by eager calls only
            return
        self.check(f"{self.name} (added after enable_usp)", module)
        for path, sub in self.hooked.items():
            if module.get_submodule(path) is not sub:
                raise NotImplementedError(
                    f"{self.name}.{path} was replaced after enable_usp (e.g. by quantization that swaps modules, "
                    f"like GGUF's GGUFLinear): usp_dit's hooks are on the module it replaced; quantize or load the "
                    f"model first, then enable_usp (or disable_usp, change the model, enable_usp)")

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None


def transformer_check(sharded: bool) -> Callable[[str, torch.nn.Module], None]:
    """What ``CallGuard`` checks on an enabled transformer (``shard_weights`` or not)."""
    def check(name: str, module: torch.nn.Module) -> None:
        _refuse_dynamic_per_tensor(name, module)
        if sharded:
            _refuse_shard(name, module, "shard_weights=True")
    return check


def encoder_check(mode: str) -> Callable[[str, torch.nn.Module], None] | None:
    """What ``CallGuard`` checks on a text encoder placed in ``mode`` (None: nothing to check)."""
    if mode == "shard":
        return lambda name, module: _refuse_shard(name, module, "text_encoder='shard'")
    if mode == "rank0":
        return _refuse_rank0
    return None


# ---------------------------------------------------------------------------------------------
# Note [wrappers beneath the hooks]


def wrap_forward(module: torch.nn.Module, make: Callable[[Callable[..., Any]], MethodWrapper]) -> MethodWrapper:
    """Install ``make(forward)`` as ``module``'s forward, beneath an accelerate hook if one is on it."""
    own = module.__dict__
    if own.get("_hf_hook") is not None and "_old_forward" in own:
        wrapper = make(own["_old_forward"])
        own["_old_forward"] = wrapper
    else:
        wrapper = make(module.forward)
        module.forward = wrapper
    return wrapper


def _slots(module: torch.nn.Module) -> Iterator[tuple[Any, str, bool]]:
    """``(holder, attribute, in __dict__)`` of every place in ``module``'s forward chain that may
    hold a callable: its forward, accelerate's ``_old_forward``, Diffusers' hook references."""
    yield module, "forward", True
    yield module, "_old_forward", True
    registry = module.__dict__.get("_diffusers_hook")
    for ref in getattr(registry, "_fn_refs", ()):
        yield ref, "forward", False
        yield ref, "original_forward", False


def _own_forward(module: torch.nn.Module, fn: Any) -> bool:
    """``fn`` is ``module``'s class forward bound to it (no instance attribute is needed for it)."""
    return getattr(fn, "__self__", None) is module and getattr(fn, "__func__", None) is type(module).forward


def unwrap_forward(module: torch.nn.Module, wrapper: MethodWrapper) -> bool:
    """Take ``wrapper`` out of ``module``'s forward chain, wherever it is now; True if found.

    In the forward itself, with the module's own forward beneath, the instance attribute goes (the
    module is as it was before ``wrap_forward``)."""
    for holder, attr, in_dict in _slots(module):
        value = holder.__dict__.get(attr) if in_dict else getattr(holder, attr, None)
        while value is not None:
            if value is wrapper:
                if holder is module and attr == "forward" and _own_forward(module, wrapper.inner):
                    del module.__dict__["forward"]
                else:
                    setattr(holder, attr, wrapper.inner)
                return True
            if not isinstance(value, MethodWrapper):
                break
            holder, attr, value = value, "inner", value.inner  # a wrapper around it: look inside
    return False


__all__ = ["GROUP_OFFLOAD_HOOKS", "CallGuard", "activation_scale_refusal", "check_enable", "encoder_check", "offloads",
           "quantization", "quantized", "transformer_check", "unwrap_forward", "usp_modules", "wrap_forward"]
