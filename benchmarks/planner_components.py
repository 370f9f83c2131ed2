"""The released configs of the pipelines' other modules, for the planner's memory model
(``usp_dit.planner.models`` Note [model memory]): text encoders, the modules held beside them
(image encoders, connectors, audio VAEs, vocoders, priors) and VAEs, built on the meta device.

    PYTHONPATH=. python -m benchmarks.count_planner_specs --components            # every entry
    PYTHONPATH=. python -m benchmarks.count_planner_specs --components gemma3_12b  # some

Layout: no tensors. Each entry is ``(class, config)``: the class by its import path, the config a
function building the released config in code, every number's source in the comment above it:

* "confirmed": read from the release's own config.json (or a verbatim mirror of it) in the stored
  public pages, named there;
* "recalled": the public release's config as known from its model card / config.json, not read
  again here (no network); the comment says why the figure is believed;
* "Diffusers' defaults": the class's own defaults, which Diffusers sets to the release it was
  written for (the conversion scripts' configs); "assumed" where that could not be checked.

``usp_dit/planner/models.py`` holds the counts (``ENCODERS``, ``OTHERS``, ``VAES``);
``count_planner_specs --components`` prints them and tests/test_planner_memory.py counts every
entry again from here (within 0.5 %).
"""
from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

# ---------------------------------------------------------------------------------------------
# Text encoders (the pipelines' text_encoder*)


def _qwen3_vl(text: dict, vision: dict) -> Any:
    from transformers import Qwen3VLConfig

    # Qwen3-VL's shared pieces (every size's config.json): vocab 151936, head_dim 128, patch 16,
    # temporal patch 2, spatial merge 2, 2304 learned vision positions.
    tie = text.pop("tie")
    text = dict(vocab_size=151936, head_dim=128, **text)
    vision = dict(patch_size=16, temporal_patch_size=2, spatial_merge_size=2, num_position_embeddings=2304,
                  in_channels=3, **vision)
    return Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=tie)


def qwen3_vl_8b() -> Any:
    # Qwen/Qwen3-VL-8B-Instruct, recalled (config.json): text 36 layers of 4096, 32 query / 8 K/V
    # heads, MLP 12288, untied head; vision 27 blocks of 1152 (16 heads, MLP 4304) merged to 4096,
    # deepstack layers 8, 16, 24. Believed: Qwen-Image 2.1 / JoyImage read 4096-wide states
    # (context_in_dim, text_dim) and Ideogram 4 13 x 4096 (llm_features_dim 53248); Ideogram 4's
    # release names "qwen-3-vl-8b" as its text encoder (a public model page).
    return _qwen3_vl(dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                          num_key_value_heads=8, tie=False),
                     dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=4096,
                          deepstack_visual_indexes=[8, 16, 24]))


def qwen3_vl_4b() -> Any:
    # Qwen/Qwen3-VL-4B-Instruct, recalled (config.json): text 36 layers of 2560, 32 / 8 heads, MLP
    # 9728, tied head; vision 24 blocks of 1024 (16 heads, MLP 4096) merged to 2560, deepstack 5,
    # 11, 17. Believed: FLUX.3 reads 8 stacked layers of 2560 (joint_attention_dim 20480), Krea 2
    # 2560 (text_hidden_dim), FIBO 2.0 bundles of 3 layers (cap_feat_dim 7680 = 3 x 2560).
    return _qwen3_vl(dict(hidden_size=2560, intermediate_size=9728, num_hidden_layers=36, num_attention_heads=32,
                          num_key_value_heads=8, tie=True),
                     dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560,
                          deepstack_visual_indexes=[5, 11, 17]))


def qwen3_vl_32b() -> Any:
    # Qwen/Qwen3-VL-32B-Instruct, recalled (config.json): text 64 layers of 5120, 64 / 8 heads, MLP
    # 25600, untied head; vision as the 8B's, merged to 5120. Believed: MiniMax-H3 reads 5120-wide
    # states (text_dim) and public pages name its text encoder Qwen3-VL-32B (62 GiB in bf16).
    return _qwen3_vl(dict(hidden_size=5120, intermediate_size=25600, num_hidden_layers=64, num_attention_heads=64,
                          num_key_value_heads=8, tie=False),
                     dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16, out_hidden_size=5120,
                          deepstack_visual_indexes=[8, 16, 24]))


