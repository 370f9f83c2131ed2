"""Tiny randomly initialised Bria (3.x and FIBO) transformers and a ``BriaPipeline``, built in code
for tests and examples.

Layout: packed latents (batch, tokens, 4 * latent_channels), ``tokens = (height / 4) * (width / 4)``
with the tiny 2x VAE (``BriaPipeline``'s ``vae_scale_factor`` is ``2 ** len(block_out_channels)``
= 4 for it), row-major; text embeddings (batch, text_len, TEXT_DIM); position ids as
``BriaPipeline`` makes them: image (tokens, 3) = (0, row, col), text (text_len, 3) = zeros;
timestep (batch,) in [0, 1000) (the pipeline passes the scheduler's t unscaled). FIBO besides:
``text_encoder_layers``, one (batch, text_len, FIBO_LAYER_DIM) tensor per block, and the key mask
(batch, 1, 1, text_len + tokens) bool as ``BriaFiboPipeline`` passes it in ``joint_attention_kwargs``.

Nothing is downloaded: the T5 tokenizer is a character vocabulary (``usp_dit.demo.tiny_chroma.tiny_t5``),
the T5 encoder, VAE and transformer are built from small configs and seeded. Every process that
calls a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import BriaFiboTransformer2DModel, BriaTransformer2DModel

from usp_dit.demo.tiny_chroma import TEXT_DIM, tiny_t5
from usp_dit.demo.tiny_video import _perturb

LATENT_CHANNELS = 4  # the tiny VAE's (the real one: 16)
FIBO_LAYER_DIM = TEXT_DIM // 2  # FIBO's text_encoder_dim: its SmolLM3's width (2048; the prompt embeds join two layers)


def tiny_bria(
    num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, num_single_layers: int = 2, seed: int = 0,
) -> BriaTransformer2DModel:
    """A small ``BriaTransformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    RoPE axes (0, h, w) split ``head_dim`` 1:3:3 as Bria's (16, 56, 56) of 128. Every parameter is
    perturbed (``tiny_video._perturb``).

    Raises:
        ValueError: ``head_dim`` is not a multiple of 16.
    """
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (three even RoPE axes, 1:3:3), got {head_dim}")
    torch.manual_seed(seed)
    model = BriaTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=head_dim, num_attention_heads=num_heads, joint_attention_dim=TEXT_DIM,
        axes_dims_rope=[head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8],
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class BriaInputs:
    """Keyword arguments of one ``BriaTransformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, N, 4 * latent_channels)
    encoder_hidden_states: torch.Tensor  # (B, T, TEXT_DIM)
    timestep: torch.Tensor  # (B,)
    img_ids: torch.Tensor  # (N, 3)
    txt_ids: torch.Tensor  # (T, 3)
    controlnet_block_samples: list[torch.Tensor] | None = None  # each (B, N, inner_dim)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def bria_inputs(
    height: int, width: int, text_len: int, batch: int = 2, seed: int = 0, controlnet_width: int | None = None,
) -> BriaInputs:
    """Seeded inputs for a ``height x width`` grid of packed latent tokens, a different prompt,
    latent and timestep per batch element; ids as the pipeline makes them. ``controlnet_width``:
    the model's inner width, to add one ControlNet residual for the double blocks (else none)."""
    g = torch.Generator().manual_seed(seed)
    num_image = height * width
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(num_image, 3).float()
    inputs = BriaInputs(
        hidden_states=torch.randn(batch, num_image, 4 * LATENT_CHANNELS, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TEXT_DIM, generator=g),
        timestep=torch.rand(batch, generator=g) * 1000, img_ids=img_ids, txt_ids=torch.zeros(text_len, 3),
    )
    if controlnet_width is not None:
        inputs.controlnet_block_samples = [torch.randn(batch, num_image, controlnet_width, generator=g)]
    return inputs


