"""Tiny randomly initialised Lumina-Image 2.0 transformers and a ``Lumina2Pipeline``, built in code.

Layout: latents (batch, channels, height, width) with 2x2 patches: ``(height / 2) * (width / 2)``
image tokens; caption embeddings (batch, text_len, TEXT_DIM) with ``encoder_attention_mask``
(batch, text_len), 1 for a real token (a prefix, as the pipeline's right-padded tokenizer gives:
valid lengths differ per element).

Nothing is downloaded: the tokenizer is the character T5 tokenizer of ``tiny_chroma`` (the pipeline
only calls it), the Gemma 2 text encoder, VAE and transformer are built from small configs and
seeded. Every process that calls a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import Lumina2Transformer2DModel

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # cap_feat_dim (Lumina-Image 2.0: Gemma-2-2B's 2304)
LATENT_CHANNELS = 4  # the tiny stand-in for the real VAE's 16


def tiny_lumina2(
    num_heads: int = 6, num_kv_heads: int = 2, head_dim: int = 16, num_layers: int = 2, seed: int = 0,
) -> Lumina2Transformer2DModel:
    """A small ``Lumina2Transformer2DModel`` (``num_heads * head_dim`` wide; 2 refiner layers of each
    kind), float32, eval mode. The defaults keep Lumina-Image 2.0's 3 query heads per kv head
    (24 / 8): 6 query and 2 kv heads, which Ulysses 4 splits unevenly (and has fewer kv heads than).
    RoPE axes (caption, row, column) split ``head_dim`` about 1:3:3 in even sizes ((4, 6, 6) of 16; the
    real model's are equal, 32 each of 96: unequal here, so that a swapped axis shows). Every
    parameter is perturbed (``tiny_video._perturb``).
    """
    axis = (head_dim // 4) // 2 * 2
    rest = (head_dim - axis) // 2 // 2 * 2
    torch.manual_seed(seed)
    model = Lumina2Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=LATENT_CHANNELS, hidden_size=num_heads * head_dim,
        num_layers=num_layers, num_refiner_layers=2, num_attention_heads=num_heads, num_kv_heads=num_kv_heads,
        multiple_of=16, norm_eps=1e-5, axes_dim_rope=(axis, rest, head_dim - axis - rest), axes_lens=(160, 64, 64),
        cap_feat_dim=TEXT_DIM,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class Lumina2Inputs:
    """Keyword arguments of one ``Lumina2Transformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, C, H, W)
    timestep: torch.Tensor  # (B,) in [0, 1]
    encoder_hidden_states: torch.Tensor  # (B, T, TEXT_DIM)
    encoder_attention_mask: torch.Tensor  # (B, T) 0 / 1

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def lumina2_inputs(height: int, width: int, valid: list[int], text_len: int = 9, seed: int = 0) -> Lumina2Inputs:
    """Seeded inputs for a ``height x width`` grid of patches (latents 2x that), one element per entry
    of ``valid`` (its count of real caption tokens, a prefix), a different prompt, latent and
    timestep per element."""
    g = torch.Generator().manual_seed(seed)
    batch = len(valid)
    return Lumina2Inputs(
        hidden_states=torch.randn(batch, LATENT_CHANNELS, 2 * height, 2 * width, generator=g),
        timestep=torch.rand(batch, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TEXT_DIM, generator=g),
        encoder_attention_mask=(torch.arange(text_len)[None, :] < torch.tensor(valid)[:, None]).long(),
    )


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_gemma2(vocab_size: int, seed: int = 0):
    """A 2-layer ``Gemma2Model`` of width ``TEXT_DIM`` (Lumina-Image 2.0's Gemma-2-2B), weights perturbed."""
    from transformers import Gemma2Config, Gemma2Model

    torch.manual_seed(seed)
    encoder = Gemma2Model(Gemma2Config(
        vocab_size=vocab_size, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0, sliding_window=16,
    ))
    _perturb(encoder, seed + 1, std=0.02)
    return encoder.eval()


def tiny_lumina2_pipeline(max_text_len: int = 64, seed: int = 0):
    """A ``Lumina2Pipeline`` of tiny random models, float32 on CPU.

    The pipeline assumes an 8x VAE (``vae_scale_factor = 8``), as the tiny 4-level one is, and 2x2
    patches: ``height x width`` gives ``(height / 16) * (width / 16)`` image tokens (48 x 80 -> 15).
    Call it with ``max_sequence_length <= max_text_len`` (each character is a token; the pipeline
    prepends its system prompt: pass a short ``system_prompt``).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, Lumina2Pipeline

    from usp_dit.demo.tiny_chroma import tiny_t5
    from usp_dit.demo.tiny_flux import tiny_vae

    tokenizer, _ = tiny_t5(max_text_len, seed + 10)
    return Lumina2Pipeline(
        transformer=tiny_lumina2(seed=seed + 30), scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_vae(4, seed + 20), text_encoder=tiny_gemma2(len(tokenizer), seed + 11), tokenizer=tokenizer,
    )
