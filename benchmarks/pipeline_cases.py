"""Full-size transformers (random weights, released configs) and one denoising step's inputs, for
``bench_pipelines.py``: the families added after Flux, CogVideoX and Mochi.

Each case returns ``(model, inputs, shape)``: a bf16 model on ``device``, the keyword arguments of
one forward (batch 1, as the family's pipeline passes them, ``return_dict=False``) and a readable
shape with the token counts. Text lengths and masks are the pipelines' usual ones; where a pipeline
pads the prompt, the mask marks a typical prompt's valid tokens, so that stock pays for its mask as
it does in real use.
"""
from __future__ import annotations

import torch

# Wan 2.1 T2V 14B (Wan-AI/Wan2.1-T2V-14B-Diffusers, transformer/config.json).
WAN_14B = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024,
)
# SkyReels-V2 DF 1.3B 540P (Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers, transformer/config.json);
# num_frame_per_block 5 is what its pipeline's asynchronous mode sets (causal_block_size=5).
SKYREELS_DF_1_3B = dict(
    patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=30, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024, inject_sample_info=True,
    num_frame_per_block=5,
)
# SD3.5 Large (stabilityai/stable-diffusion-3.5-large, transformer/config.json).
SD35_LARGE = dict(
    sample_size=128, patch_size=2, in_channels=16, num_layers=38, attention_head_dim=64, num_attention_heads=38,
    joint_attention_dim=4096, caption_projection_dim=2432, pooled_projection_dim=2048, out_channels=16,
    pos_embed_max_size=192, qk_norm="rms_norm",
)
# CogView4-6B (THUDM/CogView4-6B, transformer/config.json).
COGVIEW4_6B = dict(
    patch_size=2, in_channels=16, out_channels=16, num_layers=28, attention_head_dim=128, num_attention_heads=32,
    text_embed_dim=4096, time_embed_dim=512, condition_dim=256, pos_embed_max_size=128, sample_size=128,
    rope_axes_dim=(256, 256),
)
# Lumina-Image 2.0 (Alpha-VLLM/Lumina-Image-2.0, transformer/config.json): Gemma-2-2B captions (2304).
LUMINA2 = dict(
    sample_size=128, patch_size=2, in_channels=16, hidden_size=2304, num_layers=26, num_refiner_layers=2,
    num_attention_heads=24, num_kv_heads=8, multiple_of=256, norm_eps=1e-5, axes_dim_rope=(32, 32, 32),
    axes_lens=(300, 512, 512), cap_feat_dim=2304,
)
# HunyuanVideo, Qwen-Image, LTX-Video 0.9 and Flux.2-dev: diffusers' defaults are the released configs.
# HiDream-I1 Full (HiDream-ai/HiDream-I1-Full, transformer/config.json; Dev and Fast are the same
# architecture): 16 double- + 32 single-stream blocks, MoE of 4 routed experts (2 active), one Llama
# 3.1 layer per block (layers 0..31, then 31 for the last 16 blocks).
HIDREAM_I1 = dict(
    patch_size=2, in_channels=16, out_channels=16, num_layers=16, num_single_layers=32, attention_head_dim=128,
    num_attention_heads=20, caption_channels=[4096, 4096], text_emb_dim=2048, num_routed_experts=4,
    num_activated_experts=2, axes_dims_rope=(64, 32, 32), max_resolution=(128, 128),
    llama_layers=list(range(32)) + [31] * 16,
)
# HunyuanVideo, Qwen-Image, LTX-Video 0.9, Flux.2-dev, LongCat-Image and Ovis-Image: diffusers' defaults
# are the released configs.


def _bf(device: torch.device) -> dict:
    return dict(device=device, dtype=torch.bfloat16)


def _prompt_mask(device: torch.device, length: int, valid: int) -> torch.Tensor:
    mask = torch.zeros(1, length, dtype=torch.bool, device=device)
    mask[:, :valid] = True
    return mask


