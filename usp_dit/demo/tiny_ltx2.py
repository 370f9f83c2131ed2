"""Tiny randomly initialised LTX-2 transformers and an ``LTX2Pipeline``, for tests and examples.

Layout: the transformer takes packed latents, video tokens (batch, S_v, channels) with
``S_v = frames * height * width`` of the latent (patch 1, frame-major as ``LTX2Pipeline._pack_latents``
orders them) and audio tokens (batch, S_a, audio_channels), one per audio latent frame; text
embeddings for each stream (batch, text_seq, text_dim) with one prompt mask (batch, text_seq),
1 = real token; the video timestep (batch,) or, as the image-to-video pipeline passes it, one per
video token (batch, S_v); the audio timestep and sigma (batch,).

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import LTX2VideoTransformer3DModel

from usp_dit.demo.tiny_video import TEXT_DIM, _perturb

LATENT_CHANNELS = 4  # the tiny stand-in for the real video VAE's 128
AUDIO_LATENT_CHANNELS = 2  # the tiny audio VAE's latent channels (the real one's 8)
AUDIO_MEL_BINS = 16  # the tiny audio VAE's mel bins; 4x mel compression -> 4 latent bins
AUDIO_IN_CHANNELS = AUDIO_LATENT_CHANNELS * AUDIO_MEL_BINS // 4  # packed audio token width

# The variants the tests run: LTX-2.0 (interleaved or split RoPE) and an LTX-2.3-like one (gated
# attention, prompt modulation, perturbed attention for spatio-temporal guidance).
VARIANTS = {
    "2.0": {"rope_type": "interleaved"},
    "2.0-split": {"rope_type": "split"},
    "2.3": {"rope_type": "split", "gated_attn": True, "audio_gated_attn": True, "cross_attn_mod": True,
            "audio_cross_attn_mod": True, "perturbed_attn": True},
}


def tiny_ltx2(variant: str = "2.0", num_heads: int = 4, head_dim: int = 16, audio_head_dim: int = 8,
              seed: int = 0) -> LTX2VideoTransformer3DModel:
    """A 2-layer ``LTX2VideoTransformer3DModel``: video ``num_heads * head_dim`` wide, audio
    ``num_heads * audio_head_dim`` (as the real model, the same head count in both streams; its
    cross-attention widths equal the streams' widths), float32, eval mode.

    Every parameter is perturbed with seeded noise (``tiny_video._perturb``): no weight or bias
    keeps a default constant that could hide a token on the wrong rank.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}; choose one of {sorted(VARIANTS)}")
    torch.manual_seed(seed)
    model = LTX2VideoTransformer3DModel(
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_attention_heads=num_heads,
        attention_head_dim=head_dim, cross_attention_dim=num_heads * head_dim,
        audio_in_channels=AUDIO_IN_CHANNELS, audio_out_channels=AUDIO_IN_CHANNELS,
        audio_num_attention_heads=num_heads, audio_attention_head_dim=audio_head_dim,
        audio_cross_attention_dim=num_heads * audio_head_dim, num_layers=2, caption_channels=TEXT_DIM,
        **VARIANTS[variant],
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class LTX2Inputs:
    """Keyword arguments of one ``LTX2VideoTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, S_v, C)
    audio_hidden_states: torch.Tensor  # (B, S_a, C_a)
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    audio_encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    timestep: torch.Tensor  # (B,) or (B, S_v)
    audio_timestep: torch.Tensor  # (B,)
    sigma: torch.Tensor  # (B,)
    encoder_attention_mask: torch.Tensor  # (B, T), 1 = real prompt token
    audio_encoder_attention_mask: torch.Tensor  # (B, T)
    num_frames: int  # latent sizes, for the RoPE grid
    height: int
    width: int
    audio_num_frames: int
    fps: float = 24.0
    video_coords: torch.Tensor | None = None  # (B, 3, S_v, 2), replaces the grid above when given
    use_cross_timestep: bool = False
    spatio_temporal_guidance_blocks: list[int] | None = None
    perturbation_mask: torch.Tensor | None = None  # (B,), 0 = perturb this element

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def _masks(valid: list[list[int]], text_len: int) -> torch.Tensor:
    mask = torch.zeros(len(valid), text_len)
    for b, positions in enumerate(valid):
        mask[b, positions] = 1.0
    return mask


def ltx2_inputs(
    model: LTX2VideoTransformer3DModel, frames: int, height: int, width: int, audio_frames: int,
    call: str = "t2v", text_len: int = 9, seed: int = 0,
) -> LTX2Inputs:
    """Seeded inputs for a latent of ``frames x height x width`` video tokens and ``audio_frames``
    audio tokens, batch 2 with a different prompt, prompt masks and timestep per element (the
    video prompt of element 0 has a hole; the audio prompt masks differ from the video ones).

    ``call``: "t2v" as ``LTX2Pipeline`` calls it (one timestep per element, RoPE grids built by the
    model); "i2v" as the image-to-video pipeline does (one random timestep per video token, the
    first latent frame at 0, ``video_coords`` passed, the newer cross-modal timestep); "stg" a
    spatio-temporal guidance call (perturbed self-attention in block 1, element 1 perturbed).
    """
    cfg = model.config
    seq = frames * height * width
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, seq, cfg.in_channels, generator=g)
    audio = torch.randn(2, audio_frames, cfg.audio_in_channels, generator=g)
    text = torch.randn(2, text_len, cfg.caption_channels, generator=g)
    audio_text = torch.randn(2, text_len, cfg.caption_channels, generator=g)
    mask = _masks([[0, 1, 3, 4, 5, 6], [0, 1, 2, 3]], text_len)
    audio_mask = _masks([[0, 1, 2, 3, 4, 5, 6, 7], [2, 3, 4]], text_len)
    sigma = torch.rand(2, generator=g) * 1000
    timestep = sigma.clone()
    coords = None
    if call == "i2v":
        timestep = torch.rand(2, seq, generator=g) * 1000
        timestep[:, : height * width] = 0.0  # the conditioning first frame
        coords = model.rope.prepare_video_coords(2, frames, height, width, x.device, fps=24.0)
        coords[1:, 0] += 0.25  # element 1 later in time, as a conditioning video placed later
    stg = call == "stg"
    return LTX2Inputs(
        x, audio, text, audio_text, timestep, sigma.flip(0), sigma, mask, audio_mask, frames, height, width,
        audio_frames, video_coords=coords, use_cross_timestep=call == "i2v",
        spatio_temporal_guidance_blocks=[1] if stg else None,
        perturbation_mask=torch.tensor([1.0, 0.0]) if stg else None,
    )


# ---- whole pipelines -----------------------------------------------------------------------------


def tiny_gemma3(max_length: int, seed: int = 0):
    """The tiny character tokenizer of ``tiny_video.tiny_t5`` and a 2-layer Gemma 3 text model of
    width ``TEXT_DIM`` (the real pipeline's is Gemma 3 12B): ``(tokenizer, encoder)``. The pipeline
    stacks the encoder's 3 hidden states (embeddings and each layer) into its connectors."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from usp_dit.demo.tiny_video import tiny_t5

    tokenizer, _ = tiny_t5(max_length, seed)
    torch.manual_seed(seed)
    encoder = Gemma3ForCausalLM(Gemma3TextConfig(
        vocab_size=len(tokenizer), hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        sliding_window=16, pad_token_id=0, eos_token_id=1, bos_token_id=1,
    ))
    _perturb(encoder, seed + 1, std=0.02)
    return tokenizer, encoder.eval()


def tiny_ltx2_connectors(seed: int = 0):
    """``LTX2TextConnectors`` for the tiny Gemma (3 stacked hidden states of ``TEXT_DIM``), one
    layer of 4 x 8 per stream, no learnable registers (the padded prompt mask reaches the transformer)."""
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    torch.manual_seed(seed)
    connectors = LTX2TextConnectors(
        caption_channels=TEXT_DIM, text_proj_in_factor=3, video_connector_num_attention_heads=4,
        video_connector_attention_head_dim=TEXT_DIM // 4, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=4,
        audio_connector_attention_head_dim=TEXT_DIM // 4, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None,
    )
    _perturb(connectors, seed + 1, std=0.02)
    return connectors.eval()


def tiny_ltx2_vae(seed: int = 0):
    """An ``AutoencoderKLLTX2Video`` of ``LATENT_CHANNELS``: 32x spatial, 8x temporal compression,
    as the real one (patch 4, three down blocks that scale time and space), 8 channels wide."""
    from diffusers import AutoencoderKLLTX2Video

    torch.manual_seed(seed)
    return AutoencoderKLLTX2Video(
        latent_channels=LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8),
        layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
        upsample_residual=(False,) * 3, upsample_factor=(1,) * 3, spatial_compression_ratio=32,
        temporal_compression_ratio=8,
    ).eval()


def tiny_ltx2_audio(seed: int = 0):
    """``(audio_vae, vocoder)``: an ``AutoencoderKLLTX2Audio`` of ``AUDIO_LATENT_CHANNELS`` over
    ``AUDIO_MEL_BINS`` mel bins (4x in time and in mel bins), and a small ``LTX2Vocoder``."""
    from diffusers import AutoencoderKLLTX2Audio
    from diffusers.pipelines.ltx2 import LTX2Vocoder

    torch.manual_seed(seed)
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=8, ch_mult=(1, 2, 4), num_res_blocks=1, latent_channels=AUDIO_LATENT_CHANNELS,
        mel_bins=AUDIO_MEL_BINS, resolution=AUDIO_MEL_BINS,
    ).eval()
    vocoder = LTX2Vocoder(
        in_channels=2 * AUDIO_MEL_BINS, hidden_channels=16, upsample_kernel_sizes=[4, 4], upsample_factors=[2, 2],
        resnet_kernel_sizes=[3], resnet_dilations=[[1]], output_sampling_rate=16000,
    ).eval()
    return audio_vae, vocoder


