"""Tiny randomly initialised SD3 / SD3.5 transformers and a ``StableDiffusion3Pipeline``, for tests and examples.

Layout: latents (batch, channels, height, width); image tokens ``(height / 2) * (width / 2)``
(patch 2), row-major as ``PatchEmbed`` flattens them; text embeddings (batch, text_seq, text_dim)
(the pipeline's: both CLIPs' tokens, padded to the T5 width, then T5's tokens); pooled text
(batch, pooled_dim) (both CLIPs' projections concatenated); timestep (batch,) in [0, 1000].

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import SD3Transformer2DModel

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # joint_attention_dim (the T5 width) of the tiny transformers; real: 4096
CLIP_DIM = 16  # width and projection of each tiny CLIP; pooled_projection_dim = 2 * CLIP_DIM
LATENT_CHANNELS = 4  # the tiny stand-in for the real VAE's 16

# Variants of the family, each a tiny version of a released checkpoint's config.
SD3_VARIANTS = {
    # SD3 Medium: plain joint attention, no QK norm.
    "sd3": dict(),
    # SD3.5 Large: RMS QK norm. (Its layers are SD3's otherwise.)
    "sd3.5-large": dict(qk_norm="rms_norm"),
    # SD3.5 Medium: RMS QK norm and dual attention (attn2: self-attention over the image tokens) in
    # the first layers; here layer 0 of 2 (the last layer is context_pre_only, as in every SD3).
    "sd3.5-medium": dict(qk_norm="rms_norm", dual_attention_layers=(0,)),
}


def tiny_sd3(
    variant: str = "sd3", num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, seed: int = 0,
) -> SD3Transformer2DModel:
    """A small ``SD3Transformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    Its position table covers latents up to 32 x 32 (``pos_embed_max_size=16`` patches a side).
    Every parameter is perturbed with seeded noise (``tiny_video._perturb``).

    Raises:
        ValueError: ``variant`` is not one of ``SD3_VARIANTS``.
    """
    if variant not in SD3_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(SD3_VARIANTS)}, got {variant!r}")
    torch.manual_seed(seed)
    model = SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
        num_layers=num_layers, attention_head_dim=head_dim, num_attention_heads=num_heads,
        joint_attention_dim=TEXT_DIM, caption_projection_dim=num_heads * head_dim,
        pooled_projection_dim=2 * CLIP_DIM, pos_embed_max_size=16, **SD3_VARIANTS[variant],
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class SD3Inputs:
    """Keyword arguments of one ``SD3Transformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, C, H, W)
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    pooled_projections: torch.Tensor  # (B, pooled_dim)
    timestep: torch.Tensor  # (B,)
    skip_layers: list[int] | None = None

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def sd3_tokens(height: int, width: int) -> int:
    """Image tokens of a latent of this size (patch 2)."""
    return (height // 2) * (width // 2)


def sd3_inputs(
    model: SD3Transformer2DModel, height: int, width: int, batch: int = 2, text_len: int = 11, seed: int = 0,
) -> SD3Inputs:
    """Seeded inputs for a ``height x width`` latent; a different prompt and timestep per element."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg.in_channels, height, width, generator=g)
    text = torch.randn(batch, text_len, cfg.joint_attention_dim, generator=g)
    pooled = torch.randn(batch, cfg.pooled_projection_dim, generator=g)
    timestep = torch.rand(batch, generator=g) * 1000
    return SD3Inputs(x, text, pooled, timestep)


# ---- the whole pipeline ---------------------------------------------------------------------------


def _clip_with_projection(vocab: int, max_length: int, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection

    torch.manual_seed(seed)
    clip = CLIPTextModelWithProjection(CLIPTextConfig(
        vocab_size=vocab, hidden_size=CLIP_DIM, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        max_position_embeddings=max_length, projection_dim=CLIP_DIM, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    ))
    _perturb(clip, seed + 1, std=0.02)
    return clip.eval()


def _t5(vocab: int, seed: int):
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(seed)
    t5 = T5EncoderModel(T5Config(
        vocab_size=vocab, d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4, pad_token_id=0, eos_token_id=1,
    ))
    _perturb(t5, seed + 1, std=0.02)
    return t5.eval()


def tiny_sd3_pipeline(variant: str = "sd3.5-medium", clip_len: int = 8, seed: int = 0):
    """A ``StableDiffusion3Pipeline`` of tiny random models (two CLIPs with projection, T5, VAE,
    transformer), float32. Tokenizers over single characters (``tiny_flux``'s, no file).

    The transformer sees ``clip_len`` CLIP tokens (both CLIPs side by side on channels) and then
    ``max_sequence_length`` T5 tokens. VAE: 2x spatial compression (two blocks), patch
    2, so ``height x width`` gives ``(height / 4) * (width / 4)`` image tokens; e.g. 12 x 20 -> 15.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    from usp_dit.demo.tiny_flux import _tokenizers, tiny_vae

    clip_tok, t5_tok = _tokenizers(clip_len)
    clip_tok_2, _ = _tokenizers(clip_len)
    return StableDiffusion3Pipeline(
        transformer=tiny_sd3(variant, seed=seed + 30), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        vae=tiny_vae(2, seed + 20),
        text_encoder=_clip_with_projection(len(clip_tok), clip_len, seed + 10), tokenizer=clip_tok,
        text_encoder_2=_clip_with_projection(len(clip_tok_2), clip_len, seed + 12), tokenizer_2=clip_tok_2,
        text_encoder_3=_t5(len(t5_tok), seed + 14), tokenizer_3=t5_tok,
    )
