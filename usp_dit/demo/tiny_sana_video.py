"""Tiny randomly initialised Sana-Video transformers and a ``SanaVideoPipeline``, built in code for tests and examples.

Layout: latents (batch, LATENT_CHANNELS, frames, height, width), patch (1, 2, 2) as released:
``tokens = frames * (height / 2) * (width / 2)``, frame-major; text embeddings (batch, text_len,
TEXT_DIM) with a 0/1 mask (batch, text_len); timesteps (batch,); guidance (batch,) for the
"guided" variant.

Nothing is downloaded: the tokenizer is a T5 tokenizer over single characters (the pipeline only
calls it), the Gemma-2 text encoder (``tiny_sana.tiny_gemma2``), the Wan VAE
(``tiny_wan.tiny_wan_vae``: SANA-Video 2B 480p decodes with Wan 2.1's) and the transformer are
built from small configs and seeded. Every process that calls a builder with the same arguments
gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import SanaVideoTransformer3DModel

from usp_dit.demo.tiny_sana import TEXT_DIM, tiny_gemma2
from usp_dit.demo.tiny_video import _perturb

LATENT_CHANNELS = 4  # (SANA-Video 2B 480p: Wan 2.1's VAE, 16)
VARIANTS = ("t2v", "guided")


def tiny_sana_video(
    variant: str = "t2v", num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, seed: int = 0,
) -> SanaVideoTransformer3DModel:
    """A small ``SanaVideoTransformer3DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    ``"t2v"``: the released layout (RMS QK norm across heads, timestep only); ``"guided"``: no QK
    norm, an embedded guidance (``guidance_embeds``), so both paths of the time embedding are
    covered. RoPE splits each head's 16 dims 8 / 4 / 4 over (frames, height, width).
    Cross-attention: 2 heads x ``2 * head_dim``. Every parameter is perturbed (``tiny_video._perturb``).

    Raises:
        ValueError: an unknown ``variant``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}; use one of {VARIANTS}")
    guided = variant == "guided"
    torch.manual_seed(seed)
    model = SanaVideoTransformer3DModel(
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_attention_heads=num_heads,
        attention_head_dim=head_dim, num_layers=num_layers, num_cross_attention_heads=2,
        cross_attention_head_dim=2 * head_dim, cross_attention_dim=num_heads * head_dim, caption_channels=TEXT_DIM,
        mlp_ratio=2.5, sample_size=8, patch_size=(1, 2, 2), guidance_embeds=guided,
        qk_norm=None if guided else "rms_norm_across_heads", rope_max_seq_len=64,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class SanaVideoInputs:
    """Keyword arguments of one ``SanaVideoTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, LATENT_CHANNELS, F, 2h, 2w)
    encoder_hidden_states: torch.Tensor  # (B, T, TEXT_DIM)
    timestep: torch.Tensor  # (B,)
    encoder_attention_mask: torch.Tensor | None  # (B, T) 0 / 1
    guidance: torch.Tensor | None = None  # (B,): the "guided" variant only

    def kwargs(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if not (k == "guidance" and v is None)}


def sana_video_inputs(
    model: SanaVideoTransformer3DModel, frames: int, height: int, width: int, prompt_lengths: list[int] | None,
    text_len: int = 6, batch: int = 2, seed: int = 0,
) -> SanaVideoInputs:
    """Seeded inputs for a ``frames x height x width`` token grid (the latent is twice as high and
    wide): a different latent, prompt, timestep (and guidance) per batch element;
    ``prompt_lengths[b]``: element b's valid text tokens (a prefix mask), ``None``: no mask."""
    g = torch.Generator().manual_seed(seed)
    mask = None
    if prompt_lengths is not None:
        mask = (torch.arange(text_len)[None, :] < torch.tensor(prompt_lengths)[:, None]).long()
    guidance = torch.rand(batch, generator=g) * 5 if model.config.guidance_embeds else None
    return SanaVideoInputs(
        hidden_states=torch.randn(batch, LATENT_CHANNELS, frames, 2 * height, 2 * width, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TEXT_DIM, generator=g),
        timestep=torch.rand(batch, generator=g) * 1000, encoder_attention_mask=mask, guidance=guidance,
    )


def tiny_sana_video_pipeline(max_text_len: int = 16, seed: int = 0):
    """A ``SanaVideoPipeline`` of tiny random models (Gemma-2, Wan VAE, the "t2v" transformer), float32 on CPU.

    The VAE has 8 pixels per latent pixel and 4 frames per latent frame, the patch is 2 x 2:
    ``height x width x frames`` gives ``((frames - 1) / 4 + 1) * (height / 16) * (width / 16)``
    tokens (the pipeline takes sizes in multiples of 32: 32 x 96 x 9 frames -> 3 x 2 x 6 = 36).
    Call it with ``max_sequence_length <= max_text_len``, ``complex_human_instruction=None`` (the
    default one is a long chat instruction) and ``use_resolution_binning=False``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaVideoPipeline

    from usp_dit.demo.tiny_chroma import tiny_t5
    from usp_dit.demo.tiny_wan import tiny_wan_vae

    tokenizer, _ = tiny_t5(max_text_len)
    return SanaVideoPipeline(
        tokenizer=tokenizer, text_encoder=tiny_gemma2(seed + 10), vae=tiny_wan_vae(LATENT_CHANNELS, seed=seed + 20),
        transformer=tiny_sana_video(seed=seed + 30), scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0),
    )