def tiny_ltx2_pipeline(max_text_len: int = 16, seed: int = 0, variant: str = "2.0"):
    """An ``LTX2Pipeline`` of tiny random models (Gemma 3 encoder, text connectors, LTX-2 video
    and audio VAEs, vocoder, transformer), float32.

    The pipeline batches classifier-free guidance: one transformer call per step of batch 2
    ([negative; positive]); spatio-temporal and modality-isolation guidance add calls of batch 1.
    Video VAE: 32x spatial, 8x temporal compression and patch 1, so ``height x width x num_frames``
    gives ``((num_frames - 1) / 8 + 1) * (height / 32) * (width / 32)`` video tokens, e.g.
    96 x 160 x 17 frames -> 3 * 3 * 5 = 45; audio: ``round(num_frames / frame_rate * 25)`` tokens
    (17 frames at 24 fps -> 18). Call it with ``max_sequence_length <= max_text_len``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

    tokenizer, text_encoder = tiny_gemma3(max_text_len, seed + 10)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, base_image_seq_len=16, max_image_seq_len=256, base_shift=0.95, max_shift=2.05,
    )
    audio_vae, vocoder = tiny_ltx2_audio(seed + 40)
    return LTX2Pipeline(
        scheduler=scheduler, vae=tiny_ltx2_vae(seed + 20), audio_vae=audio_vae, text_encoder=text_encoder,
        tokenizer=tokenizer, connectors=tiny_ltx2_connectors(seed + 50), transformer=tiny_ltx2(variant, seed=seed + 30),
        vocoder=vocoder,
    )