def tiny_bria_fibo(
    num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, num_single_layers: int = 2, seed: int = 0,
) -> BriaFiboTransformer2DModel:
    """A small ``BriaFiboTransformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode,
    every parameter perturbed; RoPE axes as ``tiny_bria``'s.

    Raises:
        ValueError: ``head_dim`` is not a multiple of 16.
    """
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (three even RoPE axes, 1:3:3), got {head_dim}")
    torch.manual_seed(seed)
    model = BriaFiboTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=head_dim, num_attention_heads=num_heads, joint_attention_dim=TEXT_DIM,
        axes_dims_rope=[head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8], text_encoder_dim=FIBO_LAYER_DIM,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class BriaFiboInputs:
    """Keyword arguments of one ``BriaFiboTransformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, N, 4 * latent_channels)
    encoder_hidden_states: torch.Tensor  # (B, T, TEXT_DIM)
    text_encoder_layers: list[torch.Tensor]  # one (B, T, FIBO_LAYER_DIM) per block
    timestep: torch.Tensor  # (B,)
    img_ids: torch.Tensor  # (N, 3)
    txt_ids: torch.Tensor  # (T, 3)
    joint_attention_kwargs: dict | None  # {"attention_mask": (B, 1, 1, T + N) bool} or None

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def bria_fibo_inputs(
    height: int, width: int, text_len: int, prompt_lengths: list[int] | None, num_blocks: int = 4,
    batch: int = 2, seed: int = 0,
) -> BriaFiboInputs:
    """Seeded inputs as ``bria_inputs``'s, with ``num_blocks`` text encoder layers;
    ``prompt_lengths[b]``: element b's real text tokens (its padding rows zeroed and masked as
    keys, as the pipeline pads), ``None``: no mask (no prompt padded)."""
    base = bria_inputs(height, width, text_len, batch, seed)
    g = torch.Generator().manual_seed(seed + 1)
    layers = [torch.randn(batch, text_len, FIBO_LAYER_DIM, generator=g) for _ in range(num_blocks)]
    kwargs = None
    if prompt_lengths is not None:
        text = torch.arange(text_len)[None, :] < torch.tensor(prompt_lengths)[:, None]  # (B, T)
        padding = (~text)[:, :, None]
        base.encoder_hidden_states = base.encoder_hidden_states.masked_fill(padding, 0.0)
        layers = [t.masked_fill(padding, 0.0) for t in layers]
        mask = torch.cat([text, torch.ones(batch, height * width, dtype=torch.bool)], dim=1)
        kwargs = {"attention_mask": mask[:, None, None, :]}
    return BriaFiboInputs(
        hidden_states=base.hidden_states, encoder_hidden_states=base.encoder_hidden_states,
        text_encoder_layers=layers, timestep=base.timestep, img_ids=base.img_ids, txt_ids=base.txt_ids,
        joint_attention_kwargs=kwargs,
    )


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_bria_pipeline(max_text_len: int = 16, seed: int = 0):
    """A ``BriaPipeline`` of tiny random models (T5, VAE, transformer), float32 on CPU.

    VAE 2x compression and 2x2 patches: ``height x width`` gives ``(height / 4) * (width / 4)``
    image tokens (12 x 20 -> 15; the pipeline warns that such sizes are not multiples of 8 and
    runs them). Call it with ``max_sequence_length <= max_text_len``; the pipeline zero-pads each
    prompt's embeddings to ``max_sequence_length`` and attends them all.
    """
    from diffusers import BriaPipeline, FlowMatchEulerDiscreteScheduler

    from usp_dit.demo.tiny_flux import tiny_vae

    tokenizer, text_encoder = tiny_t5(max_text_len, seed + 10)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=16,
        max_image_seq_len=4096,
    )
    return BriaPipeline(
        transformer=tiny_bria(seed=seed + 30), scheduler=scheduler, vae=tiny_vae(2, seed + 20),
        text_encoder=text_encoder, tokenizer=tokenizer,
    )


def tiny_bria_fibo_pipeline(seed: int = 0):
    """A ``BriaFiboPipeline`` of tiny random models, float32 on CPU: a character tokenizer, a
    3-layer ``SmolLM3ForCausalLM`` of width ``FIBO_LAYER_DIM`` (the prompt embeddings are its last
    two layers side by side: ``TEXT_DIM``), a tiny ``AutoencoderKLWan`` and ``tiny_bria_fibo``.

    The pipeline's latents are ``height / 16 x width / 16`` (its ``vae_scale_factor`` is fixed at
    16, no 2x2 patches): 80 x 112 gives 5 x 7 = 35 image tokens. Pass negative prompts that are
    not empty (an empty one is the real tokenizer's token 128000, outside the tiny vocabulary).
    """
    from diffusers import BriaFiboPipeline, FlowMatchEulerDiscreteScheduler
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    from usp_dit.demo.tiny_flux2 import tiny_qwen3_tokenizer
    from usp_dit.demo.tiny_wan import tiny_wan_vae

    tokenizer = tiny_qwen3_tokenizer()
    torch.manual_seed(seed + 10)
    text_encoder = SmolLM3ForCausalLM(SmolLM3Config(
        vocab_size=len(tokenizer), hidden_size=FIBO_LAYER_DIM, intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, pad_token_id=0,
        bos_token_id=None, eos_token_id=1,
    ))
    _perturb(text_encoder, seed + 11, std=0.02)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15, base_image_seq_len=16,
        max_image_seq_len=4096,
    )
    return BriaFiboPipeline(
        transformer=tiny_bria_fibo(seed=seed + 30), scheduler=scheduler,
        vae=tiny_wan_vae(4 * LATENT_CHANNELS, seed + 20), text_encoder=text_encoder.eval(), tokenizer=tokenizer,
    )
