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

from usp_dit.pipelines.vae.halo import PadsOf, module_pads

# Act on each row by itself (or on channels / time only), whatever the VAE.
GENERIC_LOCAL: tuple[type, ...] = (
    nn.SiLU, nn.GELU, nn.ReLU, nn.Mish, nn.Identity, nn.Dropout, nn.ModuleList, nn.Sequential, nn.Linear,
)


@dataclass(frozen=True)
class Recipe:
    """How one VAE class is split.

    ``explicit``: class of a module that pads its convolution's input with ``F.pad`` -> a function
    giving that convolution's ``(top, bottom, where)`` at call time (the convolution is the module
    itself when it is an ``nn.Conv*``, else its ``conv`` child). ``attention``: module class ->
    "processor" (a Diffusers ``Attention`` whose processor must be exactly ``AttnProcessor2_0``) or
    "forward" (a block whose own forward calls ``F.scaled_dot_product_attention``). ``local``: the
    family's module classes that act per row (their forward was read for this: no sums over rows,
    no random numbers shaped like the image). ``forward_globals``: module class -> {global name of
    its forward: replacement} (e.g. a mask builder that must see every rank's rows).
    """

    region: str = "decoder"
    explicit: dict[type, PadsOf] = field(default_factory=dict)
    attention: dict[type, str] = field(default_factory=dict)
    local: tuple[type, ...] = ()
    refuse: Callable[[nn.Module], str | None] = lambda module: None
    forward_globals: dict[type, dict[str, object]] = field(default_factory=dict)


@dataclass
class Sites:
    """What ``classify`` found in one VAE's decoder."""

    convs: list[tuple[nn.Module, PadsOf]] = field(default_factory=list)
    norms: list[nn.GroupNorm] = field(default_factory=list)
    processors: list[nn.Module] = field(default_factory=list)
    forwards: list[nn.Module] = field(default_factory=list)
    rebound: list[tuple[nn.Module, dict[str, object]]] = field(default_factory=list)


def _from_wrapper(pads: Callable[[nn.Module], tuple[int, int, str]], wrapper: nn.Module, conv: nn.Module):
    """A convolution's pads as its padding wrapper says (a ``PadsOf`` for ``halo_conv_forward``)."""
    return pads(wrapper)


def _conv_of(module: nn.Module) -> nn.Module:
    return module if isinstance(module, (nn.Conv2d, nn.Conv3d)) else module.conv


def classify(region: nn.Module, recipe: Recipe) -> tuple[Sites | None, str | None]:
    """``(sites, None)`` when every module of ``region`` is known, else ``(None, reason)``."""
    from diffusers.models.attention_processor import Attention, AttnProcessor2_0

    sites, explicit = Sites(), {}
    for module in region.modules():
        if type(module) in recipe.explicit:
            explicit[_conv_of(module)] = functools.partial(_from_wrapper, recipe.explicit[type(module)], module)
    for name, module in region.named_modules():
        cls = type(module)
        reason = recipe.refuse(module)
        if reason:
            return None, f"{name or cls.__name__}: {reason}"
        if isinstance(module, (nn.Conv2d, nn.Conv3d)):
            pads_of = explicit.get(module, module_pads)
            top, bottom, _ = pads_of(module)
            if module.kernel_size[-2] > 1 or top or bottom:
                sites.convs.append((module, pads_of))
            elif module.stride[-2] != 1:
                return None, f"{name}: a convolution with row stride {module.stride[-2]}"
        elif cls is nn.GroupNorm:
            sites.norms.append(module)
        elif cls in recipe.attention:
            if recipe.attention[cls] == "processor":
                if not isinstance(module, Attention) or type(module.processor) is not AttnProcessor2_0:
                    return None, f"{name}: attention processor {type(module.processor).__name__} (AttnProcessor2_0 splits)"
                sites.processors.append(module)
            else:
                sites.forwards.append(module)
        elif isinstance(module, nn.Upsample):
            if module.mode not in ("nearest", "nearest-exact") or module.size is not None:
                return None, f"{name}: upsampling mode {module.mode!r} mixes rows"
        elif not (cls in GENERIC_LOCAL or cls in recipe.local or cls in recipe.forward_globals or cls in recipe.explicit):
            return None, f"{name or 'the decoder'}: module {cls.__name__} is not known to act per row"
        if cls in recipe.forward_globals:
            sites.rebound.append((module, recipe.forward_globals[cls]))
    return sites, None


# ---- the families ---------------------------------------------------------------------------------

def _wan_pads(conv) -> tuple[int, int, str]:
    """WanCausalConv3d / QwenImageCausalConv3d: ``F.pad(x, self._padding)`` (zeros) before the call."""
    return conv._padding[2], conv._padding[3], "explicit"


def _causal_wrapper_pads(wrapper) -> tuple[int, int, str]:
    """CogVideoX / Mochi / HunyuanVideo causal convolutions: ``F.pad(x, time_causal_padding)``
    when they pad by replicating (``pad_mode``), else their convolution pads its rows itself."""
    if getattr(wrapper, "pad_mode", "replicate") == "replicate" or not hasattr(wrapper, "const_padding_conv3d"):
        return wrapper.time_causal_padding[2], wrapper.time_causal_padding[3], "explicit"
    return module_pads(wrapper.conv)


