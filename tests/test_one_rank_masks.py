"""One rank under a padded prompt's key mask (Note [one rank under a key mask] in usp_dit.attention.usp).

With inference on one rank of the sequence, a routed call whose mask is a bool key-padding mask
goes to one kernel call with the whole mask (no per-element split, no host syncs). These checks
run the families that route image queries alone over [text; image] keys (PRX, NucleusMoE-Image;
Qwen-Image 2.1's target over [prefix; target]) and one joint-sequence family (Qwen-Image) under ``torch.no_grad`` with masked prompts of
different lengths per batch element, against the stock model in float32: max|err| / max|ref|
<= 1e-5 (float32 sums grouped differently), and check the one-call path was the one taken.
"""
from __future__ import annotations

import pytest
import torch

from tests.adapter_parity import forward
from usp_dit import single_rank_mesh
from usp_dit.attention import usp as usp_module
from usp_dit.testing import rel_err

TOL = 1e-5


def _prx():
    from usp_dit.demo.tiny_prx import prx_inputs, tiny_prx
    from usp_dit.pipelines.families.prx import ADAPTER

    model = tiny_prx("prx")
    return model, prx_inputs(5, 7, [3, 6], 8, channels=model.config.in_channels), ADAPTER


def _nucleus_moe():
    from usp_dit.demo.tiny_nucleus_moe import nucleus_moe_inputs, tiny_nucleus_moe
    from usp_dit.pipelines.families.nucleus_moe import ADAPTER

    model = tiny_nucleus_moe("moe")
    return model, nucleus_moe_inputs(model, 3, 5, [[1, 1, 0, 1, 1, 1, 0, 0, 0], [0, 1, 1, 1, 1, 1, 1, 1, 1]]), ADAPTER


def _qwen_image():
    from usp_dit.demo.tiny_qwen_image import qwen_image_inputs, tiny_qwen_image
    from usp_dit.pipelines.families.qwen_image import ADAPTER

    model = tiny_qwen_image()
    return model, qwen_image_inputs(model, [(1, 5, 7)], [[1] * 4 + [0] * 5, [1] * 9]), ADAPTER


def _qwen_image21():
    from usp_dit.demo.tiny_qwen_image21 import qwen_image21_inputs, tiny_qwen_image21
    from usp_dit.pipelines.families.qwen_image21 import ADAPTER

    model = tiny_qwen_image21()
    masks = [[1, 1, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 0, 0, 0, 0]]
    return model, qwen_image21_inputs(model, [(1, 2, 4), (1, 4, 6)], masks), ADAPTER


@pytest.mark.parametrize("build", [_prx, _nucleus_moe, _qwen_image, _qwen_image21],
                         ids=["prx", "nucleus_moe", "qwen_image", "qwen_image21"])
def test_one_rank_masked_inference_equals_stock_in_one_call(build, monkeypatch):
    model, inputs, adapter = build()
    calls = []
    real = usp_module.one_rank_masked_attention
    monkeypatch.setattr("usp_dit.pipelines._routing.one_rank_masked_attention",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        ref = forward(model, inputs)
        adapter.enable(model, single_rank_mesh(), "auto")
        try:
            out = forward(model, inputs)
        finally:
            adapter.disable(model)
    assert calls, "the one-call masked path was not taken"
    assert rel_err(out, ref) <= TOL
