"""Tiny randomly initialised Cosmos (1, Predict2, Predict2.5) transformers and a Predict2 pipeline, for tests.

Layout: latents (batch, channels, frames, height, width); the condition mask (batch, 1, frames,
height, width) where the model takes one; text embeddings (batch, text_seq, text_dim) with a key
mask (batch, text_seq); with an image context, ``encoder_hidden_states`` is ``(text, image)``,
the image (batch, image_seq, image_dim); timestep (batch,) or per frame (batch, 1, frames, 1, 1).

Every tiny config sets ``concat_padding_mask=False``: the stock model resizes the padding mask with
torchvision, which this environment lacks (the released configs set it; it is a channel
concatenated before the patch embedding, on the whole latent: nothing the split touches).
Everything is built from a seed, in code, with no download.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import CosmosTransformer3DModel

from usp_dit.demo.tiny_video import TEXT_DIM, _perturb, tiny_t5

LATENT_CHANNELS = 4
IMAGE_DIM = 24  # the tiny image context's width (Predict2.5's img_context_dim_in)

# Variants of the family, tiny (4 heads x 16, 2 layers), each with the positional and timestep
# paths of a release.
COSMOS_VARIANTS = {
    # Cosmos 1 Diffusion (text-to-world): learnable positional embedding beside the RoPE, fps-scaled RoPE.
    "cosmos1": dict(in_channels=LATENT_CHANNELS, extra_pos_embed_type="learnable", rope_scale=(2.0, 1.0, 1.0)),
    # Predict2 video-to-world: condition mask on channels, one timestep per latent frame, no learnable table.
    "predict2-v2w": dict(in_channels=LATENT_CHANNELS + 1, extra_pos_embed_type=None, rope_scale=(1.0, 3.0, 3.0)),
    # Predict2.5 with an image context: attn2 also attends to projected image tokens (CosmosAttnProcessor2_5).
    "img-context": dict(in_channels=LATENT_CHANNELS + 1, extra_pos_embed_type=None, rope_scale=(1.0, 3.0, 3.0),
                        img_context_dim_in=IMAGE_DIM, img_context_num_tokens=5, img_context_dim_out=64),  # k_img takes the model width (4 x 16)
}


def tiny_cosmos(variant: str = "cosmos1", num_heads: int = 4, head_dim: int = 16, seed: int = 0
                ) -> CosmosTransformer3DModel:
    """A 2-layer ``CosmosTransformer3DModel`` (``num_heads * head_dim`` wide), float32, eval mode,
    every parameter perturbed (the learnable positional tables start at zero in stock).

    Raises:
        ValueError: ``variant`` is not one of ``COSMOS_VARIANTS``.
    """
    if variant not in COSMOS_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(COSMOS_VARIANTS)}, got {variant!r}")
    config = dict(
        out_channels=LATENT_CHANNELS, num_attention_heads=num_heads, attention_head_dim=head_dim, num_layers=2,
        mlp_ratio=2.0, text_embed_dim=TEXT_DIM, adaln_lora_dim=16, max_size=(16, 32, 32), patch_size=(1, 2, 2),
        concat_padding_mask=False,
    )
    config.update(COSMOS_VARIANTS[variant])
    torch.manual_seed(seed)
    model = CosmosTransformer3DModel(**config)
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class CosmosInputs:
    """Keyword arguments of one ``CosmosTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, C, F, H, W)
    timestep: torch.Tensor  # (B,) or (B, 1, F, 1, 1)
    encoder_hidden_states: torch.Tensor | tuple[torch.Tensor, torch.Tensor]  # (B, T, D) or (text, image)
    attention_mask: torch.Tensor | None = None  # (B, T) bool, True = a real prompt token
    fps: int | None = None
    condition_mask: torch.Tensor | None = None  # (B, 1, F, H, W)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def cosmos_inputs(
    model: CosmosTransformer3DModel, frames: int, height: int, width: int, batch: int = 2, text_len: int = 9,
    valid: tuple[int, ...] = (9, 4), seed: int = 0,
) -> CosmosInputs:
    """Seeded inputs for ``model`` (latent sizes): a different prompt, prompt length (``valid``: real
    tokens per element; the mask is not passed with an image context, whose stock processor takes
    none) and timestep per element; per-frame timesteps and a random condition mask where the model
    takes a condition mask (Predict2 video-to-world); fps 24 for Cosmos 1."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, LATENT_CHANNELS, frames, height, width, generator=g)
    text = torch.randn(batch, text_len, cfg.text_embed_dim, generator=g)
    mask = torch.arange(text_len)[None, :] < torch.tensor(valid)[:, None]
    inputs = CosmosInputs(x, torch.rand(batch, generator=g) * 80, text, mask)
    if cfg.extra_pos_embed_type == "learnable":
        inputs.fps = 24
    if cfg.in_channels == LATENT_CHANNELS + 1:
        inputs.timestep = torch.rand(batch, 1, frames, 1, 1, generator=g) * 80
        inputs.condition_mask = (torch.rand(batch, 1, frames, height, width, generator=g) > 0.5).float()
    if cfg.img_context_dim_in:
        image = torch.randn(batch, cfg.img_context_num_tokens, cfg.img_context_dim_in, generator=g)
        inputs.encoder_hidden_states, inputs.attention_mask = (text, image), None
    return inputs


# ---- the whole pipeline ---------------------------------------------------------------------------


class PassingSafetyChecker(torch.nn.Module):
    """Stands in for ``CosmosSafetyChecker`` (its guardrail models are a separate download): passes
    every prompt and video unchanged. Cosmos pipelines refuse to run without a checker object; a
    pipeline reads every component's ``device`` and ``dtype`` (a buffer carries them)."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("anchor", torch.zeros(()), persistent=False)

    @property
    def device(self) -> torch.device:
        return self.anchor.device

    @property
    def dtype(self) -> torch.dtype:
        return self.anchor.dtype

    def check_text_safety(self, prompt: str) -> bool:
        return True

    def check_video_safety(self, video):
        return video


