"""Tiny randomly initialised Kandinsky 6 transformers and pipelines, for tests and the video example.

Layout: latents channels-last (batch, frames, height, width, channels), with ``visual_cond`` the
latent, a condition latent and its mask on channels (2 * 4 + 1); audio latents (batch, audio_seq,
audio_channels); Qwen2.5-VL text embeddings (batch, text_seq, text_dim) with a padding mask
(batch, text_seq), True = real token; CLIP pooled embeddings (batch, pooled_dim); timestep (batch,);
video RoPE positions: three index vectors (frames, height / 2, width / 2); per-frame token types
(batch, frames).

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import Kandinsky6Transformer3DModel

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # width of the tiny Qwen2.5-VL (in_text_dim) and CLIP (in_text_dim2) encoders
LATENT_CHANNELS = 4  # the tiny stand-in for the real video VAE's 16
AUDIO_CHANNELS = 4  # ... and for the audio VAE's 20


def tiny_kandinsky6(
    num_heads: int = 4, head_dim: int = 16, audio_heads: int = 2, num_visual_blocks: int = 2, seed: int = 0,
) -> Kandinsky6Transformer3DModel:
    """A ``Kandinsky6Transformer3DModel`` (1 text block a stream, ``num_visual_blocks`` fused
    blocks), video ``num_heads * head_dim`` wide, audio ``audio_heads * head_dim``, float32, eval.

    The released checkpoints' switches: ``ca_rope`` (the cross-modal attentions rotate by the
    video and audio positions), ``cross_gates``, ``fix_modulation``, two token types (the
    image-to-video reference frame). RoPE axes (frame, height, width) split ``head_dim`` 1:1.5:1.5
    as the release's (32, 48, 48) of 128. Every parameter is perturbed with seeded noise
    (``tiny_video._perturb``): the modulations, zero at init, too.

    Raises:
        ValueError: ``head_dim`` is not a multiple of 8.
    """
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 (three even RoPE axes, 2:3:3), got {head_dim}")
    frame_axis, spatial_axis = head_dim // 4, head_dim * 3 // 8
    torch.manual_seed(seed)
    model = Kandinsky6Transformer3DModel(
        in_visual_dim=LATENT_CHANNELS, out_visual_dim=LATENT_CHANNELS, in_text_dim=TEXT_DIM, in_text_dim2=TEXT_DIM,
        time_dim=32, patch_size=(1, 2, 2), model_dim=num_heads * head_dim, ff_dim=96, num_text_blocks=1,
        num_visual_blocks=num_visual_blocks, axes_dims=(frame_axis, spatial_axis, spatial_axis), visual_cond=True,
        in_audio_dim=AUDIO_CHANNELS, out_audio_dim=AUDIO_CHANNELS, model_dim_a=audio_heads * head_dim, ff_dim_a=48,
        text_token_padding=True, ca_rope=True, cross_gates=True, fix_modulation=True,
        visual_token_type_num_embeddings=2,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class Kandinsky6Inputs:
    """Keyword arguments of one ``Kandinsky6Transformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, F, H, W, 2C + 1)
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    pooled_projections: torch.Tensor  # (B, pooled_dim)
    timestep: torch.Tensor  # (B,)
    audio_hidden_states: torch.Tensor | None  # (B, S_a, audio_channels)
    visual_rope_pos: tuple  # ((F,), (H/2,), (W/2,)) long
    encoder_attention_mask: torch.Tensor | None  # (B, T) bool
    visual_token_type_ids: torch.Tensor  # (B, F) long

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def kandinsky6_tokens(model: Kandinsky6Transformer3DModel, frames: int, height: int, width: int) -> int:
    """Video tokens of a latent of this size: frames/p_t * height/p_h * width/p_w."""
    p_t, p_h, p_w = model.config.patch_size
    return (frames // p_t) * (height // p_h) * (width // p_w)


def kandinsky6_inputs(
    model: Kandinsky6Transformer3DModel, frames: int, height: int, width: int, audio_len: int | None = 7,
    text_valid: tuple[int, ...] | None = (9, 5), batch: int = 2, text_len: int = 9, seed: int = 0,
) -> Kandinsky6Inputs:
    """Seeded inputs for ``model`` (latent sizes); a different prompt, timestep, token types and
    prompt mask length per batch element (``text_valid``: real tokens of each element, the rest
    padding; ``None``: no mask), random RoPE positions (any index below the tables' 128 rows), so
    that a table cut unlike the tokens cannot pass for a shifted one. ``audio_len=None``: video only."""
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, frames, height, width, 2 * cfg.in_visual_dim + 1, generator=g)
    text = torch.randn(batch, text_len, cfg.in_text_dim, generator=g)
    pooled = torch.randn(batch, cfg.in_text_dim2, generator=g)
    timestep = torch.rand(batch, generator=g) * 1000
    audio = None if audio_len is None else torch.randn(batch, audio_len, cfg.in_audio_dim, generator=g)
    p_t, p_h, p_w = cfg.patch_size
    pos = tuple(torch.randint(0, 128, (n,), generator=g) for n in (frames // p_t, height // p_h, width // p_w))
    mask = None
    if text_valid is not None:
        mask = torch.arange(text_len)[None, :] < torch.tensor(text_valid)[:, None]
    types = torch.randint(0, 2, (batch, frames // p_t), generator=g)
    return Kandinsky6Inputs(x, text, pooled, timestep, audio, pos, mask, types)


# ---- whole pipelines -----------------------------------------------------------------------------


def _tokenizer():
    """A character tokenizer (``tiny_qwen_image.tiny_qwen_tokenizer``) on which the pipeline's chat
    template puts the prompt at token 129, as the real Qwen2.5-VL tokenizer does: the pipeline
    keeps the tokens after its fixed ``_QWEN_CROP_START`` (129), and a tokenizer of one token a
    character would keep template text instead. The template's text before the prompt, less its
    last 128 tokens, is one added token (found by lengthening it until it fits)."""
    from diffusers.pipelines.kandinsky6 import pipeline_kandinsky6_ti2va as stock

    from usp_dit.demo.tiny_qwen_image import tiny_qwen_tokenizer

    prefix = stock._PROMPT_TEMPLATE.split("{}")[0]
    for cut in range(len(prefix) - stock._QWEN_CROP_START, 0, -1):
        tokenizer = tiny_qwen_tokenizer()
        tokenizer.add_tokens([prefix[:cut]], special_tokens=True)
        if len(tokenizer(prefix, add_special_tokens=False)["input_ids"]) == stock._QWEN_CROP_START:
            return tokenizer
    raise RuntimeError("no cut of the Kandinsky 6 template puts the prompt at its crop start")


def _audio_decoders(seed: int):
    """(MMAudioVAE, MMAudioVocoder), tiny: 8 mel bins, ``AUDIO_CHANNELS`` latents, 32 samples a
    latent, 900 samples a second (so that 9 frames at 24 fps make ceil(9 / 24 * 900 / 32) = 11
    audio tokens)."""
    from diffusers import MMAudioVAE, MMAudioVocoder

    torch.manual_seed(seed)
    vae = MMAudioVAE(mel_bins=8, latent_channels=AUDIO_CHANNELS, hidden_channels=8, channel_multipliers=(1, 2),
                     layers_per_block=1, sample_rate=900, n_fft=64, hop_length=16)
    vocoder = MMAudioVocoder(num_mels=8, upsample_initial_channel=16, upsample_rates=(4, 4),
                             upsample_kernel_sizes=(8, 8), resblock_kernel_sizes=(3,), resblock_dilation_sizes=((1,),))
    _perturb(vae, seed + 1, std=0.02)
    _perturb(vocoder, seed + 2, std=0.02)
    return vae.eval(), vocoder.eval()


def tiny_kandinsky6_pipeline(seed: int = 0):
    """A ``Kandinsky6TI2VAPipeline`` of tiny random models, float32: the transformer above,
    Qwen2.5-VL-like and CLIP text encoders over characters (``_tokenizer``), HunyuanVideo's VAE
    class (the release's) 8x spatial and 4x temporal, the tiny audio VAE and vocoder, FlowMatch
    Euler. ``height x width x num_frames`` gives ``((num_frames - 1) / 4 + 1) * (height / 16) *
    (width / 16)`` video tokens (48 x 80 x 9 frames -> 45) and 11 audio tokens at 9 frames."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky6TI2VAPipeline

    from usp_dit.demo.tiny_hunyuan_video import _text_encoders as hunyuan_encoders
    from usp_dit.demo.tiny_hunyuan_video import _tokenizers as hunyuan_tokenizers
    from usp_dit.demo.tiny_hunyuan_video import tiny_hunyuan_video_vae
    from usp_dit.demo.tiny_qwen_image import tiny_qwen_text_encoder

    qwen_tok = _tokenizer()
    _, clip_tok = hunyuan_tokenizers(77)
    _, clip = hunyuan_encoders(8, len(clip_tok), seed + 11)  # (its Llama is not used)
    audio_vae, vocoder = _audio_decoders(seed + 40)
    return Kandinsky6TI2VAPipeline(
        transformer=tiny_kandinsky6(seed=seed + 30), vae=tiny_hunyuan_video_vae(seed + 20),
        text_encoder=tiny_qwen_text_encoder(len(qwen_tok), seed + 10), tokenizer=qwen_tok, text_encoder_2=clip,
        tokenizer_2=clip_tok, scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0), audio_vae=audio_vae,
        vocoder=vocoder,
    )
