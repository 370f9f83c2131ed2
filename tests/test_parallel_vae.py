"""Parallel VAE decode and encode (``usp_dit.enable_parallel_vae``) against one process.

Unit tests (no processes): the row maths, the mask over gathered keys, and ``classify`` on every
family's tiny VAE (every module of its decoder is known; an unknown module, a non-2.0 attention
processor or LTX's noise injection makes the VAE decode whole).

One spawned group of 4 ranks runs every case: the tiny VAEs of AutoencoderKL (Flux.1 / SD3 /
Chroma, with its mid-block attention), Flux.2, Wan 2.1, Qwen-Image, CogVideoX, Mochi, HunyuanVideo
(with its frame-causal mid-block attention) and LTX-Video, and of the 2025-26 families: LTX-2
(reflect-padded convolutions in decoder and encoder, timestep conditioning, residual depth-to-space
upsamplers, every downsampling kind), Wan 2.2 TI2V-5B (residual blocks, patchify), Qwen-Image 2.1,
HunyuanImage 2.1 (GroupNorm, attention, pixel-(un)shuffles) and its refiner (attention over every
frame), DC-AE (Sana, PRX, SANA-Video: BatchNorm, ReLU linear attention whose token sums are
all-reduced, in both of its processor's forms), Cosmos 1's tokenizer (Haar wavelet patcher, causal
GroupNorm, spatial attention with K/V gathered and temporal attention per pixel) and EasyAnimate's
Magvit VAE (framewise decode through the causal convolutions' frame caches; with and without
spatial_group_norm: nearest or trilinear frame interpolation), on latents whose rows and columns are odd (7 x 5,
9 x 5, 13 x 9: no split is even; on 4 ranks 7 rows leave the last rank one row, and an LTX-2
latent of 4 rows gives every rank one, so its reflecting border rows come from the neighbour) and
batch 2 where the VAE is cheap, over replicas of 2 ranks (mesh (2, 1, 1): two replicas on the
group), 4 ranks (2, 2, 1) and 4 ranks across the cfg axis (1, 2, 2: the replica's group is built
over cfg x sequence). Each case checks:
- the decoded sample equals the stock decode of the whole latent on one process: max|err| /
  max|ref| <= 1e-5 (float32: the split changes only the order of GroupNorm's sums and of the
  attention's softmax sums, measured ~1e-6);
- each rank's decoder saw at most ceil(rows / P) latent rows (the work is split, not repeated);
- after ``disable_parallel_vae`` the decode is bit-identical to stock.
Encode (``vae._encode``: the moments) on the two 4-rank grids (the 2025-26 families' also on 2
ranks), images with rows that are not a multiple of the encoder's downsampling (or, for encoders
that downsample by reshaping and need one, 5 units over 2 and 4 ranks): equal to one process
<= 1e-5, the encoder's first convolution saw fewer rows than the image has; Mochi's encoder (its
attention processor is not split) runs whole, bit for bit.
Unit tests also check that noise injection (LTX-Video, LTX-2) and circular padding are refused and
a timestep-conditioned LTX-Video decoder is split.
Fallbacks (Note [parallel VAE fallback]), each equal to stock bit for bit: fewer latent rows than
ranks, pieces thinner than a convolution's halo (DC-AE's 5x5: 7 rows on 4 ranks), a decode needing
a gradient, a VAE class without a recipe. A latent differing between the ranks raises ValueError
on every rank. A VAE with tiling on decodes the exact untiled image.
The tiny FluxPipeline through ``pipe.enable_usp()`` (2 x 2): its VAE is split (the decoder sees a
quarter of the rows), the image equals one process's, ``disable_usp`` and ``parallel_vae=False``
leave the VAE whole.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from tests import adapter_parity as parity
from usp_dit.pipelines.vae.attention import _gathered_mask
from usp_dit.pipelines.vae.patch import _alignment
from usp_dit.pipelines.vae.recipes import classify, recipes
from usp_dit.pipelines.vae.rows import aligned_split, can_split, row_offsets, row_split
from usp_dit.testing import rel_err, run_spawned

TOL = 1e-5
WORLD = 4
GRIDS = [(2, 1, 1), (2, 2, 1), (1, 2, 2)]


def _vae(family: str):
    """(tiny VAE, latent shape) of ``family``: odd rows and columns everywhere."""
    if family == "kl":
        from usp_dit.demo.tiny_flux import tiny_vae
        return tiny_vae(3), (2, 4, 13, 9)
    if family == "flux2":
        from usp_dit.demo.tiny_flux2 import tiny_flux2_vae
        vae = tiny_flux2_vae()
        return vae, (2, vae.config.latent_channels, 7, 5)
    if family == "wan":
        from usp_dit.demo.tiny_wan import tiny_wan_vae
        return tiny_wan_vae(), (2, 4, 3, 7, 5)
    if family == "qwen_image":
        from usp_dit.demo.tiny_qwen_image import tiny_qwen_image_vae
        vae = tiny_qwen_image_vae()
        return vae, (2, vae.config.z_dim, 1, 7, 5)
    if family == "cogvideox":
        from usp_dit.demo.tiny_video import tiny_cogvideox_vae
        return tiny_cogvideox_vae(), (2, 4, 3, 7, 5)
    if family == "mochi":
        from usp_dit.demo.tiny_video import tiny_mochi_vae
        return tiny_mochi_vae(), (1, 12, 2, 7, 5)
    if family == "hunyuan_video":
        from usp_dit.demo.tiny_hunyuan_video import tiny_hunyuan_video_vae
        vae = tiny_hunyuan_video_vae(attention=True)
        return vae, (1, vae.config.latent_channels, 2, 7, 5)
    if family == "ltx_video":
        from usp_dit.demo.tiny_ltx_video import tiny_ltx_video_vae
        vae = tiny_ltx_video_vae()
        return vae, (1, vae.config.latent_channels, 2, 7, 5)
    return _vae_2025(family)


def _vae_2025(family: str):
    """The VAEs of the 2025-26 families, tiny: LTX-2's video VAE with a reflecting decoder and
    encoder, a timestep-conditioned decoder (upsamplers with a residual, factor 2, as released)
    and every downsampling kind; Wan 2.2's (TI2V-5B: residual blocks, patchify 2, 16x); Qwen-Image
    2.1's (2D convolutions, Wan 2.2's blocks); HunyuanImage 2.1's (2D, GroupNorm, attention) and its
    refiner's (3D, attention over every frame)."""
    import diffusers

    torch.manual_seed(0)
    if family == "ltx2":
        vae = diffusers.AutoencoderKLLTX2Video(
            latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 16, 32),
            layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
            downsample_type=("spatial", "temporal", "spatiotemporal", "conv"), timestep_conditioning=True,
            encoder_spatial_padding_mode="reflect", spatial_compression_ratio=32, temporal_compression_ratio=8)
        return vae.eval(), (1, 8, 2, 7, 5)
    if family == "wan22":
        vae = diffusers.AutoencoderKLWan(
            base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1], num_res_blocks=1, temperal_downsample=[False, True, True],
            is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
            latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
        return vae.eval(), (1, 4, 2, 7, 5)
    if family == "qwen_image21":
        vae = diffusers.AutoencoderKLQwenImage21(
            base_dim=8, decoder_base_dim=8, z_dim=4, dim_mult=[1, 1, 1, 1, 1], num_res_blocks=1,
            latents_mean=[0.0] * 4, latents_std=[1.0] * 4)
        return vae.eval(), (2, 4, 1, 7, 5)
    if family == "hunyuan_image":
        from usp_dit.demo.tiny_hunyuan_image import tiny_hunyuan_image_vae
        vae = tiny_hunyuan_image_vae()
        return vae, (2, vae.config.latent_channels, 7, 5)
    if family == "hunyuan_image_refiner":
        from usp_dit.demo.tiny_hunyuan_image import tiny_hunyuan_image_refiner_vae
        vae = tiny_hunyuan_image_refiner_vae()
        return vae, (1, vae.config.latent_channels, 2, 7, 5)
    if family == "dc_ae":
        return _tiny_dc_ae(), (2, 4, 9, 5)
    return _vae_vae3(family)


