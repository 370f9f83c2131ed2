"""Tiny randomly initialised DiT transformers and a ``DiTPipeline``, built in code for tests and examples.

Layout: latents (batch, LATENT_CHANNELS, size, size), square; with patch p: (size / p) ** 2 image
tokens; timestep (batch,) integer in [0, 1000); class_labels (batch,) in [0, NUM_CLASSES], the
last one the null class CFG uses. The transformer predicts noise and a variance (out_channels =
2 x LATENT_CHANNELS), as the released DiT-XL/2 does.

Nothing is downloaded: the VAE and transformer are built from small configs and seeded. Every
process that calls a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import DiTTransformer2DModel

from usp_dit.demo.tiny_video import _perturb

LATENT_CHANNELS = 4  # the SD VAE's, as the release
NUM_CLASSES = 1000  # ImageNet's; class 1000 is the null class (CFG)


def tiny_dit(
    num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, sample_size: int = 10, patch_size: int = 2,
    attention_bias: bool = True, seed: int = 0,
) -> DiTTransformer2DModel:
    """A small ``DiTTransformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode; its
    ``sample_size`` is the pipeline's latent side; ``attention_bias``: the Q/K/V/out biases (the
    release has them). Every parameter is perturbed
    (``tiny_video._perturb``): stock zero-initialises nothing here, but LayerNorm-like constants would
    hide a misplaced token."""
    torch.manual_seed(seed)
    model = DiTTransformer2DModel(
        num_attention_heads=num_heads, attention_head_dim=head_dim, in_channels=LATENT_CHANNELS,
        out_channels=2 * LATENT_CHANNELS, num_layers=num_layers, sample_size=sample_size, patch_size=patch_size,
        num_embeds_ada_norm=NUM_CLASSES, attention_bias=attention_bias,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class DiTInputs:
    """Keyword arguments of one ``DiTTransformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, LATENT_CHANNELS, size, size)
    timestep: torch.Tensor  # (B,) long
    class_labels: torch.Tensor  # (B,) long, NUM_CLASSES = the null class

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def dit_inputs(size: int, class_labels: list[int], seed: int = 0) -> DiTInputs:
    """Seeded inputs of ``size x size`` latent pixels: one element per label, each with its own latent and timestep."""
    g = torch.Generator().manual_seed(seed)
    batch = len(class_labels)
    return DiTInputs(
        hidden_states=torch.randn(batch, LATENT_CHANNELS, size, size, generator=g),
        timestep=torch.randint(0, 1000, (batch,), generator=g),
        class_labels=torch.tensor(class_labels),
    )


def tiny_dit_pipeline(sample_size: int = 10, seed: int = 0):
    """A ``DiTPipeline`` of tiny random models (2x ``AutoencoderKL``, the transformer with 2x2
    patches, a DPM-Solver++ scheduler), float32 on CPU. Images are 2 x ``sample_size`` pixels a
    side with ``(sample_size / 2) ** 2`` image tokens (10 -> 20 x 20 pixels, 5 x 5 = 25 tokens)."""
    from diffusers import DiTPipeline, DPMSolverMultistepScheduler

    from usp_dit.demo.tiny_flux import tiny_vae

    return DiTPipeline(transformer=tiny_dit(sample_size=sample_size, seed=seed + 30), vae=tiny_vae(2, seed + 20),
                       scheduler=DPMSolverMultistepScheduler(), id2label={0: "tench", 1: "goldfish", 7: "cock, rooster"})