def gemma3_12b() -> Any:
    from transformers import Gemma3Config

    # google/gemma-3-12b-it, recalled (config.json): text 48 layers of 3840, 16 query / 8 K/V heads
    # x 256, MLP 15360, vocab 262208 (tied head); SigLIP vision 27 blocks of 1152 (16 heads, MLP
    # 4304) at 896 px, patch 14; 256 image tokens. Believed: LTX-2 reads 3840-wide Gemma 3 states
    # (caption_channels 3840) and names Gemma 3 12B as its text encoder.
    return Gemma3Config(
        text_config=dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                         num_key_value_heads=8, head_dim=256, vocab_size=262208),
        vision_config=dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                           image_size=896, patch_size=14),
        mm_tokens_per_image=256)


def glm4_9b() -> Any:
    from transformers import GlmConfig

    # THUDM/CogView4-6B text_encoder (GLM-4-9B), recalled (config.json of glm-4-9b-hf): 40 layers of
    # 4096, 32 query / 2 K/V heads x 128, MLP 13696, vocab 151552, q/k/v biases. The same text model
    # as GLM-Image's prior (its text_config, confirmed below: 40 x 4096, 2 K/V heads, MLP 13696).
    return GlmConfig(hidden_size=4096, intermediate_size=13696, num_hidden_layers=40, num_attention_heads=32,
                     num_key_value_heads=2, head_dim=128, vocab_size=151552, attention_bias=True)


def _qwen3(hidden: int, layers: int, heads: int, kv: int, mlp: int, vocab: int = 151936) -> Any:
    from transformers import Qwen3Config

    return Qwen3Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
                       intermediate_size=mlp, head_dim=128, vocab_size=vocab)


def qwen3_4b() -> Any:
    # Z-Image's text encoder (Qwen3-4B), confirmed: its config.json as a public repository quotes it
    # verbatim (modelscope/DiffSynth-Studio diffsynth/models/z_image_text_encoder.py): 36 layers of
    # 2560, 32 / 8 heads x 128, MLP 9728, vocab 151936. Z-Image reads 2560-wide states (cap_feat_dim).
    return _qwen3(2560, 36, 32, 8, 9728)


def qwen3_1_7b() -> Any:
    # Ovis-Image-7B's text encoder (the Qwen3-1.7B of Ovis 2.5-2B), recalled (Qwen3-1.7B config.json):
    # 28 layers of 2048, 16 / 8 heads x 128, MLP 6144. Ovis-Image reads 2048-wide states
    # (joint_attention_dim 2048).
    return _qwen3(2048, 28, 16, 8, 6144)


def qwen3_embedding_06b() -> Any:
    # ACE-Step 1.5's text encoder (Qwen3-Embedding-0.6B), recalled (config.json): 28 layers of 1024,
    # 16 / 8 heads x 128, MLP 3072, vocab 151669. ACE-Step's condition encoder reads 1024-wide states
    # (text_hidden_dim 1024).
    return _qwen3(1024, 28, 16, 8, 3072, vocab=151669)


