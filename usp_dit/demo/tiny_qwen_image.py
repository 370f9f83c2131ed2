"""Tiny randomly initialised Qwen-Image transformers and a ``QwenImagePipeline``, for tests and examples.

Layout: packed latents (batch, tokens, 4 * latent_channels), the image tokens of each sample in
``img_shapes`` order (target image first, then any condition images / layers), each frame-major
``(frames, height / 2, width / 2)`` patches; text embeddings (batch, text_seq, text_dim) and their
mask (batch, text_seq), True / 1 = a real token (any pattern: holes allowed, as the model allows);
timestep (batch,) in [0, 1] (the pipeline passes t / 1000).

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
from diffusers import QwenImageTransformer2DModel

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # joint_attention_dim of the tiny transformers (the real one: Qwen2.5-VL's 3584)
LATENT_CHANNELS = 4  # the tiny stand-in for the real VAE's 16

# Variants of the family, each a tiny version of a released checkpoint's config.
QWEN_IMAGE_VARIANTS = {
    # Qwen-Image (text-to-image), Qwen-Image-Edit / Edit-2509: one modulation for every image token.
    "t2i": dict(),
    # Qwen-Image-Edit-2511: zero_cond_t, the condition images' tokens (after the target's) are
    # modulated with the embedding of t = 0 (a per-token modulation index).
    "edit-2511": dict(zero_cond_t=True),
    # Qwen-Image-Layered: layer-aware 3D RoPE and an additional (per-sample) timestep condition.
    "layered": dict(use_layer3d_rope=True, use_additional_t_cond=True),
}


def tiny_qwen_image(
    variant: str = "t2i", num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, seed: int = 0,
) -> QwenImageTransformer2DModel:
    """A small ``QwenImageTransformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    RoPE axes (frame, height, width) split ``head_dim`` 2:3:3, as Qwen-Image's (16, 56, 56) of 128
    (each must be even). Every parameter is perturbed with seeded noise (``tiny_video._perturb``).

    Raises:
        ValueError: ``variant`` is not one of ``QWEN_IMAGE_VARIANTS``, or ``head_dim`` is not a multiple of 16.
    """
    if variant not in QWEN_IMAGE_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(QWEN_IMAGE_VARIANTS)}, got {variant!r}")
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (three even RoPE axes, 2:3:3), got {head_dim}")
    frame_axis, spatial_axis = head_dim // 4, head_dim * 3 // 8
    torch.manual_seed(seed)
    model = QwenImageTransformer2DModel(
        patch_size=2, in_channels=4 * LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=num_layers,
        attention_head_dim=head_dim, num_attention_heads=num_heads, joint_attention_dim=TEXT_DIM,
        axes_dims_rope=(frame_axis, spatial_axis, spatial_axis), **QWEN_IMAGE_VARIANTS[variant],
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class QwenImageInputs:
    """Keyword arguments of one ``QwenImageTransformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, S, 4 * latent_channels)
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    encoder_hidden_states_mask: torch.Tensor | None  # (B, T) bool, True = a real token
    timestep: torch.Tensor  # (B,)
    img_shapes: list  # per sample: [(frames, h, w) of the target, then of each condition image / layer]
    additional_t_cond: torch.Tensor | None = None  # (B,) long, the layered variant only

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def qwen_image_tokens(shapes: list[tuple[int, int, int]]) -> int:
    """Image tokens of one sample: the sum of frames * h * w over its images."""
    return sum(prod(s) for s in shapes)


def qwen_image_inputs(
    model: QwenImageTransformer2DModel, shapes: list[tuple[int, int, int]], masks: list[list[int]] | None = None,
    text_len: int = 9, seed: int = 0,
) -> QwenImageInputs:
    """Seeded inputs: batch ``len(masks)``, a different prompt and timestep per element.

    ``shapes``: the (frames, h, w) patch grids of one sample's images (every sample has the same,
    as the model's RoPE requires); ``masks[b]``: element b's text mask as 0/1 per token (holes
    allowed), default two fully valid prompts.
    """
    masks = masks or [[1] * text_len] * 2
    batch, text_len = len(masks), len(masks[0])
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, qwen_image_tokens(shapes), model.config.in_channels, generator=g)
    text = torch.randn(batch, text_len, model.config.joint_attention_dim, generator=g)
    timestep = torch.rand(batch, generator=g)
    mask = torch.tensor(masks, dtype=torch.bool)
    extra = torch.arange(batch) % 2 if model.config.use_additional_t_cond else None
    return QwenImageInputs(x, text, mask, timestep, [list(shapes)] * batch, extra)


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_qwen_image_vae(seed: int = 0):
    """An ``AutoencoderKLQwenImage`` of ``LATENT_CHANNELS``: 8x spatial compression."""
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(seed)
    return AutoencoderKLQwenImage(
        base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1], num_res_blocks=1,
        temperal_downsample=[False, True, True],
        latents_mean=[0.1 * i for i in range(LATENT_CHANNELS)],
        latents_std=[1.0 + 0.1 * i for i in range(LATENT_CHANNELS)],
    ).eval()


def tiny_qwen_tokenizer(special: tuple[str, ...] | list[str] = ("<|im_start|>", "<|im_end|>")):
    """A tokenizer over single characters (a unigram vocabulary of printable characters, written
    here, no file) with Qwen's chat tokens (``special``) as special tokens: what ``QwenImagePipeline``
    needs of Qwen2.5-VL's tokenizer (its prompt template tokenized, padded and masked). Built as a
    ``T5TokenizerFast`` (transformers builds it from the vocabulary alone)."""
    import string

    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(c, -2.0) for c in string.ascii_letters + string.digits + string.punctuation + "\n"]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, additional_special_tokens=list(special))


def tiny_qwen_text_encoder(vocab_size: int, seed: int = 0):
    """A 2-layer ``Qwen2_5_VLForConditionalGeneration`` of width ``TEXT_DIM`` (and a 1-layer vision
    tower the pipeline never calls), float32, eval mode: its last hidden states are the prompt embeddings."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
            rope_scaling={"type": "mrope", "mrope_section": [1, 1, 2]},  # 2 * (1 + 1 + 2) = head_dim 8
            bos_token_id=None, eos_token_id=1, pad_token_id=0,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT_DIM,
                           fullatt_block_indexes=[0]),
    )
    torch.manual_seed(seed)
    encoder = Qwen2_5_VLForConditionalGeneration(config)
    _perturb(encoder, seed + 1, std=0.02)
    return encoder.eval()


def tiny_qwen_image_pipeline(seed: int = 0):
    """A ``QwenImagePipeline`` of tiny random models (Qwen2.5-VL-like text encoder, character
    tokenizer, VAE, transformer), float32.

    The pipeline wraps each prompt in its chat template and keeps the tokens after the template's
    first 34: with one token per character that leaves about 130 text tokens a prompt, padded
    and masked when a batch's prompts differ in length. VAE: 8x spatial compression and patch 2,
    so ``height x width`` gives ``(height / 16) * (width / 16)`` image tokens; e.g. 48 x 80 -> 15.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9,
        base_image_seq_len=16, max_image_seq_len=4096,
    )
    tokenizer = tiny_qwen_tokenizer()
    return QwenImagePipeline(
        scheduler=scheduler, vae=tiny_qwen_image_vae(seed + 20), tokenizer=tokenizer,
        text_encoder=tiny_qwen_text_encoder(len(tokenizer), seed + 10), transformer=tiny_qwen_image(seed=seed + 30),
    )
