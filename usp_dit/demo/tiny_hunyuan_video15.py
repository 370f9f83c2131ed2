"""Tiny randomly initialised HunyuanVideo 1.5 transformers, VAE and pipelines (T2V, I2V), for tests and examples.

Layout: latents (batch, channels, frames, height, width), the transformer's input the pipelines'
``[noise; condition latents; condition mask]`` on channels (2 * ``LATENT_CHANNELS`` + 1); the
prompt's Qwen2.5-VL embeddings (batch, text_seq, text_dim) with their mask (batch, text_seq), the
ByT5 glyph embeddings (batch, glyph_seq, glyph_dim) with theirs, 1 = real token; the SigLIP image
embeddings (batch, image_tokens, image_dim), all zeros for text-to-video; timestep (batch,).

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import HunyuanVideo15Transformer3DModel

from usp_dit.demo.tiny_video import TEXT_DIM, _perturb

LATENT_CHANNELS = 4  # the tiny stand-in for the real VAE's 32
GLYPH_DIM = 16  # d_model of the tiny ByT5 encoder (the real one's 1472)
IMAGE_DIM = 16  # width of the tiny SigLIP's tokens (the real one's 1152)
IMAGE_SIZE, IMAGE_PATCH = 30, 10  # the tiny SigLIP: 3 x 3 = 9 image tokens (the real one's 729)
TARGET_SIZE = 48  # pixels; with the VAE's 16x: 3 x 3 latent patches per frame at a square image


def tiny_hunyuan_video15(
    num_heads: int = 4, head_dim: int = 16, meanflow: bool = False, seed: int = 0,
) -> HunyuanVideo15Transformer3DModel:
    """A ``HunyuanVideo15Transformer3DModel`` with two dual-stream blocks and one token refiner
    block (``num_heads * head_dim`` wide), patch 1 as released, float32, eval mode.

    ``meanflow``: the MeanFlow variant (a second timestep, ``timestep_r``, embedded and added).
    RoPE axes (time, height, width) split ``head_dim`` as (4, 6, 6) for 16 (the real model's
    (16, 56, 56) for 128, scaled). Every parameter is perturbed with seeded noise
    (``tiny_video._perturb``): no norm weight or bias keeps a default constant. The ByT5
    projection keeps its fixed inner width of 2048 (the Diffusers class hard-codes it).

    Raises:
        ValueError: ``head_dim`` is not a multiple of 8 (each RoPE axis needs an even width).
    """
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 (three even RoPE axes), got {head_dim}")
    axes = (head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8)
    torch.manual_seed(seed)
    model = HunyuanVideo15Transformer3DModel(
        in_channels=2 * LATENT_CHANNELS + 1, out_channels=LATENT_CHANNELS, num_attention_heads=num_heads,
        attention_head_dim=head_dim, num_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=1, patch_size_t=1,
        text_embed_dim=TEXT_DIM, text_embed_2_dim=GLYPH_DIM, image_embed_dim=IMAGE_DIM, rope_axes_dim=axes,
        target_size=TARGET_SIZE, use_meanflow=meanflow,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class HunyuanVideo15Inputs:
    """Keyword arguments of one ``HunyuanVideo15Transformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, 2C + 1, F, H, W)
    timestep: torch.Tensor  # (B,)
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    encoder_attention_mask: torch.Tensor  # (B, T), 1 = real prompt token
    encoder_hidden_states_2: torch.Tensor  # (B, T2, glyph_dim)
    encoder_attention_mask_2: torch.Tensor  # (B, T2), 1 = real glyph token
    image_embeds: torch.Tensor  # (B, image_tokens, image_dim); zeros: text-to-video
    timestep_r: torch.Tensor | None = None  # (B,), MeanFlow variants only

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def hunyuan_video15_tokens(model: HunyuanVideo15Transformer3DModel, frames: int, height: int, width: int) -> int:
    """Video tokens of a latent of this size: frames/p_t * height/p * width/p."""
    p, p_t = model.config.patch_size, model.config.patch_size_t
    return (frames // p_t) * (height // p) * (width // p)


def hunyuan_video15_inputs(
    model: HunyuanVideo15Transformer3DModel, frames: int, height: int, width: int, image: bool = False,
    valid: tuple[list[int], ...] = ([0, 1, 3, 4, 5, 6], [0, 1, 2, 3]),
    valid_2: tuple[list[int], ...] = ([], [0, 1, 2, 3]), text_len: int = 9, glyph_len: int = 6, seed: int = 0,
) -> HunyuanVideo15Inputs:
    """Seeded inputs; a different prompt, prompt masks and timestep per batch element.

    ``valid[b]`` / ``valid_2[b]``: the positions of element b's real prompt / glyph tokens (by
    default element 0's prompt mask has a hole and it has no glyph text, as a prompt without
    quoted text has none; element 1 has prefixes of 4 and 4). The batch size is ``len(valid)``.
    ``image``: non-zero image embeddings (image-to-video; text-to-video passes zeros, which the
    model masks out).
    """
    cfg = model.config
    batch = len(valid)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, cfg.in_channels, frames, height, width, generator=g)
    text = torch.randn(batch, text_len, cfg.text_embed_dim, generator=g)
    glyphs = torch.randn(batch, glyph_len, cfg.text_embed_2_dim, generator=g)
    mask, mask_2 = torch.zeros(batch, text_len), torch.zeros(batch, glyph_len)
    for b in range(batch):
        mask[b, valid[b]] = 1.0
        mask_2[b, valid_2[b]] = 1.0
    tokens = (IMAGE_SIZE // IMAGE_PATCH) ** 2
    images = torch.randn(batch, tokens, cfg.image_embed_dim, generator=g) if image else torch.zeros(
        batch, tokens, cfg.image_embed_dim)
    timestep = torch.randint(1, 1000, (batch,), generator=g).float()
    timestep_r = torch.randint(1, 1000, (batch,), generator=g).float() if cfg.use_meanflow else None
    return HunyuanVideo15Inputs(x, timestep, text, mask, glyphs, mask_2, images, timestep_r)


# ---- whole pipelines -----------------------------------------------------------------------------

# The real chat template wraps the prompt in a system message and the pipeline crops its first 108
# Qwen tokens; the tiny character tokenizer's template is the user's prompt alone, nothing cropped.
_TINY_CHAT_TEMPLATE = "{% for m in messages %}{% if m['role'] == 'user' %}{{ m['content'] }}{% endif %}{% endfor %}"


def tiny_hunyuan_video15_vae(seed: int = 0):
    """An ``AutoencoderKLHunyuanVideo15`` of ``LATENT_CHANNELS``: 16x spatial, 4x temporal compression as released
    (``num_frames`` = 4k + 1 decodes to exactly ``num_frames``), with its frame-causal mid-block attention."""
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(seed)
    vae = AutoencoderKLHunyuanVideo15(
        latent_channels=LATENT_CHANNELS, block_out_channels=(16,) * 5, layers_per_block=1,
        spatial_compression_ratio=16, temporal_compression_ratio=4,
    )
    _perturb(vae, seed + 1, std=0.02)  # the RMS norms' gammas too: no default constant
    return vae.eval()


def _text_encoders(seed: int, max_text_len: int):
    """(Qwen tokenizer, a 3-layer ``Qwen2_5_VLTextModel``, ByT5 tokenizer, a 2-layer ``T5EncoderModel``)."""
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel, T5Config, T5EncoderModel

    from usp_dit.demo.tiny_qwen_image import tiny_qwen_tokenizer

    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = _TINY_CHAT_TEMPLATE
    torch.manual_seed(seed)
    qwen = Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(
        vocab_size=len(tokenizer), hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * max_text_len,
        rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]}, bos_token_id=None, eos_token_id=1,
        pad_token_id=0,
    ))
    tokenizer_2 = ByT5Tokenizer()
    byt5 = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer_2), d_model=GLYPH_DIM, d_kv=4, d_ff=32, num_layers=2, num_heads=4, pad_token_id=0,
        eos_token_id=1,
    ))
    _perturb(qwen, seed + 1, std=0.02)
    _perturb(byt5, seed + 2, std=0.02)
    return tokenizer, qwen.eval(), tokenizer_2, byt5.eval()