def wan_case(build, device: torch.device, frames: int = 81, height: int = 720, width: int = 1280):
    """Wan 2.1-14B: latents (1, 16, (f-1)/4+1, h/8, w/8), 1x2x2 patches, 512 text tokens (T5, padded to 512)."""
    from diffusers import WanTransformer3DModel

    model = build(WanTransformer3DModel, WAN_14B, device)
    lat = ((frames - 1) // 4 + 1, height // 8, width // 8)
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, 16, *lat, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 512, 4096, generator=g, **_bf(device)),
        timestep=torch.full((1,), 500, device=device, dtype=torch.long), return_dict=False,
    )
    tokens = lat[0] * (lat[1] // 2) * (lat[2] // 2)
    return model, inputs, f"{frames}x{height}x{width} ({tokens} + 512 tokens)"


def skyreels_df_case(build, device: torch.device, frames: int = 97, height: int = 544, width: int = 960):
    """SkyReels-V2 DF 1.3B, diffusion forcing: latents (1, 16, (f-1)/4+1, h/8, w/8), one timestep
    per latent frame, 512 text tokens; blocks of 5 latent frames attend causally (stock builds the
    dense (S, S) frame-causal mask and hands it to SDPA; usp_dit runs it as block_causal)."""
    from diffusers import SkyReelsV2Transformer3DModel

    model = build(SkyReelsV2Transformer3DModel, SKYREELS_DF_1_3B, device)
    lat = ((frames - 1) // 4 + 1, height // 8, width // 8)
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, 16, *lat, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 512, 4096, generator=g, **_bf(device)),
        timestep=torch.randint(0, 1000, (1, lat[0]), generator=g, device=device),
        enable_diffusion_forcing=True, fps=[0], return_dict=False,
    )
    tokens = lat[0] * (lat[1] // 2) * (lat[2] // 2)
    return model, inputs, f"{frames}x{height}x{width} DF, 5-frame blocks ({tokens} + 512 tokens)"


def hunyuan_video_case(build, device: torch.device, frames: int = 129, height: int = 720, width: int = 1280):
    """HunyuanVideo: latents (1, 16, (f-1)/4+1, h/8, w/8), 2x2 patches; 256 prompt tokens (Llama,
    padded), 77 of them valid; guidance-distilled (guidance 6.0)."""
    from diffusers import HunyuanVideoTransformer3DModel

    model = build(HunyuanVideoTransformer3DModel, {}, device)
    lat = ((frames - 1) // 4 + 1, height // 8, width // 8)
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, 16, *lat, generator=g, **_bf(device)),
        timestep=torch.full((1,), 500, device=device, dtype=torch.long),
        encoder_hidden_states=torch.randn(1, 256, 4096, generator=g, **_bf(device)),
        encoder_attention_mask=_prompt_mask(device, 256, 77),
        pooled_projections=torch.randn(1, 768, generator=g, **_bf(device)),
        guidance=torch.full((1,), 6000.0, **_bf(device)), return_dict=False,
    )
    tokens = lat[0] * (lat[1] // 2) * (lat[2] // 2)
    return model, inputs, f"{frames}x{height}x{width} ({tokens} + 256 tokens, 77 valid)"


def qwen_image_case(build, device: torch.device, height: int = 1328, width: int = 1328):
    """Qwen-Image: packed latents (1, (h/16)*(w/16), 64); 128 prompt tokens (Qwen2.5-VL), 96 valid."""
    from diffusers import QwenImageTransformer2DModel

    model = build(QwenImageTransformer2DModel, {}, device)
    rows, cols = height // 16, width // 16
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, rows * cols, 64, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 128, 3584, generator=g, **_bf(device)),
        encoder_hidden_states_mask=_prompt_mask(device, 128, 96),
        timestep=torch.full((1,), 0.5, **_bf(device)), img_shapes=[[(1, rows, cols)]], return_dict=False,
    )
    return model, inputs, f"{height}x{width} ({rows * cols} + 128 tokens, 96 valid)"


