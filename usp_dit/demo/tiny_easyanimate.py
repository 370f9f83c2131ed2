"""Tiny randomly initialised EasyAnimate transformers and pipelines, for tests and the video example.

Layout: latents (batch, channels, frames, height, width); text embeddings (batch, text_seq,
text_dim) (Qwen2-VL's), and optionally a second stream (batch, t5_seq, text_dim) (T5's);
inpaint latents (batch, channels + 1, frames, height, width) (the mask, then the masked video's
latents) and control latents (batch, channels, frames, height, width); timestep (batch,).

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import EasyAnimateTransformer3DModel

from usp_dit.demo.tiny_video import TEXT_DIM, _perturb

LATENT_CHANNELS = 4  # the tiny stand-in for the Magvit VAE's 16

# Variants of the family: tiny configs (4 heads x 16, 2 layers) exercising each path of the model.
EASYANIMATE_VARIANTS = {
    # EasyAnimate V5.1: MMDiT blocks throughout, Qwen2-VL text states.
    "v5.1": dict(in_channels=LATENT_CHANNELS, mmdit_layers=2),
    # Block 1 past mmdit_layers (text through the video's weights), a post-MLP norm, a second (T5)
    # text stream with RMS-normed projections, control latents concatenated on channels.
    "mixed-control": dict(in_channels=2 * LATENT_CHANNELS, mmdit_layers=1, after_norm=True,
                          add_norm_text_encoder=True, text_embed_dim_t5=TEXT_DIM),
    # The inpaint model: mask and masked-video latents concatenated on channels.
    "inpaint": dict(in_channels=2 * LATENT_CHANNELS + 1, mmdit_layers=2),
}


def tiny_easyanimate(variant: str = "v5.1", num_heads: int = 4, head_dim: int = 16, seed: int = 0,
                     dropout: float = 0.0) -> EasyAnimateTransformer3DModel:
    """A 2-layer ``EasyAnimateTransformer3DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    Every parameter is perturbed with seeded noise (``tiny_video._perturb``): no norm weight or
    bias keeps a default constant that could hide a token on the wrong rank.

    Raises:
        ValueError: ``variant`` is not one of ``EASYANIMATE_VARIANTS``.
    """
    if variant not in EASYANIMATE_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(EASYANIMATE_VARIANTS)}, got {variant!r}")
    config = dict(
        num_attention_heads=num_heads, attention_head_dim=head_dim, out_channels=LATENT_CHANNELS, patch_size=2,
        num_layers=2, time_embed_dim=32, text_embed_dim=TEXT_DIM, dropout=dropout,
    )
    config.update(EASYANIMATE_VARIANTS[variant])
    torch.manual_seed(seed)
    model = EasyAnimateTransformer3DModel(**config)
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class EasyAnimateInputs:
    """Keyword arguments of one ``EasyAnimateTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, C, F, H, W)
    timestep: torch.Tensor  # (B,)
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    encoder_hidden_states_t5: torch.Tensor | None = None  # (B, T5, text_dim)
    inpaint_latents: torch.Tensor | None = None  # (B, C + 1, F, H, W)
    control_latents: torch.Tensor | None = None  # (B, C, F, H, W)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def easyanimate_tokens(model: EasyAnimateTransformer3DModel, frames: int, height: int, width: int) -> int:
    """Video tokens of a latent of this size: frames * height/p * width/p (no temporal patch)."""
    p = model.config.patch_size
    return frames * (height // p) * (width // p)


def easyanimate_inputs(
    model: EasyAnimateTransformer3DModel, frames: int, height: int, width: int, batch: int = 2, text_len: int = 7,
    t5_len: int = 5, seed: int = 0,
) -> EasyAnimateInputs:
    """Seeded inputs for ``model`` (latent sizes); a different prompt and timestep per batch element.
    The T5 stream, inpaint or control latents are given where the config takes them."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, LATENT_CHANNELS, frames, height, width, generator=g)
    timestep = torch.rand(batch, generator=g) * 1000
    text = torch.randn(batch, text_len, cfg.text_embed_dim, generator=g)
    t5 = torch.randn(batch, t5_len, cfg.text_embed_dim_t5, generator=g) if cfg.text_embed_dim_t5 else None
    extra = torch.randn(batch, cfg.in_channels - LATENT_CHANNELS, frames, height, width, generator=g)
    inputs = EasyAnimateInputs(x, timestep, text, t5)
    if cfg.in_channels == 2 * LATENT_CHANNELS + 1:
        inputs.inpaint_latents = extra
    elif cfg.in_channels == 2 * LATENT_CHANNELS:
        inputs.control_latents = extra
    return inputs


# ---- the whole pipeline ---------------------------------------------------------------------------

# Qwen2-VL's chat template, cut to what EasyAnimatePipeline uses (one user message of text).
_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_qwen2vl_tokenizer():
    """The character tokenizer of ``tiny_qwen_image`` with a chat template (EasyAnimatePipeline
    wraps each prompt in it)."""
    from usp_dit.demo.tiny_qwen_image import tiny_qwen_tokenizer

    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = _CHAT_TEMPLATE
    return tokenizer


def tiny_qwen2vl_text_encoder(vocab_size: int, seed: int = 0):
    """A 2-layer ``Qwen2VLForConditionalGeneration`` of width ``TEXT_DIM`` (and a 1-layer vision
    tower the pipeline never calls), float32, eval mode: its second-to-last hidden states are the
    prompt embeddings."""
    from transformers import Qwen2VLConfig, Qwen2VLForConditionalGeneration

    config = Qwen2VLConfig(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},  # 2 * (1 + 1 + 2) = head_dim 8
            bos_token_id=None, eos_token_id=1, pad_token_id=0,
        ),
        vision_config=dict(depth=1, embed_dim=16, hidden_size=TEXT_DIM, num_heads=2, mlp_ratio=2),
    )
    torch.manual_seed(seed)
    encoder = Qwen2VLForConditionalGeneration(config)
    _perturb(encoder, seed + 1, std=0.02)
    return encoder.eval()


def tiny_magvit_vae(seed: int = 0):
    """An ``AutoencoderKLMagvit`` of ``LATENT_CHANNELS``: 8x spatial, 4x temporal compression."""
    from diffusers import AutoencoderKLMagvit

    torch.manual_seed(seed)
    return AutoencoderKLMagvit(
        latent_channels=LATENT_CHANNELS, block_out_channels=[8, 8, 8, 8], layers_per_block=1, norm_num_groups=2,
    ).eval()


def tiny_easyanimate_pipeline(max_text_len: int | None = None, seed: int = 0):
    """An ``EasyAnimatePipeline`` (V5.1-like) of tiny random models, float32.

    The pipeline pads every prompt to 256 tokens (its ``encode_prompt`` default; its ``__call__``
    takes no length), all of which the transformer attends to. VAE: 8x spatial, 4x temporal
    compression and patch 2, so ``height x width x num_frames`` gives
    ``((num_frames - 1) / 4 + 1) * (height / 16) * (width / 16)`` video tokens; e.g.
    48 x 48 x 9 frames -> 3 * 3 * 3 = 27 tokens. ``max_text_len`` is accepted for the video
    example's uniform call and ignored.
    """
    from diffusers import EasyAnimatePipeline, FlowMatchEulerDiscreteScheduler

    tokenizer = tiny_qwen2vl_tokenizer()
    return EasyAnimatePipeline(
        vae=tiny_magvit_vae(seed + 20), text_encoder=tiny_qwen2vl_text_encoder(len(tokenizer), seed + 10),
        tokenizer=tokenizer, transformer=tiny_easyanimate(seed=seed + 30), scheduler=FlowMatchEulerDiscreteScheduler(),
    )
