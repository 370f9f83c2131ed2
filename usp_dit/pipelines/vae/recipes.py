"""Which VAEs split, and how each of their modules takes part (Note [an exact parallel VAE]).

A recipe names, for one exact VAE class, the module whose forward is split (its ``_decode``), the
convolutions whose row padding the stock code applies itself before the call ("explicit"), the
attention sites, and the module classes known to act per row. ``classify`` walks the decoder and
sorts every module into: a convolution (halo), a GroupNorm (all-reduced statistics), an attention
(gathered K/V), known-local, or unknown — one unknown module and the VAE is not split (every rank
decodes the whole latent: Note [parallel VAE fallback]), so a module the recipe did not foresee can
never produce a wrong image.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from usp_dit.pipelines.vae.halo import PadsOf, conv_reason, module_pads

# Act on each row by itself (or on channels / time only), whatever the VAE.
GENERIC_LOCAL: tuple[type, ...] = (
    nn.SiLU, nn.GELU, nn.ReLU, nn.Mish, nn.Identity, nn.Dropout, nn.ModuleList, nn.Sequential, nn.Linear,
)


# Why a VAE class that a supported family's pipeline uses has no recipe (the fallback's message).
_AUDIO = "a 1-D audio VAE: no image rows to split (it decodes locally on every rank)"
NO_RECIPE: dict[str, str] = {
    "AutoencoderOobleck": _AUDIO, "AutoencoderSAME": _AUDIO, "LongCatAudioDiTVae": _AUDIO,
    "AutoencoderKLLTX2Audio": _AUDIO, "AutoencoderKLMiniMaxH3Audio": _AUDIO, "Cosmos3AVAEAudioTokenizer": _AUDIO,
}


@dataclass(frozen=True)
class Explicit:
    """A module that pads its convolution's input with ``F.pad`` (or a padding module) before the
    call: ``conv(module)`` is that convolution (``None``: not in this configuration), ``pads(module)``
    its ``(top, bottom, "explicit")`` at call time."""

    conv: Callable[[nn.Module], nn.Module | None]
    pads: Callable[[nn.Module], tuple[int, int, str]]


@dataclass(frozen=True)
class Recipe:
    """How one VAE class is split.

    ``explicit``: class of a module that pads its convolution's input itself -> how
    (``Explicit``). ``attention``: module class -> "processor" (a Diffusers ``Attention`` whose
    processor must be exactly ``AttnProcessor2_0``) or "forward" (a block whose own forward calls
    ``F.scaled_dot_product_attention``). ``local``: the family's module classes that act per row
    (their forward was read for this: no sums over rows, no random numbers shaped like the image),
    encoder's and decoder's. ``forward_globals``: module class -> {global name of its forward:
    replacement} (e.g. a mask builder that must see every rank's rows). ``attributes``: module
    class -> {attribute: value} set on its instances (e.g. a static mask builder its forward reads
    off ``self``). ``methods``: module class -> {method name: function(module, ...)} bound to each
    instance (e.g. a linear attention whose sums over tokens must cover every rank's tokens).
    ``chunked``: convolution classes that convolve their input in chunks cut by its size (Note
    [chunked convolutions] in ``halo``). ``calls``: the VAE's methods split, decode's and encode's
    (a VAE without Diffusers' ``_decode`` / ``_encode`` splits its public ``decode`` / ``encode``).
    """

    explicit: dict[type, Explicit] = field(default_factory=dict)
    attention: dict[type, str] = field(default_factory=dict)
    local: tuple[type, ...] = ()
    refuse: Callable[[nn.Module], str | None] = lambda module: None
    forward_globals: dict[type, dict[str, object]] = field(default_factory=dict)
    attributes: dict[type, dict[str, object]] = field(default_factory=dict)
    methods: dict[type, dict[str, Callable]] = field(default_factory=dict)
    chunked: tuple[type, ...] = ()
    calls: dict[str, str] = field(default_factory=lambda: {"decode": "_decode", "encode": "_encode"})


@dataclass
class Sites:
    """What ``classify`` found in one VAE's decoder or encoder."""

    convs: list[tuple[nn.Module, PadsOf]] = field(default_factory=list)
    chunked: list[tuple[nn.Module, PadsOf]] = field(default_factory=list)  # of ``convs``: their forward too
    norms: list[nn.GroupNorm] = field(default_factory=list)
    processors: list[nn.Module] = field(default_factory=list)
    forwards: list[nn.Module] = field(default_factory=list)
    rebound: list[tuple[nn.Module, dict[str, object]]] = field(default_factory=list)
    attributes: list[tuple[nn.Module, dict[str, object]]] = field(default_factory=list)
    methods: list[tuple[nn.Module, dict[str, Callable]]] = field(default_factory=list)
    row_stride: int = 1  # product of the row strides of the convolutions (an encoder's downsampling)
    halo: int = 1  # the most rows a split convolution reads on one side (each piece needs at least as many)


def _from_wrapper(pads: Callable[[nn.Module], tuple[int, int, str]], wrapper: nn.Module, conv: nn.Module):
    """A convolution's pads as its padding wrapper says (a ``PadsOf`` for ``halo_conv_forward``)."""
    return pads(wrapper)


def _explicit_convs(region: nn.Module, recipe: Recipe) -> dict[nn.Module, PadsOf]:
    found = {}
    for module in region.modules():
        how = recipe.explicit.get(type(module))
        conv = how.conv(module) if how is not None else None
        if conv is not None:
            found[conv] = functools.partial(_from_wrapper, how.pads, module)
    return found


def _classify_conv(conv: nn.Module, pads_of: PadsOf, sites: Sites, chunked: tuple[type, ...]) -> str | None:
    top, bottom, where = pads_of(conv)
    if conv.kernel_size[-2] == 1 and conv.stride[-2] == 1 and not (top or bottom):
        return None  # acts per row
    reason = conv_reason(conv, top, bottom, where)
    if reason:
        return reason
    sites.convs.append((conv, pads_of))
    if type(conv) in chunked:
        sites.chunked.append((conv, pads_of))
    sites.row_stride *= conv.stride[-2]
    sites.halo = max(sites.halo, top, bottom)
    return None


def _classify_attention(module: nn.Module, how: str, sites: Sites) -> str | None:
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    if how == "forward":
        sites.forwards.append(module)
    elif not isinstance(module, Attention) or type(module.processor) is not AttnProcessor2_0:
        return f"attention processor {type(module.processor).__name__} (AttnProcessor2_0 splits)"
    else:
        sites.processors.append(module)
    return None


def classify(region: nn.Module, recipe: Recipe) -> tuple[Sites | None, str | None]:
    """``(sites, None)`` when every module of ``region`` is known, else ``(None, reason)``."""
    sites, explicit = Sites(), _explicit_convs(region, recipe)
    for name, module in region.named_modules():
        cls, reason = type(module), recipe.refuse(module)
        if isinstance(module, (nn.Conv2d, nn.Conv3d)):
            reason = reason or _classify_conv(module, explicit.get(module, module_pads), sites, recipe.chunked)
        elif cls is nn.GroupNorm:
            sites.norms.append(module)
        elif cls in recipe.attention:
            reason = reason or _classify_attention(module, recipe.attention[cls], sites)
        elif isinstance(module, nn.Upsample):
            if module.mode not in ("nearest", "nearest-exact") or module.size is not None:
                reason = f"upsampling mode {module.mode!r} mixes rows"
        elif not (cls in GENERIC_LOCAL or cls in recipe.local or cls in recipe.forward_globals or cls in recipe.explicit):
            reason = reason or f"module {cls.__name__} is not known to act per row"
        if reason:
            return None, f"{name or type(region).__name__}: {reason}" if not reason.startswith(name or "\0") else reason
        if cls in recipe.forward_globals:
            sites.rebound.append((module, recipe.forward_globals[cls]))
        if cls in recipe.attributes:
            sites.attributes.append((module, recipe.attributes[cls]))
        if cls in recipe.methods:
            sites.methods.append((module, recipe.methods[cls]))
    return sites, None


# ---- the families ---------------------------------------------------------------------------------

def _own_conv(module: nn.Module) -> nn.Module:
    return module


def _child_conv(module: nn.Module) -> nn.Module:
    return module.conv


def _wan_pads(conv) -> tuple[int, int, str]:
    """WanCausalConv3d / QwenImageCausalConv3d: ``F.pad(x, self._padding)`` (zeros) before the call."""
    return conv._padding[2], conv._padding[3], "explicit"


def _causal_wrapper_pads(wrapper) -> tuple[int, int, str]:
    """CogVideoX / Mochi / HunyuanVideo causal convolutions: ``F.pad(x, time_causal_padding)``
    when they pad by replicating (``pad_mode``), else their convolution pads its rows itself."""
    if getattr(wrapper, "pad_mode", "replicate") == "replicate" or not hasattr(wrapper, "const_padding_conv3d"):
        return wrapper.time_causal_padding[2], wrapper.time_causal_padding[3], "explicit"
    return module_pads(wrapper.conv)


def _bottom_row_pads(module) -> tuple[int, int, str]:
    """A downsampler that pads one zero row below (``F.pad(x, (0, 1, 0, 1))``) before a stride-2
    convolution without padding."""
    return 0, 1, "explicit"


def _kl_downsample_conv(module) -> nn.Module | None:
    """Diffusers' ``Downsample2D`` pads itself only when its convolution has no padding."""
    return module.conv if module.use_conv and module.padding == 0 else None


def _zero_pad_conv(resample) -> nn.Module | None:
    """Wan / Qwen-Image ``Resample`` downsampling: ``Sequential(ZeroPad2d((0, 1, 0, 1)), Conv2d)``."""
    seq = getattr(resample, "resample", None)
    if isinstance(seq, nn.Sequential) and len(seq) == 2 and isinstance(seq[0], nn.ZeroPad2d):
        left, right, top, bottom = seq[0].padding
        return seq[1] if (top, bottom) == (0, 1) else None
    return None


def _noise_injection(blocks: tuple[type, ...], module: nn.Module) -> str | None:
    """LTX-Video's and LTX-2's resnet blocks with noise injection (``decoder_inject_noise``) add
    ``torch.randn(rows, width)`` drawn for the rows they see: a piece would draw a field of its own
    shape, not its rows of the whole image's field."""
    if isinstance(module, blocks) and getattr(module, "per_channel_scale1", None) is not None:
        return "noise injection draws random numbers shaped like the whole image"
    return None


def _ltx_refuse(module: nn.Module) -> str | None:
    from diffusers.models.autoencoders.autoencoder_kl_ltx import LTXVideoResnetBlock3d

    return _noise_injection((LTXVideoResnetBlock3d,), module)


def _ltx2_refuse(module: nn.Module) -> str | None:
    from diffusers.models.autoencoders.autoencoder_kl_ltx2 import LTX2VideoResnetBlock3d

    return _noise_injection((LTX2VideoResnetBlock3d,), module)


def _timestep_local() -> tuple[type, ...]:
    """The timestep embedders of a timestep-conditioned decoder (LTX-Video 0.9.1+, LTX-2): they act
    on the (batch,) timestep only; its per-channel scale and shift then act per pixel."""
    from diffusers.models.embeddings import PixArtAlphaCombinedTimestepSizeEmbeddings, TimestepEmbedding, Timesteps

    return PixArtAlphaCombinedTimestepSizeEmbeddings, TimestepEmbedding, Timesteps


def _ltx2_recipe() -> Recipe:
    """LTX-2's video VAE (``AutoencoderKLLTX2Video``; also SANA-Video 720p's and SANA-WM's).

    ``LTX2VideoCausalConv3d`` pads time itself (repeating the first / last frame: per row) and
    leaves the rows to its ``nn.Conv3d`` (``padding`` (0, 1, 1) in ``spatial_padding_mode``,
    reflect in the released decoder, zeros in its encoder): a "module" halo, the reflecting border
    read from the piece and its neighbour's rows (``halo.add_halo``). ``PerChannelRMSNorm`` and the
    shortcut's ``nn.LayerNorm`` normalise over channels (per pixel); the up / downsamplers are a
    3x3x3 convolution followed by a depth-to-space (space-to-depth) reshape that maps latent row r
    to rows 2r, 2r + 1 (and back: encode pieces are multiples of ``spatial_compression_ratio``
    rows); the decoder's unpatchify maps row r to rows 4r .. 4r + 3. The timestep conditioning
    scales and shifts channels by the (batch,) timestep's embedding. Noise injection is refused."""
    from diffusers.models.autoencoders import autoencoder_kl_ltx2 as ltx2

    return Recipe(
        local=(ltx2.LTX2VideoDecoder3d, ltx2.LTX2VideoEncoder3d, ltx2.LTX2VideoMidBlock3d, ltx2.LTX2VideoUpBlock3d,
               ltx2.LTX2VideoDownBlock3D, ltx2.LTX2VideoResnetBlock3d, ltx2.LTX2VideoUpsampler3d,
               ltx2.LTX2VideoDownsampler3d, ltx2.LTX2VideoCausalConv3d, ltx2.PerChannelRMSNorm, nn.LayerNorm)
        + _timestep_local(),
        refuse=_ltx2_refuse,
    )


def _hunyuan_image_recipes() -> dict[type, Recipe]:
    """HunyuanImage 2.1's VAE and its refiner's.

    ``AutoencoderKLHunyuanImage`` (2D): ``nn.Conv2d`` padding zeros rows itself, ``nn.GroupNorm``,
    a one-head mid-block attention calling ``F.scaled_dot_product_attention`` on (batch, rows x
    columns, channels) tokens, up / downsampling by a convolution and a pixel-(un)shuffle (row r to
    rows 2r, 2r + 1; its encoder has no strided convolution: encode pieces are multiples of
    ``spatial_compression_ratio`` rows). ``AutoencoderKLHunyuanImageRefiner`` (3D, HunyuanVideo
    1.5-like): causal convolutions padding rows by replicating (``F.pad`` before the call), RMS
    norms over channels, the same (un)shuffles, and a mid-block attention over every frame's
    tokens without a mask (``nn.functional.scaled_dot_product_attention``): the keys' order does not
    matter to it, so the gathered (rank, frame, row, column) order needs no mask."""
    from diffusers import AutoencoderKLHunyuanImage, AutoencoderKLHunyuanImageRefiner
    from diffusers.models.autoencoders import autoencoder_kl_hunyuanimage as hi
    from diffusers.models.autoencoders import autoencoder_kl_hunyuanimage_refiner as hr

    from usp_dit.pipelines.vae.attention import GATHERED_NN

    image = Recipe(
        attention={hi.HunyuanImageAttentionBlock: "forward"},
        local=(hi.HunyuanImageEncoder2D, hi.HunyuanImageDecoder2D, hi.HunyuanImageMidBlock, hi.HunyuanImageResnetBlock,
               hi.HunyuanImageDownsample, hi.HunyuanImageUpsample),
    )
    refiner = Recipe(
        explicit={hr.HunyuanImageRefinerCausalConv3d: Explicit(_child_conv, _causal_wrapper_pads)},
        local=(hr.HunyuanImageRefinerEncoder3D, hr.HunyuanImageRefinerDecoder3D, hr.HunyuanImageRefinerMidBlock,
               hr.HunyuanImageRefinerDownBlock3D, hr.HunyuanImageRefinerUpBlock3D, hr.HunyuanImageRefinerResnetBlock,
               hr.HunyuanImageRefinerRMS_norm, hr.HunyuanImageRefinerUpsampleDCAE,
               hr.HunyuanImageRefinerDownsampleDCAE),
        forward_globals={hr.HunyuanImageRefinerAttnBlock: {"nn": GATHERED_NN}},
    )
    return {AutoencoderKLHunyuanImage: image, AutoencoderKLHunyuanImageRefiner: refiner}


def _dc_refuse(module: nn.Module) -> str | None:
    from diffusers.models.attention_processor import SanaMultiscaleAttnProcessor2_0, SanaMultiscaleLinearAttention
    from diffusers.models.autoencoders.autoencoder_dc import DCUpBlock2d

    if isinstance(module, DCUpBlock2d) and module.interpolate and module.interpolation_mode not in ("nearest",
                                                                                                   "nearest-exact"):
        return f"upsampling mode {module.interpolation_mode!r} mixes rows"
    stock_processor = SanaMultiscaleAttnProcessor2_0
    if isinstance(module, SanaMultiscaleLinearAttention) and type(module.processor) is not stock_processor:
        return f"attention processor {type(module.processor).__name__} (SanaMultiscaleAttnProcessor2_0 splits)"
    if isinstance(module, nn.BatchNorm2d) and (module.training or not module.track_running_stats):
        return "a BatchNorm2d in training mode normalises with the statistics of the rows it sees (call vae.eval())"
    return None


def _dc_recipe() -> Recipe:
    """DC-AE (``AutoencoderDC``: Sana, PRX, SANA-Video), 2D.

    ``nn.Conv2d`` padding zeros rows itself (3x3 and the multiscale projections' depthwise 5x5: a
    halo of 2 rows; the encoder's "Conv" downsampling is one of stride 2); RMS norms over channels
    and BatchNorm2d with running statistics (per channel) act per pixel; up / downsampling by a
    pixel-(un)shuffle or nearest interpolation (row r to rows 2r, 2r + 1; encode pieces are
    multiples of ``spatial_compression_ratio`` rows). The EfficientViT blocks' ReLU linear
    attention sums over every token once: that sum is all-reduced (``attention.linear_attention``,
    Note [DC-AE attention path])."""
    from diffusers.models import normalization
    from diffusers.models.attention_processor import SanaMultiscaleAttentionProjection, SanaMultiscaleLinearAttention
    from diffusers.models.autoencoders import autoencoder_dc as dc

    from usp_dit.pipelines.vae.attention import linear_attention, quadratic_attention

    return Recipe(
        local=(dc.Encoder, dc.Decoder, dc.ResBlock, dc.EfficientViTBlock, dc.DCDownBlock2d, dc.DCUpBlock2d,
               dc.GLUMBConv, SanaMultiscaleAttentionProjection, SanaMultiscaleLinearAttention, normalization.RMSNorm,
               nn.BatchNorm2d, nn.ReLU6),
        refuse=_dc_refuse,
        methods={SanaMultiscaleLinearAttention: {"apply_linear_attention": linear_attention,
                                                 "apply_quadratic_attention": quadratic_attention}},
    )


def _cosmos_conv(conv: nn.Module) -> nn.Module | None:
    """A ``CosmosCausalConv3d`` that pads rows itself (``F.pad(x, spatial_pad)`` before its own call)."""
    return conv if conv.spatial_pad[2] or conv.spatial_pad[3] else None


def _cosmos_pads(conv) -> tuple[int, int, str]:
    return conv.spatial_pad[2], conv.spatial_pad[3], "explicit"


def _cosmos_downsample_conv(module) -> nn.Module | None:
    """``CosmosDownsample3d``: ``F.pad(x, (0, 1, 0, 1, 0, 0))`` (one zero row below) before its
    stride-2 (1, 3, 3) convolution without padding."""
    return module.conv1 if module.spatial_downsample else None


def _cosmos_refuse(module: nn.Module) -> str | None:
    from diffusers.models.autoencoders import autoencoder_kl_cosmos as cosmos

    stock = (cosmos.CosmosSpatialAttentionProcessor2_0, cosmos.CosmosTemporalAttentionProcessor2_0)
    if isinstance(module, cosmos.CosmosCausalAttention) and type(module.processor) not in stock:
        return f"attention processor {type(module.processor).__name__} (Cosmos' spatial and temporal 2.0 ones split)"
    if isinstance(module, cosmos.CosmosCausalConv3d) and any(module.spatial_pad) and module.pad_mode not in (
            "constant", "replicate"):
        return f"a CosmosCausalConv3d padding rows with mode {module.pad_mode!r} (its border reads rows of the piece)"
    if isinstance(module, (cosmos.CosmosPatchEmbed3d, cosmos.CosmosUnpatcher3d)) and module.patch_method not in (
            "haar", "rearrange"):
        return f"patch method {module.patch_method!r}"
    return None


def _cosmos_recipe() -> Recipe:
    """Cosmos 1's tokenizer (``AutoencoderKLCosmos``: the Cosmos 1 Diffusion pipelines; Predict2
    and 2.5 decode with Wan 2.1's VAE).

    ``CosmosCausalConv3d`` pads time by repeating the first frame (per row) and rows with
    ``F.pad(x, spatial_pad)`` (zeros) before its own call: an "explicit" halo; the encoder's
    ``CosmosDownsample3d`` pads one zero row below before its stride-2 convolution, and its
    average pool (2x2, stride 2) on a piece of an even number of rows never reads that row.
    ``CosmosCausalGroupNorm`` is an ``nn.GroupNorm`` (over each frame's channels and pixels, or
    over every frame): all-reduced statistics. The upsampler repeats each row twice (row r to rows
    2r, 2r + 1). The Haar wavelet (un)patcher: the inverse transform is a transposed convolution
    with kernel = stride = 2 per level (row r to rows 2r, 2r + 1, no overlap); the forward one
    reflect-pads one row below and convolves with kernel = stride = 2, which on a piece of an even
    number of rows never reads the pad (encode pieces are multiples of ``patch_size`` times the
    downsampling: ``patch.py``'s alignment); "rearrange" is a reshape. Attention: the spatial
    processor over every rank's rows (``attention.cosmos_attention_forward``), the temporal one
    over one pixel's frames (per row)."""
    from diffusers.models.autoencoders import autoencoder_kl_cosmos as cosmos

    from usp_dit.pipelines.vae.attention import cosmos_attention_forward

    return Recipe(
        explicit={cosmos.CosmosCausalConv3d: Explicit(_cosmos_conv, _cosmos_pads),
                  cosmos.CosmosDownsample3d: Explicit(_cosmos_downsample_conv, _bottom_row_pads)},
        local=(cosmos.CosmosEncoder3d, cosmos.CosmosDecoder3d, cosmos.CosmosMidBlock3d, cosmos.CosmosUpBlock3d,
               cosmos.CosmosDownBlock3d, cosmos.CosmosResnetBlock3d, cosmos.CosmosConvProjection3d,
               cosmos.CosmosCausalGroupNorm, cosmos.CosmosUpsample3d, cosmos.CosmosPatchEmbed3d,
               cosmos.CosmosUnpatcher3d, cosmos.CosmosCausalAttention),
        refuse=_cosmos_refuse,
        methods={cosmos.CosmosCausalAttention: {"forward": cosmos_attention_forward}},
    )


def _magvit_recipe() -> Recipe:
    """EasyAnimate's VAE (``AutoencoderKLMagvit``).

    ``EasyAnimateCausalConv3d`` is an ``nn.Conv3d`` padding rows itself (zeros: a "module" halo);
    its causal time padding and frame cache (``prev_features``, the framewise decode's previous
    frames) hold each rank's own rows of earlier frames, and it convolves one window of frames a
    call (every rank the same windows: the halo exchanges pair up). The downsampler pads one zero
    row below (``F.pad(x, (0, 1, 0, 1))``) before its stride-2 convolution. ``nn.GroupNorm``
    (per frame with ``spatial_group_norm``, else over the frames of a call): all-reduced
    statistics. The upsampler interpolates rows by "nearest" x2 (row r to rows 2r, 2r + 1) and
    frames by "nearest" or "trilinear" x2 with the rows' scale 1: row r's source is r itself
    (align_corners=False: (r + 0.5) - 0.5) with weight 1 and row r + 1 with weight 0, so a piece's
    last row (whose r + 1 the kernel clamps to itself) gets the same value for finite
    activations. No attention."""
    from diffusers.models.autoencoders import autoencoder_kl_magvit as magvit

    return Recipe(
        explicit={magvit.EasyAnimateDownsampler3D: Explicit(_child_conv, _bottom_row_pads)},
        local=(magvit.EasyAnimateEncoder, magvit.EasyAnimateDecoder, magvit.EasyAnimateMidBlock3d,
               magvit.EasyAnimateUpBlock3d, magvit.EasyAnimateDownBlock3D, magvit.EasyAnimateResidualBlock3D,
               magvit.EasyAnimateUpsampler3D),
    )


def _height_pads(conv) -> tuple[int, int, str]:
    """``Kandinsky6SRCausalConv3d``: ``F.pad`` of ``height_pad`` zero rows each side before its call."""
    return conv.height_pad, conv.height_pad, "explicit"


def _kandinsky6_sr_recipe() -> Recipe:
    """Kandinsky 6 SR's K-VAE (``Kandinsky6SRVAE``), 16x in space, 4x in time; no attention, no GroupNorm.

    Its public ``decode`` / ``encode`` run time segments of 16 frames through one cache dict of
    each causal convolution's carried frames: on a piece, the cache holds the rank's own rows,
    and every rank runs the same segments (they depend on the frame count alone), so the halo
    exchanges pair up. ``Kandinsky6SRCausalConv3d`` pads rows with zeros by ``F.pad`` before its
    ``Kandinsky6SRSafeConv3d`` (an "explicit" halo); the up / downsamplers' (1, 3, 3) spatial
    convolutions pad their rows themselves (a "module" halo; stride 2 in the encoder). Every
    ``Kandinsky6SRSafeConv3d`` cuts large inputs into time chunks by its element count (Note
    [chunked convolutions]). ``Kandinsky6VAERMSNorm`` normalises over channels (per pixel); the
    decoder's spatial norm nearest-interpolates the latent piece to the piece's rows (an integer
    factor 2^k: latent row r to rows 2^k r .. 2^k r + 2^k - 1); the upsampler repeats rows (nearest
    x2); the downsampler's pixel-unshuffle averages 2 x 2 pixels (encode pieces are multiples of
    ``spatial_compression_ratio`` rows) and its temporal pooling acts per pixel."""
    from diffusers.models.autoencoders import autoencoder_kandinsky6_sr as k6

    return Recipe(
        explicit={k6.Kandinsky6SRCausalConv3d: Explicit(_child_conv, _height_pads)},
        local=(k6.Kandinsky6SREncoder3D, k6.Kandinsky6SRDecoder3D, k6.Kandinsky6SRResnetBlock3D,
               k6.Kandinsky6SRSpatialNorm3D, k6.Kandinsky6VAERMSNorm, k6.Kandinsky6SRUpsample,
               k6.Kandinsky6SRDownsample, nn.PixelUnshuffle, nn.Module),  # nn.Module: the plain `mid` / `up` holders
        chunked=(k6.Kandinsky6SRSafeConv3d,),
        calls={"decode": "decode", "encode": "encode"},
    )


@functools.cache
def recipes() -> dict[type, Recipe]:
    """Exact VAE class -> recipe (imports the Diffusers autoencoders on first use; built once)."""
    from diffusers import (
        AutoencoderDC,
        AutoencoderKL,
        AutoencoderKLCogVideoX,
        AutoencoderKLCosmos,
        AutoencoderKLFlux2,
        AutoencoderKLHunyuanVideo,
        AutoencoderKLHunyuanVideo15,
        AutoencoderKLLTX2Video,
        AutoencoderKLLTXVideo,
        AutoencoderKLMagvit,
        AutoencoderKLMochi,
        AutoencoderKLQwenImage,
        AutoencoderKLQwenImage21,
        AutoencoderKLWan,
        Kandinsky6SRVAE,
    )
    from diffusers.models import downsampling, normalization, resnet, upsampling
    from diffusers.models.attention_processor import Attention
    from diffusers.models.autoencoders import (
        autoencoder_kl_cogvideox as cog,
    )
    from diffusers.models.autoencoders import (
        autoencoder_kl_hunyuan_video as hy,
    )
    from diffusers.models.autoencoders import (
        autoencoder_kl_hunyuanvideo15 as hy15,
    )
    from diffusers.models.autoencoders import (
        autoencoder_kl_ltx as ltx,
    )
    from diffusers.models.autoencoders import (
        autoencoder_kl_mochi as mochi,
    )
    from diffusers.models.autoencoders import (
        autoencoder_kl_qwenimage as qwen,
    )
    from diffusers.models.autoencoders import (
        autoencoder_kl_qwenimage21 as qwen21,
    )
    from diffusers.models.autoencoders import (
        autoencoder_kl_wan as wan,
    )
    from diffusers.models.autoencoders import (
        vae,
    )
    from diffusers.models.unets import unet_2d_blocks

    from usp_dit.pipelines.vae.attention import GATHERED_NN, hunyuan_causal_mask

    causal = Explicit(_child_conv, _causal_wrapper_pads)
    kl = Recipe(
        explicit={downsampling.Downsample2D: Explicit(_kl_downsample_conv, _bottom_row_pads)},
        attention={Attention: "processor"},
        local=(vae.Decoder, vae.Encoder, unet_2d_blocks.UNetMidBlock2D, unet_2d_blocks.UpDecoderBlock2D,
               unet_2d_blocks.DownEncoderBlock2D, resnet.ResnetBlock2D, upsampling.Upsample2D),
    )
    wan_like = {
        wan: (wan.WanCausalConv3d, wan.WanAttentionBlock, wan.WanResample),
        qwen: (qwen.QwenImageCausalConv3d, qwen.QwenImageAttentionBlock, qwen.QwenImageResample),
        # Qwen-Image 2.1: Wan 2.2's blocks (residual up / down blocks, DupUp3D / AvgDown3D
        # pixel-(un)shuffles, patchify) with 2D convolutions padding rows by F.pad before the call
        qwen21: (qwen21.QwenImage21CausalConv3d, qwen21.QwenImage21AttentionBlock, qwen21.QwenImage21Resample),
    }

    def wan_recipe(module, local: tuple[type, ...]) -> Recipe:
        conv, attention, resample = wan_like[module]
        return Recipe(
            explicit={conv: Explicit(_own_conv, _wan_pads), resample: Explicit(_zero_pad_conv, _bottom_row_pads)},
            attention={attention: "forward"}, local=local + (nn.ZeroPad2d,),
        )

    wan_local = tuple(getattr(wan, n) for n in (
        "WanDecoder3d", "WanEncoder3d", "WanMidBlock", "WanResidualBlock", "WanUpBlock", "WanResidualUpBlock",
        "WanResidualDownBlock", "WanUpsample", "WanRMS_norm", "DupUp3D", "AvgDown3D") if hasattr(wan, n))
    qwen21_local = tuple(getattr(qwen21, f"QwenImage21{n}") for n in (
        "Decoder3d", "Encoder3d", "MidBlock", "ResidualBlock", "UpBlock", "ResidualUpBlock", "ResidualDownBlock",
        "Upsample", "RMS_norm", "DupUp3D", "AvgDown3D"))
    qwen_local = (qwen.QwenImageDecoder3d, qwen.QwenImageEncoder3d, qwen.QwenImageMidBlock, qwen.QwenImageResidualBlock,
                  qwen.QwenImageUpBlock, qwen.QwenImageUpsample, qwen.QwenImageRMS_norm)
    cog_recipe = Recipe(
        explicit={cog.CogVideoXCausalConv3d: causal,
                  downsampling.CogVideoXDownsample3D: Explicit(_child_conv, _bottom_row_pads)},
        local=(cog.CogVideoXDecoder3D, cog.CogVideoXEncoder3D, cog.CogVideoXMidBlock3D, cog.CogVideoXUpBlock3D,
               cog.CogVideoXDownBlock3D, cog.CogVideoXResnetBlock3D, cog.CogVideoXSpatialNorm3D,
               upsampling.CogVideoXUpsample3D),
        chunked=(cog.CogVideoXSafeConv3d,),
    )
    mochi_recipe = Recipe(
        explicit={cog.CogVideoXCausalConv3d: causal},
        attention={Attention: "processor"},
        local=(mochi.MochiDecoder3D, mochi.MochiEncoder3D, mochi.MochiMidBlock3D, mochi.MochiUpBlock3D,
               mochi.MochiDownBlock3D, mochi.MochiResnetBlock3D, mochi.MochiChunkedGroupNorm3D,
               mochi.FourierFeatures, normalization.LpNorm),
        chunked=(cog.CogVideoXSafeConv3d,),
    )
    hunyuan_recipe = Recipe(
        explicit={hy.HunyuanVideoCausalConv3d: causal},
        attention={Attention: "processor"},
        local=(hy.HunyuanVideoDecoder3D, hy.HunyuanVideoEncoder3D, hy.HunyuanVideoUpBlock3D, hy.HunyuanVideoDownBlock3D,
               hy.HunyuanVideoResnetBlockCausal3D, hy.HunyuanVideoUpsampleCausal3D, hy.HunyuanVideoDownsampleCausal3D),
        forward_globals={hy.HunyuanVideoMidBlock3D: {"prepare_causal_attention_mask": hunyuan_causal_mask}},
    )
    # HunyuanVideo 1.5: causal convolutions padding by replicating; RMS norms over channels (per
    # pixel); up / downsampling by a convolution and a pixel-(un)shuffle that maps row r to rows
    # 2r, 2r + 1 (and back: encode pieces are multiples of spatial_compression_ratio rows); the
    # mid-block attention calls ``nn.functional.scaled_dot_product_attention`` with a frame-causal
    # mask from ``self.prepare_causal_attention_mask`` (a staticmethod: replaced on the instance).
    hy15_mask = functools.partial(hunyuan_causal_mask, stock=hy15.HunyuanVideo15AttnBlock.prepare_causal_attention_mask)
    hunyuan15_recipe = Recipe(
        explicit={hy15.HunyuanVideo15CausalConv3d: causal},
        local=(hy15.HunyuanVideo15Decoder3D, hy15.HunyuanVideo15Encoder3D, hy15.HunyuanVideo15UpBlock3D,
               hy15.HunyuanVideo15DownBlock3D, hy15.HunyuanVideo15MidBlock, hy15.HunyuanVideo15ResnetBlock,
               hy15.HunyuanVideo15RMS_norm, hy15.HunyuanVideo15Upsample, hy15.HunyuanVideo15Downsample),
        forward_globals={hy15.HunyuanVideo15AttnBlock: {"nn": GATHERED_NN}},
        attributes={hy15.HunyuanVideo15AttnBlock: {"prepare_causal_attention_mask": hy15_mask}},
    )
    ltx_recipe = Recipe(
        local=(ltx.LTXVideoDecoder3d, ltx.LTXVideoEncoder3d, ltx.LTXVideoMidBlock3d, ltx.LTXVideoUpBlock3d,
               ltx.LTXVideoDownBlock3D, ltx.LTXVideoResnetBlock3d, ltx.LTXVideoUpsampler3d, ltx.LTXVideoCausalConv3d,
               normalization.RMSNorm, nn.LayerNorm)  # both over channels moved last (per pixel)
        + _timestep_local(),
        refuse=_ltx_refuse,
    )
    return {
        AutoencoderKL: kl, AutoencoderKLFlux2: kl, AutoencoderKLWan: wan_recipe(wan, wan_local),
        AutoencoderKLQwenImage: wan_recipe(qwen, qwen_local), AutoencoderKLCogVideoX: cog_recipe,
        AutoencoderKLMochi: mochi_recipe, AutoencoderKLHunyuanVideo: hunyuan_recipe,
        AutoencoderKLHunyuanVideo15: hunyuan15_recipe, AutoencoderKLLTXVideo: ltx_recipe,
        AutoencoderKLLTX2Video: _ltx2_recipe(), AutoencoderKLQwenImage21: wan_recipe(qwen21, qwen21_local),
        AutoencoderDC: _dc_recipe(), **_hunyuan_image_recipes(),
        AutoencoderKLCosmos: _cosmos_recipe(), AutoencoderKLMagvit: _magvit_recipe(),
        Kandinsky6SRVAE: _kandinsky6_sr_recipe(),
    }
