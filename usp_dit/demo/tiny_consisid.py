"""Tiny randomly initialised ConsisID transformer and pipeline, for tests and the video example.

Layout: latents (batch, frames, channels, height, width), channels = noise + image latents (I2V);
text embeddings (batch, text_seq, text_dim); ``id_cond`` (batch, id_dim) (the face embedding);
``id_vit_hidden`` a list of ``num_scale`` tensors (batch, vit_tokens, vit_dim) (the face ViT's
hidden states).

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import ConsisIDTransformer3DModel

from usp_dit.demo.tiny_video import TEXT_DIM, _perturb, cogvideox_rope, tiny_cogvideox_vae, tiny_t5

# The face-conditioning sizes of the tiny model (the released ConsisID: id 1280, ViT 1024 x 577 tokens,
# 5 scales, 32 queries of 2048 = 2/3 of the 3072 inner width).
ID_DIM, VIT_DIM, VIT_TOKENS, NUM_SCALE = 24, 32, 5, 2


def tiny_consisid(
    num_heads: int = 6, head_dim: int = 16, text_len: int = 7, in_channels: int = 8, seed: int = 0,
) -> ConsisIDTransformer3DModel:
    """A 2-layer ConsisID transformer (``num_heads * head_dim`` wide, a multiple of 3), float32, eval
    mode, with face conditioning (``is_train_face``) and a perceiver cross-attention after each block
    (``cross_attn_interval=1``; the released model has one every 2 of 42 blocks)."""
    inner = num_heads * head_dim
    torch.manual_seed(seed)
    model = ConsisIDTransformer3DModel(
        num_attention_heads=num_heads, attention_head_dim=head_dim, in_channels=in_channels, out_channels=4,
        time_embed_dim=32, text_embed_dim=TEXT_DIM, num_layers=2, sample_width=12, sample_height=12,
        sample_frames=9, max_text_seq_length=text_len, use_rotary_positional_embeddings=True,
        is_train_face=True, cross_attn_interval=1, cross_attn_dim_head=16, cross_attn_num_heads=4,
        LFE_id_dim=ID_DIM, LFE_vit_dim=VIT_DIM, LFE_depth=2, LFE_dim_head=8, LFE_num_heads=4,
        LFE_num_id_token=3, LFE_num_querie=5, LFE_output_dim=inner * 2 // 3, LFE_ff_mult=2,
        LFE_num_scale=NUM_SCALE, local_face_scale=0.7,
    )
    _perturb(model, seed + 1)
    return model.eval()


def face_inputs(batch: int, seed: int = 0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Seeded ``(id_cond (batch, ID_DIM), id_vit_hidden [NUM_SCALE x (batch, VIT_TOKENS, VIT_DIM)])``."""
    g = torch.Generator().manual_seed(seed + 100)
    id_cond = torch.randn(batch, ID_DIM, generator=g)
    return id_cond, [torch.randn(batch, VIT_TOKENS, VIT_DIM, generator=g) for _ in range(NUM_SCALE)]


@dataclass
class ConsisIDInputs:
    """Keyword arguments of one ``ConsisIDTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, F, C, H, W)
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    timestep: torch.Tensor  # (B,)
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor]
    id_cond: torch.Tensor  # (B, ID_DIM)
    id_vit_hidden: list[torch.Tensor]  # NUM_SCALE x (B, VIT_TOKENS, VIT_DIM)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def consisid_inputs(
    model: ConsisIDTransformer3DModel, frames: int, height: int, width: int, batch: int = 2, seed: int = 0
) -> ConsisIDInputs:
    """Seeded inputs for ``model``, a different face, prompt and timestep per batch element;
    tokens = frames * height/2 * width/2."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, frames, cfg.in_channels, height, width, generator=g)
    text = torch.randn(batch, cfg.max_text_seq_length, cfg.text_embed_dim, generator=g)
    timestep = torch.randint(0, 1000, (batch,), generator=g)
    return ConsisIDInputs(x, text, timestep, cogvideox_rope(model, frames, height, width), *face_inputs(batch, seed))


def tiny_consisid_pipeline(max_text_len: int = 16, seed: int = 0):
    """A ``ConsisIDPipeline`` of tiny random models, float32 (CogVideoX's tiny T5 and VAE: 8x spatial,
    4x temporal compression; 48 x 48 x 9 frames -> 27 video tokens). Call it with ``image=``,
    ``id_cond`` and ``id_vit_hidden`` of ``face_inputs(1)`` and ``max_sequence_length <= max_text_len``."""
    from diffusers import CogVideoXDPMScheduler

    # The pipeline's own module: ``diffusers.ConsisIDPipeline`` is a placeholder that raises without
    # OpenCV, which the module itself needs only to draw face keypoints (``kps_cond``, ``is_kps``
    # models), not used here.
    from diffusers.pipelines.consisid.pipeline_consisid import ConsisIDPipeline

    tokenizer, text_encoder = tiny_t5(max_text_len, seed + 10)
    return ConsisIDPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, vae=tiny_cogvideox_vae(seed + 20),
        transformer=tiny_consisid(text_len=max_text_len, seed=seed + 30), scheduler=CogVideoXDPMScheduler(),
    )
