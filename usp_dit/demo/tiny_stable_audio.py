"""Tiny randomly initialised Stable Audio transformers and a ``StableAudioPipeline``, built in code for tests.

Layout: latents (batch, LATENT_CHANNELS, frames), one token per frame; the model prepends one
global token, so it attends over 1 + frames tokens; text (batch, TEXT_LEN, TEXT_DIM) with an
optional bool mask (batch, TEXT_LEN); the global (seconds) embedding (batch, 1, 2 * TEXT_DIM);
timesteps (batch,); the RoPE table ``(cos, sin)`` (1 + frames, head_dim // 2) as
``StableAudioPipeline`` makes it (``get_1d_rotary_pos_embed``, not interleaved).

Nothing is downloaded: the T5 tokenizer is a character vocabulary (``tiny_chroma.tiny_t5``), the T5
encoder, seconds projection, Oobleck VAE and transformer are built from small configs and seeded.
Every process that calls a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import StableAudioDiTModel
from diffusers.models.embeddings import get_1d_rotary_pos_embed

from usp_dit.demo.tiny_chroma import TEXT_DIM
from usp_dit.demo.tiny_video import _perturb

LATENT_CHANNELS = 8  # in_channels = the VAE's decoder_input_channels (Stable Audio Open: 64)
TEXT_LEN = 6  # (Stable Audio Open: 128 T5 tokens + the two seconds tokens)


def tiny_stable_audio(num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, sample_size: int = 22,
                      seed: int = 0) -> StableAudioDiTModel:
    """A small ``StableAudioDiTModel`` (``num_heads * head_dim`` wide; cross-attention GQA with 2 K/V
    heads), float32, eval mode, every parameter perturbed (``tiny_video._perturb``: the LayerNorms
    and the fixed Fourier timestep weights too). ``sample_size``: the frames the pipeline generates."""
    torch.manual_seed(seed)
    model = StableAudioDiTModel(
        sample_size=sample_size, in_channels=LATENT_CHANNELS, num_layers=num_layers, attention_head_dim=head_dim,
        num_attention_heads=num_heads, num_key_value_attention_heads=2, out_channels=LATENT_CHANNELS,
        cross_attention_dim=TEXT_DIM, time_proj_dim=16, global_states_input_dim=2 * TEXT_DIM,
        cross_attention_input_dim=TEXT_DIM,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class StableAudioInputs:
    """Keyword arguments of one ``StableAudioDiTModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, LATENT_CHANNELS, frames)
    timestep: torch.Tensor  # (B,)
    encoder_hidden_states: torch.Tensor  # (B, TEXT_LEN, TEXT_DIM)
    global_hidden_states: torch.Tensor  # (B, 1, 2 * TEXT_DIM)
    rotary_embedding: tuple[torch.Tensor, torch.Tensor]  # (1 + frames, head_dim // 2) each
    encoder_attention_mask: torch.Tensor | None = None  # (B, TEXT_LEN) bool

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def stable_audio_inputs(model: StableAudioDiTModel, frames: int, prompt_lengths: list[int] | None = None,
                        seed: int = 0) -> StableAudioInputs:
    """Seeded inputs for ``frames`` latent frames, batch 2 (or ``len(prompt_lengths)``): a different
    latent, prompt, timestep and seconds embedding per element; ``prompt_lengths``: each element's
    valid text tokens (a prefix mask for the cross-attention), or no mask."""
    batch = 2 if prompt_lengths is None else len(prompt_lengths)
    g = torch.Generator().manual_seed(seed)
    rope = get_1d_rotary_pos_embed(model.config.attention_head_dim // 2, frames + 1, use_real=True,
                                   repeat_interleave_real=False)
    mask = None
    if prompt_lengths is not None:
        mask = torch.arange(TEXT_LEN)[None, :] < torch.tensor(prompt_lengths)[:, None]
    return StableAudioInputs(
        hidden_states=torch.randn(batch, LATENT_CHANNELS, frames, generator=g),
        timestep=torch.rand(batch, generator=g) * 2 + 0.1,  # EDM sigmas
        encoder_hidden_states=torch.randn(batch, TEXT_LEN, TEXT_DIM, generator=g),
        global_hidden_states=torch.randn(batch, 1, 2 * TEXT_DIM, generator=g),
        rotary_embedding=tuple(t.float() for t in rope), encoder_attention_mask=mask,
    )


def tiny_stable_audio_pipeline(sample_size: int = 22, seed: int = 0):
    """A ``StableAudioPipeline`` of tiny random models, float32 on CPU: a T5 encoder over a character
    tokenizer (prompts padded to 16 tokens), the seconds projection, a 4x Oobleck VAE (stereo,
    sampling rate 64 Hz: ``sample_size`` frames are ``4 * sample_size / 64`` seconds), the
    transformer, EDM DPM-Solver++. The pipeline always generates ``sample_size`` latent frames
    (1 + ``sample_size`` tokens: 23 by default, dividing neither 2 nor 4)."""
    from diffusers import AutoencoderOobleck, EDMDPMSolverMultistepScheduler, StableAudioPipeline
    from diffusers.pipelines.stable_audio.modeling_stable_audio import StableAudioProjectionModel

    from usp_dit.demo.tiny_chroma import tiny_t5

    tokenizer, text_encoder = tiny_t5(16, seed + 10)
    torch.manual_seed(seed + 20)
    vae = AutoencoderOobleck(
        encoder_hidden_size=4, downsampling_ratios=[2, 2], channel_multiples=[1, 2], decoder_channels=4,
        decoder_input_channels=LATENT_CHANNELS, audio_channels=2, sampling_rate=64,
    )
    _perturb(vae, seed + 21, std=0.02)
    torch.manual_seed(seed + 30)
    projection = StableAudioProjectionModel(text_encoder_dim=TEXT_DIM, conditioning_dim=TEXT_DIM, min_value=0,
                                            max_value=32)
    _perturb(projection, seed + 31)
    return StableAudioPipeline(
        vae=vae.eval(), text_encoder=text_encoder, projection_model=projection.eval(), tokenizer=tokenizer,
        transformer=tiny_stable_audio(sample_size=sample_size, seed=seed + 40), scheduler=EDMDPMSolverMultistepScheduler(),
    )
