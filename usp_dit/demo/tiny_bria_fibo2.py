"""A tiny randomly initialised Bria FIBO 2.0 transformer and ``BriaFibo2Pipeline``, built in code
for tests and examples.

Layout: latents (batch, LATENT_CHANNELS, 2 * rows, 2 * cols) for a ``rows x cols`` grid of 2x2
patches (``rows * cols`` image tokens); edit latents likewise, a list; prompt bundles
``encoder_hidden_states`` (batch, 1 + len(INJECTIONS), text_len, TEXT_DIM); the prompt mask
(batch, text_len) bool, True = a real token, or ``None``; timestep (batch,) in [0, 1].

Gists: the tiny config maps text lengths 2..12 onto 3..9 gist tokens in steps of 3 (the released:
256..2048 onto 256..512 in steps of 64), so prompts of different lengths in one batch get
different gist counts, and the forward pads and masks them (its ``[image; context; gist]`` layout).

Nothing is downloaded: the pipeline takes precomputed prompt embeddings (the Qwen3-VL text encoder
is replicated, outside what usp_dit shards), the VAE is ``tiny_flux2.tiny_flux2_vae``. Every
process that calls a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import BriaFibo2Transformer2DModel

from usp_dit.demo.tiny_flux2 import LATENT_CHANNELS
from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # cap_feat_dim (the released: 7680, three Qwen3-VL layers of 2560 concatenated)
INJECTIONS = (1,)  # injection_layer_ids: main layer 1 cross-attends to bundle 1 (the released: 5 of 44)


def tiny_bria_fibo2(num_heads: int = 4, head_dim: int = 16, seed: int = 0) -> BriaFibo2Transformer2DModel:
    """A ``BriaFibo2Transformer2DModel`` of 1 refiner and 2 main layers (the second an injection
    block), ``num_heads * head_dim`` wide, a 1-layer Perceiver; float32, eval mode, every parameter
    perturbed (the cross-attention gate's default zero too). RoPE axes split ``head_dim`` 1:1.5:1.5
    as the released (32, 48, 48) of 128.

    Raises:
        ValueError: ``head_dim`` is not a multiple of 8.
    """
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 (three even RoPE axes, 2:3:3), got {head_dim}")
    torch.manual_seed(seed)
    model = BriaFibo2Transformer2DModel(
        in_channels=LATENT_CHANNELS, patch_size=2, dim=num_heads * head_dim, n_layers=2, n_refiner_layers=1,
        n_heads=num_heads, cap_feat_dim=TEXT_DIM, injection_layer_ids=INJECTIONS, perceiver_num_layers=1,
        min_num_gist_tokens=3, max_num_gist_tokens=9, gist_step=3, gist_min_text_len=2, gist_max_text_len=12,
        axes_dims=(head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8), axes_lens=(32, 16, 16),
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class BriaFibo2Inputs:
    """Keyword arguments of one ``BriaFibo2Transformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, C, 2 * rows, 2 * cols)
    timestep: torch.Tensor  # (B,)
    encoder_hidden_states: torch.Tensor  # (B, 1 + len(INJECTIONS), T, TEXT_DIM)
    encoder_attention_mask: torch.Tensor | None  # (B, T) bool
    context_latents: list[torch.Tensor] | None  # each (B, C, 2 * rows_k, 2 * cols_k)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def bria_fibo2_inputs(
    patches: tuple[int, int], text_len: int, prompt_lengths: list[int] | None = None,
    context: tuple[tuple[int, int], ...] = (), batch: int = 2, seed: int = 0,
) -> BriaFibo2Inputs:
    """Seeded inputs: a different latent, prompt and timestep per element; ``prompt_lengths[b]``
    element b's real text tokens (its padding zeroed and masked, as the pipeline pads), ``None``
    no mask; ``context``: the edit images' patch grids (none: text-to-image)."""
    g = torch.Generator().manual_seed(seed)

    def latents(rows: int, cols: int) -> torch.Tensor:
        return torch.randn(batch, LATENT_CHANNELS, 2 * rows, 2 * cols, generator=g)

    text = torch.randn(batch, 1 + len(INJECTIONS), text_len, TEXT_DIM, generator=g)
    mask = None
    if prompt_lengths is not None:
        mask = torch.arange(text_len)[None, :] < torch.tensor(prompt_lengths)[:, None]  # (B, T)
        text = text.masked_fill(~mask[:, None, :, None], 0.0)
    return BriaFibo2Inputs(
        hidden_states=latents(*patches), timestep=torch.rand(batch, generator=g), encoder_hidden_states=text,
        encoder_attention_mask=mask, context_latents=[latents(*grid) for grid in context] or None,
    )


def tiny_bria_fibo2_pipeline(seed: int = 0):
    """A ``BriaFibo2Pipeline`` of the tiny transformer, ``tiny_flux2_vae`` (2x; the pipeline's image
    processor works in multiples of 4 pixels: ``height x width`` gives (height / 4) * (width / 4)
    image tokens) and no text encoder: call it with ``prompt_embeds`` (``bria_fibo2_inputs``'s
    ``encoder_hidden_states``) and their masks."""
    from diffusers import BriaFibo2Pipeline, FlowMatchEulerDiscreteScheduler

    from usp_dit.demo.tiny_flux2 import tiny_flux2_vae

    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=16,
        max_image_seq_len=4096,
    )
    return BriaFibo2Pipeline(transformer=tiny_bria_fibo2(seed=seed + 30), scheduler=scheduler,
                             vae=tiny_flux2_vae(seed + 20), text_encoder=None, processor=None)