def _vae_vae3(family: str):
    """Cosmos 1's tokenizer (Haar wavelet patcher, causal GroupNorm, spatial and temporal attention;
    two latent frames: the temporal upsampler runs) and EasyAnimate's Magvit VAE (two latent frames:
    the framewise decode's second call reads every convolution's frame cache and interpolates
    frames; ``magvit_trilinear``: ``spatial_group_norm=False``, norms over the frames and the
    trilinear frame interpolation)."""
    if family == "cosmos":
        from usp_dit.demo.tiny_cosmos import tiny_cosmos_vae
        return tiny_cosmos_vae(), (1, 4, 2, 7, 5)
    if family in ("magvit", "magvit_trilinear"):
        from diffusers import AutoencoderKLMagvit
        torch.manual_seed(0)
        vae = AutoencoderKLMagvit(latent_channels=4, block_out_channels=[8, 8, 8], layers_per_block=1, norm_num_groups=2,
                                  down_block_types=["SpatialDownBlock3D"] + ["SpatialTemporalDownBlock3D"] * 2,
                                  up_block_types=["SpatialUpBlock3D"] + ["SpatialTemporalUpBlock3D"] * 2,
                                  spatial_group_norm=family == "magvit")
        return vae.eval(), (1, 4, 2, 9, 3)
    raise ValueError(family)