def ministral3_3b() -> Any:
    from transformers import Mistral3Config

    # ERNIE-Image's text encoder (Mistral3Model): the text part confirmed from a verbatim copy of the
    # release's text_encoder/config.json (a public clone of ERNIE-Image-Turbo): 26 layers of 3072,
    # 32 / 8 heads x 128, MLP 9216, no projector bias, spatial merge 2. Recalled (Ministral 3 3B's
    # config.json; the copy was cut there): vocab 131072 and the Pixtral vision tower, 24 blocks of
    # 1024 (16 heads x 64, MLP 4096) at 1540 px, patch 14.
    return Mistral3Config(
        text_config={"model_type": "mistral", "hidden_size": 3072, "intermediate_size": 9216, "num_hidden_layers": 26,
                     "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 131072},
        vision_config={"model_type": "pixtral", "hidden_size": 1024, "intermediate_size": 4096,
                       "num_hidden_layers": 24, "num_attention_heads": 16, "head_dim": 64, "image_size": 1540,
                       "patch_size": 14, "num_channels": 3},
        projector_hidden_act="gelu", spatial_merge_size=2, multimodal_projector_bias=False)


def _t5gemma(hidden: int, mlp: int, layers: int, heads: int, kv: int, head_dim: int) -> Any:
    from transformers import T5GemmaConfig

    module = dict(hidden_size=hidden, intermediate_size=mlp, num_hidden_layers=layers, num_attention_heads=heads,
                  num_key_value_heads=kv, head_dim=head_dim, vocab_size=256000)
    return T5GemmaConfig(encoder=module, decoder=module, is_encoder_decoder=False, vocab_size=256000)


def t5gemma_2b() -> Any:
    # PRX's text encoder (T5Gemma 2B-2B: Gemma 2 2B's encoder), recalled (google/t5gemma-2b-2b-ul2
    # config.json): 26 layers of 2304, 8 / 4 heads x 256, MLP 9216, vocab 256000. PRX reads
    # 2304-wide states (context_in_dim 2304).
    return _t5gemma(2304, 9216, 26, 8, 4, 256)


def t5gemma_b() -> Any:
    # Stable Audio 3's text encoder (T5Gemma, max length 256), recalled and NOT confirmed: the
    # T5Gemma "b-b" encoder, 12 layers of 768, 12 heads x 64, MLP 2048, vocab 256000. Believed only
    # because SA3 reads 768-wide states (cond_token_dim 768) and b-b is the T5Gemma of that width.
    return _t5gemma(768, 2048, 12, 12, 12, 64)


def _t5(d_model: int, d_ff: int, layers: int, heads: int, vocab: int, ff: str, umt5: bool = False) -> Any:
    from transformers import T5Config, UMT5Config

    cls = UMT5Config if umt5 else T5Config
    return cls(d_model=d_model, d_ff=d_ff, num_layers=layers, num_heads=heads, d_kv=64, vocab_size=vocab,
               feed_forward_proj=ff, tie_word_embeddings=False)


def pile_t5_xl() -> Any:
    # AuraFlow's text encoder (EleutherAI Pile-T5-XL, as fal/AuraFlow's text_encoder), recalled
    # (config.json): UMT5, 24 layers of 2048, 32 heads x 64, MLP 5120 gated-silu, vocab 32128.
    # AuraFlow projects 2048-wide states (joint_attention_dim 2048).
    return _t5(2048, 5120, 24, 32, 32128, "gated-silu", umt5=True)


def mt5_xl() -> Any:
    # HunyuanDiT's second text encoder (mT5-XL, t2i/mt5), recalled (config.json): 24 layers of 2048,
    # 32 heads x 64, MLP 5120 gated-gelu, vocab 250112. HunyuanDiT reads 2048-wide states
    # (cross_attention_dim_t5 2048).
    return _t5(2048, 5120, 24, 32, 250112, "gated-gelu")


def t5_base() -> Any:
    # Stable Audio Open 1.0's text encoder (t5-base), recalled (google-t5/t5-base config.json): 12
    # layers of 768, 12 heads x 64, MLP 3072 relu, vocab 32128. SAO reads 768-wide states.
    return _t5(768, 3072, 12, 12, 32128, "relu")


def umt5_base() -> Any:
    # LongCat-AudioDiT's text encoder (umT5-base), recalled (google/umt5-base config.json): 12
    # layers of 768, 12 heads x 64, MLP 2048 gated-gelu, vocab 256384. It reads 768-wide states
    # (dit_text_dim 768).
    return _t5(768, 2048, 12, 12, 256384, "gated-gelu", umt5=True)


def hunyuan_bert() -> Any:
    from transformers import BertConfig

    # HunyuanDiT's first text encoder (its bilingual CLIP text tower, a BERT-large), recalled
    # (t2i/clip_text_encoder config.json): 24 layers of 1024, 16 heads, MLP 4096, vocab 47020, 512
    # positions, 2 token types. HunyuanDiT reads 1024-wide states (cross_attention_dim 1024).
    return BertConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096,
                      vocab_size=47020, max_position_embeddings=512, type_vocab_size=2)


def gemma_2b() -> Any:
    from transformers import GemmaConfig

    # Lumina-Next-SFT's text encoder (google/gemma-2b), recalled (config.json): 18 layers of 2048, 8
    # query / 1 K/V heads x 256, MLP 16384, vocab 256000. Lumina-Next reads 2048-wide states
    # (cross_attention_dim 2048).
    return GemmaConfig(hidden_size=2048, num_hidden_layers=18, num_attention_heads=8, num_key_value_heads=1,
                       head_dim=256, intermediate_size=16384, vocab_size=256000)