def zimage_case(build, device: torch.device, height: int = 1024, width: int = 1024, config: dict | None = None):
    """Z-Image (diffusers' defaults are the released config: 30 layers, 30 heads x 128): latents
    as the pipeline passes them, a list of (16, 1, h/8, w/8); one prompt of 100 Qwen3-4B tokens
    (the pipeline drops the padding; the model pads it to 128). ``config``: overrides (a tiny
    model to check the case builds on CPU)."""
    from diffusers import ZImageTransformer2DModel

    model = build(ZImageTransformer2DModel, config or {}, device)
    channels, text_dim = model.config.in_channels, model.config.cap_feat_dim
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        x=[torch.randn(channels, 1, height // 8, width // 8, generator=g, **_bf(device))],
        t=torch.full((1,), 0.5, **_bf(device)), cap_feats=[torch.randn(100, text_dim, generator=g, **_bf(device))],
        return_dict=False,
    )
    return model, inputs, f"{height}x{width} ({(height // 16) * (width // 16)} + 128 tokens, 100 real)"


def sd35_case(build, device: torch.device, height: int = 1024, width: int = 1024):
    """SD3.5 Large: latents (1, 16, h/8, w/8), 2x2 patches; 333 text tokens (77 CLIP + 256 T5)."""
    from diffusers import SD3Transformer2DModel

    model = build(SD3Transformer2DModel, SD35_LARGE, device)
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, 16, height // 8, width // 8, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 333, 4096, generator=g, **_bf(device)),
        pooled_projections=torch.randn(1, 2048, generator=g, **_bf(device)),
        timestep=torch.full((1,), 500.0, **_bf(device)), return_dict=False,
    )
    tokens = (height // 16) * (width // 16)
    return model, inputs, f"{height}x{width} ({tokens} + 333 tokens)"


def hidream_case(build, device: torch.device, height: int = 1024, width: int = 1024):
    """HiDream-I1 Full: latents (1, 16, h/8, w/8), 2x2 patches; 128 T5 tokens and Llama 3.1 8B's 32
    hidden states of 128 tokens, stacked (32, 1, 128, 4096) as the pipeline passes them: 128 + 2 x 128
    = 384 text tokens beside the image's; pooled CLIP-L + CLIP-G (1, 2048)."""
    from diffusers import HiDreamImageTransformer2DModel

    model = build(HiDreamImageTransformer2DModel, HIDREAM_I1, device)
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, 16, height // 8, width // 8, generator=g, **_bf(device)),
        timesteps=torch.full((1,), 500, device=device, dtype=torch.long),
        encoder_hidden_states_t5=torch.randn(1, 128, 4096, generator=g, **_bf(device)),
        encoder_hidden_states_llama3=torch.randn(32, 1, 128, 4096, generator=g, **_bf(device)),
        pooled_embeds=torch.randn(1, 2048, generator=g, **_bf(device)), return_dict=False,
    )
    tokens = (height // 16) * (width // 16) if height == width else model.max_seq
    return model, inputs, f"{height}x{width} ({tokens} + 384 tokens)"


def ltx_video_case(build, device: torch.device, frames: int = 121, height: int = 512, width: int = 768):
    """LTX-Video 0.9: packed latents (1, f'*h'*w', 128) with f' = (f-1)/8+1, h' = h/32, w' = w/32;
    128 prompt tokens (T5, padded), 64 valid (cross-attention mask)."""
    from diffusers import LTXVideoTransformer3DModel

    model = build(LTXVideoTransformer3DModel, {}, device)
    lat = ((frames - 1) // 8 + 1, height // 32, width // 32)
    tokens = lat[0] * lat[1] * lat[2]
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, tokens, 128, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 128, 4096, generator=g, **_bf(device)),
        timestep=torch.full((1,), 500, device=device, dtype=torch.long),
        encoder_attention_mask=_prompt_mask(device, 128, 64).to(torch.bfloat16),
        num_frames=lat[0], height=lat[1], width=lat[2], rope_interpolation_scale=(8 / 25, 32, 32),
        return_dict=False,
    )
    return model, inputs, f"{frames}x{height}x{width} ({tokens} + 128 tokens, 64 valid)"


def flux2_case(build, device: torch.device, height: int = 1024, width: int = 1024):
    """Flux.2-dev: packed latents (1, (h/16)*(w/16), 128), 4-axis position ids; 512 text tokens (Mistral)."""
    from diffusers import Flux2Transformer2DModel

    model = build(Flux2Transformer2DModel, {}, device)
    rows, cols = height // 16, width // 16
    r, c = torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(r), r, c, torch.zeros_like(r)], -1).reshape(1, -1, 4).to(device)
    txt_ids = torch.zeros(1, 512, 4, dtype=torch.long, device=device)
    txt_ids[..., 3] = torch.arange(512, device=device)
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, rows * cols, 128, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 512, 15360, generator=g, **_bf(device)),
        timestep=torch.full((1,), 0.5, **_bf(device)), guidance=torch.full((1,), 4.0, **_bf(device)),
        img_ids=img_ids, txt_ids=txt_ids, return_dict=False,
    )
    return model, inputs, f"{height}x{width} ({rows * cols} + 512 tokens)"


def _on(device: torch.device, kwargs: dict) -> dict:
    """Floating tensors in bf16 on ``device`` (masks and integer tensors keep their dtype)."""
    def move(name: str, v):
        if not torch.is_tensor(v):
            return v
        if v.is_floating_point() and "mask" not in name:
            return v.to(device, torch.bfloat16)
        return v.to(device)
    return {k: move(k, v) for k, v in kwargs.items()}


