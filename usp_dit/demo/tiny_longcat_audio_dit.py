"""Tiny randomly initialised LongCat-AudioDiT transformers and a ``LongCatAudioDiTPipeline``, for tests.

Layout: audio latents (batch, frames, LATENT_DIM), one token per frame; the audio mask (batch,
frames) bool; text states (batch, text_len, TEXT_DIM) with their mask (batch, text_len) bool;
the latent condition (batch, frames, LATENT_DIM); timesteps (batch,) in [0, 1].

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import LongCatAudioDiTTransformer

from usp_dit.demo.tiny_video import _perturb

LATENT_DIM = 8  # the release's 64
TEXT_DIM = 32  # the UMT5 width (the release's 768)


def tiny_longcat_audio_dit(num_heads: int = 4, head_dim: int = 16, adaln_type: str = "global",
                           seed: int = 0) -> LongCatAudioDiTTransformer:
    """A 2-block ``LongCatAudioDiTTransformer`` (``num_heads * head_dim`` wide; the release's
    options: text ConvNeXt stack, QK norm, long skip, latent condition; ``adaln_type`` "global" as
    released, or "local"), float32, eval mode, every parameter perturbed (``tiny_video._perturb``:
    the zero-initialised AdaLN, GRN and output layers too)."""
    torch.manual_seed(seed)
    model = LongCatAudioDiTTransformer(
        dit_dim=num_heads * head_dim, dit_depth=2, dit_heads=num_heads, dit_text_dim=TEXT_DIM, latent_dim=LATENT_DIM,
        adaln_type=adaln_type, ff_mult=2.0,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class LongCatAudioDiTInputs:
    """Keyword arguments of one ``LongCatAudioDiTTransformer.forward`` call."""

    hidden_states: torch.Tensor  # (B, frames, LATENT_DIM)
    encoder_hidden_states: torch.Tensor  # (B, text_len, TEXT_DIM)
    encoder_attention_mask: torch.Tensor  # (B, text_len) bool
    timestep: torch.Tensor  # (B,)
    attention_mask: torch.Tensor | None  # (B, frames) bool
    latent_cond: torch.Tensor  # (B, frames, LATENT_DIM)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def longcat_audio_dit_inputs(frames: int, text_valid: tuple[int, ...] = (9, 6), text_len: int = 9,
                             audio_mask: bool = True, seed: int = 0) -> LongCatAudioDiTInputs:
    """Seeded inputs of ``frames`` latent frames, batch ``len(text_valid)``: a different latent,
    condition, timestep and prompt per element, element b's prompt ``text_valid[b]`` tokens long
    (padded to ``text_len``, as the pipeline pads to the longest); the audio mask all True (as the
    pipeline gives it), or ``None``."""
    g = torch.Generator().manual_seed(seed)
    batch = len(text_valid)
    text_mask = torch.arange(text_len)[None, :] < torch.tensor(text_valid)[:, None]
    return LongCatAudioDiTInputs(
        hidden_states=torch.randn(batch, frames, LATENT_DIM, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TEXT_DIM, generator=g),
        encoder_attention_mask=text_mask,
        timestep=torch.rand(batch, generator=g),
        attention_mask=torch.ones(batch, frames, dtype=torch.bool) if audio_mask else None,
        latent_cond=torch.randn(batch, frames, LATENT_DIM, generator=g),
    )


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_longcat_audio_dit_pipeline(seed: int = 0):
    """A ``LongCatAudioDiTPipeline`` of tiny random models, float32: a UMT5 encoder over a character
    tokenizer (``tiny_flux._tokenizers``), a 2x VAE at a "sample rate" of 10 (5 latent frames a
    second: ``audio_duration_s=2.6`` gives 13 audio tokens) and the transformer above."""
    from diffusers import LongCatAudioDiTPipeline, LongCatAudioDiTVae

    from usp_dit.demo.tiny_auraflow import _umt5
    from usp_dit.demo.tiny_flux import _tokenizers

    _, tokenizer = _tokenizers(64)
    torch.manual_seed(seed + 20)
    vae = LongCatAudioDiTVae(
        in_channels=1, channels=16, c_mults=[1, 2], strides=[2], latent_dim=LATENT_DIM, encoder_latent_dim=16,
        downsampling_ratio=2, sample_rate=10,
    )
    _perturb(vae, seed + 21, std=0.02)
    return LongCatAudioDiTPipeline(
        vae=vae.eval(), text_encoder=_umt5(len(tokenizer), seed + 10), tokenizer=tokenizer,
        transformer=tiny_longcat_audio_dit(seed=seed + 30),
    )
