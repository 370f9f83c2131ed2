"""Tiny randomly initialised CogVideoX and Mochi transformers, for tests and the video example.

Layout: CogVideoX latents (batch, frames, channels, height, width); Mochi latents
(batch, channels, frames, height, width); text embeddings (batch, text_seq, text_dim).

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from diffusers import CogVideoXTransformer3DModel, MochiTransformer3DModel
from diffusers.models.embeddings import get_3d_rotary_pos_embed

# Variants of the CogVideoX family; each is a tiny version of a real checkpoint's config.
COGVIDEOX_VARIANTS = {
    "2b": dict(use_rotary_positional_embeddings=False),  # sin-cos table added in the patch embedding
    "5b": dict(use_rotary_positional_embeddings=True),  # RoPE table passed in by the pipeline
    "5b-i2v": dict(use_rotary_positional_embeddings=True, in_channels=8),  # image latents on channels
    # CogVideoX 1.5 image-to-video: temporal patches, ofs embedding, image latents concatenated on channels
    "1.5-i2v": dict(  # ofs_embed_dim must equal time_embed_dim (32)
        use_rotary_positional_embeddings=True, patch_size_t=2, ofs_embed_dim=32, in_channels=8),
}


def _perturb(model: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Add seeded noise to every parameter, so that no weight is a default constant (LayerNorm ones,
    Mochi's all-zero RoPE frequencies) that could hide a misplaced token."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)


@contextlib.contextmanager
def quiet_diffusers_log() -> Iterator[None]:
    """Diffusers' log at ERROR while tiny modular pipelines are built: its warnings then (a component
    "not created using ComponentSpec", guiders "experimental") are true of every tiny build and
    would print once a rank."""
    from diffusers.utils import logging as diffusers_logging

    verbosity = diffusers_logging.get_verbosity()
    diffusers_logging.set_verbosity_error()
    try:
        yield
    finally:
        diffusers_logging.set_verbosity(verbosity)


def tiny_cogvideox(
    variant: str = "5b", num_heads: int = 6, head_dim: int = 16, text_len: int = 7, seed: int = 0,
    dropout: float = 0.0,
) -> CogVideoXTransformer3DModel:
    """A 2-layer CogVideoX transformer (``num_heads * head_dim`` wide), float32, eval mode.

    ``dropout``: the config's dropout probability (embedding and feed-forward dropouts; 0 as in
    the released checkpoints).

    Raises:
        ValueError: ``variant`` is not one of ``COGVIDEOX_VARIANTS``.
    """
    if variant not in COGVIDEOX_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(COGVIDEOX_VARIANTS)}, got {variant!r}")
    config = dict(
        num_attention_heads=num_heads, attention_head_dim=head_dim, in_channels=4, out_channels=4,
        time_embed_dim=32, text_embed_dim=32, num_layers=2, sample_width=12, sample_height=12,
        sample_frames=9, max_text_seq_length=text_len, dropout=dropout,
    )
    config.update(COGVIDEOX_VARIANTS[variant])
    torch.manual_seed(seed)
    model = CogVideoXTransformer3DModel(**config)
    _perturb(model, seed + 1)
    return model.eval()


def cogvideox_rope(model: CogVideoXTransformer3DModel, frames: int, height: int, width: int):
    """The ``(cos, sin)`` table (seq, head_dim) a CogVideoX pipeline passes for a latent of this size.

    ``frames``/``height``/``width`` are latent sizes (before patching); None for the 2B variant.
    """
    cfg = model.config
    if not cfg.use_rotary_positional_embeddings:
        return None
    p, p_t = cfg.patch_size, getattr(cfg, "patch_size_t", None) or 1  # ConsisID has no patch_size_t
    grid = (height // p, width // p)
    return get_3d_rotary_pos_embed(
        embed_dim=cfg.attention_head_dim, crops_coords=((0, 0), grid), grid_size=grid,
        temporal_size=(frames + p_t - 1) // p_t,
    )


@dataclass
class CogVideoXInputs:
    """Keyword arguments of one ``CogVideoXTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, F, C, H, W)
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    timestep: torch.Tensor  # (B,)
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None
    ofs: torch.Tensor | None = None

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def cogvideox_inputs(
    model: CogVideoXTransformer3DModel, frames: int, height: int, width: int, batch: int = 2, seed: int = 0
) -> CogVideoXInputs:
    """Seeded inputs for ``model``; tokens = frames/p_t * height/p * width/p."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, frames, cfg.in_channels, height, width, generator=g)
    text = torch.randn(batch, cfg.max_text_seq_length, cfg.text_embed_dim, generator=g)
    timestep = torch.randint(0, 1000, (batch,), generator=g)
    ofs = torch.full((batch,), 2.0) if cfg.ofs_embed_dim else None
    return CogVideoXInputs(x, text, timestep, cogvideox_rope(model, frames, height, width), ofs)


def tiny_mochi(num_heads: int = 6, head_dim: int = 16, text_dim: int = 32, seed: int = 0) -> MochiTransformer3DModel:
    """A 2-layer Mochi transformer (the last layer is ``context_pre_only``, as in the real model)."""
    torch.manual_seed(seed)
    model = MochiTransformer3DModel(
        patch_size=2, num_attention_heads=num_heads, attention_head_dim=head_dim, num_layers=2,
        pooled_projection_dim=48, in_channels=4, text_embed_dim=text_dim, time_embed_dim=32,
        max_sequence_length=16,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class MochiInputs:
    """Keyword arguments of one ``MochiTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, C, F, H, W)
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    timestep: torch.Tensor  # (B,)
    encoder_attention_mask: torch.Tensor  # (B, T) bool: False marks a padded prompt token

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def mochi_inputs(
    model: MochiTransformer3DModel, frames: int, height: int, width: int, valid: list[int] | None = None,
    text_len: int = 9, seed: int = 0,
) -> MochiInputs:
    """Seeded inputs; ``valid[b]`` prompt tokens of element b are real, the rest padding (default: all).

    A negative ``valid[b] = -n`` marks the *last* n tokens real and the first ones padding (a mask
    that is not a prefix, to check that the stock processor's handling is matched exactly).
    """
    cfg = model.config
    valid = valid or [text_len, text_len]
    g = torch.Generator().manual_seed(seed)
    batch = len(valid)
    x = torch.randn(batch, cfg.in_channels, frames, height, width, generator=g)
    text = torch.randn(batch, text_len, cfg.text_embed_dim, generator=g)
    timestep = torch.randint(0, 1000, (batch,), generator=g)
    mask = torch.zeros(batch, text_len, dtype=torch.bool)
    for b, n in enumerate(valid):
        if n >= 0:
            mask[b, :n] = True
        else:
            mask[b, text_len + n:] = True
    return MochiInputs(x, text, timestep, mask)