ENCODERS: dict[str, tuple[str, Callable[[], Any]]] = {
    "gemma3_12b": ("transformers.Gemma3ForConditionalGeneration", gemma3_12b),
    "qwen3_vl_8b": ("transformers.Qwen3VLForConditionalGeneration", qwen3_vl_8b),
    "qwen3_vl_8b_model": ("transformers.Qwen3VLModel", qwen3_vl_8b),
    "qwen3_vl_4b": ("transformers.Qwen3VLForConditionalGeneration", qwen3_vl_4b),
    "qwen3_vl_4b_model": ("transformers.Qwen3VLModel", qwen3_vl_4b),
    "qwen3_vl_32b": ("transformers.Qwen3VLForConditionalGeneration", qwen3_vl_32b),
    "glm4_9b": ("transformers.GlmModel", glm4_9b),
    "qwen3_4b": ("transformers.Qwen3Model", qwen3_4b),
    "qwen3_1_7b": ("transformers.Qwen3Model", qwen3_1_7b),
    "qwen3_embedding_06b": ("transformers.Qwen3Model", qwen3_embedding_06b),
    "ministral3_3b": ("transformers.Mistral3Model", ministral3_3b),
    "t5gemma_2b": ("transformers.models.t5gemma.modeling_t5gemma.T5GemmaEncoder", t5gemma_2b),
    "t5gemma_b": ("transformers.T5GemmaEncoderModel", t5gemma_b),
    "pile_t5_xl": ("transformers.UMT5EncoderModel", pile_t5_xl),
    "mt5_xl": ("transformers.T5EncoderModel", mt5_xl),
    "t5_base": ("transformers.T5EncoderModel", t5_base),
    "umt5_base": ("transformers.UMT5EncoderModel", umt5_base),
    "hunyuan_bert": ("transformers.BertModel", hunyuan_bert),
    "gemma_2b": ("transformers.GemmaModel", gemma_2b),
}

# ---------------------------------------------------------------------------------------------
# Other modules held whole on every rank (Note [model memory]: ``ModelMemory.others``)


def clip_vit_h() -> Any:
    from transformers import CLIPVisionConfig

    # Wan 2.1 I2V's image_encoder (open-clip ViT-H/14, as Wan-AI/Wan2.1-I2V-14B-480P-Diffusers ships
    # it), recalled (config.json): 32 layers of 1280, 16 heads, MLP 5120, 224 px, patch 14. Wan's
    # image tokens are 257 x 1280 (image_dim 1280). Wan 2.2 Animate and ChronoEdit take the same.
    return CLIPVisionConfig(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=16,
                            image_size=224, patch_size=14, projection_dim=1024)


def glm_image_prior() -> Any:
    from transformers import GlmImageConfig

    # zai-org/GLM-Image vision_language_encoder/config.json, confirmed (the stored hub page): text 40
    # layers of 4096, 32 / 2 heads, MLP 13696, vocab 168064 (+16512 vision); vision 40 blocks of 1536
    # (16 heads, MLP 6144), patch 16; VQ embed 2048. transformers' GlmImageConfig defaults are those
    # figures (checked field by field); the VQ part, cut off on the page, is taken from them.
    return GlmImageConfig()


def qwen3_8b_music() -> Any:
    from transformers import Qwen3Config

    # MiniMax Music 3's language model (Qwen3ForCausalLM), confirmed from a public issue that read
    # the release's language_model/config.json (mudler/vllm.cpp#672): 36 layers of 4096, 32 / 8
    # heads x 128, MLP 12288, vocab 200000, ~8.6 B (an untied head: 8.6 B only with one).
    return Qwen3Config(hidden_size=4096, num_hidden_layers=36, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, intermediate_size=12288, vocab_size=200000, tie_word_embeddings=False)


def _diffusers_defaults() -> dict:
    return {}


