"""Tiny randomly initialised HunyuanImage 2.1 transformers, VAEs and pipelines (base, refiner), for tests and examples.

Layout: latents (batch, channels, height, width) for the base and distilled models, (batch,
2 * channels, 1, height, width) for the refiner (``[noise; condition latents]`` on channels, one
frame); the prompt's Qwen2.5-VL embeddings (batch, text_seq, text_dim) with their mask (batch,
text_seq), the ByT5 glyph embeddings (batch, glyph_seq, glyph_dim) with theirs, 1 = real token;
timestep (batch,) in [0, 1000].

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
from diffusers import HunyuanImageTransformer2DModel

from usp_dit.demo.tiny_hunyuan_video15 import GLYPH_DIM, _text_encoders
from usp_dit.demo.tiny_video import TEXT_DIM, _perturb

LATENT_CHANNELS = 4  # the tiny stand-in for the real VAE's 64 (the refiner's 32, two frames per channel group)

# Variants, each a tiny version of a released checkpoint's config.
HUNYUAN_IMAGE_VARIANTS = {
    # HunyuanImage-2.1: the Qwen2.5-VL prompt and ByT5 glyph tokens, true CFG through the guider.
    "base": dict(text_embed_2_dim=GLYPH_DIM),
    # HunyuanImage-2.1-Distilled: guidance embedded, MeanFlow (a second timestep), one call a step.
    "distilled": dict(text_embed_2_dim=GLYPH_DIM, guidance_embeds=True, use_meanflow=True),
    # HunyuanImage-2.1 refiner: 5-d latents (one frame) with the condition latents on channels, 3-d
    # RoPE, no glyph encoder, guidance embedded.
    "refiner": dict(guidance_embeds=True),
}


def tiny_hunyuan_image(
    variant: str = "base", num_heads: int = 4, head_dim: int = 16, seed: int = 0,
) -> HunyuanImageTransformer2DModel:
    """A ``HunyuanImageTransformer2DModel`` with two dual-stream blocks, one single-stream block
    and one token-refiner block (``num_heads * head_dim`` wide), patch 1 as released, float32, eval.

    RoPE axes split ``head_dim`` in halves (height, width), as the real (64, 64) of 128; the
    refiner's (frame, height, width) scaled from its (16, 56, 56) of 128: (4, 6, 6) for 16.
    Every parameter is perturbed with seeded noise (``tiny_video._perturb``). The ByT5 projection
    keeps its fixed inner width of 2048 (the Diffusers class hard-codes it).

    Raises:
        ValueError: ``variant`` is not one of ``HUNYUAN_IMAGE_VARIANTS``, or ``head_dim`` is not a multiple of 8.
    """
    if variant not in HUNYUAN_IMAGE_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(HUNYUAN_IMAGE_VARIANTS)}, got {variant!r}")
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 (even RoPE axes), got {head_dim}")
    refiner = variant == "refiner"
    if refiner:
        patch, axes = (1, 1, 1), (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)
    else:
        patch, axes = (1, 1), (head_dim // 2, head_dim // 2)
    torch.manual_seed(seed)
    model = HunyuanImageTransformer2DModel(
        in_channels=(2 if refiner else 1) * LATENT_CHANNELS, out_channels=LATENT_CHANNELS,
        num_attention_heads=num_heads, attention_head_dim=head_dim, num_layers=2, num_single_layers=1,
        num_refiner_layers=1, mlp_ratio=2.0, patch_size=patch, text_embed_dim=TEXT_DIM, rope_axes_dim=axes,
        **HUNYUAN_IMAGE_VARIANTS[variant],
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class HunyuanImageInputs:
    """Keyword arguments of one ``HunyuanImageTransformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, C, H, W), or (B, 2C, 1, H, W) for the refiner
    timestep: torch.Tensor  # (B,)
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    encoder_attention_mask: torch.Tensor  # (B, T), 1 = real prompt token
    encoder_hidden_states_2: torch.Tensor | None = None  # (B, T2, glyph_dim)
    encoder_attention_mask_2: torch.Tensor | None = None  # (B, T2), 1 = real glyph token
    timestep_r: torch.Tensor | None = None  # (B,), MeanFlow only
    guidance: torch.Tensor | None = None  # (B,), guidance-embedded variants only

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def hunyuan_image_tokens(height: int, width: int, frames: int = 1) -> int:
    """Image tokens of a latent of this size (patch 1 in every release)."""
    return prod((frames, height, width))


