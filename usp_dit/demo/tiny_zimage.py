"""Tiny randomly initialised Z-Image transformers and a ``ZImagePipeline``, for tests and examples.

Layout: the transformer's call takes lists, one entry per batch element: latents ``x[b]``
(latent_channels, 1, 2 * h, 2 * w) for an h x w patch grid, prompt embeddings ``cap_feats[b]``
(T_b, text_dim), each prompt its own length T_b; timestep ``t`` (B,) in [0, 1] (the pipeline
passes (1000 - t) / 1000). It returns a list of (latent_channels, 1, 2 * h, 2 * w).

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import ZImageTransformer2DModel

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # cap_feat_dim of the tiny transformers (the real one: Qwen3-4B's 2560)
LATENT_CHANNELS = 4  # tiny_flux.tiny_vae's (the real VAE: 16)
SEQ_MULTI_OF = 32  # the model pads every image and every prompt to a multiple of this many tokens


def tiny_zimage(
    num_heads: int = 6, head_dim: int = 16, num_layers: int = 2, num_refiner_layers: int = 2, seed: int = 0,
) -> ZImageTransformer2DModel:
    """A small ``ZImageTransformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    The default 6 heads are divided by neither 4 nor (with 2 heads a rank) evenly by 4 Ulysses
    ranks, as the released 30 heads are not. RoPE axes (text index, h, w) split ``head_dim``
    2:3:3 as the released (32, 48, 48) of 128, over (256, 64, 64) positions. Every parameter,
    the pad tokens included, is perturbed with seeded noise (``tiny_video._perturb``).

    Raises:
        ValueError: ``head_dim`` is not a multiple of 8.
    """
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 (three even RoPE axes, 2:3:3), got {head_dim}")
    torch.manual_seed(seed)
    model = ZImageTransformer2DModel(
        in_channels=LATENT_CHANNELS, dim=num_heads * head_dim, n_layers=num_layers, n_refiner_layers=num_refiner_layers,
        n_heads=num_heads, n_kv_heads=num_heads, cap_feat_dim=TEXT_DIM,
        axes_dims=[head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8], axes_lens=[256, 64, 64],
    )
    _perturb(model, seed + 1)
    return model.eval()


def zimage_tokens(patches: tuple[int, int]) -> int:
    """Image tokens the model makes of an h x w patch grid: h * w, padded to a multiple of 32."""
    count = patches[0] * patches[1]
    return count + (-count) % SEQ_MULTI_OF


@dataclass
class ZImageInputs:
    """Keyword arguments of one ``ZImageTransformer2DModel.forward`` call."""

    x: list  # per element: (latent_channels, 1, 2h, 2w)
    t: torch.Tensor  # (B,)
    cap_feats: list  # per element: (T_b, text_dim)

    def kwargs(self) -> dict:
        return {"x": list(self.x), "t": self.t, "cap_feats": list(self.cap_feats)}


def zimage_inputs(patches: tuple[int, int], text_lens: tuple[int, ...] = (7, 40), seed: int = 0) -> ZImageInputs:
    """Seeded inputs: batch ``len(text_lens)``, a different latent, prompt (of its own length) and
    timestep per element, on an h x w patch grid (``patches``)."""
    g = torch.Generator().manual_seed(seed)
    h, w = patches
    x = [torch.randn(LATENT_CHANNELS, 1, 2 * h, 2 * w, generator=g) for _ in text_lens]
    caps = [torch.randn(n, TEXT_DIM, generator=g) for n in text_lens]
    return ZImageInputs(x, torch.rand(len(text_lens), generator=g), caps)


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_qwen3(vocab_size: int, seed: int = 0):
    """A 2-layer ``Qwen3Model`` of width ``TEXT_DIM``, float32, eval mode: the pipeline reads its
    second-to-last hidden states (Z-Image's text encoder is Qwen3-4B)."""
    from transformers import Qwen3Config, Qwen3Model

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, bos_token_id=None, eos_token_id=1,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    encoder = Qwen3Model(config)
    _perturb(encoder, seed + 1, std=0.02)
    return encoder.eval()


def tiny_zimage_tokenizer():
    """A tokenizer over single characters with Qwen's chat tokens and a Qwen-like chat template
    (``tiny_qwen_image.tiny_qwen_tokenizer``): about one token per character of the templated prompt."""
    from usp_dit.demo.tiny_qwen_image import tiny_qwen_tokenizer

    tokenizer = tiny_qwen_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tokenizer


def tiny_zimage_pipeline(seed: int = 0, pipeline: str = "ZImagePipeline"):
    """A ``ZImagePipeline`` (or ``pipeline``: another Z-Image pipeline class of the same components,
    e.g. ``ZImageImg2ImgPipeline``) of tiny random models, float32.

    VAE 2x compression (``tiny_flux.tiny_vae``) and 2x2 patches: ``height x width`` gives
    ``(height / 4) * (width / 4)`` patches (20 x 28 -> 5 x 7 = 35, 64 tokens once padded).
    The pipeline drops each prompt's padding, so prompts of different lengths reach the
    transformer as embeddings of different lengths.
    """
    import diffusers
    from diffusers import FlowMatchEulerDiscreteScheduler

    from usp_dit.demo.tiny_flux import tiny_vae

    tokenizer = tiny_zimage_tokenizer()
    cls = getattr(diffusers, pipeline)
    return cls(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=tiny_vae(2, seed + 20),
        text_encoder=tiny_qwen3(len(tokenizer), seed + 10), tokenizer=tokenizer, transformer=tiny_zimage(seed=seed + 30),
    )