def tiny_cosmos_vae(seed: int = 0):
    """Cosmos 1's tokenizer (``AutoencoderKLCosmos``) as released (CV8x8x8: Haar patch 4, 8x
    spatial and temporal, four levels, one up / downsampler), with 8 channels a level and 4
    latent channels; ``resolution=64`` with ``attention_resolutions=(4,)`` puts spatial and
    temporal attention in the encoder's last down block and the decoder's first two up blocks
    (besides the mid blocks)."""
    from diffusers import AutoencoderKLCosmos

    torch.manual_seed(seed)
    return AutoencoderKLCosmos(
        latent_channels=LATENT_CHANNELS, encoder_block_out_channels=(8, 8, 8, 8), decode_block_out_channels=(8, 8, 8, 8),
        attention_resolutions=(4,), resolution=64, num_layers=1, latents_mean=None, latents_std=None,
    ).eval()


def tiny_cosmos2_text2image_pipeline(max_text_len: int = 16, seed: int = 0):
    """A ``Cosmos2TextToImagePipeline`` (Predict2-like) of tiny random models, float32: character T5,
    Wan VAE (8x spatial), the "cosmos1"-shaped transformer without its learnable table. ``height x
    width`` gives ``(height / 16) * (width / 16)`` tokens; e.g. 80 x 48 -> 15. Call it with
    ``max_sequence_length <= max_text_len`` and ``output_type="latent"`` to skip the checker's
    uint8 round trip."""
    from diffusers import Cosmos2TextToImagePipeline, FlowMatchEulerDiscreteScheduler

    from usp_dit.demo.tiny_wan import tiny_wan_vae

    tokenizer, text_encoder = tiny_t5(max_text_len, seed + 10)
    torch.manual_seed(seed + 30)
    config = dict(
        in_channels=LATENT_CHANNELS, out_channels=LATENT_CHANNELS, num_attention_heads=4, attention_head_dim=16,
        num_layers=2, mlp_ratio=2.0, text_embed_dim=TEXT_DIM, adaln_lora_dim=16, max_size=(16, 32, 32),
        patch_size=(1, 2, 2), rope_scale=(1.0, 3.0, 3.0), concat_padding_mask=False, extra_pos_embed_type=None,
    )
    transformer = CosmosTransformer3DModel(**config)
    _perturb(transformer, seed + 31)
    return Cosmos2TextToImagePipeline(
        text_encoder=text_encoder, tokenizer=tokenizer, transformer=transformer.eval(),
        vae=tiny_wan_vae(LATENT_CHANNELS, seed + 20), scheduler=FlowMatchEulerDiscreteScheduler(use_karras_sigmas=True),
        safety_checker=PassingSafetyChecker(),
    )