def hunyuan_image_inputs(
    model: HunyuanImageTransformer2DModel, height: int, width: int,
    valid: tuple[list[int], ...] = ([0, 1, 3, 4, 5, 6], [0, 1, 2, 3]),
    valid_2: tuple[list[int], ...] = ([], [0, 1, 2, 3]), text_len: int = 9, glyph_len: int = 6, seed: int = 0,
) -> HunyuanImageInputs:
    """Seeded inputs; a different prompt, prompt masks and timestep per batch element.

    ``valid[b]`` / ``valid_2[b]``: the positions of element b's real prompt / glyph tokens (by
    default element 0's prompt mask has a hole and it has no glyph tokens, as a prompt without
    quoted text has none; element 1 has prefixes of 4 and 4). The batch size is ``len(valid)``.
    """
    cfg = model.config
    batch = len(valid)
    g = torch.Generator().manual_seed(seed)
    frames = (1,) if len(cfg.patch_size) == 3 else ()
    x = torch.randn(batch, cfg.in_channels, *frames, height, width, generator=g)
    text = torch.randn(batch, text_len, cfg.text_embed_dim, generator=g)
    mask = torch.zeros(batch, text_len)
    for b in range(batch):
        mask[b, valid[b]] = 1.0
    inputs = HunyuanImageInputs(x, torch.randint(1, 1000, (batch,), generator=g).float(), text, mask)
    if cfg.text_embed_2_dim is not None:
        inputs.encoder_hidden_states_2 = torch.randn(batch, glyph_len, cfg.text_embed_2_dim, generator=g)
        inputs.encoder_attention_mask_2 = torch.zeros(batch, glyph_len)
        for b in range(batch):
            inputs.encoder_attention_mask_2[b, valid_2[b]] = 1.0
    if cfg.use_meanflow:
        inputs.timestep_r = torch.randint(1, 1000, (batch,), generator=g).float()
    if cfg.guidance_embeds:
        inputs.guidance = torch.rand(batch, generator=g) * 5000.0
    return inputs


# ---- whole pipelines -----------------------------------------------------------------------------


def tiny_hunyuan_image_vae(seed: int = 0):
    """An ``AutoencoderKLHunyuanImage`` of ``LATENT_CHANNELS``: 8x spatial compression (the real one's 32x)."""
    from diffusers import AutoencoderKLHunyuanImage

    torch.manual_seed(seed)
    vae = AutoencoderKLHunyuanImage(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, block_out_channels=(32,) * 4,
        layers_per_block=1, spatial_compression_ratio=8, sample_size=64, scaling_factor=0.75,
    )
    _perturb(vae, seed + 1, std=0.02)
    return vae.eval()


def tiny_hunyuan_image_refiner_vae(seed: int = 0):
    """An ``AutoencoderKLHunyuanImageRefiner`` of ``LATENT_CHANNELS // 2`` (the refiner packs two
    frames' channels into one): 16x spatial compression as released."""
    from diffusers import AutoencoderKLHunyuanImageRefiner

    torch.manual_seed(seed)
    vae = AutoencoderKLHunyuanImageRefiner(
        latent_channels=LATENT_CHANNELS // 2, block_out_channels=(16,) * 5, layers_per_block=1,
    )
    _perturb(vae, seed + 1, std=0.02)
    return vae.eval()


def tiny_hunyuan_image_pipeline(refiner: bool = False, guidance_scale: float = 4.0, max_text_len: int = 16,
                                max_glyph_len: int = 8, seed: int = 0):
    """A ``HunyuanImagePipeline`` (or ``HunyuanImageRefinerPipeline``) of tiny random models, float32.

    Its guider is an ``AdaptiveProjectedMixGuidance`` of ``guidance_scale`` (as released): the
    transformer is called once per branch (prompt, then negative prompt), batch 1 each for one
    prompt. Prompts are padded to ``max_text_len`` Qwen tokens (one per character; the template
    is the prompt alone, nothing cropped) and their quoted text, if any, to ``max_glyph_len`` ByT5
    bytes. Base: 8x VAE and patch 1, so ``height x width`` gives ``(height / 8) * (width / 8)``
    image tokens; e.g. 40 x 56 -> 5 x 7 = 35. Refiner: 16x VAE, e.g. 48 x 80 -> 3 x 5 = 15.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanImagePipeline, HunyuanImageRefinerPipeline
    from diffusers.guiders import AdaptiveProjectedMixGuidance

    tokenizer, qwen, tokenizer_2, byt5 = _text_encoders(seed + 10, max_text_len)
    guider = AdaptiveProjectedMixGuidance(guidance_scale=guidance_scale)
    scheduler = FlowMatchEulerDiscreteScheduler(shift=4.0)
    if refiner:
        pipe = HunyuanImageRefinerPipeline(
            scheduler=scheduler, vae=tiny_hunyuan_image_refiner_vae(seed + 20), text_encoder=qwen,
            tokenizer=tokenizer, transformer=tiny_hunyuan_image("refiner", seed=seed + 30), guider=guider,
        )
    else:
        pipe = HunyuanImagePipeline(
            scheduler=scheduler, vae=tiny_hunyuan_image_vae(seed + 20), text_encoder=qwen, tokenizer=tokenizer,
            text_encoder_2=byt5, tokenizer_2=tokenizer_2, transformer=tiny_hunyuan_image(seed=seed + 30),
            guider=guider,
        )
        pipe.tokenizer_2_max_length = max_glyph_len
    # The real model's sizes, read by the stock code from these attributes, scaled to the tiny models.
    pipe.prompt_template_encode = "{}"
    pipe.prompt_template_encode_start_idx = 0
    pipe.tokenizer_max_length = max_text_len
    return pipe
