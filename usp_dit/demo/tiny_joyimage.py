"""Tiny randomly initialised JoyImage-Edit transformers and pipelines, for tests and examples.

Layout: latents (batch, channels, frames, height, width) for generation, (batch, items, channels,
frames, height, width) for editing (the reference items first, the noisy target last, as the
pipeline stacks them); text embeddings (batch, text_seq, text_dim), no mask (the transformer takes
none); timestep (batch,) in [0, 1000].

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import JoyImageEditTransformer3DModel

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # text_dim of the tiny transformers (the real one: 4096, Qwen3-VL states)
CHANNELS = 4  # in_channels (the real one: 16, the Wan VAE's latents)


def tiny_joyimage(num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, rope_type: str = "rope",
                  seed: int = 0) -> JoyImageEditTransformer3DModel:
    """A small ``JoyImageEditTransformer3DModel`` (``num_heads * head_dim`` wide), patch (1, 2, 2) as
    released, float32, eval mode. RoPE axes (frame, height, width) scaled from the release's
    (16, 56, 56) of 128: (4, 6, 6) for 16 (``head_dim`` a multiple of 8). ``rope_type="mrope"``
    also rotates the text. Every parameter is perturbed with seeded noise (the modulation tables
    start at zero).

    Raises:
        ValueError: ``head_dim`` is not a multiple of 8.
    """
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 (even RoPE axes), got {head_dim}")
    torch.manual_seed(seed)
    model = JoyImageEditTransformer3DModel(
        patch_size=[1, 2, 2], in_channels=CHANNELS, hidden_size=num_heads * head_dim, num_attention_heads=num_heads,
        text_dim=TEXT_DIM, mlp_width_ratio=2.0, num_layers=num_layers,
        rope_dim_list=[head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8], rope_type=rope_type,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class JoyImageInputs:
    """Keyword arguments of one ``JoyImageEditTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor
    timestep: torch.Tensor
    encoder_hidden_states: torch.Tensor

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def joyimage_tokens(items: int | None, frames: int, h: int, w: int) -> int:
    """Image tokens of a call on ``items`` items (None: a 5-D call) of ``frames`` x ``h`` x ``w`` patches."""
    return (items or 1) * frames * h * w


def joyimage_inputs(model: JoyImageEditTransformer3DModel, batch: int, h: int, w: int, text_len: int,
                    items: int | None = None, frames: int = 1, seed: int = 0) -> JoyImageInputs:
    """Seeded inputs of ``h`` x ``w`` patches a frame (latents 2h x 2w), ``items`` items (None: the
    5-D generation call), ``text_len`` text tokens; a different prompt and timestep per element."""
    g = torch.Generator().manual_seed(seed)
    shape = (batch,) + ((items,) if items else ()) + (model.config.in_channels, frames, 2 * h, 2 * w)
    x = torch.randn(shape, generator=g)
    text = torch.randn(batch, text_len, model.config.text_dim, generator=g)
    timestep = torch.randint(0, 1000, (batch,), generator=g).float()
    return JoyImageInputs(x, timestep, text)


def tiny_joyimage_pipeline(seed: int = 0, text_encoder: bool = True):
    """A ``JoyImageEditPipeline`` of tiny random models, float32: a 2-layer Qwen3-VL-like text encoder
    (``tiny_nucleus_moe.tiny_qwen3_vl_generation``, width ``TEXT_DIM``) with a character tokenizer
    (``tiny_qwen_image.tiny_qwen_tokenizer``) for text-to-image prompts, a Wan VAE (8x spatial) and
    the transformer. No Qwen3-VL processor: an edit call (``image=``) takes ``prompt_embeds`` (and
    ``negative_prompt_embeds`` under CFG) with their masks. ``text_encoder=False`` leaves out the
    text encoder and tokenizer (a test that passes embeddings). ``height x width`` gives
    ``(height / 16) * (width / 16)`` tokens an item; e.g. 80 x 112 -> 5 x 7 = 35.

    The stock image processor snaps every size to its 1024-base buckets (at least 512 x 960: 1920
    tokens an item); this one keeps a given ``height`` and ``width`` (``_exact_size_processor``), so a
    test runs at a few tokens. Resizing, cropping and everything after are stock."""
    from diffusers import FlowMatchEulerDiscreteScheduler, JoyImageEditPipeline

    from usp_dit.demo.tiny_wan import tiny_wan_vae

    tokenizer = encoder = None
    if text_encoder:
        from usp_dit.demo.tiny_nucleus_moe import tiny_qwen3_vl_generation
        from usp_dit.demo.tiny_qwen_image import tiny_qwen_tokenizer

        tokenizer = tiny_qwen_tokenizer()
        encoder = tiny_qwen3_vl_generation(len(tokenizer), seed + 10)
    pipe = JoyImageEditPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=tiny_wan_vae(CHANNELS, seed=seed + 20),
        text_encoder=encoder, tokenizer=tokenizer, transformer=tiny_joyimage(seed=seed + 30), processor=None,
    )
    pipe.vae_image_processor = _exact_size_processor(pipe.vae_scale_factor_spatial)
    return pipe


def _exact_size_processor(vae_scale_factor: int):
    """A ``JoyImageEditImageProcessor`` that keeps a given (height, width) instead of its bucket."""
    from diffusers.pipelines.joyimage.image_processor import JoyImageEditImageProcessor

    class _ExactSize(JoyImageEditImageProcessor):
        def get_default_height_width(self, image, height: int | None = None, width: int | None = None):
            if height is not None and width is not None:
                return height, width
            return super().get_default_height_width(image, height, width)

    return _ExactSize(vae_scale_factor=vae_scale_factor)