def _tiny_dc_ae():
    """DC-AE as Sana's (ResBlocks with BatchNorm, then EfficientViT blocks with the ReLU linear
    attention and 5x5 multiscale projections: halos of 2 rows; nearest upsampling, strided-convolution
    downsampling), 4x. One head of 32 at the 9 x 5 latent: the image's 45 tokens take the linear
    form, the pieces' 10-25 on 2 and 4 ranks the quadratic one (Note [DC-AE attention path]); a
    latent of 4 rows (20 tokens) on 2 ranks takes the quadratic form whole."""
    import diffusers

    torch.manual_seed(0)
    kinds = ("ResBlock", "ResBlock", "EfficientViTBlock")
    vae = diffusers.AutoencoderDC(
        in_channels=3, latent_channels=4, attention_head_dim=32, encoder_block_types=kinds, decoder_block_types=kinds,
        encoder_block_out_channels=(8, 16, 32), decoder_block_out_channels=(8, 16, 32),
        encoder_layers_per_block=(1, 1, 1), decoder_layers_per_block=(1, 1, 1),
        encoder_qkv_multiscales=((), (), (5,)), decoder_qkv_multiscales=((), (), (5,)),
        upsample_block_type="interpolate", downsample_block_type="Conv",
        decoder_norm_types=("batch_norm", "batch_norm", "rms_norm"), decoder_act_fns=("relu", "relu", "silu"))
    for m in vae.modules():  # running statistics that are not the identity
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.normal_()
            m.running_var.uniform_(0.5, 2.0)
    return vae.eval()


# Extra positional arguments of a family's decode: LTX-2's timestep (batch,) for its conditioning.
DECODE_ARGS = {"ltx2": lambda z: (torch.full((z.shape[0],), 0.05),)}


FAMILIES_2025 = ["ltx2", "wan22", "qwen_image21", "hunyuan_image", "hunyuan_image_refiner", "dc_ae"]
FAMILIES_VAE3 = ["cosmos", "magvit"]
FAMILIES = (["kl", "flux2", "wan", "qwen_image", "cogvideox", "mochi", "hunyuan_video", "ltx_video"] + FAMILIES_2025
            + FAMILIES_VAE3)
# Images / videos to encode: rows not a multiple of the encoder's downsampling (but LTX's patchify
# needs a multiple of 4; encoders that downsample by reshaping, LTX-2's, Wan 2.2's, Qwen-Image 2.1's
# and HunyuanImage's, need a multiple of it, so their pieces are uneven units instead: 5 units over
# 2 and 4 ranks), frames as each VAE takes them.
ENCODE_SHAPES = {"kl": (2, 3, 54, 36), "flux2": (2, 3, 15, 10), "wan": (1, 3, 5, 60, 40), "qwen_image": (2, 3, 1, 60, 40),
                 "cogvideox": (1, 3, 5, 60, 40), "hunyuan_video": (1, 3, 5, 60, 40), "ltx_video": (1, 3, 9, 136, 32),
                 "ltx2": (1, 3, 9, 160, 64), "wan22": (1, 3, 5, 80, 48), "qwen_image21": (2, 4, 1, 80, 48),
                 "hunyuan_image": (2, 3, 40, 24), "hunyuan_image_refiner": (1, 3, 5, 80, 32), "dc_ae": (2, 3, 36, 20),
                 "cosmos": (1, 3, 9, 40, 24), "magvit": (1, 3, 5, 20, 12)}