def hunyuan_video15_case(build, device: torch.device, frames: int = 121, height: int = 480, width: int = 848):
    """HunyuanVideo 1.5 (diffusers' defaults: the released 8.3 B, 480p): latents (1, 65, 31, 30, 53),
    patch 1 -> 49290 video tokens; 1000 Qwen prompt tokens (120 real), 256 glyph tokens (none real),
    text-to-video (zero image embeddings)."""
    from diffusers import HunyuanVideo15Transformer3DModel

    from usp_dit.demo.tiny_hunyuan_video15 import hunyuan_video15_inputs

    model = build(HunyuanVideo15Transformer3DModel, {}, device)
    f, h, w = (frames - 1) // 4 + 1, height // 16, width // 16
    inputs = hunyuan_video15_inputs(model, f, h, w, valid=(list(range(120)),), valid_2=([],), text_len=1000,
                                    glyph_len=256)
    kwargs = _on(device, inputs.kwargs())
    kwargs["return_dict"] = False
    return model, kwargs, f"{frames}x{height}x{width} ({f * h * w} tokens + 1000/256 text)"


def wan_vace_case(build, device: torch.device, frames: int = 81, height: int = 480, width: int = 832):
    """Wan 2.1 VACE 14B (Wan 14B + 8 control blocks at layers 0, 5, ..., 35): latents (1, 16, 21, 60, 104),
    control (1, 96, ...), 1x2x2 patches -> 32760 tokens; 512 text tokens."""
    from diffusers import WanVACETransformer3DModel

    from usp_dit.demo.tiny_wan_vace import wan_vace_inputs

    model = build(WanVACETransformer3DModel, dict(WAN_14B, vace_in_channels=96), device)
    f, h, w = (frames - 1) // 4 + 1, height // 8, width // 8
    inputs = wan_vace_inputs(model, f, h, w, batch=1, text_len=512, scales=False)
    kwargs = _on(device, inputs.kwargs())
    kwargs["return_dict"] = False
    return model, kwargs, f"{frames}x{height}x{width} ({f * (h // 2) * (w // 2)} tokens)"


