"""Tiny randomly initialised PRX transformers and a ``PRXPipeline``, built in code for tests and examples.

Layout: latents (batch, LATENT_CHANNELS, h, w) with ``patch_size`` p: (h / p) * (w / p) image
tokens; text embeddings (batch, T, TEXT_DIM) with their mask (batch, T) bool, True = a real token
(padding at the end, as the pipeline's tokenizer pads); timestep (batch,) in [0, 1] (the pipeline
passes t / 1000).

Nothing is downloaded: the tokenizer is ``tiny_chroma.tiny_t5``'s character T5 tokenizer, the
T5Gemma encoder, VAE and transformer are built from small configs and seeded. Every process that
calls a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import PRXTransformer2DModel

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # context_in_dim (PRX: T5Gemma-2B's 2304)
LATENT_CHANNELS = 4  # the tiny stand-in for the Flux VAE's 16 (or DC-AE's 32)

# Variants of the family, each a tiny version of a released config.
PRX_VARIANTS = {
    "prx": {},  # PRX-1.2B: a linear patch embedding, timestep conditioning
    # PRX-7B (pixel space, PRXPixelPipeline): RGB in and out, a bottleneck patch embedding, resolution conditioning.
    "pixel": {"in_channels": 3, "bottleneck_size": 24, "resolution_embeds": True},
}


def tiny_prx(
    variant: str = "prx", num_heads: int = 4, head_dim: int = 16, depth: int = 2, patch_size: int = 1,
    seed: int = 0,
) -> PRXTransformer2DModel:
    """A small ``PRXTransformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    RoPE axes (row, col) split ``head_dim`` in halves, as the release's (32, 32) of 64. Every
    parameter is perturbed (``tiny_video._perturb``): stock zero-initialises the modulation.

    Raises:
        ValueError: ``variant`` is not one of ``PRX_VARIANTS``, or ``head_dim`` is not a multiple of 4.
    """
    if variant not in PRX_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(PRX_VARIANTS)}, got {variant!r}")
    if head_dim % 4:
        raise ValueError(f"head_dim must be a multiple of 4 (two even RoPE axes), got {head_dim}")
    torch.manual_seed(seed)
    options = {"in_channels": LATENT_CHANNELS, **PRX_VARIANTS[variant]}
    model = PRXTransformer2DModel(
        patch_size=patch_size, context_in_dim=TEXT_DIM,
        hidden_size=num_heads * head_dim, mlp_ratio=2.0, num_heads=num_heads, depth=depth,
        axes_dim=[head_dim // 2, head_dim // 2], **options,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class PRXInputs:
    """Keyword arguments of one ``PRXTransformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, in_channels, h, w): LATENT_CHANNELS, or 3 (RGB) for "pixel"
    timestep: torch.Tensor  # (B,)
    encoder_hidden_states: torch.Tensor  # (B, T, TEXT_DIM)
    attention_mask: torch.Tensor | None  # (B, T) bool, True = a real token

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def prx_inputs(
    height: int, width: int, prompt_lengths: list[int] | None, text_len: int = 8, batch: int = 2, seed: int = 0,
    channels: int = LATENT_CHANNELS,
) -> PRXInputs:
    """Seeded inputs of ``height x width`` latent pixels of ``channels``: a different latent, prompt
    and timestep per element; ``prompt_lengths[b]``: element b's real tokens (the rest padding,
    masked), ``None``: no mask."""
    g = torch.Generator().manual_seed(seed)
    mask = None
    if prompt_lengths is not None:
        batch = len(prompt_lengths)
        mask = torch.arange(text_len)[None, :] < torch.tensor(prompt_lengths)[:, None]
    return PRXInputs(
        hidden_states=torch.randn(batch, channels, height, width, generator=g),
        timestep=torch.rand(batch, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TEXT_DIM, generator=g),
        attention_mask=mask,
    )


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_t5gemma_encoder(vocab_size: int, seed: int = 0):
    """A 2-layer ``T5GemmaEncoder`` of width ``TEXT_DIM`` (the pipeline's text encoder), float32, eval mode."""
    from transformers import T5GemmaConfig
    from transformers.models.t5gemma.configuration_t5gemma import T5GemmaModuleConfig
    from transformers.models.t5gemma.modeling_t5gemma import T5GemmaEncoder

    module = dict(vocab_size=vocab_size, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, query_pre_attn_scalar=8, pad_token_id=0)
    # The encoder-decoder config fills in what its module configs share (dropout rates); the encoder takes its own.
    config = T5GemmaConfig(encoder=T5GemmaModuleConfig(**module), decoder=T5GemmaModuleConfig(**module),
                           vocab_size=vocab_size)
    torch.manual_seed(seed)
    encoder = T5GemmaEncoder(config.encoder)
    _perturb(encoder, seed + 1, std=0.02)
    return encoder.eval()


def tiny_prx_pipeline(max_text_len: int = 16, seed: int = 0):
    """A ``PRXPipeline`` of tiny random models (character T5 tokenizer, T5Gemma encoder, Flux-like
    ``AutoencoderKL``, the "prx" transformer with 2x2 patches), float32 on CPU.

    VAE 2x compression and 2x2 patches: ``height x width`` gives ``(height / 4) * (width / 4)``
    image tokens (12 x 20 -> 3 x 5 = 15). Prompts are padded to ``max_text_len`` tokens and masked.
    Call it with ``use_resolution_binning=False`` (the bins are the release's 1024-pixel sizes).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, PRXPipeline
    from diffusers.utils import is_ftfy_available

    from usp_dit.demo.tiny_chroma import tiny_t5
    from usp_dit.demo.tiny_flux import tiny_vae

    tokenizer, _ = tiny_t5(max_text_len, seed + 10)
    pipe = PRXPipeline(
        transformer=tiny_prx(patch_size=2, seed=seed + 30), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder=tiny_t5gemma_encoder(len(tokenizer), seed + 10), tokenizer=tokenizer,
        vae=tiny_vae(2, seed + 20),
    )
    if not is_ftfy_available():  # the stock cleaner calls ftfy.fix_text, an optional dependency
        pipe.text_preprocessor = _PlainText()
    return pipe


class _PlainText:
    """``PRXPipeline``'s text cleaner without ftfy (not installed here): prompts lower-cased and
    stripped, the same on every rank (the tiny tokenizer knows lower-case characters only)."""

    def clean_text(self, text: str) -> str:
        return text.lower().strip()

    basic_clean = clean_text


def tiny_prx_pixel_pipeline(max_text_len: int = 16, seed: int = 0):
    """A ``PRXPixelPipeline`` of tiny random models (character T5 tokenizer, T5Gemma encoder, the
    "pixel" transformer with 2x2 patches: no VAE), float32 on CPU: ``height x width`` pixels give
    ``(height / 2) * (width / 2)`` image tokens (6 x 10 -> 3 x 5 = 15). Its cleaner needs ftfy
    (module-level, not replaceable): without it, call it with ``prompt_embeds`` and masks."""
    from diffusers import FlowMatchEulerDiscreteScheduler, PRXPixelPipeline

    from usp_dit.demo.tiny_chroma import tiny_t5

    tokenizer, _ = tiny_t5(max_text_len, seed + 10)
    return PRXPixelPipeline(
        transformer=tiny_prx("pixel", patch_size=2, seed=seed + 30), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
        text_encoder=tiny_t5gemma_encoder(len(tokenizer), seed + 10), tokenizer=tokenizer,
        prompt_max_tokens=max_text_len,
    )
