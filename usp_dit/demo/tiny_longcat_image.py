"""Tiny randomly initialised LongCat-Image transformers and ``LongCatImagePipeline`` /
``LongCatImageEditPipeline``, built in code for tests and examples.

Layout: packed latents (batch, tokens, 64): 2x2 patches of the 16-channel latent (the pipelines
hard-code 16 latent channels), row-major; for the edit pipeline the condition image's packed
latent follows the target's (tokens = 2 x the target's); text embeddings (batch, text_len,
TEXT_DIM); position ids (tokens, 3) as the pipelines make them (``prepare_pos_ids``): text
(0, i, i), target image (1, text_len + h, text_len + w), condition image (2, text_len + h,
text_len + w); timestep (batch,) in [0, 1] (the pipelines pass t / 1000).

Nothing is downloaded: the tokenizer is a character vocabulary written here with Qwen's chat and
vision tokens, the Qwen2.5-VL text encoder (with a 1-layer vision tower, which the edit pipeline
calls on the prompt image), VAE and transformer are built from small configs and seeded. Every
process that calls a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

import string
from dataclasses import dataclass

import torch
from diffusers import AutoencoderKL, LongCatImageTransformer2DModel
from diffusers.pipelines.longcat_image.pipeline_longcat_image import prepare_pos_ids

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # joint_attention_dim (LongCat-Image: Qwen2.5-VL-7B's 3584)
LATENT_CHANNELS = 16  # the pipelines' hard-coded num_channels_latents
VAE_BLOCKS = 7  # 64 pixels per latent pixel: the edit pipeline always works at about 1024 x 1024 pixels
# The pipelines pad every prompt to tokenizer_max_length tokens (the real one: 512); the tiny
# pipelines set a shorter, odd one.
TINY_TEXT_LEN = 12
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def tiny_longcat_image(
    num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, num_single_layers: int = 2, seed: int = 0,
) -> LongCatImageTransformer2DModel:
    """A small ``LongCatImageTransformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    RoPE axes (modality, h, w) split ``head_dim`` 1:3:3 as LongCat-Image's (16, 56, 56) of 128.
    Every parameter is perturbed (``tiny_video._perturb``).

    Raises:
        ValueError: ``head_dim`` is not a multiple of 16.
    """
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (three even RoPE axes, 1:3:3), got {head_dim}")
    torch.manual_seed(seed)
    model = LongCatImageTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=head_dim, num_attention_heads=num_heads, joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=TEXT_DIM, axes_dims_rope=[head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8],
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class LongCatImageInputs:
    """Keyword arguments of one ``LongCatImageTransformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, N, 64)
    encoder_hidden_states: torch.Tensor  # (B, T, TEXT_DIM)
    timestep: torch.Tensor  # (B,) in [0, 1]
    img_ids: torch.Tensor  # (N, 3)
    txt_ids: torch.Tensor  # (T, 3)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def longcat_image_inputs(
    height: int, width: int, text_len: int, condition: bool = False, batch: int = 2, seed: int = 0,
) -> LongCatImageInputs:
    """Seeded inputs for a ``height x width`` grid of packed latent tokens (and, with
    ``condition``, a condition image's grid of the same size after it, as the edit pipeline
    passes it), a different prompt, latent and timestep per batch element; ids as the pipelines
    make them."""
    g = torch.Generator().manual_seed(seed)
    start = (text_len, text_len)
    img_ids = prepare_pos_ids(modality_id=1, type="image", start=start, height=height, width=width)
    if condition:
        cond_ids = prepare_pos_ids(modality_id=2, type="image", start=start, height=height, width=width)
        img_ids = torch.cat([img_ids, cond_ids])
    return LongCatImageInputs(
        hidden_states=torch.randn(batch, img_ids.shape[0], 4 * LATENT_CHANNELS, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TEXT_DIM, generator=g),
        timestep=torch.rand(batch, generator=g), img_ids=img_ids,
        txt_ids=prepare_pos_ids(modality_id=0, type="text", start=(0, 0), num_token=text_len),
    )


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_longcat_vae(seed: int = 0) -> AutoencoderKL:
    """An ``AutoencoderKL`` of ``LATENT_CHANNELS`` and ``VAE_BLOCKS`` levels: one latent pixel per 64
    pixels. One GroupNorm group of 8 channels: of the tiny configs tried, the one whose parallel
    decode stays closest to one process's through 7 levels of all-reduced statistics (3.6e-5
    relative on a random latent, against 9.4e-5 with 4 groups)."""
    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * VAE_BLOCKS, up_block_types=("UpDecoderBlock2D",) * VAE_BLOCKS,
        block_out_channels=(8,) * VAE_BLOCKS, norm_num_groups=1, sample_size=64,
        scaling_factor=0.5, shift_factor=0.1,
    ).eval()


