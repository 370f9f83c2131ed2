"""Tiny randomly initialised Qwen-Image 2.1 transformers and their inputs, for tests and examples.

Layout: packed latents (batch, tokens, latent_channels), each sample's condition images first and
the target image last, each frame-major ``(1, h, w)`` (2.1 consumes latents unpatched); text
embeddings (batch, text_seq, context_dim) over the vision-language sequence *without* the target's
slots, condition images' slots included (their embeddings are replaced by the latents); ``img_mask``
(batch, text_seq + target / 4) True at image slots (each slot stands for 2 x 2 latent tokens, so an
image's token count is a multiple of 4); the prompt mask (batch, text_seq), True = a real token;
timestep (batch,) in [0, 1].

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
from diffusers import QwenImage21Transformer2DModel

from usp_dit.demo.tiny_video import _perturb

CONTEXT_DIM = 32  # context_in_dim of the tiny transformers (the real one: Qwen3-VL's 4096)
LATENT_CHANNELS = 8  # the tiny stand-in for the real VAE's 64


def tiny_qwen_image21(
    num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, causal_condition: bool = True, seed: int = 0,
) -> QwenImage21Transformer2DModel:
    """A small ``QwenImage21Transformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    RoPE axes (frame, height, width) split ``head_dim`` 2:3:3 as the release's (16, 56, 56) of 128.
    Every parameter is perturbed with seeded noise (the zero-centred norms' zeros included).

    Raises:
        ValueError: ``head_dim`` is not a multiple of 16.
    """
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (three even RoPE axes, 2:3:3), got {head_dim}")
    torch.manual_seed(seed)
    model = QwenImage21Transformer2DModel(
        patch_size=1, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=num_layers,
        attention_head_dim=head_dim, num_attention_heads=num_heads, context_in_dim=CONTEXT_DIM,
        axes_dims_rope=(head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8), causal_condition=causal_condition,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class QwenImage21Inputs:
    """Keyword arguments of one ``QwenImage21Transformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, cond + target tokens, latent_channels)
    encoder_hidden_states: torch.Tensor  # (B, T, context_dim)
    timestep: torch.Tensor  # (B,)
    img_shapes: list  # per sample: [(1, h, w) of each condition image, then of the target]
    img_mask: torch.Tensor  # (B, T + target / 4) bool
    encoder_hidden_states_mask: torch.Tensor | None  # (B, T) bool

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def qwen_image21_inputs(
    model: QwenImage21Transformer2DModel, images: list[tuple[int, int, int]], masks: list[list[int]],
    slots_at: int = 2, seed: int = 0,
) -> QwenImage21Inputs:
    """Seeded inputs: batch ``len(masks)``, a different prompt and timestep per element.

    ``images``: (1, h, w) of each condition image, then of the target (h * w a multiple of 4);
    ``masks[b]``: element b's mask over the ``T`` vision-language positions (0/1, holes allowed),
    the condition images' slots placed from position ``slots_at`` on (their mask entries are unread).
    """
    for shape in images:
        if prod(shape) % 4:
            raise ValueError(f"an image's token count must be a multiple of 4 (2 x 2 tokens a slot), got {shape}")
    batch, text_len = len(masks), len(masks[0])
    slots = [False] * text_len
    pos = slots_at
    for shape in images[:-1]:
        for _ in range(prod(shape) // 4):
            slots[pos] = True
            pos += 1
    img_mask = torch.tensor([slots + [True] * (prod(images[-1]) // 4)] * batch)
    g = torch.Generator().manual_seed(seed)
    tokens = sum(prod(s) for s in images)
    x = torch.randn(batch, tokens, model.config.in_channels, generator=g)
    text = torch.randn(batch, text_len, model.config.context_in_dim, generator=g)
    timestep = torch.rand(batch, generator=g)
    mask = torch.tensor(masks, dtype=torch.bool)
    return QwenImage21Inputs(x, text, timestep, [list(images)] * batch, img_mask, mask)


def qwen_image21_lengths(images: list[tuple[int, int, int]], text_len: int) -> tuple[int, int]:
    """(prefix, target) token counts of the joint sequence: the text positions that are not slots
    plus the condition images' tokens, and the target's tokens."""
    cond = sum(prod(s) for s in images[:-1])
    return text_len - cond // 4 + cond, prod(images[-1])
