"""SkyReels-V2 adapter: sharded outputs and gradients equal one process's, on CPU gloo grids.

One spawned group of 4 ranks runs every case (the 2-rank grids as two data-parallel replicas).
Models: tiny 2-layer ``SkyReelsV2Transformer3DModel`` s (4 heads x 16, every weight perturbed;
``usp_dit.demo.tiny_skyreels_v2``):
- "t2v": ``num_frame_per_block=1`` (no mask), 45 tokens, batch 2;
- "df-fps": diffusion forcing, 2 latent frames per causal block (the model's frame-causal mask,
  F = 18 tokens), one timestep per frame (per-token modulation), the fps conditioning of the DF
  checkpoints (which the stock model takes at batch 1 only), 54 tokens;
- "df": diffusion forcing with 3 frames per block (F = 45), batch 2, 90 tokens.
No token count divides 4, and the frame blocks straddle the shards.

Grids: every (U, R, cfg) of tests/adapter_parity.GRIDS with each ring schedule forced (cfg grids
only for batch 2); per case output vs stock, block 0's attention sees at most ceil(S / P) tokens,
bit-identical after disable, and every routed attention call runs in the zigzag layout with
``block_causal`` = the mask's frame length (``None`` for "t2v"). Parameter gradients on 2 and 4 ranks (loss / P per rank, summed).

Tolerance: max|err| / max|ref| <= 1e-5 (float32): sharding only reorders float32 sums (the
block-causal plans' merges by log-sum-exp).
"""
from __future__ import annotations

from unittest import mock

import pytest
import torch

from tests import adapter_parity as parity
from usp_dit import single_rank_mesh
from usp_dit.demo.tiny_skyreels_v2 import skyreels_inputs, skyreels_tokens, tiny_skyreels_v2
from usp_dit.pipelines import _routing
from usp_dit.pipelines._frame_mask import FrameMaskReader
from usp_dit.pipelines.families.skyreels_v2 import ADAPTER

TOL = 1e-5
WORLD = 4

# name: (frames per causal block, latent frames, height, width, diffusion forcing, batch, fps)
SHAPES = {
    "t2v": (1, 3, 6, 10, False, 2, True),
    "df-fps": (2, 6, 6, 6, True, 1, True),
    "df": (3, 6, 6, 10, True, 2, False),
}


def _build(name: str):
    block, frames, h, w, df, batch, fps = SHAPES[name]
    model = tiny_skyreels_v2(num_frame_per_block=block, inject_sample_info=fps)
    return model, skyreels_inputs(model, frames, h, w, df, batch=batch)


def _output_case(name: str, mesh) -> dict[str, float]:
    """Output vs stock (tests/adapter_parity.sharded_output_case), and what the routed attention
    calls were asked: the zigzag layout, and block_causal = the mask's frame (frames per causal
    block x tokens per frame) exactly where the model masks."""
    model, inputs = _build(name)
    block, frames, h, w, *_ = SHAPES[name]
    calls = []
    inner = _routing.usp_attention

    def spy(*args, **kwargs):
        calls.append((kwargs.get("layout"), kwargs.get("block_causal")))
        return inner(*args, **kwargs)

    with mock.patch.object(_routing, "usp_attention", spy):
        res = parity.sharded_output_case(model, inputs, ADAPTER, mesh, model.blocks[0].attn1,
                                         skyreels_tokens(model, frames, h, w))
    frame = block * (h // 2) * (w // 2) if block > 1 else None
    res["calls_not_zigzag_with_frame"] = float(not calls or set(calls) != {("zigzag", frame)})
    return res


def _fits(name: str, grid: tuple) -> bool:
    return SHAPES[name][5] % grid[2] == 0  # the cfg degree splits the batch


def _run_all() -> dict:
    results: dict = {}
    parity.run_grid_cases(results, list(SHAPES), _output_case,
                          lambda name, mesh: parity.gradient_errors(*_build(name), ADAPTER, mesh), fits=_fits)
    return results


@pytest.fixture(scope="module")
def grid_results() -> list[dict]:
    return parity.spawn_grid(_run_all, WORLD)


test_sharded_output_matches_one_process, test_parameter_gradients_match_one_process = parity.grid_tests(
    parity.output_keys(list(SHAPES), _fits), parity.grad_keys(SHAPES), TOL,
)


def compile_case(mesh) -> dict[str, float]:
    """The "df" model (block-causal, batch 2) compiled with ``fullgraph=True`` on ``mesh`` vs the
    eager enabled model (``compiled_case``): the compiled processor takes the frame length from the
    config, not the mask. Called on spawned ranks (tests/test_compile_grid.py)."""
    return parity.compiled_case(*_build("df"), mesh)


# ---- one process ---------------------------------------------------------------------------------

def test_one_rank_block_causal_equals_stock():
    model, inputs = _build("df")
    ref = parity.forward(model, inputs)
    ADAPTER.enable(model, single_rank_mesh(), "auto")
    try:
        out = parity.forward(model, inputs)
    finally:
        ADAPTER.disable(model)
    assert (out - ref).abs().max() <= TOL * ref.abs().max()


def test_frame_mask_reader_reads_and_checks():
    pos = torch.arange(12)
    mask = ((pos[None, :] // 4) <= (pos[:, None] // 4))[None, None]
    reader = FrameMaskReader()
    assert reader.frame(mask, 12) == 4
    bad = mask.clone()
    bad[0, 0, 5, 9] = True  # a key from a later frame
    with pytest.raises(NotImplementedError, match="not"):
        FrameMaskReader().frame(bad, 12)
    with pytest.raises(NotImplementedError, match=r"\(12, 12\) bool"):
        reader.frame(mask.float(), 12)


def test_temb_of_wrong_length_is_refused():
    from usp_dit.pipelines._token_sharding import ShardState
    from usp_dit.pipelines.families.skyreels_v2 import SkyReelsTembHook

    model, _ = _build("df")
    hook = SkyReelsTembHook(model, ShardState(single_rank_mesh(), "auto", seq_len=90))
    args = (torch.zeros(1, 90, 64), None, torch.zeros(1, 6, 7, 64))
    with pytest.raises(ValueError, match="per-token modulation has 7 tokens but the latent has 90"):
        hook._cut(model.blocks[0], model.blocks[0], args, {})


def test_mask_frame_checked_against_config_frame():
    from usp_dit.pipelines._routing import Route
    from usp_dit.pipelines._token_sharding import ShardState
    from usp_dit.pipelines.families.skyreels_v2 import SkyReelsFrameHook, USPSkyReelsV2AttnProcessor

    model, inputs = _build("df")
    state = ShardState(single_rank_mesh(), "auto", seq_len=12)
    assert SkyReelsFrameHook(model, state).frame(inputs.hidden_states) == 45  # 3 frames x (6 // 2) x (10 // 2)
    assert SkyReelsFrameHook(_build("t2v")[0], state).frame(inputs.hidden_states) is None
    pos = torch.arange(12)
    mask = ((pos[None, :] // 4) <= (pos[:, None] // 4))[None, None]
    processor = USPSkyReelsV2AttnProcessor(Route(state))
    processor.config_frame = 4
    assert processor._mask_frame(mask, 12) == 4
    processor.config_frame = 6
    with pytest.raises(NotImplementedError, match="frame length is 4 tokens, but the config gives 6"):
        processor._mask_frame(mask, 12)