def cogview4_case(build, device: torch.device, height: int = 1024, width: int = 1024, config: dict | None = None):
    """CogView4-6B: latents (1, 16, h/8, w/8), 2x2 patches; a GLM prompt of 128 tokens (the pipeline
    pads it to a multiple of 16 and passes no mask); the conditional call of a step."""
    from diffusers import CogView4Transformer2DModel

    model = build(CogView4Transformer2DModel, COGVIEW4_6B if config is None else config, device)
    g = torch.Generator(device).manual_seed(0)
    size = torch.tensor([[height, width]], **_bf(device))
    inputs = dict(
        hidden_states=torch.randn(1, model.config.in_channels, height // 8, width // 8, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 128, model.config.text_embed_dim, generator=g, **_bf(device)),
        timestep=torch.full((1,), 500.0, **_bf(device)), original_size=size, target_size=size,
        crop_coords=torch.zeros(1, 2, **_bf(device)), return_dict=False,
    )
    tokens = (height // 16) * (width // 16)
    return model, inputs, f"{height}x{width} ({tokens} + 128 tokens)"


def lumina2_case(build, device: torch.device, height: int = 1024, width: int = 1024, config: dict | None = None):
    """Lumina-Image 2.0: latents (1, 16, h/8, w/8), 2x2 patches; 256 Gemma caption tokens (the
    pipeline pads to max_sequence_length), 96 valid (system prompt and a typical prompt)."""
    from diffusers import Lumina2Transformer2DModel

    model = build(Lumina2Transformer2DModel, LUMINA2 if config is None else config, device)
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, model.config.in_channels, height // 8, width // 8, generator=g, **_bf(device)),
        timestep=torch.full((1,), 0.5, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 256, model.config.cap_feat_dim, generator=g, **_bf(device)),
        encoder_attention_mask=_prompt_mask(device, 256, 96), return_dict=False,
    )
    tokens = (height // 16) * (width // 16)
    return model, inputs, f"{height}x{width} ({tokens} + 256 caption tokens, 96 valid)"
def krea2_case(build, device: torch.device, height: int = 1024, width: int = 1024):
    """Krea 2 (diffusers' defaults: the released 28 blocks, 48 query / 12 K/V heads x 128): packed
    latents (1, (h/16)*(w/16), 64); 512 text tokens of 12 tapped Qwen3-VL layers, 120 real (a typical
    prompt: [prompt | padding | 5 suffix tokens], the mask's hole in the middle)."""
    from diffusers import Krea2Transformer2DModel

    from usp_dit.demo.tiny_krea2 import krea2_inputs

    model = build(Krea2Transformer2DModel, {}, device)
    rows, cols = height // 16, width // 16
    inputs = krea2_inputs(model, rows, cols, valid=(list(range(115)) + list(range(507, 512)),), text_len=512)
    kwargs = _on(device, inputs.kwargs())
    kwargs["return_dict"] = False
    return model, kwargs, f"{height}x{width} ({rows * cols} + 512 tokens, 120 real)"


def hunyuan_image_case(build, device: torch.device, height: int = 2048, width: int = 2048):
    """HunyuanImage 2.1 (diffusers' defaults with the released ByT5 width 1472: 20 dual- and 40
    single-stream blocks, 28 heads x 128): latents (1, 64, h/32, w/32), patch 1; 1000 Qwen prompt
    tokens (120 real), 128 glyph tokens (none real)."""
    from diffusers import HunyuanImageTransformer2DModel

    from usp_dit.demo.tiny_hunyuan_image import hunyuan_image_inputs

    model = build(HunyuanImageTransformer2DModel, dict(text_embed_2_dim=1472), device)
    rows, cols = height // 32, width // 32
    inputs = hunyuan_image_inputs(model, rows, cols, valid=(list(range(120)),), valid_2=([],), text_len=1000,
                                  glyph_len=128)
    kwargs = _on(device, inputs.kwargs())
    kwargs["return_dict"] = False
    return model, kwargs, f"{height}x{width} ({rows * cols} tokens + 1000/128 text)"
def sana_case(build, device: torch.device, height: int = 1024, width: int = 1024):
    """Sana 1600M (diffusers' defaults are its released config): latents (1, 32, h/32, w/32), patch 1
    (DC-AE 32x); 300 prompt tokens (Gemma-2), 120 valid. Linear self-attention (an all-reduce of
    summaries under usp_dit), the Mix-FFN's conv with its halo rows."""
    from diffusers import SanaTransformer2DModel

    model = build(SanaTransformer2DModel, {}, device)
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, 32, height // 32, width // 32, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 300, 2304, generator=g, **_bf(device)),
        encoder_attention_mask=_prompt_mask(device, 300, 120).long(),
        timestep=torch.full((1,), 500.0, **_bf(device)), return_dict=False,
    )
    tokens = (height // 32) * (width // 32)
    return model, inputs, f"{height}x{width} ({tokens} tokens + 300 text, 120 valid)"
def sana_video_case(build, device: torch.device, frames: int = 81, height: int = 480, width: int = 832):
    """SANA-Video 2B 480p (diffusers' defaults are its released config: 20 layers, 20 heads x 112):
    latents (1, 16, (f-1)/4+1, h/8, w/8) (Wan 2.1's VAE), 1x2x2 patches; 300 prompt tokens
    (Gemma-2), 120 valid. Linear self-attention with RoPE (an all-reduce of summaries under
    usp_dit), the Mix-FFN's spatial and temporal convs with their halo rows and frames."""
    from diffusers import SanaVideoTransformer3DModel

    model = build(SanaVideoTransformer3DModel, {}, device)
    lat = ((frames - 1) // 4 + 1, height // 8, width // 8)
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, 16, *lat, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 300, 2304, generator=g, **_bf(device)),
        encoder_attention_mask=_prompt_mask(device, 300, 120).long(),
        timestep=torch.full((1,), 500.0, **_bf(device)), return_dict=False,
    )
    tokens = lat[0] * (lat[1] // 2) * (lat[2] // 2)
    return model, inputs, f"{frames}x{height}x{width} ({tokens} tokens + 300 text, 120 valid)"
# PixArt-Sigma-XL-2-1024-MS (diffusers' defaults are the rest: 28 layers, 16 heads x 72, patch 2).
PIXART_SIGMA = dict(caption_channels=4096, interpolation_scale=2, use_additional_conditions=False)


def pixart_case(build, device: torch.device, height: int = 1024, width: int = 1024, config: dict | None = None):
    """PixArt-Sigma 1024: latents (1, 4, h/8, w/8), patch 2; 300 T5 tokens, 120 valid (masked
    cross-attention, local to each rank's tokens under usp_dit). ``config``: overrides (a tiny
    check on CPU)."""
    from diffusers import PixArtTransformer2DModel

    model = build(PixArtTransformer2DModel, {**PIXART_SIGMA, **(config or {})}, device)
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, model.config.in_channels, height // 8, width // 8, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 300, model.config.caption_channels, generator=g, **_bf(device)),
        encoder_attention_mask=_prompt_mask(device, 300, 120).long(),
        timestep=torch.full((1,), 500, device=device, dtype=torch.long),
        added_cond_kwargs={"resolution": None, "aspect_ratio": None}, return_dict=False,
    )
    tokens = (height // 16) * (width // 16)
    return model, inputs, f"{height}x{width} ({tokens} tokens + 300 text, 120 valid)"


# HunyuanDiT-v1.2 (diffusers' defaults are v1.0 - v1.1's: 40 layers, 16 heads x 88 there).
HUNYUAN_DIT = dict(num_attention_heads=16, attention_head_dim=88, in_channels=4, patch_size=2, hidden_size=1408,
                   num_layers=40, mlp_ratio=4.3637, sample_size=128, use_style_cond_and_image_meta_size=False)


def hunyuan_dit_case(build, device: torch.device, height: int = 1024, width: int = 1024, config: dict | None = None):
    """HunyuanDiT v1.2 1024: latents (1, 4, h/8, w/8), patch 2; 77 Bert + 256 mT5 tokens (30 / 60
    valid: padding replaced by learned rows), the 2D RoPE table as the pipeline makes it.
    ``config``: overrides (a tiny check on CPU)."""
    from diffusers import HunyuanDiT2DModel
    from diffusers.models.embeddings import get_2d_rotary_pos_embed

    model = build(HunyuanDiT2DModel, {**HUNYUAN_DIT, **(config or {})}, device)
    cfg = model.config
    rows, cols = height // 16, width // 16
    rope = get_2d_rotary_pos_embed(cfg.attention_head_dim, ((0, 0), (rows, cols)), (rows, cols), device=device)
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, cfg.in_channels, height // 8, width // 8, generator=g, **_bf(device)),
        timestep=torch.full((1,), 500.0, **_bf(device)),
        encoder_hidden_states=torch.randn(1, cfg.text_len, cfg.cross_attention_dim, generator=g, **_bf(device)),
        text_embedding_mask=_prompt_mask(device, cfg.text_len, 30).long(),
        encoder_hidden_states_t5=torch.randn(1, cfg.text_len_t5, cfg.cross_attention_dim_t5, generator=g,
                                             **_bf(device)),
        text_embedding_mask_t5=_prompt_mask(device, cfg.text_len_t5, 60).long(),
        image_meta_size=None, style=None, image_rotary_emb=tuple(t.to(torch.bfloat16) for t in rope),
        return_dict=False,
    )
    return model, inputs, f"{height}x{width} ({rows * cols} tokens + {cfg.text_len}/{cfg.text_len_t5} text)"


def _image_ids(height: int, width: int, modality: float, start: int, device: torch.device) -> torch.Tensor:
    """(tokens, 3) ids (modality, start + row, start + col) of the packed 2x2 patches of a
    ``height x width`` image (8 pixels per latent pixel)."""
    r, c = torch.meshgrid(torch.arange(height // 16), torch.arange(width // 16), indexing="ij")
    return torch.stack([torch.full_like(r, 0) + modality, r + start, c + start], -1).reshape(-1, 3).float().to(device)


def longcat_image_case(build, device: torch.device, height: int = 1024, width: int = 1024):
    """LongCat-Image: packed latents (1, (h/16)*(w/16), 64); 512 text tokens (Qwen2.5-VL, padded,
    no mask); ids as ``LongCatImagePipeline`` makes them: text (0, i, i), image (1, 512 + h, 512 + w)."""
    from diffusers import LongCatImageTransformer2DModel

    model = build(LongCatImageTransformer2DModel, {}, device)
    img_ids = _image_ids(height, width, 1.0, 512, device)
    txt_ids = torch.arange(512, device=device).float()[:, None].repeat(1, 3)
    txt_ids[:, 0] = 0
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, img_ids.shape[0], 64, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 512, 3584, generator=g, **_bf(device)),
        timestep=torch.full((1,), 0.5, **_bf(device)), img_ids=img_ids, txt_ids=txt_ids, return_dict=False,
    )
    return model, inputs, f"{height}x{width} ({img_ids.shape[0]} + 512 tokens)"


def ovis_image_case(build, device: torch.device, height: int = 1024, width: int = 1024):
    """Ovis-Image-7B: packed latents (1, (h/16)*(w/16), 64); 256 text tokens (Qwen3, padded, no
    mask); ids as ``OvisImagePipeline`` makes them: text (0, i, i), image (0, h, w)."""
    from diffusers import OvisImageTransformer2DModel

    model = build(OvisImageTransformer2DModel, {}, device)
    img_ids = _image_ids(height, width, 0.0, 0, device)
    txt_ids = torch.arange(256, device=device).float()[:, None].repeat(1, 3)
    txt_ids[:, 0] = 0
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, img_ids.shape[0], 64, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 256, 2048, generator=g, **_bf(device)),
        timestep=torch.full((1,), 0.5, **_bf(device)), img_ids=img_ids, txt_ids=txt_ids, return_dict=False,
    )
    return model, inputs, f"{height}x{width} ({img_ids.shape[0]} + 256 tokens)"