ENCODE_WHOLE = {"mochi": "MochiVaeAttnProcessor2_0"}  # its encoder's attention processor is not split
# Encodes on the 4-rank grids; the 2025-26 families' also on 2 ranks.
ENCODES = [(g, f) for g in GRIDS for f in FAMILIES if g != GRIDS[0] or f in FAMILIES_2025 + FAMILIES_VAE3]
# Encode pieces' unit where it is not the strided convolutions' product: a patchify (Wan 2.2's 2,
# LTX's 4 inside the encoder) or downsampling by reshaping (LTX-2's, HunyuanImage's).
ENCODE_ALIGN = {"ltx_video": 32, "ltx2": 32, "wan22": 16, "hunyuan_image": 8, "hunyuan_image_refiner": 16, "cosmos": 8}


# ---- without processes ------------------------------------------------------------------------------

def test_rows_split_and_scale():
    sizes = row_split(13, 4)
    assert sizes == [4, 3, 3, 3] and row_offsets(sizes) == [0, 4, 7, 10]
    # encode: whole units of the downsampling, the last piece also takes the rows left over
    assert aligned_split(52, 4, 8) == [16, 16, 8, 12] and aligned_split(57, 3, 8) == [24, 16, 17]
    assert aligned_split(64, 4, 8) == [16] * 4 and aligned_split(31, 4, 8) is None
    assert can_split(4, 4) and not can_split(3, 4) and not can_split(9, 1)


def test_gathered_mask_cuts_the_columns_prepare_attention_mask_appends():
    mask = torch.randn(2, 3, 5, 11)
    assert torch.equal(_gathered_mask(mask, 11, 5), mask)
    padded = torch.cat([mask, torch.zeros(2, 3, 5, 5)], -1)  # Attention.prepare_attention_mask's pad
    assert torch.equal(_gathered_mask(padded, 11, 5), mask)
    with pytest.raises(NotImplementedError, match="not the 11 keys"):
        _gathered_mask(torch.randn(2, 3, 5, 5), 11, 5)  # a mask over the local keys only


@pytest.mark.parametrize("family", FAMILIES)
def test_every_decoder_and_encoder_module_is_known(family):
    vae, _ = _vae(family)
    sites, reason = classify(vae.decoder, recipes()[type(vae)])
    assert reason is None and sites.convs and sites.row_stride == 1, reason
    if family in ("kl", "flux2", "hunyuan_video"):
        assert sites.processors, "the mid-block attention must be split"
    if family in ("wan", "qwen_image", "wan22", "qwen_image21", "hunyuan_image"):
        assert sites.forwards, "the attention block must be split"
    if family == "hunyuan_image_refiner":
        assert sites.rebound, "the mid-block attention must be split"
    if family == "dc_ae":
        assert sites.methods, "the linear attention must be split"
    if family == "cosmos":
        assert len(sites.methods) == 6, "every spatial and temporal attention takes the recipe's forward"
    if family in ("cogvideox", "mochi"):  # CogVideoXSafeConv3d chunks time by size (Note [chunked convolutions])
        safe = [c for c, _ in sites.convs if type(c).__name__ == "CogVideoXSafeConv3d"]
        assert safe and [c for c, _ in sites.chunked] == safe
    sites, reason = classify(vae.encoder, recipes()[type(vae)])
    if family in ENCODE_WHOLE:
        assert ENCODE_WHOLE[family] in reason
    else:
        assert reason is None and _alignment(vae, sites) == ENCODE_ALIGN.get(family, sites.row_stride) > 1, reason


def test_unknown_module_or_processor_makes_the_vae_decode_whole():
    from diffusers.models.attention_processor import AttnProcessor

    class Blur(nn.Module):  # mixes rows: a recipe cannot know it
        def forward(self, x):
            return x

    vae, _ = _vae("kl")
    vae.decoder.mid_block.extra = Blur()
    _, reason = classify(vae.decoder, recipes()[type(vae)])
    assert "Blur is not known to act per row" in reason
    vae, _ = _vae("kl")
    vae.decoder.mid_block.attentions[0].set_processor(AttnProcessor())
    _, reason = classify(vae.decoder, recipes()[type(vae)])
    assert "AttnProcessor2_0 splits" in reason