OTHERS: dict[str, tuple[str, Callable[[], Any]]] = {
    "clip_vit_h_image": ("transformers.CLIPVisionModel", clip_vit_h),
    "glm_image_prior": ("transformers.GlmImageForConditionalGeneration", glm_image_prior),
    "music3_language_model": ("transformers.Qwen3ForCausalLM", qwen3_8b_music),
    # Diffusers' defaults (the classes were written for these releases; their configs not read here):
    "ltx2_connectors": ("diffusers.pipelines.ltx2.connectors.LTX2TextConnectors", _diffusers_defaults),
    "ltx2_audio_vae": ("diffusers.AutoencoderKLLTX2Audio", _diffusers_defaults),
    "ltx2_vocoder": ("diffusers.pipelines.ltx2.vocoder.LTX2Vocoder", _diffusers_defaults),
    "minimax_h3_audio_vae": ("diffusers.AutoencoderKLMiniMaxH3Audio", _diffusers_defaults),
    "cosmos3_sound": ("diffusers.Cosmos3AVAEAudioTokenizer", _diffusers_defaults),
    "kandinsky6_audio_vae": ("diffusers.MMAudioVAE", _diffusers_defaults),
    "kandinsky6_vocoder": ("diffusers.MMAudioVocoder", _diffusers_defaults),
    "sa3_duration": ("diffusers.pipelines.stable_audio_3.modeling_stable_audio_3.StableAudio3DurationEmbedder",
                     _diffusers_defaults),
    "ace_step_condition": ("diffusers.pipelines.ace_step.modeling_ace_step.AceStepConditionEncoder",
                           _diffusers_defaults),
    # MiniMax Music 3's depth decoder (0.646 B) and condition encoder (0.025 B): the class defaults
    # give exactly the parameter counts the public issue above read from the release's headers.
    "music3_rvq_depth_decoder": ("diffusers.MiniMaxMusic3RVQDepthDecoder", _diffusers_defaults),
    "music3_condition_encoder": ("diffusers.MiniMaxMusic3ConditionEncoder", _diffusers_defaults),
    # Stable Audio Open 1.0's projection_model/config.json, recalled: 768 -> 768, seconds in [0, 512].
    "stable_audio_projection": ("diffusers.pipelines.stable_audio.modeling_stable_audio.StableAudioProjectionModel",
                                lambda: dict(text_encoder_dim=768, conditioning_dim=768, min_value=0, max_value=512)),
}

# ---------------------------------------------------------------------------------------------
# VAEs (``VAEDecode``): the class's config; the decode's memory is in the planner (measured or
# estimated: its ``source``), and benchmarks/bench_vae.py --vae KEY measures it on a GPU.

# Flux.1's AutoencoderKL (16 latent channels); benchmarks/bench_vae.py's FLUX_VAE is the same.
_KL_2D = dict(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 4,
              up_block_types=("UpDecoderBlock2D",) * 4, norm_num_groups=32)

