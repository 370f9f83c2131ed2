"""Tiny randomly initialised Sana transformers and a ``SanaPipeline``, built in code for tests and examples.

Layout: latents (batch, LATENT_CHANNELS, height, width), one token per latent pixel (patch 1, as every
released Sana): ``tokens = height * width``, row-major; text embeddings (batch, text_len, TEXT_DIM)
with a 0/1 mask (batch, text_len); timesteps (batch,); Sana-Sprint's guidance (batch,).

Nothing is downloaded: the tokenizer is a T5 tokenizer over single characters (the pipeline only
calls it), the Gemma-2 text encoder, the DC-AE and the transformer are built from small configs and
seeded. Every process that calls a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import SanaTransformer2DModel

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # caption_channels (Sana: Gemma-2-2B's 2304)
LATENT_CHANNELS = 4  # (Sana's DC-AE: 32)
VARIANTS = ("sana", "sprint")


def tiny_sana(
    variant: str = "sana", num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, seed: int = 0,
) -> SanaTransformer2DModel:
    """A small ``SanaTransformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    ``"sana"``: Sana 600M / 1600M-like (no QK norm, no position table, timestep only);
    ``"sprint"``: Sana-Sprint-like (RMS QK norm across heads, embedded guidance) with a sin-cos
    position table added in ``patch_embed`` (``interpolation_scale``), so both paths are covered.
    Cross-attention: 2 heads x ``2 * head_dim``. Every parameter is perturbed (``tiny_video._perturb``).

    Raises:
        ValueError: an unknown ``variant``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}; use one of {VARIANTS}")
    sprint = variant == "sprint"
    torch.manual_seed(seed)
    model = SanaTransformer2DModel(
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_attention_heads=num_heads,
        attention_head_dim=head_dim, num_layers=num_layers, num_cross_attention_heads=2,
        cross_attention_head_dim=2 * head_dim, cross_attention_dim=num_heads * head_dim, caption_channels=TEXT_DIM,
        mlp_ratio=2.5, sample_size=8, patch_size=1, interpolation_scale=1 if sprint else None,
        qk_norm="rms_norm_across_heads" if sprint else None, guidance_embeds=sprint,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class SanaInputs:
    """Keyword arguments of one ``SanaTransformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, LATENT_CHANNELS, H, W)
    encoder_hidden_states: torch.Tensor  # (B, T, TEXT_DIM)
    timestep: torch.Tensor  # (B,)
    encoder_attention_mask: torch.Tensor | None  # (B, T) 0 / 1
    guidance: torch.Tensor | None = None  # (B,): Sana-Sprint only

    def kwargs(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not (k == "guidance" and v is None)}


def sana_inputs(
    model: SanaTransformer2DModel, height: int, width: int, prompt_lengths: list[int] | None, text_len: int = 6,
    batch: int = 2, seed: int = 0,
) -> SanaInputs:
    """Seeded inputs for a ``height x width`` token grid: a different latent, prompt, timestep (and
    guidance) per batch element; ``prompt_lengths[b]``: element b's valid text tokens (a prefix mask,
    as the pipeline's right padding), ``None``: no mask."""
    g = torch.Generator().manual_seed(seed)
    mask = None
    if prompt_lengths is not None:
        mask = (torch.arange(text_len)[None, :] < torch.tensor(prompt_lengths)[:, None]).long()
    guidance = torch.rand(batch, generator=g) * 5 if model.config.guidance_embeds else None
    return SanaInputs(
        hidden_states=torch.randn(batch, LATENT_CHANNELS, height, width, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TEXT_DIM, generator=g),
        timestep=torch.rand(batch, generator=g) * 1000, encoder_attention_mask=mask, guidance=guidance,
    )


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_gemma2(seed: int = 0):
    """A 2-layer ``Gemma2Model`` of width ``TEXT_DIM`` (Sana's text encoder: Gemma-2-2B), float32, eval."""
    from transformers import Gemma2Config, Gemma2Model

    from usp_dit.demo.tiny_chroma import tiny_t5

    tokenizer, _ = tiny_t5(16)
    torch.manual_seed(seed)
    encoder = Gemma2Model(Gemma2Config(
        vocab_size=len(tokenizer), hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=16, pad_token_id=0,
        attn_implementation="eager",
    ))
    _perturb(encoder, seed + 1, std=0.02)
    return encoder.eval()


def tiny_dc_ae(seed: int = 0):
    """A 6-stage ``AutoencoderDC`` of narrow stages: 32 pixels per latent pixel, as Sana's DC-AE
    (``SanaPipeline`` takes sizes in multiples of 32 only), float32, eval."""
    from diffusers import AutoencoderDC

    torch.manual_seed(seed)
    vae = AutoencoderDC(
        in_channels=3, latent_channels=LATENT_CHANNELS, attention_head_dim=8,
        encoder_block_types="ResBlock", decoder_block_types="ResBlock",
        encoder_block_out_channels=(4, 8, 8, 8, 8, 8), decoder_block_out_channels=(4, 8, 8, 8, 8, 8),
        encoder_layers_per_block=(1,) * 6, decoder_layers_per_block=(1,) * 6,
        encoder_qkv_multiscales=((),) * 6, decoder_qkv_multiscales=((),) * 6, scaling_factor=0.4,
    )
    _perturb(vae, seed + 1, std=0.02)
    return vae.eval()


def tiny_sana_pipeline(max_text_len: int = 16, seed: int = 0):
    """A ``SanaPipeline`` of tiny random models (Gemma-2, DC-AE, the "sana" transformer), float32 on CPU.

    The DC-AE has 32 pixels per latent pixel and the patch is 1: ``height x width`` gives
    ``(height / 32) * (width / 32)`` image tokens (160 x 224 -> 35). Call it with
    ``max_sequence_length <= max_text_len``, ``complex_human_instruction=None`` (the default one
    is a long chat instruction) and ``use_resolution_binning=False`` (the bins are Sana's sizes).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaPipeline

    from usp_dit.demo.tiny_chroma import tiny_t5

    tokenizer, _ = tiny_t5(max_text_len)
    return SanaPipeline(
        tokenizer=tokenizer, text_encoder=tiny_gemma2(seed + 10), vae=tiny_dc_ae(seed + 20),
        transformer=tiny_sana(seed=seed + 30), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
