"""Tiny randomly initialised NucleusMoE-Image transformers and a ``NucleusMoEImagePipeline``, for tests and examples.

Layout: packed latents (batch, N, 4 * latent_channels), 2x2 latent patches row-major, N = h * w;
text embeddings (batch, T, TEXT_DIM) with their mask (batch, T), True = a real token (any
pattern: the model masks keys element-wise); timestep (batch,) in [0, 1] (the pipeline passes
t / 1000); ``img_shapes`` one ``(1, h, w)`` per sample.

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import NucleusMoEImageTransformer2DModel

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # joint_attention_dim of the tiny transformers (the real one: Qwen3-VL-8B's 4096)
LATENT_CHANNELS = 4  # the tiny stand-in for the real (Qwen-Image) VAE's 16
TEXT_LAYERS = 2  # the tiny Qwen3-VL's layers; the pipeline takes hidden_states[-2] (the real: [-8] of 36)

# Variants of the family, each a tiny version of a released config.
NUCLEUS_MOE_VARIANTS = {
    # NucleusMoE-Image: block 0 dense (the release: blocks 0-2 and the last), block 1 an expert-choice
    # MoE (4 experts, each choosing ceil(2 * N / 4) tokens of a sample), grouped-query attention.
    "moe": dict(dense_moe_strategy="leave_first_block_dense", num_experts=4, moe_intermediate_dim=32,
                capacity_factors=2.0, num_key_value_heads=2),
    # Every block dense (the config's all_dense strategy): nothing data-dependent, so it also compiles
    # in one graph (the MoE's expert loop reads its token counts on the host, in stock too).
    "dense": dict(dense_moe_strategy="all_dense"),
}


def tiny_nucleus_moe(
    variant: str = "moe", num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, seed: int = 0,
) -> NucleusMoEImageTransformer2DModel:
    """A small ``NucleusMoEImageTransformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    RoPE axes (frame, height, width) split ``head_dim`` 1:3:3, as the release's (16, 56, 56) of 128.
    The experts' packed weights (``torch.empty`` in stock, loaded from a checkpoint) are drawn from a
    seeded normal first; then every parameter is perturbed (``tiny_video._perturb``).

    Raises:
        ValueError: ``variant`` is not one of ``NUCLEUS_MOE_VARIANTS``, or ``head_dim`` is not a multiple of 16.
    """
    if variant not in NUCLEUS_MOE_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(NUCLEUS_MOE_VARIANTS)}, got {variant!r}")
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (three even RoPE axes: 1:3:3, (4, 6, 6) of 16), got {head_dim}")
    options = dict(NUCLEUS_MOE_VARIANTS[variant])
    if options.get("num_key_value_heads", 0) > num_heads:
        options["num_key_value_heads"] = num_heads
    torch.manual_seed(seed)
    model = NucleusMoEImageTransformer2DModel(
        patch_size=2, in_channels=4 * LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=num_layers,
        attention_head_dim=head_dim, num_attention_heads=num_heads, joint_attention_dim=TEXT_DIM,
        axes_dims_rope=(head_dim // 8 * 2, head_dim * 3 // 8, head_dim * 3 // 8), **options,
    )
    g = torch.Generator().manual_seed(seed + 2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:  # uninitialised memory otherwise
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class NucleusMoEInputs:
    """Keyword arguments of one ``NucleusMoEImageTransformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, N, 4 * latent_channels)
    encoder_hidden_states: torch.Tensor  # (B, T, TEXT_DIM)
    encoder_hidden_states_mask: torch.Tensor | None  # (B, T) bool, True = a real token
    timestep: torch.Tensor  # (B,)
    img_shapes: list  # per sample: (1, h, w)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def nucleus_moe_inputs(
    model: NucleusMoEImageTransformer2DModel, height: int, width: int, masks: list[list[int]] | None = None,
    text_len: int = 9, seed: int = 0,
) -> NucleusMoEInputs:
    """Seeded inputs of ``height x width`` patches: batch ``len(masks)`` (2 without masks), a
    different prompt and timestep per element; ``masks[b]``: element b's text mask, 0/1 per token
    (holes allowed); ``None``: no mask."""
    batch, text_len = (2, text_len) if masks is None else (len(masks), len(masks[0]))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, height * width, model.config.in_channels, generator=g)
    text = torch.randn(batch, text_len, model.config.joint_attention_dim, generator=g)
    timestep = torch.rand(batch, generator=g)
    mask = None if masks is None else torch.tensor(masks, dtype=torch.bool)
    return NucleusMoEInputs(x, text, mask, timestep, [(1, height, width)] * batch)


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_nucleus_tokenizer():
    """``tiny_qwen_image.tiny_qwen_tokenizer`` (one token per character, Qwen's chat tokens) with a
    Qwen-like chat template that renders a message's content given as a string or as a list of
    ``{"type": "text", "text": ...}`` parts (the pipeline's user message)."""
    from usp_dit.demo.tiny_qwen_image import tiny_qwen_tokenizer

    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
        "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
        "{% for part in m['content'] %}{{ part['text'] }}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tokenizer


def tiny_qwen3_vl_generation(vocab_size: int, seed: int = 0):
    """A ``TEXT_LAYERS``-layer ``Qwen3VLForConditionalGeneration`` of width ``TEXT_DIM`` (and a 1-layer
    vision tower the pipeline never calls), float32, eval mode, every weight perturbed."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab_size, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=TEXT_LAYERS,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=2048,
            rope_scaling={"rope_type": "default", "mrope_section": [1, 1, 2], "mrope_interleaved": True},
            pad_token_id=0,
        ),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=TEXT_DIM,
                           deepstack_visual_indexes=[]),
    )
    torch.manual_seed(seed)
    encoder = Qwen3VLForConditionalGeneration(config)
    _perturb(encoder, seed + 1, std=0.02)
    return encoder.eval()


def tiny_nucleus_moe_pipeline(seed: int = 0):
    """A ``NucleusMoEImagePipeline`` of tiny random models (Qwen3-VL-like text encoder, character
    tokenizer standing in for the ``Qwen3VLProcessor``: the pipeline uses its chat template and
    tokenizer only; Qwen-Image VAE; the "moe" transformer), float32.

    The pipeline wraps each prompt in its chat template with its default system prompt (about 330
    tokens here, one per character), pads the batch to its longest prompt (a multiple of 8) and
    masks the padding. VAE: 8x spatial compression and patch 2, so ``height x width`` gives
    ``(height / 16) * (width / 16)`` image tokens; e.g. 48 x 80 -> 3 x 5 = 15.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, NucleusMoEImagePipeline

    from usp_dit.demo.tiny_qwen_image import tiny_qwen_image_vae

    tokenizer = tiny_nucleus_tokenizer()
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=16,
        max_image_seq_len=4096,
    )
    pipe = NucleusMoEImagePipeline(
        transformer=tiny_nucleus_moe(seed=seed + 30), scheduler=scheduler, vae=tiny_qwen_image_vae(seed + 20),
        text_encoder=tiny_qwen3_vl_generation(len(tokenizer), seed + 10), processor=tokenizer,
    )
    # The release reads hidden_states[-8] of its 36-layer Qwen3-VL; the tiny one has TEXT_LAYERS layers.
    pipe.default_return_index = -TEXT_LAYERS
    return pipe
