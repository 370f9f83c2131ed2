"""Tiny randomly initialised Ovis-Image transformers and an ``OvisImagePipeline``, built in code for tests and examples.

Layout: packed latents (batch, tokens, 4 * latent_channels), ``tokens = (height / 4) * (width / 4)``
with the tiny 2x VAE, row-major; text embeddings (batch, text_len, TEXT_DIM); position ids as
``OvisImagePipeline`` makes them: image (tokens, 3) = (0, row, col), text (text_len, 3) = (0, i, i);
timestep (batch,) in [0, 1] (the pipeline passes t / 1000).

Nothing is downloaded: the tokenizer is a character vocabulary written here with Qwen's chat
tokens and a chat template, the Qwen3 text encoder, VAE and transformer are built from small
configs and seeded. Every process that calls a builder with the same arguments gets bit-identical
weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import OvisImageTransformer2DModel

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # joint_attention_dim (Ovis-Image: its Qwen3's 2048)
LATENT_CHANNELS = 4  # the tiny VAE's (the real one: 16)


def tiny_ovis_image(
    num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, num_single_layers: int = 2, seed: int = 0,
) -> OvisImageTransformer2DModel:
    """A small ``OvisImageTransformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    RoPE axes (0, h, w) split ``head_dim`` 1:3:3 as Ovis-Image's (16, 56, 56) of 128. Every
    parameter is perturbed (``tiny_video._perturb``).

    Raises:
        ValueError: ``head_dim`` is not a multiple of 16.
    """
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (three even RoPE axes, 1:3:3), got {head_dim}")
    torch.manual_seed(seed)
    model = OvisImageTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, out_channels=4 * LATENT_CHANNELS, num_layers=num_layers,
        num_single_layers=num_single_layers, attention_head_dim=head_dim, num_attention_heads=num_heads,
        joint_attention_dim=TEXT_DIM, axes_dims_rope=(head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8),
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class OvisImageInputs:
    """Keyword arguments of one ``OvisImageTransformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, N, 4 * latent_channels)
    encoder_hidden_states: torch.Tensor  # (B, T, TEXT_DIM)
    timestep: torch.Tensor  # (B,) in [0, 1]
    img_ids: torch.Tensor  # (N, 3)
    txt_ids: torch.Tensor  # (T, 3)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def ovis_image_inputs(height: int, width: int, text_len: int, batch: int = 2, seed: int = 0) -> OvisImageInputs:
    """Seeded inputs for a ``height x width`` grid of packed latent tokens, a different prompt,
    latent and timestep per batch element; ids as the pipeline makes them."""
    g = torch.Generator().manual_seed(seed)
    num_image = height * width
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(num_image, 3).float()
    positions = torch.arange(text_len).float()
    txt_ids = torch.stack([torch.zeros(text_len), positions, positions], dim=-1)
    return OvisImageInputs(
        hidden_states=torch.randn(batch, num_image, 4 * LATENT_CHANNELS, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TEXT_DIM, generator=g),
        timestep=torch.rand(batch, generator=g), img_ids=img_ids, txt_ids=txt_ids,
    )


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_ovis_text_encoder(vocab_size: int, seed: int = 0):
    """A 2-layer ``Qwen3Model`` of width ``TEXT_DIM``, float32, eval mode, every weight perturbed:
    its last hidden states are the prompt embeddings."""
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, pad_token_id=0,
        bos_token_id=None, eos_token_id=1,
    )
    torch.manual_seed(seed)
    encoder = Qwen3Model(config)
    _perturb(encoder, seed + 1, std=0.02)
    return encoder.eval()


def tiny_ovis_image_pipeline(seed: int = 0):
    """An ``OvisImagePipeline`` of tiny random models (Qwen3-like text encoder, character tokenizer
    with a chat template, VAE, transformer), float32 on CPU.

    VAE 2x compression and 2x2 patches: ``height x width`` gives ``(height / 4) * (width / 4)``
    image tokens (12 x 20 -> 15). The text is ``max_sequence_length`` tokens (the pipeline pads
    to it; its padding rows zeroed, all attended).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, OvisImagePipeline

    from usp_dit.demo.tiny_flux import tiny_vae
    from usp_dit.demo.tiny_flux2 import tiny_qwen3_tokenizer

    tokenizer = tiny_qwen3_tokenizer()
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=16,
        max_image_seq_len=4096,
    )
    return OvisImagePipeline(
        scheduler=scheduler, vae=tiny_vae(2, seed + 20), text_encoder=tiny_ovis_text_encoder(len(tokenizer), seed + 10),
        tokenizer=tokenizer, transformer=tiny_ovis_image(seed=seed + 30),
    )
