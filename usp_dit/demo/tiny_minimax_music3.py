"""Tiny randomly initialised MiniMax Music 3 transformers and their inputs, for tests.

Layout: Flow-VAE latents (batch, IN_CHANNELS, frames); the frame-aligned condition (batch, frames,
CONDITION_DIM); timesteps (batch,) in [0, 1]. ``frames`` latent frames give ``1 + frames`` tokens
(the time token first).

Built from a seed, in code, with no download: every rank gets bit-identical weights and inputs.
The stock pipeline is modular blocks around an autoregressive language model (not built here);
its core denoise step (the windows, the guider) is, around the tiny transformer
(``tiny_minimax_music3_denoise``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import MiniMaxMusic3Transformer1DModel

from usp_dit.demo.tiny_video import _perturb, quiet_diffusers_log

IN_CHANNELS = 8  # the release's 128
CONDITION_DIM = 24  # the release's 2048


def tiny_minimax_music3(num_heads: int = 4, head_dim: int = 16, seed: int = 0) -> MiniMaxMusic3Transformer1DModel:
    """A 2-layer ``MiniMaxMusic3Transformer1DModel`` (``num_heads * head_dim`` wide; half of each
    head rotated, as the release's 32 of 64), float32, eval mode, every parameter perturbed
    (``tiny_video._perturb``)."""
    torch.manual_seed(seed)
    model = MiniMaxMusic3Transformer1DModel(
        in_channels=IN_CHANNELS, condition_dim=CONDITION_DIM, num_layers=2, num_attention_heads=num_heads,
        attention_head_dim=head_dim, ff_inner_dim=96, rotary_dim=head_dim // 2, fourier_embedding_dim=16,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class MiniMaxMusic3Inputs:
    """Keyword arguments of one ``MiniMaxMusic3Transformer1DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, IN_CHANNELS, frames)
    timestep: torch.Tensor  # (B,)
    encoder_hidden_states: torch.Tensor  # (B, frames, CONDITION_DIM)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def minimax_music3_inputs(frames: int, batch: int = 2, seed: int = 0) -> MiniMaxMusic3Inputs:
    """Seeded inputs of ``frames`` latent frames: a different latent, condition and timestep per element."""
    g = torch.Generator().manual_seed(seed)
    return MiniMaxMusic3Inputs(
        hidden_states=torch.randn(batch, IN_CHANNELS, frames, generator=g),
        timestep=torch.rand(batch, generator=g),
        encoder_hidden_states=torch.randn(batch, frames, CONDITION_DIM, generator=g),
    )


FRAME_LAYERS, FRAME_DIM = 2, 8  # the condition encoder's hidden states a frame (the release's 8 x 4096)


def tiny_minimax_music3_denoise(guidance_scale: float = 3.0, seed: int = 0):
    """The stock modular ``MiniMaxMusic3CoreDenoiseStep`` (200-frame windows, each flow-matched from
    its own noise and blended into the previous one, a ``ClassifierFreeGuidance`` guider: two
    transformer calls a step) as a pipeline of a tiny condition encoder (``FRAME_LAYERS`` x
    ``FRAME_DIM`` per frame onto ``CONDITION_DIM``), the tiny transformer and the stock scheduler.
    Call it with ``frame_hiddens`` (1, frames, FRAME_LAYERS * FRAME_DIM): 200 frames make one window
    of 689 latent frames; more make another every 100."""
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler, MiniMaxMusic3ConditionEncoder
    from diffusers.modular_pipelines.minimax_music3.modular_blocks_minimax_music3 import MiniMaxMusic3CoreDenoiseStep

    torch.manual_seed(seed)
    encoder = MiniMaxMusic3ConditionEncoder(condition_hidden_dim=FRAME_DIM, num_condition_layers=FRAME_LAYERS,
                                            out_dim=CONDITION_DIM)
    _perturb(encoder, seed + 2)
    with quiet_diffusers_log():
        pipe = MiniMaxMusic3CoreDenoiseStep().init_pipeline()
        pipe.update_components(condition_encoder=encoder.eval(), transformer=tiny_minimax_music3(seed=seed),
                               scheduler=FlowMatchEulerDiscreteScheduler(),
                               guider=ClassifierFreeGuidance(guidance_scale=guidance_scale))
    return pipe