def tiny_longcat_tokenizer():
    """A tokenizer over single characters (a unigram vocabulary written here, no file) with Qwen's
    chat and vision tokens as special tokens, and a Qwen-like chat template: what the pipelines
    need of Qwen2.5-VL's tokenizer (their prompt templates tokenized, the prompt padded)."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(c, -2.0) for c in string.ascii_letters + string.digits + string.punctuation + "\n"]
    tokenizer = T5TokenizerFast(vocab=pieces, extra_ids=0,
                                additional_special_tokens=["<|im_start|>", "<|im_end|>"] + VISION_TOKENS)
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tokenizer


def tiny_longcat_text_encoder(tokenizer, seed: int = 0):
    """A 2-layer ``Qwen2_5_VLForConditionalGeneration`` of width ``TEXT_DIM`` with a 1-layer vision
    tower (patch 14, 2x2 merge) whose image tokens are the tokenizer's ``<|image_pad|>``, float32,
    eval mode, every weight perturbed: its last hidden states are the prompt embeddings."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = dict(zip(("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id"),
                   tokenizer.convert_tokens_to_ids(VISION_TOKENS)))
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer), hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
            rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},  # 2 * (1 + 1 + 2) = head_dim 8
            bos_token_id=None, eos_token_id=1, pad_token_id=0,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT_DIM,
                           fullatt_block_indexes=[0]),
        **ids,
    )
    torch.manual_seed(seed)
    encoder = Qwen2_5_VLForConditionalGeneration(config)
    _perturb(encoder, seed + 1, std=0.02)
    return encoder.eval()


@dataclass
class TinyVLProcessor:
    """What the pipelines use of their ``Qwen2VLProcessor`` (``text_processor``): its
    ``image_processor`` (the edit pipeline's prompt image) and its tokenizer. Transformers builds a
    ``Qwen2VLProcessor`` only with a video processor, which needs torchvision; the prompt rewrite
    (``enable_prompt_rewrite``, the only other use: ``apply_chat_template`` and ``generate``) is
    not run by the tiny pipelines."""

    image_processor: object
    tokenizer: object


def tiny_longcat_processor(tokenizer) -> TinyVLProcessor:
    """A ``TinyVLProcessor`` over ``tokenizer`` whose (PIL) ``Qwen2VLImageProcessorPil`` makes at
    most 8 x 8 patches of 14 pixels (16 image tokens after the 2x2 merge) of the edit pipeline's
    prompt image."""
    from transformers import Qwen2VLImageProcessorPil

    return TinyVLProcessor(Qwen2VLImageProcessorPil(min_pixels=28 * 28, max_pixels=112 * 112), tokenizer)


def tiny_longcat_image_pipeline(edit: bool = False, text_len: int = TINY_TEXT_LEN, seed: int = 0):
    """A ``LongCatImagePipeline`` (``edit``: ``LongCatImageEditPipeline``) of tiny random models,
    float32, its prompts padded to ``text_len`` tokens (the pipelines' ``tokenizer_max_length``).

    VAE 64x compression and 2x2 patches: ``height x width`` gives ``(height / 128) * (width / 128)``
    image tokens (384 x 640 -> 15). The edit pipeline sizes its output to about 1024 x 1024 at the
    input image's aspect ratio: a 21 x 8 image gives 1664 x 640, 13 x 5 = 65 target tokens and 65
    condition tokens; its text is ``text_len`` + the prompt image's vision tokens + 2. Call with
    ``enable_prompt_rewrite=False`` (the text-to-image pipeline's default rewrites the prompt
    with the text encoder's ``generate``).
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, LongCatImageEditPipeline, LongCatImagePipeline

    tokenizer = tiny_longcat_tokenizer()
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=16, max_image_seq_len=4096,
    )
    cls = LongCatImageEditPipeline if edit else LongCatImagePipeline
    pipe = cls(
        scheduler=scheduler, vae=tiny_longcat_vae(seed + 20), text_encoder=tiny_longcat_text_encoder(tokenizer, seed + 10),
        tokenizer=tokenizer, text_processor=tiny_longcat_processor(tokenizer),
        transformer=tiny_longcat_image(seed=seed + 30),
    )
    pipe.tokenizer_max_length = text_len
    return pipe
