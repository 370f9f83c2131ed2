"""Tiny randomly initialised HunyuanVideo transformers and a ``HunyuanVideoPipeline``, for tests and examples.

Layout: latents (batch, channels, frames, height, width); text embeddings (batch, text_seq,
text_dim) with their prompt mask (batch, text_seq), 1 = real token; pooled CLIP embeddings
(batch, pooled_dim); timestep and guidance (batch,).

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import HunyuanVideoTransformer3DModel

from usp_dit.demo.tiny_video import _CHARS, TEXT_DIM, _perturb

LATENT_CHANNELS = 4  # the tiny stand-in for the real VAE's 16

# Variants of the family, each a tiny version of a released checkpoint's config.
HUNYUAN_VIDEO_VARIANTS = {
    # HunyuanVideo T2V (guidance-distilled: the guidance scale is embedded).
    "t2v": dict(in_channels=LATENT_CHANNELS, guidance_embeds=True),
    # HunyuanVideo-I2V, "latent_concat": noise, image latents and a mask channel on channels (2 * 16 + 1 in).
    "i2v-concat": dict(
        in_channels=2 * LATENT_CHANNELS + 1, guidance_embeds=False, image_condition_type="latent_concat"),
    # HunyuanVideo-I2V, "token_replace": the first latent frame's tokens get their own modulation
    # (timestep 0), the other tokens the ordinary one.
    "i2v-token-replace": dict(in_channels=LATENT_CHANNELS, guidance_embeds=True, image_condition_type="token_replace"),
}


def tiny_hunyuan_video(
    variant: str = "t2v", num_heads: int = 4, head_dim: int = 16, seed: int = 0,
) -> HunyuanVideoTransformer3DModel:
    """A ``HunyuanVideoTransformer3DModel`` with one dual-stream and one single-stream block and one
    token refiner block (``num_heads * head_dim`` wide), float32, eval mode.

    RoPE axes (time, height, width) split ``head_dim`` as (4, 6, 6) for 16 (the real model's
    (16, 56, 56) for 128, scaled). Every parameter is perturbed with seeded noise
    (``tiny_video._perturb``): no norm weight or bias keeps a default constant.

    Raises:
        ValueError: ``variant`` is not one of ``HUNYUAN_VIDEO_VARIANTS``, or ``head_dim`` is not a
            multiple of 8 (each RoPE axis needs an even width).
    """
    if variant not in HUNYUAN_VIDEO_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(HUNYUAN_VIDEO_VARIANTS)}, got {variant!r}")
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 (three even RoPE axes), got {head_dim}")
    axes = (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)
    config = dict(
        out_channels=LATENT_CHANNELS, num_attention_heads=num_heads, attention_head_dim=head_dim, num_layers=1,
        num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        text_embed_dim=TEXT_DIM, pooled_projection_dim=TEXT_DIM, rope_axes_dim=axes,
    )
    config.update(HUNYUAN_VIDEO_VARIANTS[variant])
    torch.manual_seed(seed)
    model = HunyuanVideoTransformer3DModel(**config)
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class HunyuanVideoInputs:
    """Keyword arguments of one ``HunyuanVideoTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, C, F, H, W)
    timestep: torch.Tensor  # (B,)
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    encoder_attention_mask: torch.Tensor  # (B, T), 1 = real prompt token
    pooled_projections: torch.Tensor  # (B, pooled_dim)
    guidance: torch.Tensor | None = None  # (B,), guidance-distilled variants only

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def hunyuan_video_tokens(model: HunyuanVideoTransformer3DModel, frames: int, height: int, width: int) -> int:
    """Video tokens of a latent of this size: frames/p_t * height/p * width/p."""
    p, p_t = model.config.patch_size, model.config.patch_size_t
    return (frames // p_t) * (height // p) * (width // p)


def hunyuan_video_inputs(
    model: HunyuanVideoTransformer3DModel, frames: int, height: int, width: int,
    valid: list[list[int]] | None = None, text_len: int = 9, seed: int = 0,
) -> HunyuanVideoInputs:
    """Seeded inputs; a different prompt, prompt mask, timestep and guidance per batch element.

    ``valid[b]``: the positions of element b's real prompt tokens (default: a prompt mask with a
    hole for element 0, ``[0, 1, 3, 4, 5, 6]``, and a prefix of 4 for element 1). The batch size is
    ``len(valid)``.
    """
    cfg = model.config
    valid = valid if valid is not None else [[0, 1, 3, 4, 5, 6], [0, 1, 2, 3]]
    batch = len(valid)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg.in_channels, frames, height, width, generator=g)
    text = torch.randn(batch, text_len, cfg.text_embed_dim, generator=g)
    mask = torch.zeros(batch, text_len)
    for b, positions in enumerate(valid):
        mask[b, positions] = 1.0
    pooled = torch.randn(batch, cfg.pooled_projection_dim, generator=g)
    timestep = torch.randint(1, 1000, (batch,), generator=g).float()
    guidance = (torch.rand(batch, generator=g) * 6 + 1) * 1000 if cfg.guidance_embeds else None
    return HunyuanVideoInputs(x, timestep, text, mask, pooled, guidance)