# ---- whole pipelines -----------------------------------------------------------------------------

TEXT_DIM = 32  # d_model of the tiny T5 encoder = text_embed_dim of the tiny transformers
_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 .,!?'-"


def tiny_t5(max_length: int, seed: int = 0):
    """A T5 tokenizer over single characters (a unigram vocabulary written here, no file) and a
    2-layer ``T5EncoderModel`` of width ``TEXT_DIM``; returns ``(tokenizer, encoder)``."""
    from transformers import T5Config, T5EncoderModel, T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(c, -2.0) for c in _CHARS if c != " "]
    tokenizer = T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=max_length)
    torch.manual_seed(seed)
    encoder = T5EncoderModel(T5Config(
        vocab_size=len(tokenizer), d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        pad_token_id=0, eos_token_id=1,
    ))
    _perturb(encoder, seed + 1, std=0.02)
    return tokenizer, encoder.eval()


def tiny_cogvideox_vae(seed: int = 0):
    """An ``AutoencoderKLCogVideoX`` with 4 latent channels: 8x spatial, 4x temporal compression."""
    from diffusers import AutoencoderKLCogVideoX

    torch.manual_seed(seed)
    return AutoencoderKLCogVideoX(
        down_block_types=("CogVideoXDownBlock3D",) * 4, up_block_types=("CogVideoXUpBlock3D",) * 4,
        block_out_channels=(8, 8, 8, 8), latent_channels=4, layers_per_block=1, norm_num_groups=2,
        temporal_compression_ratio=4, sample_height=48, sample_width=48,
    ).eval()


