"""Tiny randomly initialised Qwen-Image 2.1 transformers and their inputs, for tests and examples.

Layout: packed latents (batch, tokens, latent_channels), each sample's condition images first and
the target image last, each frame-major ``(1, h, w)`` (2.1 consumes latents unpatched); text
embeddings (batch, text_seq, context_dim) over the vision-language sequence *without* the target's
slots, condition images' slots included (their embeddings are replaced by the latents); ``img_mask``
(batch, text_seq + target / 4) True at image slots (each slot stands for 2 x 2 latent tokens, so an
image's token count is a multiple of 4); the prompt mask (batch, text_seq), True = a real token;
timestep (batch,) in [0, 1].

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod

import torch
from diffusers import QwenImage21Transformer2DModel

from usp_dit.demo.tiny_video import _perturb

CONTEXT_DIM = 32  # context_in_dim of the tiny transformers (the real one: Qwen3-VL's 4096)
LATENT_CHANNELS = 8  # the tiny stand-in for the real VAE's 64


def tiny_qwen_image21(
    num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, causal_condition: bool = True, seed: int = 0,
) -> QwenImage21Transformer2DModel:
    """A small ``QwenImage21Transformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    RoPE axes (frame, height, width) split ``head_dim`` 2:3:3 as the release's (16, 56, 56) of 128.
    Every parameter is perturbed with seeded noise (the zero-centred norms' zeros included).

    Raises:
        ValueError: ``head_dim`` is not a multiple of 16.
    """
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (three even RoPE axes, 2:3:3), got {head_dim}")
    torch.manual_seed(seed)
    model = QwenImage21Transformer2DModel(
        patch_size=1, in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_layers=num_layers,
        attention_head_dim=head_dim, num_attention_heads=num_heads, context_in_dim=CONTEXT_DIM,
        axes_dims_rope=(head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8), causal_condition=causal_condition,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class QwenImage21Inputs:
    """Keyword arguments of one ``QwenImage21Transformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, cond + target tokens, latent_channels)
    encoder_hidden_states: torch.Tensor  # (B, T, context_dim)
    timestep: torch.Tensor  # (B,)
    img_shapes: list  # per sample: [(1, h, w) of each condition image, then of the target]
    img_mask: torch.Tensor  # (B, T + target / 4) bool
    encoder_hidden_states_mask: torch.Tensor | None  # (B, T) bool

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def qwen_image21_inputs(
    model: QwenImage21Transformer2DModel, images: list[tuple[int, int, int]], masks: list[list[int]],
    slots_at: int = 2, seed: int = 0,
) -> QwenImage21Inputs:
    """Seeded inputs: batch ``len(masks)``, a different prompt and timestep per element.

    ``images``: (1, h, w) of each condition image, then of the target (h * w a multiple of 4);
    ``masks[b]``: element b's mask over the ``T`` vision-language positions (0/1, holes allowed),
    the condition images' slots placed from position ``slots_at`` on (their mask entries are unread).
    """
    for shape in images:
        if prod(shape) % 4:
            raise ValueError(f"an image's token count must be a multiple of 4 (2 x 2 tokens a slot), got {shape}")
    batch, text_len = len(masks), len(masks[0])
    slots = [False] * text_len
    pos = slots_at
    for shape in images[:-1]:
        for _ in range(prod(shape) // 4):
            slots[pos] = True
            pos += 1
    img_mask = torch.tensor([slots + [True] * (prod(images[-1]) // 4)] * batch)
    g = torch.Generator().manual_seed(seed)
    tokens = sum(prod(s) for s in images)
    x = torch.randn(batch, tokens, model.config.in_channels, generator=g)
    text = torch.randn(batch, text_len, model.config.context_in_dim, generator=g)
    timestep = torch.rand(batch, generator=g)
    mask = torch.tensor(masks, dtype=torch.bool)
    return QwenImage21Inputs(x, text, timestep, [list(images)] * batch, img_mask, mask)


def qwen_image21_lengths(images: list[tuple[int, int, int]], text_len: int) -> tuple[int, int]:
    """(prefix, target) token counts of the joint sequence: the text positions that are not slots
    plus the condition images' tokens, and the target's tokens."""
    cond = sum(prod(s) for s in images[:-1])
    return text_len - cond // 4 + cond, prod(images[-1])


# Qwen3-VL's chat and vision tokens that QwenImage21Pipeline's prompt template and processor use.
_VL_TOKENS = ["<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
# A chat template of the shape Qwen3-VL's has for text messages, whose content is a string (FLUX.3's
# text encoder step) or a list of text parts (QwenImage21Pipeline: it tokenizes its system message
# with it to know how many leading tokens to drop); the assistant's turn opened on request.
_CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
                  "{% if message['content'] is string %}{{ message['content'] }}{% else %}"
                  "{% for part in message['content'] %}{{ part['text'] }}{% endfor %}{% endif %}<|im_end|>\n"
                  "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_qwen3_vl_processor():
    """A ``Qwen3VLProcessor`` over single characters (``tiny_qwen_image.tiny_qwen_tokenizer``, with
    Qwen3-VL's chat and vision tokens as special tokens) and the PIL image processor, with no video
    processor (text-to-image and image conditions need none; transformers' video processor needs
    torchvision). Built in code: no download."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor

    from usp_dit.demo.tiny_qwen_image import tiny_qwen_tokenizer

    class _ImageOnlyProcessor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, attribute_name, arg):  # video_processor=None allowed
            if attribute_name == "video_processor" and arg is None:
                return None
            return super().check_argument_for_proper_class(attribute_name, arg)

    # Qwen3-VL's vision patches (16 pixels, 2 x 2 merged, 2 frames); condition images of at most 64 x 64.
    images = Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                                      size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64})
    return _ImageOnlyProcessor(image_processor=images, tokenizer=tiny_qwen_tokenizer(_VL_TOKENS), video_processor=None,
                               chat_template=_CHAT_TEMPLATE)


def tiny_qwen3_vl(tokenizer, seed: int = 0):
    """A 2-layer ``Qwen3VLForConditionalGeneration`` of width ``CONTEXT_DIM`` (the tiny transformer's
    ``context_in_dim``; 2 heads x 16, one K/V head, interleaved M-RoPE 2:3:3) and a 1-block vision
    tower, float32, every parameter perturbed; its vocabulary and vision token ids are ``tokenizer``'s."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = {f"{name}_token_id": tokenizer.convert_tokens_to_ids(token) for name, token in (
        ("image", "<|image_pad|>"), ("video", "<|video_pad|>"), ("vision_start", "<|vision_start|>"),
        ("vision_end", "<|vision_end|>"))}
    config = Qwen3VLConfig(
        **ids,
        text_config=dict(vocab_size=len(tokenizer), hidden_size=CONTEXT_DIM, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=512,
                         rope_scaling={"rope_type": "default", "mrope_section": [2, 3, 3], "mrope_interleaved": True}),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=CONTEXT_DIM,
                           deepstack_visual_indexes=[0], patch_size=16, spatial_merge_size=2, temporal_patch_size=2),
    )
    torch.manual_seed(seed)
    encoder = Qwen3VLForConditionalGeneration(config)
    _perturb(encoder, seed + 1)
    return encoder.eval()


def tiny_qwen_image21_vae(seed: int = 0):
    """A small ``AutoencoderKLQwenImage21``: 16x (four halvings, as the pipeline assumes), RGBA,
    ``LATENT_CHANNELS`` latent channels, float32, every parameter perturbed."""
    from diffusers import AutoencoderKLQwenImage21

    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage21(base_dim=8, decoder_base_dim=8, z_dim=LATENT_CHANNELS, dim_mult=[1, 1, 1, 1, 1],
                                   num_res_blocks=1, latents_mean=[0.0] * LATENT_CHANNELS,
                                   latents_std=[1.0] * LATENT_CHANNELS)
    _perturb(vae, seed + 1)
    return vae.eval()


def tiny_qwen_image21_pipeline(seed: int = 0):
    """A ``QwenImage21Pipeline`` of tiny random models (processor, Qwen3-VL, VAE, transformer), float32.

    ``height x width`` (multiples of 32) gives ``(height / 16) * (width / 16)`` target tokens (the
    VAE's 16x, no patchify), a multiple of 4 as the model needs; 64 x 96 gives 4 x 6 = 24.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImage21Pipeline

    processor = tiny_qwen3_vl_processor()
    return QwenImage21Pipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=tiny_qwen_image21_vae(seed + 20),
        text_encoder=tiny_qwen3_vl(processor.tokenizer, seed + 10), processor=processor,
        transformer=tiny_qwen_image21(seed=seed + 30),
    )
