"""Tiny randomly initialised ACE-Step transformers and an ``AceStepPipeline``, for tests.

Layout: audio latents (batch, frames, ACOUSTIC_DIM); context latents (batch, frames, 2 *
ACOUSTIC_DIM) (source latents and chunk mask, as the pipeline concatenates them); the packed
condition (batch, cond_seq, HIDDEN); timesteps (batch,) in [0, 1]. Patch 2: ``frames`` latent
frames give ``ceil(frames / 2)`` audio tokens.

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import AceStepTransformer1DModel

from usp_dit.demo.tiny_video import _perturb

ACOUSTIC_DIM = 8  # the release's 64
HIDDEN = 64  # the release's 2048 (and the condition encoder's width)


def tiny_ace_step(num_heads: int = 4, num_kv_heads: int = 2, head_dim: int = 16, sliding_window: int = 64,
                  layer_types: list[str] | None = None, seed: int = 0) -> AceStepTransformer1DModel:
    """A 2-layer ``AceStepTransformer1DModel`` (layer 0 sliding-window, layer 1 full attention, as
    the release alternates them; GQA ``num_heads`` / ``num_kv_heads``), float32, eval mode, every
    parameter perturbed (``tiny_video._perturb``). ``sliding_window``: 64 by default, wider than the
    tests' sequences (Note [ACE-Step's sliding window] in ``usp_dit.pipelines.families.ace_step``)."""
    torch.manual_seed(seed)
    model = AceStepTransformer1DModel(
        hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=2, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, head_dim=head_dim, in_channels=3 * ACOUSTIC_DIM,
        audio_acoustic_hidden_dim=ACOUSTIC_DIM, patch_size=2, rope_theta=10000.0, sliding_window=sliding_window,
        layer_types=layer_types,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class AceStepInputs:
    """Keyword arguments of one ``AceStepTransformer1DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, frames, ACOUSTIC_DIM)
    timestep: torch.Tensor  # (B,)
    timestep_r: torch.Tensor  # (B,)
    encoder_hidden_states: torch.Tensor  # (B, cond_seq, HIDDEN)
    context_latents: torch.Tensor  # (B, frames, 2 * ACOUSTIC_DIM)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def ace_step_inputs(frames: int, cond_len: int = 7, batch: int = 2, seed: int = 0) -> AceStepInputs:
    """Seeded inputs of ``frames`` latent frames: a different latent, condition, context and pair
    of timesteps (t, r) per element."""
    g = torch.Generator().manual_seed(seed)
    t = torch.rand(batch, generator=g)
    return AceStepInputs(
        hidden_states=torch.randn(batch, frames, ACOUSTIC_DIM, generator=g),
        timestep=t,
        timestep_r=t * torch.rand(batch, generator=g),  # r <= t: the mean-flow path (t - r) non-zero
        encoder_hidden_states=torch.randn(batch, cond_len, HIDDEN, generator=g),
        context_latents=torch.randn(batch, frames, 2 * ACOUSTIC_DIM, generator=g),
    )


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_ace_step_pipeline(seed: int = 0):
    """An ``AceStepPipeline`` of tiny random models, float32: a Qwen3 text encoder over a character
    tokenizer (``tiny_flux2.tiny_qwen3_tokenizer``), the condition encoder (lyrics and timbre
    encoders), an Oobleck VAE (2x downsampling at a 4 Hz "sampling rate": 2 latent frames a second)
    and the transformer (``HIDDEN`` wide, base model: CFG on). ``audio_duration`` seconds give
    ``2 * audio_duration`` latent frames, half as many audio tokens (e.g. 10.5 s -> 21 -> 11)."""
    from diffusers import AceStepPipeline, AutoencoderOobleck, FlowMatchEulerDiscreteScheduler
    from diffusers.pipelines.ace_step import AceStepConditionEncoder
    from transformers import Qwen3Config, Qwen3Model

    from usp_dit.demo.tiny_flux2 import tiny_qwen3_tokenizer

    tokenizer = tiny_qwen3_tokenizer()
    torch.manual_seed(seed + 10)
    text_encoder = Qwen3Model(Qwen3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=len(tokenizer), max_position_embeddings=512, pad_token_id=0,
    ))
    _perturb(text_encoder, seed + 11, std=0.02)
    torch.manual_seed(seed + 20)
    condition_encoder = AceStepConditionEncoder(
        hidden_size=HIDDEN, intermediate_size=96, text_hidden_dim=32, timbre_hidden_dim=ACOUSTIC_DIM,
        num_lyric_encoder_hidden_layers=1, num_timbre_encoder_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, rope_theta=10000.0, sliding_window=16,
    )
    _perturb(condition_encoder, seed + 21, std=0.02)
    torch.manual_seed(seed + 30)
    vae = AutoencoderOobleck(
        encoder_hidden_size=6, downsampling_ratios=[1, 2], decoder_channels=3, decoder_input_channels=ACOUSTIC_DIM,
        audio_channels=2, channel_multiples=[2, 4], sampling_rate=4,
    )
    _perturb(vae, seed + 31, std=0.02)
    return AceStepPipeline(
        transformer=tiny_ace_step(seed=seed + 40), condition_encoder=condition_encoder.eval(), vae=vae.eval(),
        text_encoder=text_encoder.eval(), tokenizer=tokenizer,
        scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1, shift=1.0),
    )