# ---- whole pipelines -----------------------------------------------------------------------------

# The pipeline's default template is the real model's chat template, cropped at its 95th Llama
# token; a tiny tokenizer over single characters needs its own: the prompt alone, nothing cropped.
TINY_PROMPT_TEMPLATE = {"template": "{}", "crop_start": 0}


def _tokenizers(max_length: int):
    """A Llama (BPE) tokenizer padding on the right, as HunyuanVideo's does, and a CLIP tokenizer,
    both over single characters and built without any file; returns ``(llama, clip)``."""
    from transformers import CLIPTokenizer, LlamaTokenizerFast

    llama_vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "<pad>": 3, "\u2581": 4}
    clip_vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in _CHARS:
        if c != " ":
            llama_vocab.setdefault(c, len(llama_vocab))
            clip_vocab.setdefault(c, len(clip_vocab))
            clip_vocab.setdefault(c + "</w>", len(clip_vocab))
    llama = LlamaTokenizerFast(
        vocab=llama_vocab, merges=[], pad_token="<pad>", padding_side="right", model_max_length=max_length)
    clip = CLIPTokenizer(vocab=clip_vocab, merges=[], model_max_length=77)
    return llama, clip


def _text_encoders(llama_vocab: int, clip_vocab: int, seed: int):
    """A 3-layer ``LlamaModel`` (the pipeline reads its third hidden state from the end) and a
    2-layer ``CLIPTextModel`` (its pooled output), both ``TEXT_DIM`` wide."""
    from transformers import CLIPTextConfig, CLIPTextModel, LlamaConfig, LlamaModel

    torch.manual_seed(seed)
    llama = LlamaModel(LlamaConfig(
        vocab_size=llama_vocab, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=3,
    ))
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=clip_vocab, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=77, projection_dim=TEXT_DIM,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    ))
    _perturb(llama, seed + 1, std=0.02)
    _perturb(clip, seed + 2, std=0.02)
    return llama.eval(), clip.eval()


def tiny_hunyuan_video_vae(seed: int = 0, attention: bool = False):
    """An ``AutoencoderKLHunyuanVideo`` of ``LATENT_CHANNELS``: 8x spatial, 4x temporal compression
    (``num_frames`` = 4k + 1 decodes to exactly ``num_frames``); ``attention``: the real model's
    frame-causal mid-block attention."""
    from diffusers import AutoencoderKLHunyuanVideo

    torch.manual_seed(seed)
    return AutoencoderKLHunyuanVideo(
        latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8), layers_per_block=1, norm_num_groups=2,
        mid_block_add_attention=attention,
    ).eval()


def tiny_hunyuan_video_pipeline(max_text_len: int = 16, seed: int = 0):
    """A ``HunyuanVideoPipeline`` (T2V, guidance-distilled) of tiny random models, float32.

    Call it with ``prompt_template=TINY_PROMPT_TEMPLATE`` and ``max_sequence_length <= max_text_len``.
    VAE: 8x spatial, 4x temporal compression and patch 2, so ``height x width x num_frames`` gives
    ``((num_frames - 1) / 4 + 1) * (height / 16) * (width / 16)`` video tokens; e.g. 48 x 80 x 9
    frames -> 3 * 3 * 5 = 45 tokens. With ``true_cfg_scale > 1`` and a negative prompt the pipeline
    calls the transformer once more per step (batch 1 each).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideoPipeline

    llama_tok, clip_tok = _tokenizers(max_text_len)
    llama, clip = _text_encoders(len(llama_tok), len(clip_tok), seed + 10)
    return HunyuanVideoPipeline(
        text_encoder=llama, tokenizer=llama_tok, transformer=tiny_hunyuan_video("t2v", seed=seed + 30),
        vae=tiny_hunyuan_video_vae(seed + 20), scheduler=FlowMatchEulerDiscreteScheduler(shift=7.0),
        text_encoder_2=clip, tokenizer_2=clip_tok,
    )
