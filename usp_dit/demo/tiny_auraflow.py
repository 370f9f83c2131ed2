"""Tiny randomly initialised AuraFlow transformer and ``AuraFlowPipeline``, for tests and the image example.

Layout: latents (batch, 4, height, width); image tokens ``(height / 2) * (width / 2)`` (patch 2),
row-major; text embeddings (batch, text_len, text_dim) (UMT5's, padded positions zeroed by the
pipeline); timestep (batch,) in [0, 1].

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import AuraFlowTransformer2DModel

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # joint_attention_dim (UMT5-XXL's 2048 in the release)
LATENT_CHANNELS = 4  # as the release's SDXL-like VAE


def tiny_auraflow(
    num_heads: int = 6, head_dim: int = 16, num_joint_layers: int = 2, num_single_layers: int = 2, seed: int = 0,
) -> AuraFlowTransformer2DModel:
    """A small ``AuraFlowTransformer2DModel`` (``num_heads * head_dim`` wide: caption projection of the
    same width, as the release's 3072), float32, eval mode, with a learned position table of 16 x 16
    patches; every parameter perturbed (the register tokens and position table included)."""
    torch.manual_seed(seed)
    model = AuraFlowTransformer2DModel(
        sample_size=16, patch_size=2, in_channels=LATENT_CHANNELS, num_mmdit_layers=num_joint_layers,
        num_single_dit_layers=num_single_layers, attention_head_dim=head_dim, num_attention_heads=num_heads,
        joint_attention_dim=TEXT_DIM, caption_projection_dim=num_heads * head_dim, out_channels=LATENT_CHANNELS,
        pos_embed_max_size=256,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class AuraFlowInputs:
    """Keyword arguments of one ``AuraFlowTransformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, 4, H, W)
    encoder_hidden_states: torch.Tensor  # (B, T, TEXT_DIM)
    timestep: torch.Tensor  # (B,)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def auraflow_inputs(
    model: AuraFlowTransformer2DModel, height: int, width: int, valid: list[int], text_len: int = 9, seed: int = 0,
) -> AuraFlowInputs:
    """Seeded inputs, batch ``len(valid)``; ``height x width`` latent pixels give
    ``(height / 2) * (width / 2)`` image tokens. Element b's prompt has ``valid[b]`` real tokens,
    the rest zeroed as ``AuraFlowPipeline`` zeroes padding (the model takes no mask: padding is attended)."""
    g = torch.Generator().manual_seed(seed)
    batch = len(valid)
    x = torch.randn(batch, model.config.in_channels, height, width, generator=g)
    text = torch.randn(batch, text_len, model.config.joint_attention_dim, generator=g)
    text = text * (torch.arange(text_len)[None, :, None] < torch.tensor(valid)[:, None, None])
    return AuraFlowInputs(x, text, torch.rand(batch, generator=g))


def _umt5(vocab: int, seed: int):
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(seed)
    encoder = UMT5EncoderModel(UMT5Config(
        vocab_size=vocab, d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4, pad_token_id=0, eos_token_id=1,
    ))
    _perturb(encoder, seed + 1, std=0.02)
    return encoder.eval()


def tiny_auraflow_pipeline(max_text_len: int = 16, seed: int = 0):
    """An ``AuraFlowPipeline`` of tiny random models (UMT5 encoder over a character tokenizer, a 2x
    VAE, the transformer above), float32. ``height x width`` pixels give ``(height / 4) * (width / 4)``
    image tokens; e.g. 20 x 28 -> 5 x 7 = 35. Call it with ``max_sequence_length <= max_text_len``."""
    from diffusers import AuraFlowPipeline, FlowMatchEulerDiscreteScheduler

    from usp_dit.demo.tiny_flux import _tokenizers, tiny_vae

    _, tokenizer = _tokenizers(max_text_len)
    return AuraFlowPipeline(
        tokenizer=tokenizer, text_encoder=_umt5(len(tokenizer), seed + 10), vae=tiny_vae(2, seed + 20),
        transformer=tiny_auraflow(seed=seed + 30), scheduler=FlowMatchEulerDiscreteScheduler(),
    )