def _image_encoder(seed: int):
    """A 1-layer ``SiglipVisionModel`` (``IMAGE_SIZE`` square, ``IMAGE_PATCH`` patches) and its processor."""
    import transformers
    from transformers import SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(seed)
    encoder = SiglipVisionModel(SiglipVisionConfig(
        hidden_size=IMAGE_DIM, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        image_size=IMAGE_SIZE, patch_size=IMAGE_PATCH,
    ))
    _perturb(encoder, seed + 1, std=0.02)
    # The PIL processor (the default one needs torchvision): the same resize and normalisation.
    processor = getattr(transformers, "SiglipImageProcessorPil", transformers.SiglipImageProcessor)
    return encoder.eval(), processor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})


def tiny_hunyuan_video15_pipeline(image_to_video: bool = False, guidance_scale: float = 4.0, max_text_len: int = 16,
                                  max_glyph_len: int = 8, seed: int = 0):
    """A ``HunyuanVideo15Pipeline`` (or ``HunyuanVideo15ImageToVideoPipeline``) of tiny random models, float32.

    Its guider is a ``ClassifierFreeGuidance`` of ``guidance_scale``: above 1 the transformer is
    called once per branch (prompt, then negative prompt), batch 1 each for one prompt. Prompts
    are padded to ``max_text_len`` Qwen tokens (one per character) and their quoted text, if any,
    to ``max_glyph_len`` ByT5 bytes (a prompt without quoted text has no glyph tokens). VAE: 16x
    spatial and 4x temporal compression, patch 1 (as released), so ``height x width x num_frames``
    gives ``((num_frames - 1) / 4 + 1) * (height / 16) * (width / 16)`` video tokens; e.g. 48 x 80
    x 9 frames -> 3 * 3 * 5 = 45 tokens. Image-to-video picks its size from the image's aspect
    ratio and ``TARGET_SIZE`` (a square image: 48 x 48, 3 x 3 patches a frame); its image gives
    9 SigLIP tokens and is VAE-encoded as the first frame's condition.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline
    from diffusers.guiders import ClassifierFreeGuidance

    tokenizer, qwen, tokenizer_2, byt5 = _text_encoders(seed + 10, max_text_len)
    parts = dict(
        text_encoder=qwen, tokenizer=tokenizer, transformer=tiny_hunyuan_video15(seed=seed + 30),
        vae=tiny_hunyuan_video15_vae(seed + 20), scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0),
        text_encoder_2=byt5, tokenizer_2=tokenizer_2, guider=ClassifierFreeGuidance(guidance_scale=guidance_scale),
    )
    if image_to_video:
        encoder, processor = _image_encoder(seed + 40)
        pipe = HunyuanVideo15ImageToVideoPipeline(image_encoder=encoder, feature_extractor=processor, **parts)
    else:
        pipe = HunyuanVideo15Pipeline(**parts)
    # The real model's sizes, read by the stock code from these attributes, scaled to the tiny models.
    pipe.prompt_template_encode_start_idx = 0
    pipe.tokenizer_max_length = max_text_len
    pipe.tokenizer_2_max_length = max_glyph_len
    pipe.vision_num_semantic_tokens = (IMAGE_SIZE // IMAGE_PATCH) ** 2
    return pipe