# ConsisID-preview (BestWishYsh/ConsisID-preview, transformer/config.json, as Diffusers documents it; not
# checked against the hub here): CogVideoX-5B I2V's transformer (48 heads x 64, 42 layers, image latents
# on channels) with face conditioning, a perceiver cross-attention after every 2nd block; the local
# facial extractor's sizes are Diffusers' defaults (1280-d face embedding, 5 EVA-CLIP scales of 1024).
CONSISID = dict(
    num_attention_heads=48, attention_head_dim=64, in_channels=32, out_channels=16, time_embed_dim=512,
    text_embed_dim=4096, num_layers=42, use_rotary_positional_embeddings=True, is_train_face=True, is_kps=False,
    cross_attn_interval=2,
)


def consisid_case(build, device: torch.device, frames: int = 49, height: int = 480, width: int = 720,
                  config: dict | None = None):
    """ConsisID: latents (1, (frames-1)/4+1, 2 x 16, h/8, w/8) (noise + image latents), 2x2 patches;
    226 T5 tokens; the RoPE table as ConsisIDPipeline makes it; one face: ``id_cond`` (1, 1280) and
    5 ViT scales of (1, 577, 1024). ``config``: overrides (a tiny model to check the case builds on CPU)."""
    from diffusers import ConsisIDTransformer3DModel
    from diffusers.models.embeddings import get_3d_rotary_pos_embed

    model = build(ConsisIDTransformer3DModel, CONSISID if config is None else config, device)
    cfg = model.config
    lat_f, lat_h, lat_w = (frames - 1) // 4 + 1, height // 8, width // 8
    grid = (lat_h // 2, lat_w // 2)  # at the model's native 480x720 the pipeline's crop is the whole grid
    cos, sin = get_3d_rotary_pos_embed(
        embed_dim=cfg.attention_head_dim, crops_coords=((0, 0), grid), grid_size=grid, temporal_size=lat_f,
        device=device,
    )
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, lat_f, cfg.in_channels, lat_h, lat_w, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 226, cfg.text_embed_dim, generator=g, **_bf(device)),
        timestep=torch.full((1,), 500, device=device, dtype=torch.long),
        image_rotary_emb=(cos.to(device), sin.to(device)),
        id_cond=torch.randn(1, cfg.LFE_id_dim, generator=g, **_bf(device)),
        id_vit_hidden=[torch.randn(1, 577, cfg.LFE_vit_dim, generator=g, **_bf(device))
                       for _ in range(cfg.LFE_num_scale)],
        return_dict=False,
    )
    tokens = lat_f * grid[0] * grid[1]
    return model, inputs, f"{frames}x{height}x{width} ({tokens} + 226 tokens, 32 identity tokens)"


