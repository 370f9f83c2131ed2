"""The FP8 step recipe's linear layers (``usp_dit.quantize_fp8_linears``, Note [the FP8 step recipe]).

Float8 matmuls need a GPU of compute capability >= 8.9 (torchao refuses the CPU), so on CPU this
checks what the recipe quantizes, by name against Diffusers' module layout written out by hand
(an independent list, not the selection rule run twice), and the composition with ``enable_usp``
through the same entry point with a per-token int8 config that runs on CPU. Tolerance: the enabled
one-process call against the same quantized model called stock, float32, 1e-5 relative (the same
quantized rows; attention routed through usp_dit sums in another order). The float8 run itself is
tests/gpu/test_memory_composition_gpu.py's and benchmarks/bench_fp8_step.py's.
"""
from __future__ import annotations

import sys

import pytest
import torch

from usp_dit.demo.tiny_flux import tiny_flux_transformer
from usp_dit.demo.tiny_wan import tiny_wan
from usp_dit.pipelines.fp8_linears import fp8_linear_names, quantize_fp8_linears

FLUX_DOUBLE = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0", "attn.add_q_proj", "attn.add_k_proj",
               "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj",
               "ff_context.net.2"]
FLUX_SINGLE = ["attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp", "proj_out"]
WAN_BLOCK = ["attn1.to_q", "attn1.to_k", "attn1.to_v", "attn1.to_out.0", "attn2.to_q", "attn2.to_k", "attn2.to_v",
             "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2"]


def test_the_recipe_takes_the_blocks_projections_and_mlps_and_leaves_modulation_and_the_ends():
    flux = tiny_flux_transformer(num_layers=2, num_single_layers=2)
    want = {f"transformer_blocks.{i}.{n}" for i in range(2) for n in FLUX_DOUBLE}
    want |= {f"single_transformer_blocks.{i}.{n}" for i in range(2) for n in FLUX_SINGLE}
    assert set(fp8_linear_names(flux)) == want
    wan = tiny_wan()
    assert set(fp8_linear_names(wan)) == {f"blocks.{i}.{n}" for i in range(2) for n in WAN_BLOCK}
    # What stays: the modulation of every block, the embedders and the final projection.
    kept = {n for n, m in flux.named_modules() if isinstance(m, torch.nn.Linear)} - want
    assert {"transformer_blocks.0.norm1.linear", "single_transformer_blocks.1.norm.linear", "x_embedder",
            "context_embedder", "proj_out", "norm_out.linear"} <= kept


def test_quantized_layers_compose_with_enable_usp_at_one_process():
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig

    from usp_dit import disable_usp, enable_usp

    model = tiny_wan()
    chosen = quantize_fp8_linears(model, config=Int8DynamicActivationInt8WeightConfig())
    assert chosen == sorted(fp8_linear_names(model))
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            subclass = type(module.weight).__module__.startswith("torchao")
            assert subclass == (name in chosen), name
    g = torch.Generator().manual_seed(3)
    inputs = dict(hidden_states=torch.randn(2, model.config.in_channels, 3, 6, 10, generator=g),
                  encoder_hidden_states=torch.randn(2, 7, model.config.text_dim, generator=g),
                  timestep=torch.tensor([300, 801]), return_dict=False)
    with torch.no_grad():
        stock = model(**inputs)[0]
        enable_usp(model)
        try:
            enabled = model(**inputs)[0]
        finally:
            disable_usp(model)
    assert (enabled - stock).abs().max() <= 1e-5 * stock.abs().max()


def test_without_torchao_the_error_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    with pytest.raises(RuntimeError, match="pip install torchao"):
        quantize_fp8_linears(tiny_wan())


def test_the_default_config_keeps_an_all_zero_activation_row_finite(monkeypatch):
    """Note [the FP8 step recipe]: torchao scales a row by max|row| / 448, so an all-zero row (a
    zero-padded token) would quantise to 0 / 0 = NaN. The recipe's default config bounds the scale
    from below; quantising activations the way that config asks (torchao's own Float8Tensor, which
    runs on CPU) keeps the zero row exactly zero and the other rows within e4m3's rounding (2^-4 of
    their largest value: 3 mantissa bits, round to nearest)."""
    import torchao.quantization as tq

    seen = {}
    monkeypatch.setattr(tq, "quantize_", lambda model, config, filter_fn=None: seen.setdefault("config", config))
    quantize_fp8_linears(tiny_wan())  # the float8 transform itself needs a GPU: the config is what is checked
    config = seen["config"]
    assert isinstance(config, tq.Float8DynamicActivationFloat8WeightConfig)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(0)).bfloat16()
    x[2] = 0
    q = tq.Float8Tensor.from_hp(x, config.activation_dtype, granularity=tq.PerRow(),
                                hp_value_lb=config.activation_value_lb, hp_value_ub=config.activation_value_ub)
    back = q.dequantize().float()
    assert torch.isfinite(back).all() and torch.equal(back[2], torch.zeros(32))
    rows = x.float().abs().amax(dim=-1, keepdim=True)
    assert ((back - x.float()).abs() <= rows / 16).all()
