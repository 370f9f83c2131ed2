"""Tiny randomly initialised JoyImage-Edit-Plus transformers and pipelines, for tests and examples.

Layout: latents as flat padded patches (batch, max_patches, channels, 1, 2, 2), per element the
target's patches then each reference's, each item's in (t, h, w) order, zeros after the element's
last patch; ``shape_list`` one list per element of each item's (t, h, w) patch grid, target first;
text embeddings (batch, text_seq, text_dim) with a mask (batch, text_seq), 1 = valid; timestep
(batch,) in [0, 1000].

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from diffusers import JoyImageEditPlusTransformer3DModel

from usp_dit.demo.tiny_joyimage import CHANNELS, TEXT_DIM
from usp_dit.demo.tiny_video import _perturb

Grid = tuple[int, int, int]  # an item's (t, h, w) patches


def tiny_joyimage_plus(num_heads: int = 4, head_dim: int = 16, num_layers: int = 2,
                       seed: int = 0) -> JoyImageEditPlusTransformer3DModel:
    """A small ``JoyImageEditPlusTransformer3DModel`` (``num_heads * head_dim`` wide), patch (1, 2, 2)
    as released, float32, eval mode; RoPE axes (4, 6, 6) for head_dim 16 (the release's (16, 56, 56)
    of 128, scaled). Every parameter is perturbed with seeded noise (the modulation tables start at zero).

    Raises:
        ValueError: ``head_dim`` is not a multiple of 8.
    """
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 (even RoPE axes), got {head_dim}")
    torch.manual_seed(seed)
    model = JoyImageEditPlusTransformer3DModel(
        patch_size=[1, 2, 2], in_channels=CHANNELS, hidden_size=num_heads * head_dim, num_attention_heads=num_heads,
        text_dim=TEXT_DIM, mlp_width_ratio=2.0, num_layers=num_layers,
        rope_dim_list=[head_dim // 4, 3 * head_dim // 8, 3 * head_dim // 8],
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class JoyImagePlusInputs:
    """Keyword arguments of one ``JoyImageEditPlusTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor
    timestep: torch.Tensor
    encoder_hidden_states: torch.Tensor
    encoder_hidden_states_mask: torch.Tensor | None
    shape_list: list[list[Grid]]

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def plus_tokens(shape_list: list[list[Grid]]) -> int:
    """The call's sequence length: the longest element's patch count (the others are padded to it)."""
    return max(sum(math.prod(g) for g in items) for items in shape_list)


def joyimage_plus_inputs(model: JoyImageEditPlusTransformer3DModel, shape_list: list[list[Grid]],
                         text_valid: list[int], text_len: int, mask: bool = True,
                         seed: int = 0) -> JoyImagePlusInputs:
    """Seeded inputs of one element per entry of ``shape_list`` (its items' patch grids, target
    first): random patches, zeros after each element's last (as the pipeline pads); ``text_len``
    text tokens, of which element b's first ``text_valid[b]`` are valid (``mask=False``: no mask
    passed); a different prompt and timestep per element.

    Raises:
        ValueError: ``text_valid`` does not give one length in [1, text_len] per element.
    """
    batch = len(shape_list)
    if len(text_valid) != batch or not all(1 <= v <= text_len for v in text_valid):
        raise ValueError(f"text_valid must give one length in [1, {text_len}] per element ({batch}), got {text_valid}")
    g = torch.Generator().manual_seed(seed)
    pt, ph, pw = model.config.patch_size
    x = torch.randn(batch, plus_tokens(shape_list), model.config.in_channels, pt, ph, pw, generator=g)
    for b, items in enumerate(shape_list):
        x[b, sum(math.prod(i) for i in items):] = 0
    text = torch.randn(batch, text_len, model.config.text_dim, generator=g)
    timestep = torch.randint(0, 1000, (batch,), generator=g).float()
    text_mask = (torch.arange(text_len)[None, :] < torch.tensor(text_valid)[:, None]).long() if mask else None
    return JoyImagePlusInputs(x, timestep, text, text_mask, [list(items) for items in shape_list])


VISION_TOKENS = ("<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|video_pad|>")


