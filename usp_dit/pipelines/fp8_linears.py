"""The FP8 step recipe's linear layers: torchao float8 on the Linear layers of a DiT's blocks.

Layout: a Linear's weight (out_features, in_features); its activations (..., in_features), one row a
token, so a rank's shard of the tokens is a shard of the rows.

Note [the FP8 step recipe]
    A video DiT's step is attention plus linear layers (Wan 2.1-14B at 720p: about 2/3 attention,
    1/3 projections and MLPs on an H100). usp_dit's FP8 attention backends (``fp8_flashinfer``,
    ``fp8``) take the first; torchao takes the second, composed and not rewritten:
    ``quantize_fp8_linears(transformer)`` applies torchao's
    ``Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), activation_value_lb=ACTIVATION_LB)``
    -- one scale per weight row
    and one per activation row (token) -- so a shard of the tokens computes exactly the rows one
    process computes (Note [offload and quantization under USP] in ``composition``: a per-tensor
    activation scale would be the max over this rank's tokens only, and is refused there). Then
    ``enable_usp(..., backend="fp8_flashinfer")``, in either order.

    Which Linear layers: those inside the family's blocks (``plan.block_lists``, where nearly all of
    the FLOPs are), except
      - modulation layers (a name with "norm", "modulation", "adaln" or "scale_shift"): their input
        is one row per sample (the timestep embedding), so FP8 saves nothing there, while its
        rounding would reach every token through the scale and shift it produces;
      - layers whose in or out features are not multiples of 16 (the FP8 matmul's alignment).
    Embedders, the final projection (which writes the prediction itself) and everything outside
    the blocks keep the model's dtype. The error this costs is measured per model in docs/FP8.md
    ("The FP8 step recipe"), next to its speed: the recipe is lossy and opt-in.

    An all-zero activation row (a zero-padded token, a zero register) would get the scale
    max|row| / 448 = 0 from torchao, and 0 / 0 = NaN in every output of that row (torchao 0.17,
    its PyTorch quantisation path; checked on CPU in tests/test_fp8_linears.py). The default config
    therefore bounds the scale from below (``activation_value_lb``, ``ACTIVATION_LB``): such a row
    quantises to zeros and its output is the layer's bias, as in bf16. A row whose largest value is
    below the bound loses nothing measurable. (torchao then takes its PyTorch quantisation rather
    than the MSLK kernel, which refuses a lower bound.)
"""
from __future__ import annotations

from typing import Any

import torch

from usp_dit.pipelines.base import find_adapter

_MODULATION = ("norm", "modulation", "adaln", "scale_shift")
_ALIGN = 16
ACTIVATION_LB = 1e-12  # the smallest max|row| an activation scale is computed from (above: zero rows)
INSTALL = "pip install torchao  # and a GPU of compute capability >= 8.9 (H100, L40S, RTX 4090)"


def fp8_linear_names(transformer: torch.nn.Module) -> list[str]:
    """Qualified names of the Linear layers the recipe quantizes (Note [the FP8 step recipe]).

    Raises:
        NotImplementedError: ``transformer``'s family has no plan (no block lists to scope it).
    """
    plan = getattr(find_adapter(transformer), "plan", None)
    if plan is None:
        raise NotImplementedError(f"quantize_fp8_linears: {type(transformer).__name__}'s adapter has no plan "
                                  f"(block lists), so the recipe cannot tell its blocks' layers")
    names = []
    for list_name in plan.block_lists:
        for name, module in getattr(transformer, list_name).named_modules(prefix=list_name):
            if not isinstance(module, torch.nn.Linear):
                continue
            if any(word in name.lower() for word in _MODULATION):
                continue
            if module.in_features % _ALIGN or module.out_features % _ALIGN:
                continue
            names.append(name)
    return names


def quantize_fp8_linears(transformer: torch.nn.Module, config: Any = None) -> list[str]:
    """Quantize the recipe's Linear layers of ``transformer`` in place with torchao; their names.

    Args:
        transformer: a Diffusers transformer of a supported family, on its GPU, enabled or not.
        config: a torchao ``quantize_`` config (default ``Float8DynamicActivationFloat8WeightConfig(
            granularity=PerRow(), activation_value_lb=ACTIVATION_LB)``); it must scale activations
            per token or not at all (checked again by ``enable_usp`` and before each call).

    Raises:
        RuntimeError: torchao is not installed (the message has the install line).
        NotImplementedError: the family has no plan.
    """
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
    except ImportError as err:
        raise RuntimeError(f"quantize_fp8_linears needs torchao: {INSTALL}") from err
    names = set(fp8_linear_names(transformer))
    if config is None:
        config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), activation_value_lb=ACTIVATION_LB)
    quantize_(transformer, config, filter_fn=lambda module, fqn: fqn in names)
    return sorted(names)
