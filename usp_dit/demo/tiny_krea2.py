"""Tiny randomly initialised Krea 2 transformers and a ``Krea2Pipeline``, for tests and examples.

Layout: packed latents (batch, N, 4 * latent_channels), 2x2 latent patches row-major; the text
encoder's taps (batch, T, num_text_layers, text_dim) with their mask (batch, T), True = a real
token (any pattern: the pipeline pads in the middle of its template); ``position_ids`` (T + N, 3),
zeros for the text, (0, h, w) for the image; timestep (batch,) in [0, 1].

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import Krea2Transformer2DModel

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # text_hidden_dim of the tiny transformers (the real one: Qwen3-VL-4B's 2560)
NUM_TEXT_LAYERS = 3  # tapped text-encoder layers (the real one: 12)
LATENT_CHANNELS = 4  # the tiny stand-in for the real (Qwen-Image) VAE's 16


def tiny_krea2(num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, seed: int = 0) -> Krea2Transformer2DModel:
    """A small ``Krea2Transformer2DModel`` (two blocks, one layer-wise and one refiner text-fusion
    block; ``num_heads * head_dim`` wide, grouped-query attention with ``num_kv_heads`` as released),
    float32, eval mode.

    RoPE axes (t, h, w) split ``head_dim`` 1:3:3 scaled from the real (32, 48, 48) of 128: (4, 6, 6)
    for 16. Every parameter is perturbed with seeded noise (``tiny_video._perturb``): the RMS norms'
    zero-centred scales and the modulation tables too.

    Raises:
        ValueError: ``head_dim`` is not a multiple of 8.
    """
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 (three even RoPE axes), got {head_dim}")
    torch.manual_seed(seed)
    model = Krea2Transformer2DModel(
        in_channels=4 * LATENT_CHANNELS, num_layers=2, attention_head_dim=head_dim, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, intermediate_size=64, timestep_embed_dim=32, text_hidden_dim=TEXT_DIM,
        num_text_layers=NUM_TEXT_LAYERS, text_num_attention_heads=4, text_num_key_value_heads=2,
        text_intermediate_size=64, num_layerwise_text_blocks=1, num_refiner_text_blocks=1,
        axes_dims_rope=(head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8),
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class Krea2Inputs:
    """Keyword arguments of one ``Krea2Transformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, N, 4C)
    encoder_hidden_states: torch.Tensor  # (B, T, num_text_layers, text_dim)
    timestep: torch.Tensor  # (B,) in [0, 1]
    position_ids: torch.Tensor  # (T + N, 3)
    encoder_attention_mask: torch.Tensor | None  # (B, T) bool

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def krea2_inputs(
    model: Krea2Transformer2DModel, height: int, width: int,
    valid: tuple[list[int], ...] | None = ([0, 1, 2, 5, 6, 7, 8], [0, 1, 2, 3, 8]), text_len: int = 9,
    seed: int = 0,
) -> Krea2Inputs:
    """Seeded inputs of ``height x width`` patches; a different prompt, mask and timestep per element.

    ``valid[b]``: the positions of element b's real text tokens (by default holes in the middle, as
    the pipeline's ``[prompt | padding | suffix]``: 7 and 5 real tokens); ``None``: no mask. The
    batch size is ``len(valid)`` (2 without a mask).
    """
    cfg = model.config
    batch = 2 if valid is None else len(valid)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, height * width, cfg.in_channels, generator=g)
    text = torch.randn(batch, text_len, cfg.num_text_layers, cfg.text_hidden_dim, generator=g)
    mask = None
    if valid is not None:
        mask = torch.zeros(batch, text_len, dtype=torch.bool)
        for b in range(batch):
            mask[b, valid[b]] = True
    image_ids = torch.zeros(height, width, 3)
    image_ids[..., 1] = torch.arange(height)[:, None]
    image_ids[..., 2] = torch.arange(width)[None, :]
    ids = torch.cat([torch.zeros(text_len, 3), image_ids.reshape(-1, 3)])
    return Krea2Inputs(x, text, torch.rand(batch, generator=g), ids, mask)


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_qwen3_vl(vocab_size: int, seed: int = 0):
    """A 3-layer ``Qwen3VLModel`` of width ``TEXT_DIM`` (and a 1-layer vision tower the pipeline never
    calls), float32, eval mode: its hidden states 1..3 are the tapped layers."""
    from transformers import Qwen3VLConfig, Qwen3VLModel

    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=NUM_TEXT_LAYERS,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=1024,
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


def tiny_krea2_pipeline(seed: int = 0):
    """A ``Krea2Pipeline`` of tiny random models (Qwen3-VL-like text encoder, character tokenizer,
    Qwen-Image VAE, transformer), float32.

    The template is scaled down to the prompt then one suffix character, nothing cropped: each
    prompt gives the call's ``max_sequence_length`` text tokens (one per character, padded before
    the suffix: a mask with a hole). VAE: 8x spatial compression and patch 2, so ``height x width`` gives
    ``(height / 16) * (width / 16)`` image tokens; e.g. 80 x 112 -> 5 x 7 = 35.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, Krea2Pipeline

    from usp_dit.demo.tiny_qwen_image import tiny_qwen_image_vae, tiny_qwen_tokenizer

    tokenizer = tiny_qwen_tokenizer()
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=16,
        max_image_seq_len=4096,
    )
    pipe = Krea2Pipeline(
        scheduler=scheduler, vae=tiny_qwen_image_vae(seed + 20), text_encoder=tiny_qwen3_vl(len(tokenizer), seed + 10),
        tokenizer=tokenizer, transformer=tiny_krea2(seed=seed + 30),
        text_encoder_select_layers=tuple(range(1, NUM_TEXT_LAYERS + 1)),
    )
    # The real template's sizes, read by the stock code from these attributes, scaled down.
    pipe.prompt_template_encode_prefix = ""
    pipe.prompt_template_encode_suffix = "."
    pipe.prompt_template_encode_start_idx = 0
    pipe.prompt_template_encode_num_suffix_tokens = len(tokenizer(".").input_ids)
    return pipe