def test_ltx_noise_injection_is_not_split():
    from diffusers import AutoencoderKLLTX2Video, AutoencoderKLLTXVideo

    vae = AutoencoderKLLTXVideo(
        latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
        decoder_inject_noise=(True, False, False, False, False),
    )
    _, reason = classify(vae.decoder, recipes()[type(vae)])
    assert "random numbers" in reason
    vae = AutoencoderKLLTX2Video(
        latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        decoder_inject_noise=(False, False, True, False),
    )
    _, reason = classify(vae.decoder, recipes()[type(vae)])
    assert reason.startswith("up_blocks.") and "random numbers" in reason


def test_timestep_conditioned_ltx_video_decoder_splits():
    """LTX-Video 0.9.1+ decoders are timestep-conditioned: their embedders act on the timestep only."""
    from diffusers import AutoencoderKLLTXVideo

    vae = AutoencoderKLLTXVideo(
        latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1), timestep_conditioning=True,
    )
    _, reason = classify(vae.decoder, recipes()[type(vae)])
    assert reason is None


def test_cosmos_unknown_processor_or_reflecting_rows_are_not_split():
    vae, _ = _vae("cosmos")
    attention = vae.decoder.mid_block.attentions[0]
    attention.processor = type("MyProcessor", (), {"__call__": attention.processor.__call__})()
    _, reason = classify(vae.decoder, recipes()[type(vae)])
    assert reason.startswith("mid_block.attentions.0") and "MyProcessor" in reason
    vae, _ = _vae("cosmos")
    vae.decoder.conv_in.conv_s.pad_mode = "reflect"
    _, reason = classify(vae.decoder, recipes()[type(vae)])
    assert "mode 'reflect'" in reason


def test_circular_padding_is_not_split():
    from usp_dit.pipelines.vae.halo import conv_reason

    conv = nn.Conv2d(2, 2, 3, padding=1, padding_mode="circular")
    assert "circularly" in conv_reason(conv, 1, 1, "module")
    assert conv_reason(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"), 1, 1, "module") is None


# ---- on 4 ranks --------------------------------------------------------------------------------------

def _decode(vae, z, *args):
    with torch.no_grad():
        return vae.decode(z, *args).sample


def _decode_seen(vae, z, *args) -> tuple[torch.Tensor, int]:
    """The decoded sample and the most latent rows the decoder's first convolution saw in that decode."""
    seen = []
    hook = vae.decoder.conv_in.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[-2]))
    try:
        return _decode(vae, z, *args), max(seen)
    finally:
        hook.remove()


_REFS: dict = {}  # (family, rows) -> the one-process decode, shared by the grids (the same VAE and latent)


def _case(family: str, grid, rows: int | None = None) -> dict[str, float]:
    from usp_dit import init_usp
    from usp_dit.pipelines.vae import disable_parallel_vae, enable_parallel_vae

    vae, shape = _vae(family)
    if rows is not None:  # a latent of exactly ``rows`` rows (e.g. one row per rank)
        shape = shape[:-2] + (rows, shape[-1])
    z = torch.randn(shape, generator=torch.Generator().manual_seed(len(family)))
    args = DECODE_ARGS.get(family, lambda z: ())(z)
    if (family, rows) not in _REFS:
        _REFS[family, rows] = _decode(vae, z, *args)
    ref = _REFS[family, rows]
    mesh = init_usp(*grid)
    state = enable_parallel_vae(vae, mesh)
    try:
        out, seen = _decode_seen(vae, z, *args)
    finally:
        disable_parallel_vae(vae)
    parts = grid[0] * grid[1] * grid[2]
    return {
        "out": rel_err(out, ref),
        "not_split": float(state.reason is not None),
        "rows_above_share": float(seen > math.ceil(z.shape[-2] / parts)),
        "disable_not_bit_identical": float(not torch.equal(_decode(vae, z, *args), ref)),
    }


