"""Training objectives of diffusion fine-tuning: noised inputs, timesteps and regression targets.

Layout: latents of any shape (batch, ...); timesteps (batch,); the prediction and target have the
latents' shape. The model output the loss reads is the full (gathered) prediction, identical on
every rank of a replica, so the loss is the ordinary one-process loss (docs/TRAINING.md).

Objectives (``t`` drawn per batch element):
  * "flow" (rectified flow / flow matching, as Flux, SD3, Mochi are trained):
        x_t = (1 - t) x_0 + t ε,  t ~ U(0, 1),  target = ε - x_0,  model timestep = t * T
  * "epsilon" (DDPM noise prediction, scaled-linear betas as CogVideoX and SD use):
        x_t = sqrt(ā_n) x_0 + sqrt(1 - ā_n) ε,  n ~ U{0 .. T-1},  target = ε,  model timestep = n
``T`` = ``num_train_timesteps`` (1000).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

OBJECTIVES = ("flow", "epsilon")


@dataclass
class NoisedBatch:
    """One training batch after noising: the model input, its timestep and the regression target."""

    noisy: torch.Tensor  # (B, ...) like the latents
    timestep: torch.Tensor  # (B,) the transformer's ``timestep`` argument
    target: torch.Tensor  # (B, ...) like the latents


def scaled_linear_alphas_cumprod(num_train_timesteps: int = 1000, beta_start: float = 0.00085,
                                 beta_end: float = 0.012) -> torch.Tensor:
    """ā_n for n = 0..T-1 of the "scaled_linear" schedule (betas linear in sqrt), float64, (T,)."""
    betas = torch.linspace(beta_start ** 0.5, beta_end ** 0.5, num_train_timesteps, dtype=torch.float64) ** 2
    return torch.cumprod(1.0 - betas, dim=0)


def _expand(per_sample: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, 1, ..., 1) in ``like``'s dtype, broadcastable against ``like``."""
    return per_sample.to(like.dtype).reshape(-1, *([1] * (like.dim() - 1)))


def noise_batch(latents: torch.Tensor, objective: str, generator: torch.Generator,
                num_train_timesteps: int = 1000) -> NoisedBatch:
    """Draw noise and timesteps from ``generator`` and noise ``latents`` (B, ...) for ``objective``.

    Every rank of a replica must pass a generator in the same state (``replica_generator``): the
    draws are then identical, with no communication.

    Raises:
        ValueError: ``objective`` is not one of ``OBJECTIVES``.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    gen_device = generator.device
    noise = torch.randn(latents.shape, generator=generator, device=gen_device, dtype=torch.float32)
    noise = noise.to(latents.device, latents.dtype)
    batch = latents.shape[0]
    if objective == "flow":
        t = torch.rand(batch, generator=generator, device=gen_device).to(latents.device)
        noisy = (1 - _expand(t, latents)) * latents + _expand(t, latents) * noise
        return NoisedBatch(noisy, t * num_train_timesteps, noise - latents)
    n = torch.randint(0, num_train_timesteps, (batch,), generator=generator, device=gen_device).to(latents.device)
    a = scaled_linear_alphas_cumprod(num_train_timesteps).to(latents.device)[n]
    noisy = _expand(a.sqrt(), latents) * latents + _expand((1 - a).sqrt(), latents) * noise
    return NoisedBatch(noisy, n, noise)


def mse_loss(pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """mean((pred - target)^2) in float32: a scalar, the same on every rank of a replica."""
    return (pred.float() - target.float()).pow(2).mean()
