"""Tiny randomly initialised CogView4 / CogView3-Plus transformers and a ``CogView4Pipeline``, built in code.

Layout: latents (batch, channels, height, width) with 2x2 patches: ``(height / 2) * (width / 2)``
image tokens; text embeddings (batch, text_len, TEXT_DIM); CogView4's optional ``attention_mask``
(batch, text_len), 1 for a real token (a prefix here: valid lengths differ per element); the size
conditions (batch, 2) each.

Nothing is downloaded: the tokenizer is the character T5 tokenizer of ``tiny_chroma`` (CogView4's
GLM tokenizer stands in for nothing else: the pipeline only calls it and reads ``pad_token_id``),
the GLM text encoder, VAE and transformer are built from small configs and seeded. Every process
that calls a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import CogView3PlusTransformer2DModel, CogView4Transformer2DModel

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # text_embed_dim (CogView4: GLM-4's 4096; CogView3-Plus: T5's 4096)
LATENT_CHANNELS = 4  # the tiny stand-in for the real VAE's 16


def tiny_cogview4(
    num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, in_channels: int = LATENT_CHANNELS, seed: int = 0,
) -> CogView4Transformer2DModel:
    """A small ``CogView4Transformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    ``in_channels``: 2 x LATENT_CHANNELS for CogView4 Control (control latents on the channels).
    The RoPE's (h, w) axes table is 16 x 16 (the real 256 x 256): positions are rescaled to it, so
    every grid size gets distinct rows. Every parameter is perturbed (``tiny_video._perturb``).
    """
    torch.manual_seed(seed)
    model = CogView4Transformer2DModel(
        patch_size=2, in_channels=in_channels, out_channels=LATENT_CHANNELS, num_layers=num_layers,
        attention_head_dim=head_dim, num_attention_heads=num_heads, text_embed_dim=TEXT_DIM, time_embed_dim=32,
        condition_dim=16, rope_axes_dim=(16, 16),
    )
    _perturb(model, seed + 1)
    return model.eval()


def tiny_cogview3plus(num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, seed: int = 0):
    """A small ``CogView3PlusTransformer2DModel``, float32, eval mode, every parameter perturbed."""
    torch.manual_seed(seed)
    model = CogView3PlusTransformer2DModel(
        patch_size=2, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=num_layers,
        attention_head_dim=head_dim, num_attention_heads=num_heads, text_embed_dim=TEXT_DIM, time_embed_dim=32,
        condition_dim=16, pos_embed_max_size=16, sample_size=16,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class CogViewInputs:
    """Keyword arguments of one ``CogView4Transformer2DModel`` / ``CogView3PlusTransformer2DModel`` call."""

    hidden_states: torch.Tensor  # (B, C, H, W)
    encoder_hidden_states: torch.Tensor  # (B, T, TEXT_DIM)
    timestep: torch.Tensor  # (B,)
    original_size: torch.Tensor  # (B, 2)
    target_size: torch.Tensor  # (B, 2)
    crop_coords: torch.Tensor  # (B, 2)
    attention_mask: torch.Tensor | None = None  # (B, T) 0 / 1 (CogView4 only)

    def kwargs(self) -> dict:
        kwargs = dict(self.__dict__)
        if kwargs["attention_mask"] is None:
            kwargs.pop("attention_mask")  # CogView3-Plus takes none
        return kwargs


def cogview_inputs(
    height: int, width: int, valid: list[int] | None, text_len: int = 7, channels: int = LATENT_CHANNELS,
    seed: int = 0,
) -> CogViewInputs:
    """Seeded inputs for a ``height x width`` grid of patches (latents 2x that), one element per entry
    of ``valid`` (its count of real text tokens, a prefix: the mask), or batch 2 and no mask for
    ``None``; a different prompt, latent, timestep and size per element."""
    g = torch.Generator().manual_seed(seed)
    batch = len(valid) if valid else 2
    mask = None
    if valid:
        mask = (torch.arange(text_len)[None, :] < torch.tensor(valid)[:, None]).float()
    return CogViewInputs(
        hidden_states=torch.randn(batch, channels, 2 * height, 2 * width, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TEXT_DIM, generator=g),
        timestep=torch.rand(batch, generator=g) * 1000,
        original_size=torch.randint(64, 1024, (batch, 2), generator=g).float(),
        target_size=torch.randint(64, 1024, (batch, 2), generator=g).float(),
        crop_coords=torch.randint(0, 64, (batch, 2), generator=g).float(),
        attention_mask=mask,
    )


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_glm(vocab_size: int, seed: int = 0):
    """A 2-layer ``GlmModel`` of width ``TEXT_DIM`` (CogView4's GLM-4-9B), every weight perturbed."""
    from transformers import GlmConfig, GlmModel

    torch.manual_seed(seed)
    encoder = GlmModel(GlmConfig(
        vocab_size=vocab_size, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, pad_token_id=0,
    ))
    _perturb(encoder, seed + 1, std=0.02)
    return encoder.eval()


def tiny_cogview4_pipeline(max_text_len: int = 64, control: bool = False, seed: int = 0):
    """A ``CogView4Pipeline`` (``CogView4ControlPipeline`` with ``control``) of tiny random models,
    float32 on CPU.

    VAE 8x compression (as the real one) and 2x2 patches: ``height x width`` (multiples of 16, the
    pipeline's check) gives ``(height / 16) * (width / 16)`` image tokens (48 x 80 -> 15). Prompts are padded on the left to a multiple of 16 tokens (one per
    character, plus the end token). Call it with ``max_sequence_length <= max_text_len``.
    """
    from diffusers import CogView4ControlPipeline, CogView4Pipeline, FlowMatchEulerDiscreteScheduler

    from usp_dit.demo.tiny_chroma import tiny_t5
    from usp_dit.demo.tiny_flux import tiny_vae

    tokenizer, _ = tiny_t5(max_text_len, seed + 10)
    scheduler = FlowMatchEulerDiscreteScheduler(
        base_shift=0.25, max_shift=0.75, base_image_seq_len=256, use_dynamic_shifting=True,
        time_shift_type="linear",
    )
    cls = CogView4ControlPipeline if control else CogView4Pipeline
    channels = 2 * LATENT_CHANNELS if control else LATENT_CHANNELS
    return cls(
        tokenizer=tokenizer, text_encoder=tiny_glm(len(tokenizer), seed + 11), vae=tiny_vae(4, seed + 20),
        transformer=tiny_cogview4(in_channels=channels, seed=seed + 30), scheduler=scheduler,
    )