def _encode_case(family: str, grid) -> dict[str, float]:
    """``vae._encode`` (the moments: mean and log-variance) split vs whole."""
    from usp_dit import init_usp
    from usp_dit.pipelines.vae import disable_parallel_vae, enable_parallel_vae

    vae, _ = _vae(family)
    x = torch.randn(ENCODE_SHAPES.get(family, (1, 3, 7, 60, 40)), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = vae._encode(x)
        state = enable_parallel_vae(vae, init_usp(*grid))
        seen = []
        first_conv = next(m for m in vae.encoder.modules() if isinstance(m, (nn.Conv2d, nn.Conv3d)))
        hook = first_conv.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[-2]))
        try:
            out = vae._encode(x)
        finally:
            hook.remove()
            disable_parallel_vae(vae)
        again = vae._encode(x)
    if family in ENCODE_WHOLE:
        return {"split_anyway": float(state.reasons["encode"] is None), "not_bit_identical": float(not torch.equal(out, ref))}
    return {
        "out": rel_err(out, ref),
        "not_split": float(state.reasons["encode"] is not None),
        "rows_not_split": float(max(seen) >= x.shape[-2]),
        "disable_not_bit_identical": float(not torch.equal(again, ref)),
    }


def _fallbacks() -> dict[str, float]:
    """Each fallback decodes the whole latent on every rank: equal to stock bit for bit."""
    from diffusers import AutoencoderTiny

    from usp_dit import init_usp
    from usp_dit.pipelines.vae import disable_parallel_vae, enable_parallel_vae

    mesh = init_usp(2, 2)
    out = {}
    vae, _ = _vae("kl")
    z = torch.randn(1, 4, 9, 7, generator=torch.Generator().manual_seed(2))
    ref = _decode(vae, z)
    vae.enable_tiling()
    vae.tile_latent_min_size = 4  # stock tiles (blends) these latents: the split decode is untiled
    z_small = torch.randn(1, 4, 3, 9, generator=torch.Generator().manual_seed(1))  # 3 rows, 4 ranks
    ref_small = _decode(vae, z_small)  # decoded whole, as stock does: tiled
    enable_parallel_vae(vae, mesh)
    try:
        out["few_rows_not_bit_identical"] = float(not torch.equal(_decode(vae, z_small), ref_small))
        out["tiling_on_untiled_exact"] = rel_err(_decode(vae, z), ref)
        z_grad = z.clone().requires_grad_()
        vae.use_tiling = False
        out["grad_not_bit_identical"] = float(not torch.equal(vae.decode(z_grad).sample.detach(), ref))
        out.update(parity.differing_inputs_flags(vae.decode, z))
    finally:
        disable_parallel_vae(vae)
    dc = _tiny_dc_ae()  # 7 rows on 4 ranks: a piece of 1 row, thinner than its 5x5 convolutions' halo of 2
    z_dc = torch.randn(1, 4, 7, 5, generator=torch.Generator().manual_seed(4))
    ref_dc = _decode(dc, z_dc)
    state = enable_parallel_vae(dc, mesh)
    try:
        out["thin_pieces_not_bit_identical"] = float(not torch.equal(_decode(dc, z_dc), ref_dc))
        out["thin_pieces_no_reason"] = float(not any("reads 2 rows" in why for _, why in state.logged))
    finally:
        disable_parallel_vae(dc)
    tiny = AutoencoderTiny(latent_channels=4, encoder_block_out_channels=(8, 8), decoder_block_out_channels=(8, 8),
                           num_encoder_blocks=(1, 1), num_decoder_blocks=(1, 1)).eval()
    z_tiny = torch.randn(1, 4, 9, 7, generator=torch.Generator().manual_seed(3))
    ref_tiny = _decode(tiny, z_tiny)
    state = enable_parallel_vae(tiny, mesh)
    out["no_recipe_reason_missing"] = float("no parallel recipe" not in (state.reason or ""))
    out["no_recipe_not_bit_identical"] = float(not torch.equal(_decode(tiny, z_tiny), ref_tiny))
    disable_parallel_vae(tiny)
    return out