def tiny_joyimage_plus_tokenizer():
    """``tiny_qwen_image.tiny_qwen_tokenizer`` (one token per character, Qwen's chat tokens) with
    Qwen-VL's vision tokens (``VISION_TOKENS``) as special tokens."""
    from usp_dit.demo.tiny_qwen_image import tiny_qwen_tokenizer

    tokenizer = tiny_qwen_tokenizer()
    tokenizer.add_tokens(list(VISION_TOKENS), special_tokens=True)
    return tokenizer


def tiny_qwen3_vl_processor(tokenizer):
    """A real ``Qwen3VLProcessor`` over ``tokenizer`` and a (PIL) ``Qwen2VLImageProcessorPil`` of
    Qwen3-VL's patches (16 pixels, 2 frames, 2x2 merge), at most 64 x 64 pixels an image (at most 4
    vision tokens a reference). Transformers checks the processor's video processor's class, which needs
    torchvision (absent here); the pipeline passes no video, so the check is skipped for a missing one."""
    from transformers import Qwen2VLImageProcessorPil, Qwen3VLProcessor

    class _NoVideoQwen3VLProcessor(Qwen3VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    images = Qwen2VLImageProcessorPil(patch_size=16, temporal_patch_size=2, merge_size=2, min_pixels=32 * 32,
                                      max_pixels=64 * 64)
    return _NoVideoQwen3VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=None)


def tiny_joyimage_plus_pipeline(seed: int = 0):
    """A ``JoyImageEditPlusPipeline`` of tiny random models, float32: a 2-layer Qwen3-VL text encoder
    with its 1-layer vision tower (``tiny_nucleus_moe.tiny_qwen3_vl_generation``, width ``TEXT_DIM``,
    its vision token ids set to the tokenizer's), a character tokenizer with the vision tokens
    (``tiny_joyimage_plus_tokenizer``) and a real ``Qwen3VLProcessor`` (``tiny_qwen3_vl_processor``):
    the pipeline encodes each prompt with its reference images inline; a Wan VAE (8x spatial) and
    the transformer. (Diffusers 0.42.1's ``__call__`` reads ``prompt`` to format the prompts even
    when ``prompt_embeds`` are given, so a call needs prompts, and so the text encoder.)

    The target is ``height x width`` (``(height / 16) * (width / 16)`` tokens); each reference keeps
    its own size (a multiple of 16): the stock image processor snaps every reference to its
    1024-base buckets (at least 512 x 960), this one (``_own_size_processor``) leaves it, so a test
    runs at a few tokens. Everything after is stock."""
    from diffusers import FlowMatchEulerDiscreteScheduler, JoyImageEditPlusPipeline

    from usp_dit.demo.tiny_nucleus_moe import tiny_qwen3_vl_generation
    from usp_dit.demo.tiny_wan import tiny_wan_vae

    tokenizer = tiny_joyimage_plus_tokenizer()
    processor = tiny_qwen3_vl_processor(tokenizer)
    encoder = tiny_qwen3_vl_generation(len(tokenizer), seed + 10)
    ids = tokenizer.convert_tokens_to_ids(list(VISION_TOKENS))
    # the model finds the images' placeholder tokens by these ids (read at each forward)
    for name, token in zip(("vision_start_token_id", "image_token_id", "vision_end_token_id", "video_token_id"),
                           ids, strict=True):
        setattr(encoder.config, name, token)
    pipe = JoyImageEditPlusPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=tiny_wan_vae(CHANNELS, seed=seed + 20),
        text_encoder=encoder, tokenizer=tokenizer, transformer=tiny_joyimage_plus(seed=seed + 30), processor=processor,
    )
    pipe.image_processor = _own_size_processor(pipe.vae_scale_factor_spatial)
    return pipe


def _own_size_processor(vae_scale_factor: int):
    """A ``JoyImageEditImageProcessor`` whose default size is the given one, else the image's own."""
    from diffusers.pipelines.joyimage.image_processor import JoyImageEditImageProcessor

    class _OwnSize(JoyImageEditImageProcessor):
        def get_default_height_width(self, image, height: int | None = None, width: int | None = None):
            if height is not None and width is not None:
                return height, width
            if image is not None and not isinstance(image, list):
                return image.size[1], image.size[0]
            return super().get_default_height_width(image, height, width)

    return _OwnSize(vae_scale_factor=vae_scale_factor)