VAE_CONFIGS: dict[str, tuple[str, Callable[[], dict]]] = {
    # The SD / SDXL VAE (4 latent channels, 128-512, quant convs), confirmed: HunyuanDiT's
    # t2i/sdxl-vae-fp16-fix/config.json (the stored hub page); PixArt-Sigma, AuraFlow, Lumina-Next
    # and DiT (sd-vae-ft-ema) take VAEs of this same architecture (their scaling factors differ).
    "sd": ("diffusers.AutoencoderKL", lambda: dict(_KL_2D, latent_channels=4, block_out_channels=(128, 256, 512, 512),
                                                    layers_per_block=2, sample_size=1024)),
    # CogView4-6B's vae/config.json, recalled (CogView3-Plus's VAE): 16 latent channels, 128-512-1024-
    # 1024, 3 layers a block, no quant convs. GLM-Image's VAE assumed the same (the same team's
    # 16-channel VAE; its config was not found).
    "cogview4": ("diffusers.AutoencoderKL", lambda: dict(_KL_2D, latent_channels=16,
                                                          block_out_channels=(128, 512, 1024, 1024), layers_per_block=3,
                                                          use_quant_conv=False, use_post_quant_conv=False)),
    # hunyuanvideo-community/HunyuanImage-2.1-Diffusers vae/config.json, confirmed (a verbatim
    # mirror's, the stored hub page): 64 latent channels, 128-...-1024, 32x.
    "hunyuan_image": ("diffusers.AutoencoderKLHunyuanImage", lambda: dict(
        in_channels=3, out_channels=3, latent_channels=64, block_out_channels=(128, 256, 512, 512, 1024, 1024),
        layers_per_block=2, spatial_compression_ratio=32, sample_size=384, scaling_factor=0.75289)),
    # Sana 1600M's DC-AE (mit-han-lab/dc-ae-f32c32-sana-1.0-diffusers), recalled (config.json as
    # diffusers' convert_dcae_to_diffusers.py writes it): ResBlocks then EfficientViT blocks,
    # 128-...-1024, interpolate / conv resampling, batch-norm + relu in the first three decoder stages.
    "sana": ("diffusers.AutoencoderDC", lambda: dict(
        encoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
        decoder_block_types=("ResBlock",) * 3 + ("EfficientViTBlock",) * 3,
        upsample_block_type="interpolate", downsample_block_type="Conv",
        decoder_norm_types=("batch_norm",) * 3 + ("rms_norm",) * 3, decoder_act_fns=("relu",) * 3 + ("silu",) * 3,
        scaling_factor=0.41407)),
    # The Wan 2.2 VAE (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json), recalled: 48 latent
    # channels, encoder 160 / decoder 256 base width, residual, 2x2 patches (12 channels), 16x.
    "wan22": ("diffusers.AutoencoderKLWan", lambda: dict(
        base_dim=160, decoder_base_dim=256, z_dim=48, is_residual=True, in_channels=12, out_channels=12,
        patch_size=2, scale_factor_spatial=16, latents_mean=[0.0] * 48, latents_std=[1.0] * 48)),
    # Diffusers' defaults (assumed the releases': LTX-2's from the same conversion script as its
    # transformer, the rest written for their one release):
    "ltx2": ("diffusers.AutoencoderKLLTX2Video", _diffusers_defaults),
    "qwen_image21": ("diffusers.AutoencoderKLQwenImage21", _diffusers_defaults),
    "minimax_h3": ("diffusers.AutoencoderKLMiniMaxH3", _diffusers_defaults),
    "same": ("diffusers.AutoencoderSAME", _diffusers_defaults),
    "longcat_audio": ("diffusers.LongCatAudioDiTVae", _diffusers_defaults),
    "music3_vocoder": ("diffusers.MiniMaxMusic3Vocoder", _diffusers_defaults),
    # stabilityai/stable-audio-open-1.0 vae/config.json, confirmed (a verbatim mirror's, the stored
    # hub page): Diffusers' defaults, 44.1 kHz, 2048x.
    "oobleck": ("diffusers.AutoencoderOobleck", _diffusers_defaults),
    # ACE-Step 1.5's VAE, recalled: Oobleck at 48 kHz, 1920x (2 x 4 x 4 x 6 x 10: the adapter's 25
    # latent frames a second), Stable Audio's widths.
    "oobleck_48k": ("diffusers.AutoencoderOobleck", lambda: dict(downsampling_ratios=[2, 4, 4, 6, 10],
                                                                  sampling_rate=48000)),
}


def component_class(path: str) -> type:
    """The class at ``path`` (``"package.Class"`` or ``"package.module.Class"``)."""
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _build(path: str, config: Any) -> torch.nn.Module:
    cls = component_class(path)
    with torch.device("meta"):
        if isinstance(config, dict):
            return cls(**config)
        if path.endswith("T5GemmaEncoder"):
            return cls(config.encoder)  # the encoder stack itself takes the module config
        return cls(config)


def meta_component(table: str, key: str) -> torch.nn.Module:
    """The released module ``key`` of ``table`` ("encoders", "others" or "vaes") on the meta
    device, as ``from_pretrained(torch_dtype=torch.bfloat16)`` loads it: bf16, a Diffusers class's
    ``_keep_in_fp32_modules`` float32 (transformers keeps float32 modules only for float16 loads)."""
    path, config = {"encoders": ENCODERS, "others": OTHERS, "vaes": VAE_CONFIGS}[table][key]
    return as_loaded(_build(path, config()), path.startswith("diffusers"))


def as_loaded(model: torch.nn.Module, diffusers_class: bool) -> torch.nn.Module:
    """``model`` in bf16, a Diffusers class's ``_keep_in_fp32_modules`` float32 (as loaded)."""
    keep = getattr(model, "_keep_in_fp32_modules", None) if diffusers_class else None
    model.to(torch.bfloat16)
    for name, param in model.named_parameters():
        if any(part in (keep or ()) for part in name.split(".")):
            param.data = param.data.float()
    return model
