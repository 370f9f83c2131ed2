"""Tiny randomly initialised Chroma transformers and a ``ChromaPipeline``, built in code for tests and examples.

Layout: packed latents (batch, tokens, 4 * latent_channels), ``tokens = (height / 4) * (width / 4)``
with the tiny 2x VAE; text embeddings (batch, text_len, text_dim); position ids as ``ChromaPipeline``
makes them: image (tokens, 3) = (0, row, col), text (text_len, 3) zeros; the mask (batch,
text_len + tokens) as the pipeline makes it: float, 1 for the prompt's tokens and its first padding
token, 0 for the rest of the padding, 1 for every image token.

Nothing is downloaded: the T5 tokenizer gets a vocabulary of single characters written here, the
T5 encoder, VAE and transformer are built from small configs and seeded. Every process that calls
a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

import string
from dataclasses import dataclass

import torch
from diffusers import ChromaTransformer2DModel

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # joint_attention_dim (Chroma: T5-XXL's 4096)
LATENT_CHANNELS = 4


def tiny_chroma(
    num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, num_single_layers: int = 2, seed: int = 0,
) -> ChromaTransformer2DModel:
    """A small ``ChromaTransformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    RoPE axes (0, h, w) split ``head_dim`` 1:3:3 as Chroma's (16, 56, 56) of 128; a 2-layer
    approximator. Every parameter is perturbed (``tiny_video._perturb``).

    Raises:
        ValueError: ``head_dim`` is not a multiple of 16.
    """
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (three even RoPE axes, 1:3:3), got {head_dim}")
    torch.manual_seed(seed)
    model = ChromaTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=head_dim, num_attention_heads=num_heads, joint_attention_dim=TEXT_DIM,
        axes_dims_rope=(head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8),
        approximator_num_channels=16, approximator_hidden_dim=32, approximator_layers=2,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class ChromaInputs:
    """Keyword arguments of one ``ChromaTransformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, N, 4 * latent_channels)
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    timestep: torch.Tensor  # (B,) in [0, 1]
    img_ids: torch.Tensor  # (N, 3)
    txt_ids: torch.Tensor  # (T, 3)
    attention_mask: torch.Tensor | None  # (B, T + N) float 0 / 1

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def chroma_mask(prompt_lengths: list[int], text_len: int, num_image: int) -> torch.Tensor:
    """The pipeline's (B, T + N) float mask: token i of prompt b counts iff i <= its length (the
    prompt and the first padding token), then every image token."""
    text = torch.arange(text_len)[None, :] <= torch.tensor(prompt_lengths)[:, None]
    return torch.cat([text, torch.ones(len(prompt_lengths), num_image, dtype=torch.bool)], dim=1).float()


def chroma_inputs(
    height: int, width: int, prompt_lengths: list[int] | None, text_len: int = 6, batch: int = 2, seed: int = 0,
) -> ChromaInputs:
    """Seeded inputs for a ``height x width`` grid of packed latent tokens, a different prompt,
    latent and timestep per batch element; ``prompt_lengths[b]``: element b's prompt tokens (mask
    as the pipeline makes it), ``None``: no mask."""
    g = torch.Generator().manual_seed(seed)
    num_image = height * width
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(num_image, 3).float()
    mask = chroma_mask(prompt_lengths, text_len, num_image) if prompt_lengths else None
    return ChromaInputs(
        hidden_states=torch.randn(batch, num_image, 4 * LATENT_CHANNELS, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TEXT_DIM, generator=g),
        timestep=torch.rand(batch, generator=g), img_ids=img_ids, txt_ids=torch.zeros(text_len, 3),
        attention_mask=mask,
    )


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_t5(max_length: int, seed: int = 0):
    """A T5 tokenizer over single characters (no file) and a 2-layer ``T5EncoderModel`` of width ``TEXT_DIM``."""
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    chars = string.ascii_lowercase + string.digits + string.punctuation
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)] + [(c, -2.0) for c in chars]
    tokenizer = T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=max_length)
    torch.manual_seed(seed)
    encoder = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        pad_token_id=0, eos_token_id=1,
    ))
    _perturb(encoder, seed + 1, std=0.02)
    return tokenizer, encoder.eval()


def tiny_chroma_pipeline(max_text_len: int = 16, seed: int = 0):
    """A ``ChromaPipeline`` of tiny random models (T5, VAE, transformer), float32 on CPU.

    VAE 2x compression and 2x2 patches: ``height x width`` gives ``(height / 4) * (width / 4)``
    image tokens (12 x 20 -> 15). Call it with ``max_sequence_length <= max_text_len``.
    """
    from diffusers import ChromaPipeline, FlowMatchEulerDiscreteScheduler

    from usp_dit.demo.tiny_flux import tiny_vae

    tokenizer, text_encoder = tiny_t5(max_text_len, seed + 10)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=16,
        max_image_seq_len=4096,
    )
    return ChromaPipeline(
        scheduler=scheduler, vae=tiny_vae(2, seed + 20), text_encoder=text_encoder, tokenizer=tokenizer,
        transformer=tiny_chroma(seed=seed + 30),
    )
