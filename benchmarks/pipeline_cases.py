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
# Lumina-Next-SFT (Alpha-VLLM/Lumina-Next-SFT-diffusers; Lumina-T2X's NextDiT_2B_GQA_patch2): 2B, Gemma-2B captions.
LUMINA_NEXT = dict(
    sample_size=128, patch_size=2, in_channels=4, hidden_size=2304, num_layers=24, num_attention_heads=32,
    num_kv_heads=8, multiple_of=256, norm_eps=1e-5, learn_sigma=True, qk_norm=True, cross_attention_dim=2048,
)
# One DreamLite U-Net attention block at the deepest level of diffusers' DreamLiteUNetModel defaults.
DREAMLITE_BLOCK = dict(
    num_attention_heads=64, attention_head_dim=20, in_channels=1280, num_layers=1, norm_num_groups=32,
    cross_attention_dim=2048, qk_norm="rms_norm", num_kv_heads=1, ff_mult=6,
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


def lumina_next_case(build, device: torch.device, height: int = 1024, width: int = 1024, config: dict | None = None):
    """Lumina-Next-SFT: latents (1, 4, h/8, w/8), 2x2 patches; 128 Gemma caption tokens (the pipeline
    pads to a multiple of 8), 96 valid, attended by cross-attention; the pipeline's proportional
    attention (base (1024 / 16)^2 tokens) and its 384 x 384 RoPE table at scale 1."""
    from diffusers import LuminaNextDiT2DModel
    from diffusers.models.embeddings import get_2d_rotary_pos_embed_lumina

    model = build(LuminaNextDiT2DModel, LUMINA_NEXT if config is None else config, device)
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, model.config.in_channels, height // 8, width // 8, generator=g, **_bf(device)),
        timestep=torch.full((1,), 0.5, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 128, model.config.cross_attention_dim, generator=g, **_bf(device)),
        encoder_mask=_prompt_mask(device, 128, 96),
        image_rotary_emb=get_2d_rotary_pos_embed_lumina(model.head_dim, 384, 384).to(device),
        cross_attention_kwargs={"base_sequence_length": (model.config.sample_size * 8 // 16) ** 2}, return_dict=False,
    )
    tokens = (height // 16) * (width // 16)
    return model, inputs, f"{height}x{width} ({tokens} image tokens; 128 caption tokens, 96 valid)"


def dreamlite_case(build, device: torch.device, height: int = 1024, width: int = 1024, config: dict | None = None):
    """One DreamLite attention block at its U-Net's deepest level (diffusers' ``DreamLiteUNetModel``
    defaults: 1280 channels, 64 heads as its legacy ``attention_head_dim``, 1 kv head, RMS QK norm,
    feed-forward x6; the released checkpoint's config not checked): the latent (h/8 x w/8) down 4x,
    (h/32) * (w/32) tokens; 128 text tokens of 2048 (Qwen3-VL), 96 valid. The U-Net's convolutions
    run whole on every rank (Note [DreamLite's pipelines]): only its blocks are split."""
    from diffusers import DreamLiteTransformer2DModel
    from diffusers.models.attention_processor import Attention
    from diffusers.models.unets.unet_dreamlite import DreamLiteAttnProcessor2_0

    model = build(DreamLiteTransformer2DModel, DREAMLITE_BLOCK if config is None else config, device)
    for module in model.modules():  # as DreamLiteUNetModel installs it
        if isinstance(module, Attention):
            module.set_processor(DreamLiteAttnProcessor2_0())
    g = torch.Generator(device).manual_seed(0)
    channels = model.config.in_channels
    inputs = dict(
        hidden_states=torch.randn(1, channels, height // 32, width // 32, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 128, model.config.cross_attention_dim, generator=g, **_bf(device)),
        encoder_attention_mask=_prompt_mask(device, 128, 96), return_dict=False,
    )
    tokens = (height // 32) * (width // 32)
    return model, inputs, f"{height}x{width} ({tokens} tokens of one U-Net level; 128 text tokens, 96 valid)"


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



def bria_fibo2_case(build, device: torch.device, height: int = 1024, width: int = 1024, text_len: int = 512,
                    config: dict | None = None):
    """FIBO 2.0 (diffusers' ``BriaFibo2Transformer2DModel`` defaults, taken as the released config:
    44 layers + 2 refiner, 28 heads x 128, injection blocks 6, 14, 22, 30, 38): latents
    (1, 32, h/8, w/8) as the pipeline passes them (the Flux.2 VAE), 2x2 patches; ``text_len``
    Qwen3-VL tokens, unpadded, in 6 bundles of 7680 (the Perceiver's and one per injection block):
    512 give 320 gist tokens. ``config``: overrides (a tiny model, to check the case builds on CPU)."""
    from diffusers import BriaFibo2Transformer2DModel

    model = build(BriaFibo2Transformer2DModel, config or {}, device)
    cfg = model.config
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, cfg.in_channels, height // 8, width // 8, generator=g, **_bf(device)),
        timestep=torch.full((1,), 0.5, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 1 + len(cfg.injection_layer_ids), text_len, cfg.cap_feat_dim,
                                          generator=g, **_bf(device)),
        return_dict=False,
    )
    tokens = (height // 8 // cfg.patch_size) * (width // 8 // cfg.patch_size)
    return model, inputs, f"{height}x{width} ({tokens} image + gist tokens of {text_len} text)"

# ---- families without a GPU figure yet (checked on CPU by benchmarks/check_cases.py) ----------------------
#
# Each case below takes ``config``: overrides of the released config (a tiny model, to check the case on
# CPU), and builds its inputs from the model's config, so the same code serves both sizes.

# Qwen-Image 2.1 (Qwen/Qwen-Image-2.1, transformer/config.json as public repositories quote it: 32 blocks,
# 32 heads x 128, context_in_dim 4096 (Qwen3-VL), mlp_ratio 3, RoPE (16, 56, 56), causal_condition):
# diffusers' defaults.
QWEN_IMAGE21: dict = {}


def qwen_image21_case(build, device: torch.device, height: int = 1024, width: int = 1024, text_len: int = 100,
                      config: dict | None = None):
    """Qwen-Image 2.1 text-to-image: target latents (1, (h/16)*(w/16), 64) (2.1 consumes latents
    unpatched), a prompt of ``text_len`` Qwen3-VL tokens (one prompt: nothing padded, so the pipeline
    passes no mask), ``img_mask`` with one slot per 2x2 target tokens; the pipeline's full forward
    (``use_kv_cache=False``, or the first step that fills the cache: ``kv_cache=None`` here)."""
    from diffusers import QwenImage21Transformer2DModel

    model = build(QwenImage21Transformer2DModel, {**QWEN_IMAGE21, **(config or {})}, device)
    cfg = model.config
    rows, cols = height // 16, width // 16
    g = torch.Generator(device).manual_seed(0)
    # one slot per 2x2 target tokens appended to the (slot-free) text positions, as the pipeline appends them
    slots = torch.ones(1, rows * cols // 4, dtype=torch.bool)
    img_mask = torch.cat([torch.zeros(1, text_len, dtype=torch.bool), slots], dim=1).to(device)
    inputs = dict(
        hidden_states=torch.randn(1, rows * cols, cfg.in_channels, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, text_len, cfg.context_in_dim, generator=g, **_bf(device)),
        timestep=torch.full((1,), 0.5, **_bf(device)), img_shapes=[[(1, rows, cols)]], img_mask=img_mask,
        encoder_hidden_states_mask=None, return_dict=False,
    )
    return model, inputs, f"{height}x{width} ({rows * cols} + {text_len} tokens, block-causal prefix)"


# FLUX.3: diffusers' Flux3Transformer2DModel defaults (5 per-mode + 28 single blocks, 24 heads x 128,
# Qwen3-VL's 8 stacked layers = 20480 text channels). NOT confirmed against a released config.json (none
# found in the stored public sources): an assumption.
FLUX3: dict = {}


def flux3_case(build, device: torch.device, height: int = 1024, width: int = 1024, text_len: int = 160,
               config: dict | None = None):
    """FLUX.3 text-to-image: packed latents (1, (h/16)*(w/16), 128); a prompt window of ``text_len``
    tokens (the text encoder step right-pads the prompt to a multiple of 80 and the transformer
    attends to the padding: no mask); ids as the modular pipeline makes them (image H/W scaled by
    0.5, text along the L axis); the conditional call of a step."""
    from diffusers import Flux3Transformer2DModel
    from diffusers.modular_pipelines.flux3.before_denoise import Flux3TextRoPEInputsStep, _prepare_image_ids

    model = build(Flux3Transformer2DModel, {**FLUX3, **(config or {})}, device)
    cfg = model.config
    rows, cols = height // 16, width // 16
    g = torch.Generator(device).manual_seed(0)
    text = torch.randn(1, text_len, cfg.joint_attention_dim, generator=g, **_bf(device))
    inputs = dict(
        hidden_states=torch.randn(1, rows * cols, cfg.in_channels, generator=g, **_bf(device)),
        encoder_hidden_states=text, timestep=torch.full((1,), 0.5, **_bf(device)),
        img_ids=_prepare_image_ids(rows, cols, 0.5).to(device),
        txt_ids=Flux3TextRoPEInputsStep._prepare_text_ids(text).to(device), return_dict=False,
    )
    return model, inputs, f"{height}x{width} ({rows * cols} + {text_len} tokens)"


# LTX-2 (Lightricks/LTX-2): the "2.0" transformer config of diffusers' scripts/convert_ltx2_to_diffusers.py,
# i.e. diffusers' defaults with split RoPE (48 blocks; video 32 heads x 128, audio 32 x 64; Gemma 3 3840).
LTX2: dict = dict(rope_type="split")


def ltx2_case(build, device: torch.device, frames: int = 121, height: int = 512, width: int = 768,
              text_len: int = 1024, config: dict | None = None):
    """LTX-2 text-to-video+audio as ``LTX2Pipeline`` calls it (its defaults: 121 x 512 x 768 at 24
    fps): packed video latents (1, f'*h'*w', 128), f' = (f-1)/8+1, h' = h/32, w' = w/32; audio
    latents (1, round(f/24 * 25), 128); both streams' text from the connectors, 1024 tokens whose
    mask is all ones (the connectors' learnable registers replace the padding); the RoPE
    coordinates the pipeline precomputes; ``sigma`` = the timestep, cross-modal timestep on."""
    from diffusers import LTX2VideoTransformer3DModel

    model = build(LTX2VideoTransformer3DModel, {**LTX2, **(config or {})}, device)
    cfg = model.config
    lat = ((frames - 1) // 8 + 1, height // 32, width // 32)
    tokens = lat[0] * lat[1] * lat[2]
    audio_frames = round(frames / 24.0 * cfg.audio_sampling_rate / cfg.audio_hop_length / cfg.audio_scale_factor)
    g = torch.Generator(device).manual_seed(0)
    timestep = torch.full((1,), 500.0, **_bf(device))
    inputs = dict(
        hidden_states=torch.randn(1, tokens, cfg.in_channels, generator=g, **_bf(device)),
        audio_hidden_states=torch.randn(1, audio_frames, cfg.audio_in_channels, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, text_len, cfg.caption_channels, generator=g, **_bf(device)),
        audio_encoder_hidden_states=torch.randn(1, text_len, cfg.caption_channels, generator=g, **_bf(device)),
        timestep=timestep, sigma=timestep,
        encoder_attention_mask=torch.ones(1, text_len, dtype=torch.long, device=device),
        audio_encoder_attention_mask=torch.ones(1, text_len, dtype=torch.long, device=device),
        num_frames=lat[0], height=lat[1], width=lat[2], fps=24.0, audio_num_frames=audio_frames,
        video_coords=model.rope.prepare_video_coords(1, *lat, device, fps=24.0),
        audio_coords=model.audio_rope.prepare_audio_coords(1, audio_frames, device),
        isolate_modalities=False, spatio_temporal_guidance_blocks=None, perturbation_mask=None,
        use_cross_timestep=True, return_dict=False,
    )
    return model, inputs, f"{frames}x{height}x{width} ({tokens} video + {audio_frames} audio + {text_len} text)"


# Kandinsky 5.0 T2V Lite sft 5s (kandinskylab/Kandinsky-5.0-T2V-Lite-sft-5s-Diffusers; the dit_params of
# configs/config_5s_sft.yaml in ai-forever/Kandinsky-5): 32 visual blocks of 1792 (28 heads x 64), visual_cond,
# dense attention (the 10 s checkpoints' NABLA attention: flex_cases.kandinsky5_nabla_case, compiled).
KANDINSKY5_LITE = dict(
    in_visual_dim=16, out_visual_dim=16, time_dim=512, patch_size=(1, 2, 2), model_dim=1792, ff_dim=7168,
    num_text_blocks=2, num_visual_blocks=32, axes_dims=(16, 24, 24), visual_cond=True, in_text_dim=3584,
    in_text_dim2=768,
)


def kandinsky5_case(build, device: torch.device, frames: int = 121, height: int = 512, width: int = 768,
                    text_len: int = 100, config: dict | None = None):
    """Kandinsky 5.0 T2V Lite at ``Kandinsky5T2VPipeline``'s defaults (121 x 512 x 768): latents
    channels-last (1, (f-1)/4+1, h/8, w/8, 2 x 16 + 1) (noise, zero condition and its mask),
    1x2x2 patches; a prompt of ``text_len`` Qwen2.5-VL tokens (unpadded: the pipeline passes
    cu_seqlens and no mask), the CLIP pooled vector; RoPE positions and scale as the pipeline makes
    them (scale (1, 2, 2) between 480 and 854 pixels); no ``sparse_params`` (dense attention)."""
    from diffusers import Kandinsky5Transformer3DModel

    model = build(Kandinsky5Transformer3DModel, {**KANDINSKY5_LITE, **(config or {})}, device)
    # As from_pretrained(torch_dtype=bf16) loads it: the time embeddings and modulations stay float32
    # (_keep_in_fp32_modules), or the float32 sinusoidal time features meet bf16 weights.
    for name, module in model.named_modules():
        if set(name.split(".")) & set(model._keep_in_fp32_modules or ()):
            module.float()
    cfg = model.config
    lat = ((frames - 1) // 4 + 1, height // 8, width // 8)
    channels = 2 * cfg.in_visual_dim + 1 if cfg.visual_cond else cfg.in_visual_dim
    between_480p = 480 <= height <= 854 and 480 <= width <= 854
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, *lat, channels, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, text_len, cfg.in_text_dim, generator=g, **_bf(device)),
        pooled_projections=torch.randn(1, cfg.in_text_dim2, generator=g, **_bf(device)),
        timestep=torch.full((1,), 500.0, **_bf(device)),
        visual_rope_pos=[torch.arange(lat[0], device=device), torch.arange(lat[1] // 2, device=device),
                         torch.arange(lat[2] // 2, device=device)],
        text_rope_pos=torch.arange(text_len, device=device),
        scale_factor=(1, 2, 2) if between_480p else (1, 3.16, 3.16), sparse_params=None, return_dict=False,
    )
    tokens = lat[0] * (lat[1] // 2) * (lat[2] // 2)
    return model, inputs, f"{frames}x{height}x{width} ({tokens} + {text_len} tokens)"


# ChronoEdit-14B (nvidia/ChronoEdit-14B-Diffusers): Wan 2.1 I2V-14B's architecture (in 16 + 4 + 16 channels,
# CLIP ViT-H 1280 image tokens through added K/V) with temporal RoPE skip 8. Assumed from the Wan 2.1 I2V-14B
# release it is fine-tuned from and the class's defaults; its own config.json was not found to confirm.
CHRONOEDIT_14B = dict(in_channels=36, image_dim=1280, added_kv_proj_dim=5120, rope_temporal_skip_len=8)


def chronoedit_case(build, device: torch.device, frames: int = 5, height: int = 480, width: int = 832,
                    image_len: int = 257, config: dict | None = None):
    """ChronoEdit edit at ``ChronoEditPipeline``'s defaults: 480 x 832, 5 frames without temporal
    reasoning (2 latent frames: the input image's and the edit's); latents (1, 16 + 4 + 16, 2, h/8,
    w/8), 1x2x2 patches; 512 UMT5 tokens (padded with zeros, no mask); 257 CLIP image tokens."""
    from diffusers import ChronoEditTransformer3DModel

    model = build(ChronoEditTransformer3DModel, {**CHRONOEDIT_14B, **(config or {})}, device)
    cfg = model.config
    lat = ((frames - 1) // 4 + 1, height // 8, width // 8)
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, cfg.in_channels, *lat, generator=g, **_bf(device)),
        timestep=torch.full((1,), 500, device=device, dtype=torch.long),
        encoder_hidden_states=torch.randn(1, 512, cfg.text_dim, generator=g, **_bf(device)),
        encoder_hidden_states_image=torch.randn(1, image_len, cfg.image_dim, generator=g, **_bf(device)),
        return_dict=False,
    )
    tokens = lat[0] * (lat[1] // 2) * (lat[2] // 2)
    return model, inputs, f"{frames}x{height}x{width} ({tokens} + 512 text + {image_len} image tokens)"


# Helios-Base (BestWishYsh/Helios-Base): diffusers' HeliosTransformer3DModel defaults (Wan 14B's 40 blocks of
# 40 heads x 128, RoPE (44, 42, 42), the multi-term memory patches). NOT confirmed against the released
# config.json (not found in the stored public sources): an assumption.
HELIOS: dict = {}


def helios_case(build, device: torch.device, height: int = 384, width: int = 640, chunk: int = 9,
                history: tuple[int, int, int] = (16, 2, 1), config: dict | None = None):
    """Helios at ``HeliosPipeline``'s defaults (384 x 640, chunks of 9 latent frames, history sizes
    [16, 2, 1], keep_first_frame): the chunk's latents (1, 16, 9, h/8, w/8); long / mid / short
    history latents of 16 / 2 / 1 + 1 (the first frame) latent frames and their frame indices as the
    pipeline splits ``arange(1 + 16 + 2 + 1 + 9)``; 512 UMT5 tokens (padded with zeros, no mask)."""
    from diffusers import HeliosTransformer3DModel

    model = build(HeliosTransformer3DModel, {**HELIOS, **(config or {})}, device)
    cfg = model.config
    h, w = height // 8, width // 8
    long, mid, short = history
    prefix, hist_long, hist_mid, hist_1x, current = torch.arange(1 + long + mid + short + chunk, device=device).split(
        [1, long, mid, short, chunk])
    g = torch.Generator(device).manual_seed(0)

    def latent(f: int) -> torch.Tensor:
        return torch.randn(1, cfg.in_channels, f, h, w, generator=g, **_bf(device))

    inputs = dict(
        hidden_states=latent(chunk), timestep=torch.full((1,), 500.0, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 512, cfg.text_dim, generator=g, **_bf(device)),
        indices_hidden_states=current[None], indices_latents_history_short=torch.cat([prefix, hist_1x])[None],
        indices_latents_history_mid=hist_mid[None], indices_latents_history_long=hist_long[None],
        latents_history_short=latent(1 + short), latents_history_mid=latent(mid), latents_history_long=latent(long),
        return_dict=False,
    )
    tokens = chunk * (h // 2) * (w // 2)
    shape = f"{height}x{width}, chunk {chunk} + history {long}/{mid}/{1 + short} ({tokens} chunk tokens + 512 text)"
    return model, inputs, shape


# Cosmos 3 Nano (nvidia/Cosmos3-Nano, transformer/config.json as a public repository quotes it verbatim):
# the Qwen3-VL-8B-like 36 layers of 4096 (32 query / 8 K/V heads x 128) for both the understanding and the
# generation stream, interleaved mRoPE (24, 20, 20), with the sound and action heads.
COSMOS3_NANO = dict(
    action_dim=64, action_gen=True, sound_dim=64, sound_gen=True, rms_norm_eps=1e-6, rope_theta=5000000.0,
    rope_scaling={"mrope_interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
)


def cosmos3_case(build, device: torch.device, frames: int = 189, height: int = 720, width: int = 1280,
                 text_len: int = 256, config: dict | None = None):
    """Cosmos 3 text-to-video at ``Cosmos3OmniPipeline``'s defaults (189 x 720 x 1280 at 24 fps, no
    sound): the packed call the pipeline builds with its own segment helpers: ``text_len`` prompt
    tokens (chat template included), the video latent (1, 48, (f-1)/4+1, h/16, w/16) in 2x2
    patches, every frame noisy, one timestep per noisy token, mRoPE positions of the joint sequence."""
    from types import SimpleNamespace

    from diffusers import Cosmos3OmniPipeline
    from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer

    model = build(Cosmos3OmniTransformer, {**COSMOS3_NANO, **(config or {})}, device)
    cfg = model.config
    lat = ((frames - 1) // 4 + 1, height // 16, width // 16)
    g = torch.Generator(device).manual_seed(0)
    latents = torch.randn(1, cfg.latent_channel, *lat, generator=g, **_bf(device))
    stand_in = SimpleNamespace(transformer=model, vae_scale_factor_temporal=4)  # what the two helpers read
    text = Cosmos3OmniPipeline._prepare_text_segment(
        stand_in, torch.randint(0, cfg.vocab_size, (text_len,), generator=g, device=device).tolist(), device)
    vision = Cosmos3OmniPipeline._prepare_vision_segment(
        stand_in, latents, has_image_condition=False, mrope_offset=text["vision_start_temporal_offset"],
        vision_fps=24.0, curr=text["und_len"], device=device, condition_frame_indexes=[])
    inputs = dict(
        input_ids=text["input_ids"], text_indexes=text["text_indexes"],
        position_ids=torch.cat([text["text_mrope_ids"], vision["vision_mrope_ids"]], dim=1),
        und_len=text["und_len"], sequence_length=text["und_len"] + vision["num_vision_tokens"],
        vision_tokens=[latents], vision_token_shapes=vision["vision_token_shapes"],
        vision_sequence_indexes=vision["vision_sequence_indexes"],
        vision_mse_loss_indexes=vision["vision_mse_loss_indexes"],
        vision_timesteps=torch.full((vision["num_noisy_vision_tokens"],), 500.0, device=device),
        vision_noisy_frame_indexes=vision["vision_noisy_frame_indexes"], return_dict=False,
    )
    return model, inputs, f"{frames}x{height}x{width} ({vision['num_vision_tokens']} + {text_len} tokens)"


# Wan 2.2 Animate 14B (Wan-AI/Wan2.2-Animate-14B-Diffusers, transformer/config.json as a public repository
# quotes it): diffusers' defaults with CLIP image tokens through added K/V (5120).
WAN_ANIMATE_14B = dict(added_kv_proj_dim=5120)


def wan_animate_case(build, device: torch.device, segment_frames: int = 77, height: int = 720, width: int = 1280,
                     image_len: int = 257, face_size: int | None = None, config: dict | None = None):
    """Wan Animate at ``WanAnimatePipeline``'s defaults (720 x 1280, segments of 77 frames): latents
    (1, 16 + 20, 1 + (77-1)/4+1, h/8, w/8) (the reference frame first; noise beside the reference
    and previous-segment condition latents and mask), pose latents (1, 16, 20, h/8, w/8), the
    segment's face video (1, 3, 77, 512, 512) in [-1, 1]; 512 UMT5 tokens; 257 CLIP image tokens."""
    from diffusers import WanAnimateTransformer3DModel

    model = build(WanAnimateTransformer3DModel, {**WAN_ANIMATE_14B, **(config or {})}, device)
    cfg = model.config
    lat_f, h, w = (segment_frames - 1) // 4 + 1, height // 8, width // 8
    face = face_size or cfg.motion_encoder_size
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, cfg.in_channels, lat_f + 1, h, w, generator=g, **_bf(device)),
        timestep=torch.full((1,), 500, device=device, dtype=torch.long),
        encoder_hidden_states=torch.randn(1, 512, cfg.text_dim, generator=g, **_bf(device)),
        encoder_hidden_states_image=torch.randn(1, image_len, cfg.image_dim, generator=g, **_bf(device)),
        pose_hidden_states=torch.randn(1, cfg.latent_channels, lat_f, h, w, generator=g, **_bf(device)),
        face_pixel_values=torch.rand(1, 3, segment_frames, face, face, generator=g, **_bf(device)) * 2 - 1,
        motion_encode_batch_size=None, return_dict=False,
    )
    tokens = (lat_f + 1) * (h // 2) * (w // 2)
    return model, inputs, f"{segment_frames}x{height}x{width} segment ({tokens} + 512 text + {image_len} image tokens)"


# MiniMax-H3 (transformer/config.json as public repositories quote it: 50 blocks + 2 refiner blocks of 5376,
# 56 heads x 128, Qwen3-VL 5120 text): diffusers' defaults. 33 B parameters: 66 GB in bf16.
MINIMAX_H3: dict = {}


def minimax_h3_case(build, device: torch.device, num_frames: int = 124, height: int | None = None,
                    width: int | None = None, text_len: int = 200, config: dict | None = None):
    """MiniMax-H3 text-to-video+audio at the modular pipeline's defaults (124 frames at 24 fps on its
    16:9 canvas, 768 x 1344): the packed ``[text | audio | video]`` sequence the stock layout step
    builds (``build_packed_sequence``), video rows (1, n_video, 24 x 2 x 2), stereo channel-major
    audio rows (1, n_audio, 32), ``text_len`` Qwen3-VL tokens (one prompt, unpadded), and the
    stock per-row timestep plan (text and video rows at the video timestep, audio at its own)."""
    from diffusers import MiniMaxH3Transformer3DModel
    from diffusers.modular_pipelines.minimax_h3 import modular_pipeline as mp
    from diffusers.modular_pipelines.minimax_h3.before_denoise import (
        MiniMaxH3PrepareLayoutStep,
        MiniMaxH3SetTimestepsStep,
    )

    model = build(MiniMaxH3Transformer3DModel, {**MINIMAX_H3, **(config or {})}, device)
    cfg = model.config
    patch = tuple(cfg.patch_size)
    if height is None:
        height, width = mp.resolve_canvas_size(16, 9, 16 * patch[2], 768, 768 * 1344)
    num_frames = mp.align_num_frames(num_frames, 17, 5)
    latent_frames = mp.video_latent_num_frames(num_frames, 17, 5)
    audio_latents = mp.audio_latent_num_frames(num_frames)
    position_ids, tags, video_idx, audio_idx, text_idx, _, _ = MiniMaxH3PrepareLayoutStep.build_packed_sequence(
        torch.ones(text_len, dtype=torch.long), latent_frames, height // 16, width // 16, audio_latents, patch,
        mp.MINIMAX_H3_AUDIO_CHANNELS, mp.MINIMAX_H3_AUDIO_TAG, mp.MINIMAX_H3_VIDEO_TAG)
    timestep, timestep_indices = MiniMaxH3SetTimestepsStep.build_row_timesteps(
        video_idx, audio_idx, 0, 0, text_len, 0.7, 0.8, 0.999, 1.0)
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, video_idx.numel(), cfg.in_channels * patch[1] * patch[2], generator=g,
                                  **_bf(device)),
        audio_hidden_states=torch.randn(1, audio_idx.numel(), cfg.audio_in_channels, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, text_len, cfg.text_dim, generator=g, **_bf(device)),
        timestep=timestep.to(device), timestep_indices=timestep_indices.to(device), token_tags=tags.to(device),
        position_ids=position_ids.to(device), video_indices=video_idx.to(device), audio_indices=audio_idx.to(device),
        text_indices=text_idx.to(device), return_dict=False,
    )
    return model, inputs, (f"{num_frames}x{height}x{width} ({video_idx.numel()} video + {audio_idx.numel()} audio + "
                           f"{text_len} text rows)")
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


def nucleus_moe_case(build, device: torch.device, height: int = 1024, width: int = 1024, config: dict | None = None):
    """NucleusMoE-Image: packed latents (1, (h/16)*(w/16), 64); 256 prompt tokens (Qwen3-VL: the
    default system prompt and the user's, padded), 200 real. The config is Diffusers'
    ``NucleusMoEImageTransformer2DModel`` defaults (24 layers, 16 heads x 128, expert-choice MoE in
    blocks 3-22, capacity factor 8) with 64 routed experts, the model card's count (NucleusAI/Nucleus-Image's
    transformer/config.json was not at hand offline to compare; this config counts 12.1 B parameters on the
    meta device, the card says 17 B total, so the release differs somewhere). The packed experts are ``torch.empty``
    in stock (loaded from a checkpoint): drawn here from N(0, 0.02). ``config``: overrides (a tiny
    model to check the case builds on CPU)."""
    from diffusers import NucleusMoEImageTransformer2DModel

    model = build(NucleusMoEImageTransformer2DModel, {"num_experts": 64, **(config or {})}, device)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".experts." in name:
                p.normal_(0.0, 0.02)
    cfg = model.config
    rows, cols = height // 16, width // 16
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, rows * cols, cfg.in_channels, generator=g, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 256, cfg.joint_attention_dim, generator=g, **_bf(device)),
        encoder_hidden_states_mask=_prompt_mask(device, 256, 200), timestep=torch.full((1,), 0.5, **_bf(device)),
        img_shapes=[(1, rows, cols)], return_dict=False,
    )
    return model, inputs, f"{height}x{width} ({rows * cols} + 256 tokens, 200 real)"


def omnigen_case(build, device: torch.device, height: int = 1024, width: int = 1024, config: dict | None = None):
    """OmniGen v1: latents (1, 4, h/8, w/8), 2x2 patches; a text-to-image prompt of 100 Phi-3 tokens
    (the instruction template and the prompt), the mask and positions from Diffusers' collator. The
    config is Diffusers' ``OmniGenTransformer2DModel`` defaults (32 Phi-3 layers, 3072 wide, 32 heads
    x 96; 3.76 B on the meta device, OmniGen's stated 3.8 B), with su-scaled RoPE factors of 1 (the checkpoint's
    were not at hand offline). ``config``: overrides (a tiny model to check the case builds on CPU)."""
    from diffusers import OmniGenTransformer2DModel

    from usp_dit.demo.tiny_omnigen import omnigen_inputs

    base = {"rope_scaling": {"short_factor": [1.0] * 48, "long_factor": [1.0] * 48}}
    model = build(OmniGenTransformer2DModel, {**base, **(config or {})}, device)
    rows, cols = height // 16, width // 16
    inputs = omnigen_inputs(rows, cols, (100,))
    kwargs = {k: (v.to(device) if torch.is_tensor(v) else v) for k, v in inputs.kwargs().items()}
    kwargs["hidden_states"] = kwargs["hidden_states"].to(torch.bfloat16)
    kwargs["timestep"] = kwargs["timestep"].to(torch.bfloat16)
    kwargs["return_dict"] = False
    return model, kwargs, f"{height}x{width} ({rows * cols} image + 101 prefix tokens)"


def joyimage_case(build, device: torch.device, height: int = 1024, width: int = 1024, text_len: int = 300,
                  config: dict | None = None):
    """JoyImage-Edit (Diffusers' ``JoyImageEditTransformer3DModel`` defaults: 20 double-stream blocks,
    3072 wide, 24 heads x 128, text 4096; the checkpoint's own config.json was not at hand offline):
    an edit call, latents (1, 2, 16, 1, h/8, w/8) (a reference and the target, split together),
    patch (1, 2, 2); ``text_len`` Qwen3-VL prompt tokens, no mask (the pipeline passes none).
    ``config``: overrides (a tiny model to check the case builds on CPU)."""
    from diffusers import JoyImageEditTransformer3DModel

    model = build(JoyImageEditTransformer3DModel, dict(config or {}), device)
    g = torch.Generator(device).manual_seed(0)
    channels = model.config.in_channels
    kwargs = dict(
        hidden_states=torch.randn(1, 2, channels, 1, height // 8, width // 8, generator=g, **_bf(device)),
        timestep=torch.full((1,), 500.0, device=device, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(1, text_len, model.config.text_dim, generator=g, **_bf(device)),
        return_dict=False,
    )
    tokens = 2 * (height // 16) * (width // 16)
    return model, kwargs, f"{height}x{width} edit ({tokens} image tokens, 2 items + {text_len} text)"


def anyflow_case(build, device: torch.device, frames: int = 81, height: int = 480, width: int = 832,
                 text_len: int = 512, config: dict | None = None):
    """AnyFlow-Wan2.1-T2V-14B at ``AnyFlowPipeline``'s default size (diffusers' AnyFlowTransformer3DModel
    defaults: Wan 2.1-14B's backbone with the dual-timestep embedder): latents (1, (f-1)/4+1, 16, h/8, w/8)
    (frames before channels, as the pipeline permutes them), 1x2x2 patches, 512 UMT5 tokens; one flow-map
    step t=1000 -> r=750 per latent frame."""
    from diffusers import AnyFlowTransformer3DModel

    model = build(AnyFlowTransformer3DModel, config or {}, device)
    cfg = model.config
    lat = ((frames - 1) // 4 + 1, height // 8, width // 8)
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, lat[0], cfg.in_channels, lat[1], lat[2], generator=g, **_bf(device)),
        timestep=torch.full((1, lat[0]), 1000.0, device=device), r_timestep=torch.full((1, lat[0]), 750.0, device=device),
        encoder_hidden_states=torch.randn(1, text_len, cfg.text_dim, generator=g, **_bf(device)), return_dict=False,
    )
    tokens = lat[0] * (lat[1] // 2) * (lat[2] // 2)
    return model, inputs, f"{frames}x{height}x{width} ({tokens} + {text_len} tokens)"


def joyimage_plus_case(build, device: torch.device, height: int = 1024, width: int = 1024, text_len: int = 300,
                       config: dict | None = None):
    """JoyImage-Edit-Plus (Diffusers' ``JoyImageEditPlusTransformer3DModel`` defaults: 20 double-stream
    blocks, 3072 wide, 24 heads x 128, text 4096; the checkpoint's own config.json was not at hand
    offline): an edit call with one ``height x width`` reference beside the target, as the pipeline
    packs them: flat patches (1, 2 * (h/16) * (w/16), 16, 1, 2, 2) with their ``shape_list``;
    ``text_len`` Qwen3-VL prompt tokens under an all-valid mask (the pipeline passes one).
    ``config``: overrides (a tiny model to check the case builds on CPU)."""
    from diffusers import JoyImageEditPlusTransformer3DModel

    model = build(JoyImageEditPlusTransformer3DModel, dict(config or {}), device)
    g = torch.Generator(device).manual_seed(0)
    grid = (1, height // 16, width // 16)
    tokens = 2 * grid[1] * grid[2]
    kwargs = dict(
        hidden_states=torch.randn(1, tokens, model.config.in_channels, 1, 2, 2, generator=g, **_bf(device)),
        timestep=torch.full((1,), 500.0, device=device, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(1, text_len, model.config.text_dim, generator=g, **_bf(device)),
        encoder_hidden_states_mask=torch.ones(1, text_len, device=device, dtype=torch.long),
        shape_list=[[grid, grid]],
        return_dict=False,
    )
    return model, kwargs, f"{height}x{width} edit ({tokens} image tokens, target + 1 reference + {text_len} text)"


def ideogram4_case(build, device: torch.device, height: int = 1024, width: int = 1024, max_text: int = 2048,
                   valid: int = 300, config: dict | None = None):
    """Ideogram 4, the conditional call of a step: one packed sequence ``[padding; text; image]`` as
    ``Ideogram4Pipeline`` builds it: the prompt left-padded to ``max_text`` rows (the pipeline's
    default ``max_sequence_length``, 2048), ``valid`` of them real (a structured caption of a few
    hundred Qwen3-VL tokens), then (h/16)*(w/16) image tokens (the Flux.2 VAE's 32 channels at h/8,
    patchified 2x2: 128 channels). The config is Diffusers' ``Ideogram4Transformer2DModel`` defaults
    (34 layers, 18 heads x 256, SwiGLU 12288, text features 13 x 4096), which its docstring gives
    as the released model's (ideogram-ai's transformer/config.json was not at hand offline to
    compare). ``config``: overrides (a tiny model to check the case builds on CPU)."""
    from diffusers import Ideogram4Pipeline, Ideogram4Transformer2DModel

    model = build(Ideogram4Transformer2DModel, config or {}, device)
    cfg = model.config
    grid_h, grid_w = height // 16, width // 16
    position_ids, segment_ids, indicator = Ideogram4Pipeline._prepare_ids([valid], grid_h, grid_w, max_text, device)
    length = max_text + grid_h * grid_w
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, length, cfg.in_channels, generator=g, **_bf(device)),
        timestep=torch.full((1,), 0.5, **_bf(device)),
        encoder_hidden_states=torch.randn(1, length, cfg.llm_features_dim, generator=g, **_bf(device)),
        position_ids=position_ids, segment_ids=segment_ids, indicator=indicator, return_dict=False,
    )
    return model, inputs, f"{height}x{width} ({grid_h * grid_w} image + {max_text} text rows, {valid} real)"


def prx_case(build, device: torch.device, height: int = 1024, width: int = 1024, config: dict | None = None):
    """PRX-1.2B (the Flux VAE variant): latents (1, 16, h/8, w/8), 2x2 patches; 256 T5Gemma tokens,
    100 real (the pipeline pads to the tokenizer's length and masks the rest). The config is
    Diffusers' ``PRXTransformer2DModel`` defaults (16 blocks, 28 heads x 64, T5Gemma-2B's 2304-wide
    text). ``config``: overrides (a tiny model to check the case builds on CPU)."""
    from diffusers import PRXTransformer2DModel

    model = build(PRXTransformer2DModel, dict(config or {}), device)
    cfg = model.config
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, cfg.in_channels, height // 8, width // 8, generator=g, **_bf(device)),
        timestep=torch.full((1,), 0.5, **_bf(device)),
        encoder_hidden_states=torch.randn(1, 256, cfg.context_in_dim, generator=g, **_bf(device)),
        attention_mask=_prompt_mask(device, 256, 100), return_dict=False,
    )
    tokens = (height // (8 * cfg.patch_size)) * (width // (8 * cfg.patch_size))
    return model, inputs, f"{height}x{width} ({tokens} image tokens, 256 text keys, 100 real)"


# DiT-XL/2 512 (facebook/DiT-XL-2-512, transformer/config.json): diffusers' defaults but for the
# latent size and the learned-sigma output.
DIT_XL_2_512 = dict(num_attention_heads=16, attention_head_dim=72, in_channels=4, out_channels=8, num_layers=28,
                    sample_size=64, patch_size=2)


def dit_case(build, device: torch.device, height: int = 512, width: int = 512, config: dict | None = None):
    """DiT-XL/2 512: latents (1, 4, h/8, w/8), square, 2x2 patches; a class label and a timestep
    (no text). 512 x 512 is the release's largest size (1024 tokens); the sin-cos table is rebuilt
    for another one. ``config``: overrides (a tiny model to check the case builds on CPU)."""
    from diffusers import DiTTransformer2DModel

    if height != width:
        raise ValueError(f"DiT folds its output as a square: height={height} and width={width} must be equal")
    model = build(DiTTransformer2DModel, {**DIT_XL_2_512, **(config or {})}, device)
    g = torch.Generator(device).manual_seed(0)
    inputs = dict(
        hidden_states=torch.randn(1, model.config.in_channels, height // 8, width // 8, generator=g, **_bf(device)),
        timestep=torch.full((1,), 500, device=device, dtype=torch.long),
        class_labels=torch.full((1,), 207, device=device, dtype=torch.long), return_dict=False,
    )
    tokens = (height // 16) * (width // 16)
    return model, inputs, f"{height}x{width} ({tokens} tokens, class-conditional)"


def sana_wm_case(build, device: torch.device, frames: int = 161, height: int = 704, width: int = 1280,
                 text_len: int = 300, valid: int = 120, config: dict | None = None):
    """SANA-WM 1600M bidirectional as ``SanaWMPipeline`` calls it (its defaults: 161 x 704 x 1280; diffusers'
    ``SanaWMTransformer3DModel`` defaults are the released ``Efficient-Large-Model/SANA-WM_bidirectional``
    config, its docstring says: 20 layers of 2240, GDN heads of 112, softmax every 4th block): latents
    (1, 128, (f-1)/8+1, h/32, w/32) (the LTX-2 VAE), patch 1; per-frame timesteps (1, 1, f'), frame 0
    (the image's latent frame) at 0; ``text_len`` Gemma-2 tokens, ``valid`` real (a right-padded
    mask); camera conditions (1, f', 20) (a camera moving forward, pinhole intrinsics at latent scale)
    and the Plucker rays (1, 48, f', h', w'). One call of batch 1 (the pipeline's CFG batches 2)."""
    from diffusers import SanaWMTransformer3DModel

    model = build(SanaWMTransformer3DModel, dict(config or {}), device)
    cfg = model.config
    lat = ((frames - 1) // 8 + 1, height // 32, width // 32)
    g = torch.Generator(device).manual_seed(0)
    timestep = torch.full((1, 1, lat[0]), 500.0, **_bf(device))
    timestep[:, :, 0] = 0.0
    c2w = torch.eye(4, device=device).repeat(1, lat[0], 1, 1)
    c2w[..., 2, 3] = torch.linspace(0, 1, lat[0], device=device)  # forward along +z
    intrinsics = torch.tensor([lat[2], lat[2], lat[2] / 2, lat[1] / 2], device=device).repeat(1, lat[0], 1)
    inputs = dict(
        hidden_states=torch.randn(1, cfg.in_channels, *lat, generator=g, **_bf(device)),
        timestep=timestep,
        encoder_hidden_states=torch.randn(1, 1, text_len, cfg.caption_channels, generator=g, **_bf(device)),
        mask=_prompt_mask(device, text_len, valid).long(),
        camera_conditions=torch.cat([c2w.flatten(-2), intrinsics], dim=-1).to(torch.bfloat16),
        chunk_plucker=torch.randn(1, cfg.chunk_plucker_channels, *lat, generator=g, **_bf(device)),
        return_dict=False,
    )
    tokens = lat[0] * lat[1] * lat[2]
    return model, inputs, f"{frames}x{height}x{width} ({tokens} tokens + {text_len} text, {valid} valid)"
