"""Tiny randomly initialised Wan 2.1 / 2.2 transformers and pipelines, for tests and the video example.

Layout: latents (batch, channels, frames, height, width); text embeddings (batch, text_seq,
text_dim); CLIP image embeddings (batch, image_seq, image_dim); timestep (batch,) or, for
Wan 2.2 TI2V-5B, one per token (batch, tokens).

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import WanTransformer3DModel

from usp_dit.demo.tiny_video import TEXT_DIM, _perturb, tiny_t5

# Wan's stock processor takes the image tokens to be everything before the last 512 context tokens
# (``WanAttnProcessor``: "512 is the context length of the text encoder, hardcoded for now"), so
# the I2V variants must be called with exactly 512 text tokens.
I2V_TEXT_LEN = 512
LATENT_CHANNELS = 4  # the tiny stand-in for the real VAE's 16 (Wan 2.1, 2.2 A14B); 12 for TI2V's 48

# Variants of the family, each a tiny version of a released checkpoint's config (ratios kept:
# channels /4, width 64 = 4 heads x 16, added K/V width = model width as in the real I2V).
WAN_VARIANTS = {
    # Wan 2.1 T2V 1.3B / 14B, and each expert of Wan 2.2 T2V-A14B: 16 latent channels in and out.
    "t2v": dict(in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS),
    # Wan 2.1 I2V 14B: CLIP image embeddings (image_dim 1280) through the added K/V cross-attention;
    # noise, mask and image latents concatenated on channels (16 + 4 + 16 = 36 in, 16 out).
    "i2v": dict(in_channels=3 * LATENT_CHANNELS, out_channels=LATENT_CHANNELS, image_dim=24, added_kv_proj_dim=64),
    # Wan 2.2 TI2V-5B: the 48-channel VAE's latents in and out, and one timestep per token.
    "ti2v-5b": dict(in_channels=3 * LATENT_CHANNELS, out_channels=3 * LATENT_CHANNELS),
}


def tiny_wan(variant: str = "t2v", num_heads: int = 4, head_dim: int = 16, seed: int = 0) -> WanTransformer3DModel:
    """A 2-layer ``WanTransformer3DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    Every parameter is perturbed with seeded noise (``tiny_video._perturb``): no norm weight or
    bias keeps a default constant that could hide a token on the wrong rank.

    Raises:
        ValueError: ``variant`` is not one of ``WAN_VARIANTS``.
    """
    if variant not in WAN_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(WAN_VARIANTS)}, got {variant!r}")
    config = dict(
        patch_size=(1, 2, 2), num_attention_heads=num_heads, attention_head_dim=head_dim, text_dim=TEXT_DIM,
        freq_dim=16, ffn_dim=96, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32,
    )
    config.update(WAN_VARIANTS[variant])
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**config)
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class WanInputs:
    """Keyword arguments of one ``WanTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, C, F, H, W)
    timestep: torch.Tensor  # (B,), or (B, tokens) for TI2V-5B
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    encoder_hidden_states_image: torch.Tensor | None = None  # (B, image_seq, image_dim), I2V only

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def wan_tokens(model: WanTransformer3DModel, frames: int, height: int, width: int) -> int:
    """Video tokens of a latent of this size: frames/p_t * height/p_h * width/p_w."""
    p_t, p_h, p_w = model.config.patch_size
    return (frames // p_t) * (height // p_h) * (width // p_w)


def wan_inputs(
    model: WanTransformer3DModel, frames: int, height: int, width: int, batch: int = 2, text_len: int = 9,
    image_len: int = 5, per_token_timestep: bool = False, seed: int = 0,
) -> WanInputs:
    """Seeded inputs for ``model`` (latent sizes); a different prompt and timestep per batch element.

    I2V models (``image_dim`` set) get ``image_len`` image tokens and ``I2V_TEXT_LEN`` text tokens
    (``text_len`` is ignored for them). ``per_token_timestep``: TI2V-5B's (B, tokens) timestep, random
    per token (the pipeline's is 0 on the first latent frame and t elsewhere: random rows catch a
    timestep sliced unlike the tokens), with frame 0 at 0 as in the pipeline.
    """
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg.in_channels, frames, height, width, generator=g)
    text_len = I2V_TEXT_LEN if cfg.image_dim else text_len
    text = torch.randn(batch, text_len, cfg.text_dim, generator=g)
    image = torch.randn(batch, image_len, cfg.image_dim, generator=g) if cfg.image_dim else None
    if per_token_timestep:
        timestep = torch.rand(batch, wan_tokens(model, frames, height, width), generator=g) * 1000
        timestep[:, : (height // cfg.patch_size[1]) * (width // cfg.patch_size[2])] = 0.0  # first latent frame
    else:
        timestep = torch.randint(0, 1000, (batch,), generator=g)
    return WanInputs(x, timestep, text, image)


# ---- whole pipelines -----------------------------------------------------------------------------


def tiny_wan_vae(latent_channels: int = LATENT_CHANNELS, seed: int = 0):
    """An ``AutoencoderKLWan`` of ``latent_channels``: 8x spatial, 4x temporal compression
    (``num_frames`` = 4k + 1 decodes to exactly ``num_frames``)."""
    from diffusers import AutoencoderKLWan

    torch.manual_seed(seed)
    return AutoencoderKLWan(
        base_dim=8, z_dim=latent_channels, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1 * i for i in range(latent_channels)],
        latents_std=[1.0 + 0.1 * i for i in range(latent_channels)],
    ).eval()


def tiny_wan_pipeline(
    max_text_len: int = 16, seed: int = 0, two_experts: bool = False, boundary_ratio: float = 0.5, ti2v: bool = False,
):
    """A ``WanPipeline`` (Wan 2.1 T2V-like) of tiny random models, float32.

    With ``two_experts`` it is Wan 2.2 T2V-A14B-like: ``transformer`` (high noise, timesteps
    >= ``boundary_ratio * 1000``) and ``transformer_2`` (low noise), two differently seeded models.
    With ``ti2v`` it is Wan 2.2 TI2V-5B-like in text-to-video mode: the "ti2v-5b" transformer on
    3x the latent channels, and ``expand_timesteps`` (the pipeline passes one timestep per token).
    (The real TI2V VAE compresses 16x spatially; this one 8x, like the others.)

    VAE: 8x spatial, 4x temporal compression and patch (1, 2, 2), so ``height x width x num_frames``
    gives ``((num_frames - 1) / 4 + 1) * (height / 16) * (width / 16)`` video tokens; e.g.
    48 x 80 x 9 frames -> 3 * 3 * 5 = 45 tokens. Call it with ``max_sequence_length <= max_text_len``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, WanPipeline

    if ti2v and two_experts:
        raise ValueError("TI2V-5B is a single model: ti2v and two_experts exclude each other")
    tokenizer, text_encoder = tiny_t5(max_text_len, seed + 10)
    variant = "ti2v-5b" if ti2v else "t2v"
    experts = {"transformer": tiny_wan(variant, seed=seed + 30)}
    if two_experts:
        experts["transformer_2"] = tiny_wan(variant, seed=seed + 40)
    return WanPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder,
        vae=tiny_wan_vae(WAN_VARIANTS[variant]["in_channels"], seed=seed + 20),
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), boundary_ratio=boundary_ratio if two_experts else None,
        expand_timesteps=ti2v, **experts,
    )
