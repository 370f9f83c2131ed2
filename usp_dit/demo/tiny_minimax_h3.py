"""Tiny randomly initialised MiniMax-H3 transformers and their packed inputs, for tests; its two
VAEs, and the stock modular pipeline of its text-to-video+audio denoise and decode steps around them
(``tiny_minimax_h3_pipeline``), for the video example.

Layout: the transformer takes patchified rows, not latents: video (batch, n_video, in_channels * 4)
(patch (1, 2, 2)), audio (batch, n_audio, audio_in_channels), text (batch, n_text, text_dim); and
one packed layout shared by the batch: positions of each modality's rows in the sequence, each
(n,), per-row ``token_tags`` and ``timestep_indices`` (seq,), ``position_ids`` (seq, 3), the
distinct timesteps (num_timesteps,). The VAEs': video latents (1, VAE_LATENT_CHANNELS, 5k + 2,
height / 16, width / 16) for 17k + 5 frames; audio latents (2, AUDIO_LATENT_CHANNELS, frames / 24 *
40) (the stereo channels as a batch of two mono ones) for (2, 1, 800 x that) samples at 32 kHz.

Built from a seed, in code, with no download: every rank gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import MiniMaxH3Transformer3DModel

from usp_dit.demo.tiny_video import _perturb, quiet_diffusers_log

IN_CHANNELS = 4  # video latent channels (the release's 24); rows are 4 * 2 * 2 = 16 wide
AUDIO_CHANNELS = 6  # the release's 32
TEXT_DIM = 24  # the release's 5120
NUM_TIMESTEPS = 3  # distinct noise levels in one packed call (target video, audio, conditioning)
# The stock modular pipeline reads its latent widths from the VAEs (24 and 32 without them, the release's).
VAE_LATENT_CHANNELS = 24
AUDIO_LATENT_CHANNELS = 32


def tiny_minimax_h3(num_heads: int = 4, head_dim: int = 16, seed: int = 0, in_channels: int = IN_CHANNELS,
                    audio_channels: int = AUDIO_CHANNELS) -> MiniMaxH3Transformer3DModel:
    """A 2-layer ``MiniMaxH3Transformer3DModel`` with one refiner block (the release's layout, tiny:
    ``num_heads * head_dim`` wider than ``hidden_size`` as in the release; 12 of the 16 head channels
    rotated), float32, eval mode, every parameter perturbed (``tiny_video._perturb``). The stock
    modular pipeline needs the release's latent widths: ``in_channels=24, audio_channels=32``."""
    torch.manual_seed(seed)
    model = MiniMaxH3Transformer3DModel(
        num_attention_heads=num_heads, attention_head_dim=head_dim, hidden_size=48, num_layers=2,
        num_refiner_layers=1, ffn_dim=96, in_channels=in_channels, audio_in_channels=audio_channels,
        patch_size=(1, 2, 2), text_dim=TEXT_DIM, freq_dim=16, time_embed_hidden_dim=32, time_embed_dim=24,
        rope_freq_dim=head_dim // 8,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class MiniMaxH3Inputs:
    """Keyword arguments of one ``MiniMaxH3Transformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, n_video, IN_CHANNELS * 4)
    audio_hidden_states: torch.Tensor  # (B, n_audio, AUDIO_CHANNELS)
    encoder_hidden_states: torch.Tensor  # (B, n_text, TEXT_DIM)
    timestep: torch.Tensor  # (NUM_TIMESTEPS,) in [0, 1]
    timestep_indices: torch.Tensor  # (seq,)
    token_tags: torch.Tensor  # (seq,): 0 video, 1 text, 2 audio
    position_ids: torch.Tensor  # (seq, 3)
    video_indices: torch.Tensor  # (n_video,)
    audio_indices: torch.Tensor  # (n_audio,)
    text_indices: torch.Tensor  # (n_text,)

    def kwargs(self) -> dict:
        return dict(self.__dict__)

    @property
    def tokens(self) -> int:
        return self.position_ids.shape[0]


def minimax_h3_inputs(n_text: int, n_video: int, n_audio: int, batch: int = 2, seed: int = 0) -> MiniMaxH3Inputs:
    """Seeded inputs: the modalities' rows scattered over the packed sequence in a random order
    (stronger than the release's blocks of rows: every shard then holds rows of every modality),
    random (t, h, w) positions and per-row timestep indices; a different prompt, video and audio
    per batch element (the layout is shared: the model's contract)."""
    g = torch.Generator().manual_seed(seed)
    seq = n_text + n_video + n_audio
    order = torch.randperm(seq, generator=g)
    text_indices, video_indices, audio_indices = order[:n_text], order[n_text:n_text + n_video], order[n_text + n_video:]
    tags = torch.empty(seq, dtype=torch.long)
    tags[video_indices], tags[text_indices], tags[audio_indices] = 0, 1, 2
    return MiniMaxH3Inputs(
        hidden_states=torch.randn(batch, n_video, IN_CHANNELS * 4, generator=g),
        audio_hidden_states=torch.randn(batch, n_audio, AUDIO_CHANNELS, generator=g),
        encoder_hidden_states=torch.randn(batch, n_text, TEXT_DIM, generator=g),
        timestep=torch.rand(NUM_TIMESTEPS, generator=g),
        timestep_indices=torch.randint(0, NUM_TIMESTEPS, (seq,), generator=g),
        token_tags=tags,
        position_ids=torch.randint(0, 8, (seq, 3), generator=g),
        video_indices=video_indices, audio_indices=audio_indices, text_indices=text_indices,
    )


def tiny_minimax_h3_denoise(seed: int = 0):
    """The stock modular ``MiniMaxH3CoreDenoiseStep`` (text-to-video+audio: packed layout, noise,
    per-row timesteps, the denoising loop, unpacking) as a pipeline around a tiny transformer (the
    release's latent widths) and the stock schedulers. Call it with ``prompt_embeds`` (1, T,
    ``TEXT_DIM``), ``text_token_tags`` (T,) of ones, ``height``/``width`` multiples of 32,
    ``num_frames`` (e.g. 124 at 64 x 64: 148 video + 414 audio rows + T text rows)."""
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3CoreDenoiseStep

    pipe = MiniMaxH3CoreDenoiseStep().init_pipeline()
    pipe.update_components(transformer=tiny_minimax_h3(seed=seed, in_channels=VAE_LATENT_CHANNELS,
                                                       audio_channels=AUDIO_LATENT_CHANNELS),
                           scheduler=MiniMaxH3Scheduler(), audio_scheduler=MiniMaxH3Scheduler())
    return pipe


def tiny_minimax_h3_vae(seed: int = 0):
    """A tiny ``AutoencoderKLMiniMaxH3`` with the release's geometry and ``VAE_LATENT_CHANNELS``:
    16x spatial (four 2x levels), 4x temporal in chunks of 17 frames (``clip_length``, 3 latent
    frames dropped a chunk: 17k + 5 frames decode from 5k + 2 latent frames), so the stock blocks'
    frame and canvas arithmetic is the release's; a 3D CNN encoder of 8 channels a level and a
    1-layer ViT decoder of 2 heads x 16 (12 rotated channels a head), 2 register tokens. Its
    latents' mean and std are the identity (the release's are per-channel statistics). Float32,
    eval mode, every parameter perturbed."""
    from diffusers import AutoencoderKLMiniMaxH3

    torch.manual_seed(seed)
    vae = AutoencoderKLMiniMaxH3(
        latent_channels=VAE_LATENT_CHANNELS, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        spatial_downsample_factors=(2, 2, 2, 2), temporal_downsample_factors=(1, 2, 2, 1), norm_num_groups=4,
        decoder_num_layers=1, decoder_num_attention_heads=2, decoder_attention_head_dim=16,
        decoder_num_register_tokens=2, decoder_ffn_mult=2,
        latents_mean=(0.0,) * VAE_LATENT_CHANNELS, latents_std=(1.0,) * VAE_LATENT_CHANNELS,
    )
    _perturb(vae, seed + 1)
    return vae.eval()


def tiny_minimax_h3_audio_vae(seed: int = 0):
    """A tiny ``AutoencoderKLMiniMaxH3Audio`` with the release's rates: a hop of 800 samples
    (strides 8, 10, 10 in place of 2, 4, 4, 5, 5) at 32 kHz, so 40 latents a second as the stock
    blocks assume; ``AUDIO_LATENT_CHANNELS`` latents, a 64-wide trunk, a BigVGAN decoder of 32, 16,
    8, 4 channels with one AMP block (kernel 3, dilations 1 and 3) an upsampling. Identity latent
    statistics. Float32, eval mode, every parameter perturbed."""
    from diffusers import AutoencoderKLMiniMaxH3Audio

    torch.manual_seed(seed)
    vae = AutoencoderKLMiniMaxH3Audio(
        encoder_dim=4, encoder_rates=(8, 10, 10), latent_dim=64, latent_channels=AUDIO_LATENT_CHANNELS,
        num_attention_heads=2, decoder_dim=32, decoder_rates=(8, 10, 10), decoder_kernel_sizes=(16, 20, 20),
        resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1, 3),),
        latents_mean=[0.0] * AUDIO_LATENT_CHANNELS, latents_std=[1.0] * AUDIO_LATENT_CHANNELS,
    )
    _perturb(vae, seed + 1)
    return vae.eval()


def tiny_minimax_h3_pipeline(seed: int = 0):
    """``MiniMaxH3Blocks``' text-to-video+audio path less its text encoder, as a
    ``MiniMaxH3ModularPipeline`` of tiny random models, float32: the stock ``MiniMaxH3CoreDenoiseStep``
    (as ``tiny_minimax_h3_denoise``; the release's schedules: shift 12 video, 3 audio), then the stock
    ``MiniMaxH3DecodeStep`` (``tiny_minimax_h3_vae``, ``tiny_minimax_h3_audio_vae``). Call it with
    ``minimax_h3_text()``, ``height``/``width`` multiples of 32, ``num_frames`` 17k + 5 of 5 to 15 s
    at 24 fps (124 to 345), ``output=["videos", "audio", "sampling_rate"]``."""
    from diffusers import MiniMaxH3Scheduler
    from diffusers.modular_pipelines import SequentialPipelineBlocks
    from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import (
        MiniMaxH3CoreDenoiseStep,
        MiniMaxH3DecodeStep,
    )


    with quiet_diffusers_log():
        blocks = SequentialPipelineBlocks.from_blocks_dict(
            {"denoise": MiniMaxH3CoreDenoiseStep(), "decode": MiniMaxH3DecodeStep()})
        pipe = blocks.init_pipeline()  # a MiniMaxH3ModularPipeline (the blocks' model_name)
        pipe.update_components(
            transformer=tiny_minimax_h3(seed=seed, in_channels=VAE_LATENT_CHANNELS,
                                        audio_channels=AUDIO_LATENT_CHANNELS),
            scheduler=MiniMaxH3Scheduler(shift=12.0), audio_scheduler=MiniMaxH3Scheduler(shift=3.0),
            vae=tiny_minimax_h3_vae(seed + 20), audio_vae=tiny_minimax_h3_audio_vae(seed + 30),
        )
    return pipe


def minimax_h3_text(length: int = 7, seed: int = 0) -> dict:
    """Seeded stand-ins for the text encoder step's outputs: ``prompt_embeds`` (1, length,
    ``TEXT_DIM``) and ``text_token_tags`` (length,), every row a text row (tag 1)."""
    g = torch.Generator().manual_seed(seed)
    return {"prompt_embeds": torch.randn(1, length, TEXT_DIM, generator=g),
            "text_token_tags": torch.ones(length, dtype=torch.long)}