def _pipeline() -> dict[str, float]:
    """``pipe.enable_usp()`` splits the pipeline's VAE; ``parallel_vae=False`` and disable do not."""
    from usp_dit.demo.tiny_flux import tiny_flux_pipeline
    from usp_dit.pipelines.vae import is_parallel_vae_enabled

    pipe = tiny_flux_pipeline()
    seen = []
    pipe.vae.decoder.conv_in.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[-2]))

    def image():
        seen.clear()
        return pipe("a fox", height=40, width=40, num_inference_steps=2, max_sequence_length=16,
                    generator=torch.Generator().manual_seed(0), output_type="pt").images

    ref = image()
    whole = max(seen)
    pipe.enable_usp(ulysses_degree=2, ring_degree=2)
    out = {"enabled_missing": float(not is_parallel_vae_enabled(pipe.vae))}
    out["image"] = rel_err(image(), ref)
    out["rows_not_split"] = float(max(seen) > math.ceil(whole / 4))
    pipe.disable_usp()
    out["still_enabled"] = float(is_parallel_vae_enabled(pipe.vae))
    pipe.enable_usp(ulysses_degree=2, ring_degree=2, parallel_vae=False)
    image()
    out["opt_out_split"] = float(is_parallel_vae_enabled(pipe.vae) or max(seen) != whole)
    pipe.disable_usp()
    return out


def _run_all() -> dict:
    from tests.adapter_parity import record

    results: dict = {}
    for grid in GRIDS:
        for family in FAMILIES:
            record(results, f"{family}-u{grid[0]}r{grid[1]}cfg{grid[2]}", lambda: _case(family, grid))
    for grid, family in ENCODES:
        record(results, f"encode-{family}-u{grid[0]}r{grid[1]}cfg{grid[2]}", lambda: _encode_case(family, grid))
    # LTX-2's reflecting border on ranks of one latent row (the border rows come from the neighbour)
    record(results, "ltx2-one-row-each-u2r2cfg1", lambda: _case("ltx2", (2, 2, 1), rows=4))
    # DC-AE's attention in the quadratic form for the whole latent (K and V gathered)
    record(results, "dc_ae-quadratic-u2r1cfg1", lambda: _case("dc_ae", (2, 1, 1), rows=4))
    # EasyAnimate without spatial_group_norm: trilinear frame interpolation, norms over frames
    record(results, "magvit_trilinear-u2r2cfg1", lambda: _case("magvit_trilinear", (2, 2, 1)))
    record(results, "fallbacks", _fallbacks)
    record(results, "pipeline", _pipeline)
    return results


@pytest.fixture(scope="module")
def per_rank():
    return run_spawned(_run_all, WORLD)


# Extra latents: LTX-2's with one row per rank, DC-AE's whose attention takes the quadratic form;
# EasyAnimate's VAE without spatial_group_norm.
EXTRA_CASES = ["ltx2-one-row-each-u2r2cfg1", "dc_ae-quadratic-u2r1cfg1", "magvit_trilinear-u2r2cfg1"]
CASES = [f"{f}-u{u}r{r}cfg{c}" for (u, r, c) in GRIDS for f in FAMILIES] + EXTRA_CASES


@pytest.mark.parametrize("key", CASES)
def test_parallel_decode_equals_one_process(per_rank, key):
    for rank, res in enumerate(per_rank):
        errors = res[key]
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        assert errors["out"] <= TOL, f"rank {rank}: {errors}"
        assert errors == {**errors, "not_split": 0.0, "rows_above_share": 0.0, "disable_not_bit_identical": 0.0}, (
            f"rank {rank}: {errors}")


def test_enable_usp_splits_the_pipelines_vae(per_rank):
    for rank, res in enumerate(per_rank):
        checks = res["pipeline"]
        assert not isinstance(checks, str), f"rank {rank}: {checks}"
        assert checks.pop("image") <= TOL, f"rank {rank}"
        assert not any(checks.values()), f"rank {rank}: {checks}"


ENCODE_CASES = [f"encode-{f}-u{u}r{r}cfg{c}" for ((u, r, c), f) in ENCODES]


@pytest.mark.parametrize("key", ENCODE_CASES)
def test_parallel_encode_equals_one_process(per_rank, key):
    for rank, res in enumerate(per_rank):
        errors = res[key]
        assert not isinstance(errors, str), f"rank {rank}: {errors}"
        assert errors.pop("out", 0.0) <= TOL, f"rank {rank}: {errors}"
        assert not any(errors.values()), f"rank {rank}: {errors}"


def test_fallbacks_decode_whole(per_rank):
    for rank, res in enumerate(per_rank):
        checks = res["fallbacks"]
        assert not isinstance(checks, str), f"rank {rank}: {checks}"
        assert checks.pop("tiling_on_untiled_exact") <= TOL, f"rank {rank}"
        assert not any(checks.values()), f"rank {rank}: {checks}"
