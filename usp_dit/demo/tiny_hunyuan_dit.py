"""Tiny randomly initialised HunyuanDiT transformers, built in code for tests and examples.

Layout: latents (batch, LATENT_CHANNELS, height, width), 2 x 2 latent pixels a token: ``tokens =
(height / 2) * (width / 2)``, row-major; Bert-side text (batch, TEXT_LEN, TEXT_DIM) and mT5-side
text (batch, TEXT_LEN_T5, TEXT_DIM), each with a 0/1 mask; timesteps (batch,); image_meta_size
(batch, 6); style (batch,); the 2D RoPE table ``(cos, sin)`` (tokens, head_dim) as
``HunyuanDiTPipeline`` makes it (``get_2d_rotary_pos_embed`` over the token grid). The output has
2 x LATENT_CHANNELS channels (learned sigma).

Nothing is downloaded. Every process that calls a builder with the same arguments gets
bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import HunyuanDiT2DModel
from diffusers.models.embeddings import get_2d_rotary_pos_embed

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # cross_attention_dim and cross_attention_dim_t5 (HunyuanDiT: Bert 1024, mT5-XL 2048)
TEXT_LEN, TEXT_LEN_T5 = 5, 7  # (HunyuanDiT: 77, 256)
LATENT_CHANNELS = 4


def tiny_hunyuan_dit(
    num_heads: int = 4, head_dim: int = 16, num_layers: int = 6, seed: int = 0, text_len: int = TEXT_LEN,
    text_len_t5: int = TEXT_LEN_T5,
) -> HunyuanDiT2DModel:
    """A small ``HunyuanDiT2DModel`` (``num_heads * head_dim`` wide, patch 2), float32, eval mode.

    6 layers (an even count, as 28 released: the skips pair up): blocks 4 and 5 take the long skips
    of blocks 1 and 0. Style and image-size
    conditions on (as v1.0 - v1.1; v1.2 turns them off). Every parameter is perturbed
    (``tiny_video._perturb``).
    """
    torch.manual_seed(seed)
    model = HunyuanDiT2DModel(
        num_attention_heads=num_heads, attention_head_dim=head_dim, in_channels=LATENT_CHANNELS, patch_size=2,
        sample_size=8, hidden_size=num_heads * head_dim, num_layers=num_layers, mlp_ratio=2.0,
        cross_attention_dim=TEXT_DIM, cross_attention_dim_t5=TEXT_DIM, pooled_projection_dim=TEXT_DIM,
        text_len=text_len, text_len_t5=text_len_t5,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class HunyuanDiTInputs:
    """Keyword arguments of one ``HunyuanDiT2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, LATENT_CHANNELS, 2 H, 2 W)
    timestep: torch.Tensor  # (B,)
    encoder_hidden_states: torch.Tensor  # (B, TEXT_LEN, TEXT_DIM)
    text_embedding_mask: torch.Tensor  # (B, TEXT_LEN) 0 / 1
    encoder_hidden_states_t5: torch.Tensor  # (B, TEXT_LEN_T5, TEXT_DIM)
    text_embedding_mask_t5: torch.Tensor  # (B, TEXT_LEN_T5) 0 / 1
    image_meta_size: torch.Tensor  # (B, 6)
    style: torch.Tensor  # (B,) long
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor]  # (H * W, head_dim) each

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def _prefix_mask(lengths: list[int], length: int) -> torch.Tensor:
    return (torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]).long()


def hunyuan_dit_inputs(
    model: HunyuanDiT2DModel, height: int, width: int, prompt_lengths: list[int], prompt_lengths_t5: list[int],
    seed: int = 0,
) -> HunyuanDiTInputs:
    """Seeded inputs for a ``height x width`` token grid, batch ``len(prompt_lengths)``: a different
    latent, prompt, timestep and size per element (style 0: the released models have one); element b's valid Bert / mT5 tokens are
    ``prompt_lengths[b]`` / ``prompt_lengths_t5[b]`` (prefix masks, as the pipeline's right padding).
    The RoPE grid is cropped at an offset, so its rows are not those of a grid starting at 0."""
    g = torch.Generator().manual_seed(seed)
    batch = len(prompt_lengths)
    head_dim = model.config.attention_head_dim
    rope = get_2d_rotary_pos_embed(head_dim, ((1, 2), (1 + height, 2 + width)), (height, width))
    return HunyuanDiTInputs(
        hidden_states=torch.randn(batch, LATENT_CHANNELS, 2 * height, 2 * width, generator=g),
        timestep=torch.rand(batch, generator=g) * 1000,
        encoder_hidden_states=torch.randn(batch, TEXT_LEN, TEXT_DIM, generator=g),
        text_embedding_mask=_prefix_mask(prompt_lengths, TEXT_LEN),
        encoder_hidden_states_t5=torch.randn(batch, TEXT_LEN_T5, TEXT_DIM, generator=g),
        text_embedding_mask_t5=_prefix_mask(prompt_lengths_t5, TEXT_LEN_T5),
        image_meta_size=torch.rand(batch, 6, generator=g) * 1024,
        style=torch.zeros(batch, dtype=torch.long), image_rotary_emb=tuple(t.float() for t in rope),
    )


def tiny_hunyuan_dit_pipeline(seed: int = 0):
    """A ``HunyuanDiTPipeline`` of tiny random models (a Bert and a T5 encoder of width ``TEXT_DIM``
    with one character tokenizer, an 8x VAE, the transformer), float32 on CPU, no safety checker, a
    DPM-Solver++ scheduler (the released DDPM one divides by sqrt(alpha_bar) ~ 6e-3 at t = 999 in a
    2-step test, scaling float32 rounding by ~160).

    The pipeline pads its two prompts to 77 and 256 tokens (fixed there), so the transformer's text
    lengths are those. 8x VAE and 2 x 2 patches, as the pipeline's RoPE grid assumes: ``height x
    width`` gives ``(height / 16) * (width / 16)`` image tokens (80 x 112 -> 5 x 7 = 35). Call it
    with ``use_resolution_binning=False`` (the bins are the real model's sizes).
    """
    from diffusers import DPMSolverMultistepScheduler, HunyuanDiTPipeline
    from transformers import BertConfig, BertModel

    from usp_dit.demo.tiny_chroma import tiny_t5
    from usp_dit.demo.tiny_flux import tiny_vae

    tokenizer, text_encoder_2 = tiny_t5(256, seed + 10)
    torch.manual_seed(seed + 11)
    bert = BertModel(BertConfig(
        vocab_size=len(tokenizer), hidden_size=TEXT_DIM, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=128, pad_token_id=0,
    ), add_pooling_layer=False)
    _perturb(bert, seed + 12, std=0.02)
    return HunyuanDiTPipeline(
        vae=tiny_vae(4, seed + 20), text_encoder=bert.eval(), tokenizer=tokenizer,
        transformer=tiny_hunyuan_dit(seed=seed + 30, text_len=77, text_len_t5=256),
        scheduler=DPMSolverMultistepScheduler(), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False,
        text_encoder_2=text_encoder_2, tokenizer_2=tokenizer,
    )
