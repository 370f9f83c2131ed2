"""Tiny randomly initialised Ideogram 4 transformers and an ``Ideogram4Pipeline``, built in code for tests and examples.

Layout: one packed sequence per element as ``Ideogram4Pipeline`` builds it: ``[left padding;
text (text_lens[b] tokens); image (grid_h * grid_w tokens, row-major)]``, L = max_text + N;
``hidden_states`` (B, L, IN_CHANNELS), ``encoder_hidden_states`` (B, L, LLM_FEATURES), ``position_ids``
(B, L, 3), ``segment_ids`` / ``indicator`` (B, L) long, ``timestep`` (B,) in [0, 1] (or (B, L)).

Nothing is downloaded: the pipeline's text encoder is a tiny ``Qwen3VLModel`` with the 36 decoder
layers the pipeline taps (13 of them), the character tokenizer of ``usp_dit.demo.tiny_qwen_image``
with a one-message chat template, the VAE the tiny ``AutoencoderKLFlux2`` of ``usp_dit.demo.tiny_flux2``.
Every process that calls a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import Ideogram4Transformer2DModel

from usp_dit.demo.tiny_flux2 import LATENT_CHANNELS
from usp_dit.demo.tiny_video import _perturb

IN_CHANNELS = 4 * LATENT_CHANNELS  # the pipeline's 2x2-patchified Flux.2 latent (released: 128)
TEXT_DIM = 16  # the tiny Qwen3-VL's width (released: Qwen3-VL-8B's 4096)
NUM_TAPS = 13  # QWEN3_VL_ACTIVATION_LAYERS: hidden states of 13 decoder layers, concatenated
LLM_FEATURES = NUM_TAPS * TEXT_DIM  # llm_features_dim (released: 13 * 4096 = 53248)


def tiny_ideogram4(num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, seed: int = 0) -> Ideogram4Transformer2DModel:
    """A small ``Ideogram4Transformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    MRoPE sections (t, h, w) = head_dim // 8 each (interleaved: h and w take every third of the
    first 3 * head_dim // 8 frequencies; released (24, 20, 20) of 128). Every parameter is perturbed
    (``tiny_video._perturb``), the stock norms' ones too.
    """
    torch.manual_seed(seed)
    section = max(1, head_dim // 8)
    model = Ideogram4Transformer2DModel(
        in_channels=IN_CHANNELS, num_layers=num_layers, attention_head_dim=head_dim, num_attention_heads=num_heads,
        intermediate_size=2 * num_heads * head_dim, adaln_dim=32, llm_features_dim=LLM_FEATURES,
        rope_theta=5_000_000, mrope_section=(section, section, section),
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class Ideogram4Inputs:
    """Keyword arguments of one ``Ideogram4Transformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, L, IN_CHANNELS)
    timestep: torch.Tensor  # (B,) or (B, L)
    encoder_hidden_states: torch.Tensor  # (B, L, LLM_FEATURES)
    position_ids: torch.Tensor  # (B, L, 3)
    segment_ids: torch.Tensor  # (B, L)
    indicator: torch.Tensor  # (B, L)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def ideogram4_inputs(grid_h: int, grid_w: int, text_lens: tuple[int, ...], max_text: int, seed: int = 0,
                     per_token_time: bool = False) -> Ideogram4Inputs:
    """Seeded inputs packed as the pipeline packs them (``Ideogram4Pipeline._prepare_ids``): one element
    per entry of ``text_lens`` (its valid text tokens, left-padded to ``max_text``), each its own
    latents, text features and time. ``max_text=0``: the unconditional call's image alone. Every row
    of the features and latents is random (the model itself zeroes the rows of the other roles)."""
    from diffusers import Ideogram4Pipeline

    g = torch.Generator().manual_seed(seed)
    batch, length = len(text_lens), max_text + grid_h * grid_w
    position_ids, segment_ids, indicator = Ideogram4Pipeline._prepare_ids(
        list(text_lens), grid_h, grid_w, max_text, torch.device("cpu"))
    time_shape = (batch, length) if per_token_time else (batch,)
    return Ideogram4Inputs(
        hidden_states=torch.randn(batch, length, IN_CHANNELS, generator=g),
        timestep=torch.rand(time_shape, generator=g),
        encoder_hidden_states=torch.randn(batch, length, LLM_FEATURES, generator=g),
        position_ids=position_ids, segment_ids=segment_ids, indicator=indicator,
    )


# ---- the whole pipeline ---------------------------------------------------------------------------

_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% for c in m['content'] %}{{ c['text'] }}{% endfor %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_qwen3_vl_36(vocab_size: int, seed: int = 0):
    """A ``Qwen3VLModel`` of width ``TEXT_DIM`` with the 36 decoder layers ``Ideogram4Pipeline`` taps
    (and a 1-layer vision tower it never calls), float32, eval mode."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=TEXT_DIM, intermediate_size=32, num_hidden_layers=36,
            num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=1024,
            rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True},
            pad_token_id=0,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT_DIM,
                           deepstack_visual_indexes=[]),
    )
    torch.manual_seed(seed)
    encoder = Qwen3VLModel(config)
    _perturb(encoder, seed + 1, std=0.02)
    return encoder.eval()


def tiny_ideogram4_pipeline(seed: int = 0):
    """An ``Ideogram4Pipeline`` of tiny random models: the conditional and unconditional transformers
    (two differently seeded ``tiny_ideogram4``), the 36-layer tiny Qwen3-VL, the character tokenizer,
    the Flux.2 VAE (2 blocks: ``vae_scale_factor`` 2, times the 2x2 patchify: ``height x width`` gives
    ``(height / 4) * (width / 4)`` image tokens, 20 x 28 -> 35), float32 on CPU, no prompt enhancer.
    Call it with a small ``max_sequence_length`` (the prompt's chat template is about 30 tokens)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Ideogram4Pipeline

    from usp_dit.demo.tiny_flux2 import tiny_flux2_vae
    from usp_dit.demo.tiny_qwen_image import tiny_qwen_tokenizer

    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = _CHAT_TEMPLATE
    return Ideogram4Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=tiny_flux2_vae(seed + 20),
        text_encoder=tiny_qwen3_vl_36(len(tokenizer), seed + 10), tokenizer=tokenizer,
        transformer=tiny_ideogram4(seed=seed + 30), unconditional_transformer=tiny_ideogram4(seed=seed + 40),
    )
