"""Tiny randomly initialised AnyFlow transformers and pipelines, for tests and the video example.

Layout: latents (batch, **frames, channels**, height, width) (``AnyFlowTransformer3DModel``'s
order); text embeddings (batch, text_seq, text_dim); image embeddings (batch, image_seq, image_dim);
timesteps ``t`` and ``r`` (batch, frames), one per latent frame.

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import AnyFlowTransformer3DModel

from usp_dit.demo.tiny_video import TEXT_DIM, _perturb, tiny_t5
from usp_dit.demo.tiny_wan import LATENT_CHANNELS, tiny_wan_vae

# Variants, each a tiny version of a released config (AnyFlow's checkpoints are Wan 2.1's shape):
# width 64 = 4 heads x 16, channels / 4.
ANYFLOW_VARIANTS = {
    "t2v": dict(in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS),
    # Image conditioning (``image_dim``): image tokens concatenated before the text in cross-attention.
    "i2v": dict(in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, image_dim=24),
    # deltatime_type "t-r": the delta embedder takes t - r instead of r.
    "t-r": dict(in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, deltatime_type="t-r"),
}


def tiny_anyflow(
    variant: str = "t2v", num_heads: int = 4, head_dim: int = 16, seed: int = 0,
) -> AnyFlowTransformer3DModel:
    """A 2-layer ``AnyFlowTransformer3DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    Every parameter is perturbed with seeded noise (``tiny_video._perturb``), and the non-persistent
    ``delta_emb_gate`` buffer is set to 0.3 (not the default 0.25) so that both embedders matter.

    Raises:
        ValueError: ``variant`` is not one of ``ANYFLOW_VARIANTS``.
    """
    if variant not in ANYFLOW_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(ANYFLOW_VARIANTS)}, got {variant!r}")
    config = dict(
        patch_size=(1, 2, 2), num_attention_heads=num_heads, attention_head_dim=head_dim, text_dim=TEXT_DIM,
        freq_dim=16, ffn_dim=96, num_layers=2, cross_attn_norm=True, rope_max_seq_len=32, gate_value=0.3,
    )
    config.update(ANYFLOW_VARIANTS[variant])
    torch.manual_seed(seed)
    model = AnyFlowTransformer3DModel(**config)
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class AnyFlowInputs:
    """Keyword arguments of one ``AnyFlowTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, F, C, H, W)
    timestep: torch.Tensor  # (B, F): t per latent frame
    r_timestep: torch.Tensor  # (B, F): r per latent frame
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    encoder_hidden_states_image: torch.Tensor | None = None  # (B, image_seq, image_dim)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def anyflow_tokens(model: AnyFlowTransformer3DModel, frames: int, height: int, width: int) -> int:
    """Video tokens of a latent of this size: frames * height/p_h * width/p_w (p_t is 1)."""
    _, p_h, p_w = model.config.patch_size
    return frames * (height // p_h) * (width // p_w)


def anyflow_inputs(
    model: AnyFlowTransformer3DModel, frames: int, height: int, width: int, batch: int = 2, text_len: int = 9,
    image_len: int = 5, seed: int = 0,
) -> AnyFlowInputs:
    """Seeded inputs for ``model`` (latent sizes): a different prompt per element, and a random
    ``t`` and ``r <= t`` per latent frame and element (random rows catch a modulation row cut unlike
    the tokens), with frame 0 at t = 0 as the pipeline's video conditioning sets it."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, frames, cfg.in_channels, height, width, generator=g)
    text = torch.randn(batch, text_len, cfg.text_dim, generator=g)
    image = torch.randn(batch, image_len, cfg.image_dim, generator=g) if cfg.image_dim else None
    t = torch.rand(batch, frames, generator=g) * 1000
    t[:, 0] = 0.0
    r = t * torch.rand(batch, frames, generator=g)
    return AnyFlowInputs(x, t, r, text, image)


def tiny_anyflow_pipeline(max_text_len: int = 16, seed: int = 0):
    """An ``AnyFlowPipeline`` of tiny random models, float32: the T5 stand-in, the "t2v" transformer
    and Wan's VAE (8x spatial, 4x temporal compression, patch (1, 2, 2)), so ``height x width x
    num_frames`` gives ``((num_frames - 1) / 4 + 1) * (height / 16) * (width / 16)`` video tokens;
    e.g. 48 x 80 x 9 frames -> 3 * 3 * 5 = 45 tokens. Call it with ``max_sequence_length <= max_text_len``.
    """
    from diffusers import AnyFlowPipeline, FlowMapEulerDiscreteScheduler

    tokenizer, text_encoder = tiny_t5(max_text_len, seed + 10)
    return AnyFlowPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, transformer=tiny_anyflow("t2v", seed=seed + 30),
        vae=tiny_wan_vae(LATENT_CHANNELS, seed=seed + 20), scheduler=FlowMapEulerDiscreteScheduler(shift=3.0),
    )
