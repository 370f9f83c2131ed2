"""Tiny randomly initialised Lumina-Next transformers (``LuminaNextDiT2DModel``) and a ``LuminaPipeline``.

Layout: latents (batch, channels, height, width) with 2x2 patches: ``(height / 2) * (width / 2)``
image tokens; caption embeddings (batch, text_len, TEXT_DIM) with ``encoder_mask`` (batch, text_len),
1 for a real token (a prefix, as the pipeline's right-padded tokenizer gives: valid lengths differ
per element); the 2-D RoPE table (rows, columns, head_dim / 2) complex, the pipeline's
``get_2d_rotary_pos_embed_lumina`` (the model takes its top-left ``height x width`` patches).

Nothing is downloaded: the tokenizer is the character T5 tokenizer of ``tiny_chroma`` (the pipeline
only calls it), the Gemma 2 text encoder is ``tiny_lumina2``'s, the VAE ``tiny_flux``'s. Every
process that calls a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from diffusers import LuminaNextDiT2DModel
from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

from usp_dit.demo.tiny_lumina2 import TEXT_DIM, tiny_gemma2
from usp_dit.demo.tiny_video import _perturb

LATENT_CHANNELS = 4  # Lumina-Next-SFT's VAE (SDXL's) has 4 latent channels too
ROPE_SIDE = 16  # patches a side of the RoPE table of the tiny inputs (the pipeline's: 384)


def tiny_lumina_next(
    num_heads: int = 6, num_kv_heads: int = 2, head_dim: int = 16, num_layers: int = 2, sample_size: int = 16,
    seed: int = 0,
) -> LuminaNextDiT2DModel:
    """A small ``LuminaNextDiT2DModel`` (``num_heads * head_dim`` wide, ``learn_sigma``: 2 x channels
    out), float32, eval mode. 6 query heads on 2 kv heads (Lumina-Next-SFT: 32 on 8), which Ulysses 4
    splits unevenly and has fewer kv heads than; ``head_dim`` a multiple of 4 (the 2-D RoPE). Every
    parameter is perturbed (``tiny_video._perturb``): the blocks' zero-initialised cross-attention
    gates included, so the caption reaches the image."""
    torch.manual_seed(seed)
    model = LuminaNextDiT2DModel(
        sample_size=sample_size, patch_size=2, in_channels=LATENT_CHANNELS, hidden_size=num_heads * head_dim,
        num_layers=num_layers, num_attention_heads=num_heads, num_kv_heads=num_kv_heads, multiple_of=16,
        norm_eps=1e-5, learn_sigma=True, qk_norm=True, cross_attention_dim=TEXT_DIM,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class LuminaNextInputs:
    """Keyword arguments of one ``LuminaNextDiT2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, C, H, W)
    timestep: torch.Tensor  # (B,) in [0, 1]
    encoder_hidden_states: torch.Tensor  # (B, T, TEXT_DIM)
    encoder_mask: torch.Tensor  # (B, T) 0 / 1
    image_rotary_emb: torch.Tensor  # (ROPE_SIDE, ROPE_SIDE, head_dim / 2) complex
    cross_attention_kwargs: dict = field(default_factory=dict)  # {"base_sequence_length": n}: proportional attention

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def lumina_next_inputs(
    height: int, width: int, valid: list[int], head_dim: int = 16, text_len: int = 9,
    base_sequence_length: int | None = None, ntk_factor: float = 1.0, linear_factor: float = 1.0, seed: int = 0,
) -> LuminaNextInputs:
    """Seeded inputs for a ``height x width`` grid of patches (latents 2x that), one element per entry
    of ``valid`` (its count of real caption tokens, a prefix), a different prompt, latent and
    timestep per element. ``base_sequence_length``: the pipeline's proportional attention (its
    softmax scale depends on the image token count); ``ntk_factor`` / ``linear_factor``: its
    resolution scaling of the RoPE table."""
    g = torch.Generator().manual_seed(seed)
    batch = len(valid)
    return LuminaNextInputs(
        hidden_states=torch.randn(batch, LATENT_CHANNELS, 2 * height, 2 * width, generator=g),
        timestep=torch.rand(batch, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TEXT_DIM, generator=g),
        encoder_mask=(torch.arange(text_len)[None, :] < torch.tensor(valid)[:, None]).long(),
        image_rotary_emb=get_2d_rotary_pos_embed_lumina(head_dim, ROPE_SIDE, ROPE_SIDE, linear_factor=linear_factor,
                                                        ntk_factor=ntk_factor),
        cross_attention_kwargs={} if base_sequence_length is None else {"base_sequence_length": base_sequence_length},
    )


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_lumina_next_pipeline(max_text_len: int = 64, seed: int = 0):
    """A ``LuminaPipeline`` (Lumina-Next) of tiny random models, float32 on CPU.

    The pipeline assumes an 8x VAE (``vae_scale_factor = 8``), as the tiny 4-level one is, and 2x2
    patches: ``height x width`` gives ``(height / 16) * (width / 16)`` image tokens (48 x 80 -> 15).
    Its default image is ``sample_size * 8 = 128`` pixels a side: proportional attention's base
    length is (128 / 16)^2 = 64 tokens and the RoPE scaling factor sqrt(height * width) / 128.
    Each character is a token; call it with ``clean_caption=False`` (no bs4 / ftfy needed).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, LuminaPipeline

    from usp_dit.demo.tiny_chroma import tiny_t5
    from usp_dit.demo.tiny_flux import tiny_vae

    tokenizer, _ = tiny_t5(max_text_len, seed + 10)
    return LuminaPipeline(
        transformer=tiny_lumina_next(seed=seed + 30), scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_vae(4, seed + 20), text_encoder=tiny_gemma2(len(tokenizer), seed + 11), tokenizer=tokenizer,
    )
