"""Tiny randomly initialised Stable Audio 3 transformers and pipelines, built in code for tests.

Layout: latents (batch, LATENT_CHANNELS, frames), one token per frame (patch 1); the model prepends
``num_memory_tokens`` learned tokens, so it attends over memory + frames tokens; the context
(batch, TEXT_LEN, TEXT_DIM) with a 0/1 mask (batch, TEXT_LEN) (the model replaces the padded rows
by a learned one); the global duration embedding (batch, TEXT_DIM); timesteps (batch,) in [0, 1];
the inpainting condition ``local_add_cond`` (batch, 1 + LATENT_CHANNELS, frames).

Nothing is downloaded: the tokenizer is the character T5 tokenizer of ``tiny_chroma`` (SA3's Gemma
tokenizer stands in for nothing else: the pipelines only call it), the T5Gemma encoder, duration
embedder, SAME autoencoder and transformer are built from small configs and seeded. Every process
that calls a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import StableAudio3DiTModel

from usp_dit.demo.tiny_chroma import TEXT_DIM
from usp_dit.demo.tiny_video import _perturb

LATENT_CHANNELS = 8  # io_channels = the SAME autoencoder's latent_dim (SA3: 256)
TEXT_LEN = 6  # (SA3: 256 T5Gemma tokens + the duration token)
NUM_MEMORY = 7  # (SA3: 64)


def tiny_stable_audio3(num_heads: int = 4, head_dim: int = 16, depth: int = 2, num_memory_tokens: int = NUM_MEMORY,
                       patch_size: int = 1, seed: int = 0) -> StableAudio3DiTModel:
    """A small ``StableAudio3DiTModel`` (``num_heads * head_dim`` wide, differential attention),
    float32, eval mode, every parameter perturbed (``tiny_video._perturb``: the zero-initialised
    pre/post convolutions, inpainting projections and padding row too)."""
    torch.manual_seed(seed)
    model = StableAudio3DiTModel(
        io_channels=LATENT_CHANNELS, patch_size=patch_size, embed_dim=num_heads * head_dim, depth=depth,
        num_heads=num_heads, cond_token_dim=TEXT_DIM, global_cond_dim=TEXT_DIM,
        local_add_cond_dim=1 + LATENT_CHANNELS, timestep_features_dim=16, ff_mult=2.0,
        num_memory_tokens=num_memory_tokens,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class StableAudio3Inputs:
    """Keyword arguments of one ``StableAudio3DiTModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, LATENT_CHANNELS, frames)
    timestep: torch.Tensor  # (B,)
    encoder_hidden_states: torch.Tensor  # (B, TEXT_LEN, TEXT_DIM)
    global_hidden_states: torch.Tensor  # (B, TEXT_DIM)
    encoder_attention_mask: torch.Tensor  # (B, TEXT_LEN) 0 / 1
    local_add_cond: torch.Tensor | None = None  # (B, 1 + LATENT_CHANNELS, frames)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def stable_audio3_inputs(frames: int, prompt_lengths: list[int], inpaint: bool = False,
                         seed: int = 0) -> StableAudio3Inputs:
    """Seeded inputs for ``frames`` latent frames, batch ``len(prompt_lengths)``: a different latent,
    prompt, timestep and duration per element; element b's valid text tokens are ``prompt_lengths[b]``
    (a prefix mask, as the pipelines' right padding). ``inpaint``: an inpainting condition, its
    channel 0 a 0/1 keep-mask that differs per element, the rest the masked reference latent."""
    batch = len(prompt_lengths)
    g = torch.Generator().manual_seed(seed)
    local = None
    if inpaint:
        keep = (torch.rand(batch, 1, frames, generator=g) > 0.5).float()
        local = torch.cat([keep, keep * torch.randn(batch, LATENT_CHANNELS, frames, generator=g)], dim=1)
    return StableAudio3Inputs(
        hidden_states=torch.randn(batch, LATENT_CHANNELS, frames, generator=g),
        timestep=torch.rand(batch, generator=g),
        encoder_hidden_states=torch.randn(batch, TEXT_LEN, TEXT_DIM, generator=g),
        global_hidden_states=torch.randn(batch, TEXT_DIM, generator=g),
        encoder_attention_mask=(torch.arange(TEXT_LEN)[None, :] < torch.tensor(prompt_lengths)[:, None]).long(),
        local_add_cond=local,
    )


SAMPLING_RATE = 64  # Hz; the tiny SAME autoencoder makes one latent frame of 8 samples: 8 frames a second


def _components(seed: int) -> dict:
    from diffusers import AutoencoderSAME, FlowMatchEulerDiscreteScheduler, StableAudio3DurationEmbedder
    from transformers import T5GemmaConfig, T5GemmaEncoderModel

    from usp_dit.demo.tiny_chroma import tiny_t5

    tokenizer, _ = tiny_t5(24, seed + 10)
    module = {"vocab_size": len(tokenizer), "hidden_size": TEXT_DIM, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "query_pre_attn_scalar": 8,
              "sliding_window": 16, "max_position_embeddings": 64}
    torch.manual_seed(seed + 11)
    text_encoder = T5GemmaEncoderModel(T5GemmaConfig(encoder=module, decoder=module, vocab_size=len(tokenizer), is_encoder_decoder=False))
    _perturb(text_encoder, seed + 12, std=0.02)
    torch.manual_seed(seed + 20)
    vae = AutoencoderSAME(
        audio_channels=2, patch_size=4, encoder_channels=8, encoder_c_mults=[1], encoder_strides=[2],
        encoder_transformer_depths=[1], latent_dim=LATENT_CHANNELS, dim_heads=8, ff_mult=2, sampling_rate=SAMPLING_RATE,
    )
    _perturb(vae, seed + 21, std=0.02)
    torch.manual_seed(seed + 30)
    duration = StableAudio3DurationEmbedder(output_dim=TEXT_DIM, fourier_dim=16, max_val=32.0)
    _perturb(duration, seed + 31)
    return {"vae": vae.eval(), "text_encoder": text_encoder.eval(), "tokenizer": tokenizer,
            "duration_embedder": duration.eval(), "transformer": tiny_stable_audio3(seed=seed + 40),
            "scheduler": FlowMatchEulerDiscreteScheduler()}


def tiny_stable_audio3_pipeline(kind: str = "text", seed: int = 0):
    """A Stable Audio 3 pipeline of tiny random models, float32 on CPU: ``kind`` "text"
    (``StableAudio3Pipeline``) or "inpaint" (``StableAudio3InpaintPipeline``); a 2-layer T5Gemma
    encoder over a character tokenizer (prompts padded to 24 tokens), the duration embedder, a 8x
    SAME autoencoder (stereo, ``SAMPLING_RATE`` Hz: 8 latent frames a second), the transformer
    (``NUM_MEMORY`` memory tokens), a deterministic flow-matching Euler scheduler (the base
    checkpoint's; the distilled one's ping-pong sampling draws fresh noise each step).

    Raises:
        ValueError: ``kind`` is not "text" or "inpaint".
    """
    from diffusers import StableAudio3InpaintPipeline, StableAudio3Pipeline

    pipelines = {"text": StableAudio3Pipeline, "inpaint": StableAudio3InpaintPipeline}
    if kind not in pipelines:
        raise ValueError(f"kind={kind!r}; allowed: {sorted(pipelines)}")
    return pipelines[kind](**_components(seed))
