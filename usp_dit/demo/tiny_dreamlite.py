"""Tiny randomly initialised DreamLite attention blocks (``DreamLiteTransformer2DModel``) and U-Nets, built in code.

Layout: a block's input (batch, CHANNELS, height, width), one token per position (``height * width``
tokens, row-major); text (batch, text_len, TEXT_DIM) with ``encoder_attention_mask`` (batch,
text_len), 1 for a real token (a prefix: valid lengths differ per element). The U-Net: latents
(batch, LATENT_CHANNELS, height, width), the same text, ``added_cond_kwargs["time_ids"]`` (batch, 6)
(DreamLite's size conditioning).

Nothing is downloaded. Every process that calls a builder with the same arguments gets
bit-identical weights and inputs; every parameter is perturbed (``tiny_video._perturb``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import DreamLiteTransformer2DModel
from diffusers.models.attention_processor import Attention
from diffusers.models.unets.unet_dreamlite import DreamLiteAttnProcessor2_0, DreamLiteUNetModel

from usp_dit.demo.tiny_video import _perturb

CHANNELS = 32  # a block's channels (its U-Net level's)
TEXT_DIM = 16  # cross_attention_dim (DreamLite: Qwen3-VL's 2048)
LATENT_CHANNELS = 4


def tiny_dreamlite(
    num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 8, num_layers: int = 2,
    use_self_attention: bool = True, use_linear_projection: bool = False, seed: int = 0,
) -> DreamLiteTransformer2DModel:
    """A small ``DreamLiteTransformer2DModel`` (``num_heads * head_dim`` = CHANNELS wide; RMS QK norm,
    GQA, feed-forward x6 as DreamLite's), float32, eval mode, with ``DreamLiteAttnProcessor2_0`` on
    every attention module as ``DreamLiteUNetModel`` installs it."""
    torch.manual_seed(seed)
    model = DreamLiteTransformer2DModel(
        num_attention_heads=num_heads, attention_head_dim=head_dim, in_channels=CHANNELS, num_layers=num_layers,
        norm_num_groups=8, cross_attention_dim=TEXT_DIM, use_linear_projection=use_linear_projection,
        use_self_attention=use_self_attention, qk_norm="rms_norm", num_kv_heads=num_kv_heads, ff_mult=6,
    )
    for module in model.modules():
        if isinstance(module, Attention):
            module.set_processor(DreamLiteAttnProcessor2_0())
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class DreamLiteInputs:
    """Keyword arguments of one ``DreamLiteTransformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, CHANNELS, H, W)
    encoder_hidden_states: torch.Tensor  # (B, T, TEXT_DIM)
    encoder_attention_mask: torch.Tensor  # (B, T) 0 / 1

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def dreamlite_inputs(height: int, width: int, valid: list[int], text_len: int = 7, seed: int = 0) -> DreamLiteInputs:
    """Seeded inputs for a ``height x width`` map, one element per entry of ``valid`` (its count of real
    text tokens, a prefix), a different map and prompt per element."""
    g = torch.Generator().manual_seed(seed)
    batch = len(valid)
    return DreamLiteInputs(
        hidden_states=torch.randn(batch, CHANNELS, height, width, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TEXT_DIM, generator=g),
        encoder_attention_mask=(torch.arange(text_len)[None, :] < torch.tensor(valid)[:, None]).long(),
    )


# ---- the U-Net the blocks live in (Note [DreamLite's pipelines]) ----------------------------------


def tiny_dreamlite_unet(seed: int = 0) -> DreamLiteUNetModel:
    """A 2-level ``DreamLiteUNetModel`` (16 and CHANNELS channels): a level without self-attention
    (DreamLite's "remove self-attention" blocks), a level and the mid block with it; separable
    convs, RMS QK norm, one kv head (DreamLite's MQA), ``time_ids`` size conditioning. Float32, eval."""
    torch.manual_seed(seed)
    unet = DreamLiteUNetModel(
        sample_size=16, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
        down_block_types=("DreamLiteCrossAttnNoSelfAttnDownBlock2D", "DreamLiteCrossAttnDownBlock2D"),
        up_block_types=("DreamLiteCrossAttnUpBlock2D", "DreamLiteCrossAttnNoSelfAttnUpBlock2D"),
        block_out_channels=(16, CHANNELS), layers_per_block=1, norm_num_groups=8, cross_attention_dim=TEXT_DIM,
        attention_head_dim=8, addition_embed_type="text_time", addition_time_embed_dim=8,
        projection_class_embeddings_input_dim=6 * 8 + TEXT_DIM, num_kv_heads=1,
    )
    _perturb(unet, seed + 1)
    return unet.eval()


def dreamlite_unet_inputs(height: int, width: int, valid: list[int], text_len: int = 7, seed: int = 0) -> dict:
    """Keyword arguments of one ``DreamLiteUNetModel`` call on a ``height x width`` latent (both even)."""
    g = torch.Generator().manual_seed(seed)
    batch = len(valid)
    text = torch.randn(batch, text_len, TEXT_DIM, generator=g)
    return {
        "sample": torch.randn(batch, LATENT_CHANNELS, height, width, generator=g),
        "timestep": torch.rand(batch, generator=g) * 1000, "encoder_hidden_states": text,
        "encoder_attention_mask": (torch.arange(text_len)[None, :] < torch.tensor(valid)[:, None]).long(),
        "added_cond_kwargs": {"text_embeds": text.mean(1), "time_ids": torch.rand(batch, 6, generator=g) * 64},
    }


def enable_usp_on_unet_blocks(unet: torch.nn.Module, mesh) -> list[DreamLiteTransformer2DModel]:
    """``usp_dit.enable_usp(block, mesh=mesh)`` on every ``DreamLiteTransformer2DModel`` of ``unet``
    (Note [DreamLite's pipelines] in ``usp_dit.pipelines.families.dreamlite``): each splits its
    tokens over ``mesh``, the rest of the U-Net runs whole on every rank. Returns the blocks, for
    ``usp_dit.disable_usp`` each."""
    from usp_dit.pipelines import enable_usp

    blocks = [m for m in unet.modules() if isinstance(m, DreamLiteTransformer2DModel)]
    for block in blocks:
        enable_usp(block, mesh=mesh)
    return blocks