# AuraFlow v0.3 (fal/AuraFlow-v0.3, transformer/config.json, as recalled; not checked against the hub here):
# Diffusers' defaults (4 MMDiT + 32 single-stream blocks, 12 heads x 256, UMT5-XXL's 2048 projected
# to 3072) with a position table of 96 x 96 patches (the default's 32 x 32 cannot hold 1024 x 1024).
AURAFLOW_V03 = dict(pos_embed_max_size=9216)


def auraflow_case(build, device: torch.device, height: int = 1024, width: int = 1024, config: dict | None = None):
    """AuraFlow: latents (1, 4, h/8, w/8), 2x2 patches; 256 UMT5 tokens (the pipeline pads to
    max_sequence_length and zeroes the padding; the model takes no mask) + 8 register tokens.
    ``config``: overrides (a tiny model to check the case builds on CPU)."""
    from diffusers import AuraFlowTransformer2DModel

    model = build(AuraFlowTransformer2DModel, AURAFLOW_V03 if config is None else config, device)
    cfg = model.config
    g = torch.Generator(device).manual_seed(0)
    text = torch.randn(1, 256, cfg.joint_attention_dim, generator=g, **_bf(device))
    inputs = dict(
        hidden_states=torch.randn(1, cfg.in_channels, height // 8, width // 8, generator=g, **_bf(device)),
        encoder_hidden_states=text * _prompt_mask(device, 256, 96)[..., None],
        timestep=torch.full((1,), 0.5, **_bf(device)), return_dict=False,
    )
    tokens = (height // 16) * (width // 16)
    return model, inputs, f"{height}x{width} ({tokens} + 8 register + 256 text tokens, 96 real)"
def bria_case(build, device: torch.device, height: int = 1024, width: int = 1024, config: dict | None = None):
    """Bria 3.x: packed latents (1, (h/16)*(w/16), 64); 128 text tokens (T5, ``BriaPipeline``'s
    default ``max_sequence_length``, zero-padded, no mask); ids as the pipeline makes them: text
    zeros, image (0, h, w). The config is Diffusers' ``BriaTransformer2DModel`` defaults (Flux.1's
    widths and depths: 19 + 38 blocks, 24 heads x 128); BRIA-3.2's own config.json (a 4 B model)
    was not at hand offline: pass it as ``config`` for the released model. ``config``: overrides
    (also a tiny model, to check the case builds on CPU)."""
    from diffusers import BriaTransformer2DModel

    model = build(BriaTransformer2DModel, config or {}, device)
    channels, text_dim = model.config.in_channels, model.config.joint_attention_dim
    img_ids = _image_ids(height, width, 0.0, 0, device)
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, img_ids.shape[0], channels, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 128, text_dim, generator=g, **_bf(device)),
        timestep=torch.full((1,), 500.0, **_bf(device)), img_ids=img_ids,
        txt_ids=torch.zeros(128, 3, device=device), return_dict=False,
    )
    return model, inputs, f"{height}x{width} ({img_ids.shape[0]} + 128 tokens)"