def tiny_mochi_vae(seed: int = 0):
    """An ``AutoencoderKLMochi`` with 12 latent channels: 8x spatial, 6x temporal expansion."""
    from diffusers import AutoencoderKLMochi

    torch.manual_seed(seed)
    return AutoencoderKLMochi(
        latent_channels=12, out_channels=3, encoder_block_out_channels=(32, 32, 32, 32),
        decoder_block_out_channels=(32, 32, 32, 32), layers_per_block=(1, 1, 1, 1, 1),
    ).eval()


def tiny_cogvideox_pipeline(max_text_len: int = 16, seed: int = 0, image_to_video: bool = False):
    """A ``CogVideoXPipeline`` (5B-like: RoPE passed by the pipeline) of tiny random models, float32;
    with ``image_to_video`` a ``CogVideoXImageToVideoPipeline`` (call it with ``image=``).

    VAE: 8x spatial, 4x temporal compression, so ``height x width x num_frames`` gives
    ``((num_frames - 1) / 4 + 1) * (height / 16) * (width / 16)`` video tokens (patch 2); e.g.
    48 x 48 x 9 frames -> 27 tokens. Call it with ``max_sequence_length <= max_text_len``.
    """
    from diffusers import CogVideoXDDIMScheduler, CogVideoXImageToVideoPipeline, CogVideoXPipeline

    tokenizer, text_encoder = tiny_t5(max_text_len, seed + 10)
    vae = tiny_cogvideox_vae(seed + 20)
    transformer = tiny_cogvideox("5b-i2v" if image_to_video else "5b", text_len=max_text_len, seed=seed + 30)
    cls = CogVideoXImageToVideoPipeline if image_to_video else CogVideoXPipeline
    return cls(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=vae, transformer=transformer,
        scheduler=CogVideoXDDIMScheduler(),
    )


def gradient_image(height: int, width: int):
    """A deterministic RGB ``PIL.Image`` (colour gradients) to start image-to-video from."""
    from PIL import Image

    ys = torch.linspace(0, 1, height)[:, None].expand(height, width)
    xs = torch.linspace(0, 1, width)[None, :].expand(height, width)
    rgb = torch.stack([xs, ys, (xs + ys) / 2], dim=-1)
    return Image.fromarray((rgb * 255).round().to(torch.uint8).numpy())


def tiny_mochi_pipeline(max_text_len: int = 16, seed: int = 0):
    """A ``MochiPipeline`` of tiny random models, float32.

    VAE: 8x spatial, 6x temporal expansion, so ``height x width x num_frames`` gives
    ``((num_frames - 1) / 6 + 1) * (height / 16) * (width / 16)`` video tokens (patch 2); e.g.
    48 x 48 x 13 frames -> 27 tokens. Call it with ``max_sequence_length <= max_text_len``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, MochiPipeline

    tokenizer, text_encoder = tiny_t5(max_text_len, seed + 10)
    vae = tiny_mochi_vae(seed + 20)
    torch.manual_seed(seed + 30)
    transformer = MochiTransformer3DModel(
        patch_size=2, num_attention_heads=6, attention_head_dim=16, num_layers=2, pooled_projection_dim=48,
        in_channels=12, text_embed_dim=TEXT_DIM, time_embed_dim=32, max_sequence_length=max_text_len,
    )
    _perturb(transformer, seed + 31)
    return MochiPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(), vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
        transformer=transformer.eval(),
    )
