"""Tiny randomly initialised ChronoEdit transformers and pipelines, for tests and the video example.

Layout: latents (batch, channels, frames, height, width); the transformer's input is the noise, the
mask and the image latents concatenated on channels (``z + 4 + z``); text embeddings (batch, 512,
text_dim: the stock processor takes everything before the last 512 context tokens for image tokens);
CLIP image embeddings (batch, image_seq, image_dim); timestep (batch,).

ChronoEdit-14B is Wan 2.1 I2V-14B's architecture with its own RoPE (two latent frames, the edit
mode's input and output, take temporal positions 0 and ``rope_temporal_skip_len - 1``), so the
inputs are ``usp_dit.demo.tiny_wan``'s. Built from a seed, in code, with no download: every rank
gets bit-identical weights and inputs.
"""
from __future__ import annotations

import torch
from diffusers import ChronoEditTransformer3DModel

from usp_dit.demo.tiny_video import TEXT_DIM, _perturb, tiny_t5
from usp_dit.demo.tiny_wan import I2V_TEXT_LEN, LATENT_CHANNELS, WanInputs, tiny_wan_vae, wan_inputs, wan_tokens

IMAGE_DIM = 24  # the tiny CLIP vision tower's width (the real one: 1280)
CLIP_IMAGE_SIZE = 32  # pixels the tiny CLIP sees: (32 / 8)^2 + 1 = 17 image tokens
TEMPORAL_SKIP = 4  # rope_temporal_skip_len (the release's 8, over a tiny rope_max_seq_len of 32)


def tiny_chronoedit(num_heads: int = 4, head_dim: int = 16, seed: int = 0) -> ChronoEditTransformer3DModel:
    """A 2-layer ``ChronoEditTransformer3DModel`` (ChronoEdit-14B's config, tiny), float32, eval
    mode, every parameter perturbed (``tiny_video._perturb``)."""
    torch.manual_seed(seed)
    model = ChronoEditTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=num_heads, attention_head_dim=head_dim,
        in_channels=3 * LATENT_CHANNELS, out_channels=LATENT_CHANNELS, text_dim=TEXT_DIM, freq_dim=16, ffn_dim=96,
        num_layers=2, cross_attn_norm=True, image_dim=IMAGE_DIM, added_kv_proj_dim=num_heads * head_dim,
        rope_max_seq_len=32, rope_temporal_skip_len=TEMPORAL_SKIP,
    )
    _perturb(model, seed + 1)
    return model.eval()


def chronoedit_inputs(model: ChronoEditTransformer3DModel, frames: int, height: int, width: int, batch: int = 2,
                      per_token_timestep: bool = False, seed: int = 0) -> WanInputs:
    """Seeded inputs (``tiny_wan.wan_inputs``): ``I2V_TEXT_LEN`` text tokens and 5 image tokens, a
    different prompt and timestep per element; 2 latent frames take the edit mode's RoPE."""
    return wan_inputs(model, frames, height, width, batch=batch, per_token_timestep=per_token_timestep, seed=seed)


chronoedit_tokens = wan_tokens  # frames/p_t * height/p_h * width/p_w


def tiny_clip_vision(seed: int = 0):
    """``(CLIPVisionModel, image processor)``: 2 layers of width ``IMAGE_DIM``, 8-pixel patches over
    ``CLIP_IMAGE_SIZE`` pixels. The pipeline reads the penultimate hidden state, (B, 17, IMAGE_DIM)."""
    from transformers import CLIPVisionConfig, CLIPVisionModel

    try:  # the PIL processor: the default one needs torchvision
        from transformers import CLIPImageProcessorPil as Processor
    except ImportError:  # pragma: no cover - older transformers
        from transformers import CLIPImageProcessor as Processor
    torch.manual_seed(seed)
    encoder = CLIPVisionModel(CLIPVisionConfig(
        hidden_size=IMAGE_DIM, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
        image_size=CLIP_IMAGE_SIZE, patch_size=8, projection_dim=IMAGE_DIM,
    ))
    _perturb(encoder, seed + 1, std=0.02)
    size = CLIP_IMAGE_SIZE
    processor = Processor(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return encoder.eval(), processor


def tiny_chronoedit_pipeline(max_text_len: int = I2V_TEXT_LEN, seed: int = 0):
    """A ``ChronoEditPipeline`` of tiny random models, float32 (call it with ``image=`` and
    ``max_sequence_length=512``: the stock processor's fixed text length).

    VAE (``tiny_wan.tiny_wan_vae``): 8x spatial, 4x temporal compression, patch (1, 2, 2). The
    pipeline edits with 5 frames (2 latent frames: the input image's and the edit's) unless
    ``enable_temporal_reasoning``; e.g. 48 x 80 -> 2 * 3 * 5 = 30 video tokens a call.
    """
    from diffusers import ChronoEditPipeline, UniPCMultistepScheduler

    tokenizer, text_encoder = tiny_t5(max_text_len, seed + 10)
    image_encoder, image_processor = tiny_clip_vision(seed + 50)
    return ChronoEditPipeline(
        tokenizer=tokenizer, text_encoder=text_encoder, image_encoder=image_encoder, image_processor=image_processor,
        transformer=tiny_chronoedit(seed=seed + 30), vae=tiny_wan_vae(LATENT_CHANNELS, seed=seed + 20),
        # The release's scheduler (the temporal-reasoning mode trims its multistep history).
        scheduler=UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=5.0),
    )