def ernie_image_case(build, device: torch.device, height: int = 1024, width: int = 1024, config: dict | None = None):
    """ERNIE-Image: latents (1, 128, h/16, w/16) (the Flux.2 VAE's 32 channels at h/8, patchified
    2x2 by the pipeline; patch size 1 in the model); a Mistral-3 prompt of 128 tokens, no padding
    (batch 1: the pipeline pads to the batch's longest prompt). The config is Diffusers'
    ``ErnieImageTransformer2DModel`` defaults (24 layers, 3072 wide, 24 heads x 128, text_in_dim
    2560), which the diffusers docs give as ERNIE-Image's (baidu/ERNIE-Image transformer/config.json
    was not at hand offline to compare). ``config``: overrides (a tiny model to check the case builds on CPU)."""
    from diffusers import ErnieImageTransformer2DModel

    model = build(ErnieImageTransformer2DModel, config or {}, device)
    cfg = model.config
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, cfg.in_channels, height // 16, width // 16, generator=g, **_bf(device)),
        timestep=torch.full((1,), 500.0, **_bf(device)),
        text_bth=torch.randn(1, 128, cfg.text_in_dim, generator=g, **_bf(device)),
        text_lens=torch.tensor([128], device=device), return_dict=False,
    )
    return model, inputs, f"{height}x{width} ({(height // 16) * (width // 16)} + 128 tokens)"


def glm_image_case(build, device: torch.device, height: int = 1024, width: int = 1024, config: dict | None = None):
    """GLM-Image's diffusion decoder: latents (1, 16, h/8, w/8), 2x2 patches, one AR prior token per
    image token; a glyph prompt of 32 ByT5 tokens (the quoted text only: short), no mask (the
    pipeline passes none); the conditional call of a step. The config is Diffusers'
    ``GlmImageTransformer2DModel`` defaults (30 layers, 64 heads x 40, text_embed_dim 1472, codebook
    16384: zai-org/GLM-Image's transformer, per the diffusers docs; its config.json was not at hand
    offline to compare). ``config``: overrides (a tiny model to check the case builds on CPU)."""
    from diffusers import GlmImageTransformer2DModel

    model = build(GlmImageTransformer2DModel, config or {}, device)
    cfg = model.config
    g = torch.Generator(device).manual_seed(0)
    tokens = (height // 16) * (width // 16)
    inputs = dict(
        hidden_states=torch.randn(1, cfg.in_channels, height // 8, width // 8, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 32, cfg.text_embed_dim, generator=g, **_bf(device)),
        prior_token_id=torch.randint(0, cfg.prior_vq_quantizer_codebook_size, (1, tokens), generator=g, device=device),
        prior_token_drop=torch.zeros(1, tokens, dtype=torch.bool, device=device),
        timestep=torch.full((1,), 500.0, **_bf(device)), target_size=torch.tensor([[height, width]], **_bf(device)),
        crop_coords=torch.zeros(1, 2, **_bf(device)), return_dict=False,
    )
    return model, inputs, f"{height}x{width} ({tokens} + 32 tokens)"