def _ltx_refuse(module: nn.Module) -> str | None:
    from diffusers.models.autoencoders.autoencoder_kl_ltx import LTXVideoResnetBlock3d

    if isinstance(module, LTXVideoResnetBlock3d) and getattr(module, "per_channel_scale1", None) is not None:
        return "noise injection draws random numbers shaped like the whole image"
    return None


def recipes() -> dict[type, Recipe]:
    """Exact VAE class -> recipe (imports the Diffusers autoencoders on first use)."""
    from diffusers import (
        AutoencoderKL, AutoencoderKLCogVideoX, AutoencoderKLFlux2, AutoencoderKLHunyuanVideo, AutoencoderKLLTXVideo, AutoencoderKLMochi,
        AutoencoderKLQwenImage, AutoencoderKLWan,
    )
    from diffusers.models.attention_processor import Attention
    from diffusers.models.autoencoders import (
        autoencoder_kl_cogvideox as cog, autoencoder_kl_hunyuan_video as hy, autoencoder_kl_ltx as ltx,
        autoencoder_kl_mochi as mochi, autoencoder_kl_qwenimage as qwen, autoencoder_kl_wan as wan, vae,
    )
    from diffusers.models import normalization, resnet, upsampling
    from diffusers.models.unets import unet_2d_blocks

    from usp_dit.pipelines.vae.attention import hunyuan_causal_mask

    kl = Recipe(
        attention={Attention: "processor"},
        local=(vae.Decoder, unet_2d_blocks.UNetMidBlock2D, unet_2d_blocks.UpDecoderBlock2D, resnet.ResnetBlock2D,
               upsampling.Upsample2D),
    )
    wan_recipe = Recipe(
        explicit={wan.WanCausalConv3d: _wan_pads},
        attention={wan.WanAttentionBlock: "forward"},
        local=(wan.WanDecoder3d, wan.WanMidBlock, wan.WanResidualBlock, wan.WanUpBlock, wan.WanResample,
               wan.WanUpsample, wan.WanRMS_norm, getattr(wan, "WanResidualUpBlock", wan.WanUpBlock),
               getattr(wan, "DupUp3D", wan.WanUpBlock)),
    )
    qwen_recipe = Recipe(
        explicit={qwen.QwenImageCausalConv3d: _wan_pads},
        attention={qwen.QwenImageAttentionBlock: "forward"},
        local=(qwen.QwenImageDecoder3d, qwen.QwenImageMidBlock, qwen.QwenImageResidualBlock, qwen.QwenImageUpBlock,
               qwen.QwenImageResample, qwen.QwenImageUpsample, qwen.QwenImageRMS_norm),
    )
    cog_recipe = Recipe(
        explicit={cog.CogVideoXCausalConv3d: _causal_wrapper_pads},
        local=(cog.CogVideoXDecoder3D, cog.CogVideoXMidBlock3D, cog.CogVideoXUpBlock3D, cog.CogVideoXResnetBlock3D,
               cog.CogVideoXSpatialNorm3D, cog.CogVideoXSafeConv3d, upsampling.CogVideoXUpsample3D),
    )
    mochi_recipe = Recipe(
        explicit={cog.CogVideoXCausalConv3d: _causal_wrapper_pads},
        attention={Attention: "processor"},
        local=(mochi.MochiDecoder3D, mochi.MochiMidBlock3D, mochi.MochiUpBlock3D, mochi.MochiResnetBlock3D,
               mochi.MochiChunkedGroupNorm3D, cog.CogVideoXSafeConv3d),
    )
    hunyuan_recipe = Recipe(
        explicit={hy.HunyuanVideoCausalConv3d: _causal_wrapper_pads},
        attention={Attention: "processor"},
        local=(hy.HunyuanVideoDecoder3D, hy.HunyuanVideoUpBlock3D, hy.HunyuanVideoResnetBlockCausal3D,
               hy.HunyuanVideoUpsampleCausal3D),
        forward_globals={hy.HunyuanVideoMidBlock3D: {"prepare_causal_attention_mask": hunyuan_causal_mask}},
    )
    ltx_recipe = Recipe(
        local=(ltx.LTXVideoDecoder3d, ltx.LTXVideoMidBlock3d, ltx.LTXVideoUpBlock3d, ltx.LTXVideoResnetBlock3d,
               ltx.LTXVideoUpsampler3d, ltx.LTXVideoCausalConv3d, normalization.RMSNorm),
        refuse=_ltx_refuse,
    )
    return {
        AutoencoderKL: kl, AutoencoderKLFlux2: kl, AutoencoderKLWan: wan_recipe, AutoencoderKLQwenImage: qwen_recipe,
        AutoencoderKLCogVideoX: cog_recipe, AutoencoderKLMochi: mochi_recipe,
        AutoencoderKLHunyuanVideo: hunyuan_recipe, AutoencoderKLLTXVideo: ltx_recipe,
    }
