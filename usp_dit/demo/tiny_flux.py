"""A tiny randomly initialised Flux transformer and ``FluxPipeline``, built in code for tests and examples.

Layout: packed latents (batch, tokens, 4 * latent_channels), ``tokens = (height / (2 * vae_scale)) *
(width / (2 * vae_scale))``; text embeddings (batch, text_len, text_dim); pooled (batch, text_dim).

Nothing is downloaded: the CLIP and T5 tokenizers get a vocabulary of single characters written
here, the text encoders, VAE and transformer are built from small configs and seeded. Every process
that calls a builder with the same arguments gets bit-identical weights.
"""
from __future__ import annotations

import string

import torch
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel

TEXT_DIM = 32  # width of both tiny text encoders (CLIP pooled and T5 per-token)
LATENT_CHANNELS = 4
_CHARS = string.ascii_lowercase + string.digits + string.punctuation


def perturb_parameters(model: torch.nn.Module, seed: int, std: float = 0.1) -> None:
    """Add seeded noise to every parameter so that no weight keeps a default constant (norm ones,
    zero biases) that could hide a token placed on the wrong rank."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)


def tiny_flux_transformer(
    num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, num_single_layers: int = 2,
    guidance_embeds: bool = True, seed: int = 0,
) -> FluxTransformer2DModel:
    """A small ``FluxTransformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    ``guidance_embeds=True`` is the dev variant, ``False`` schnell. Inputs: hidden_states
    (B, N, 16), encoder_hidden_states (B, T, 32), pooled_projections (B, 32).
    """
    if head_dim % 16:
        raise ValueError(f"head_dim must be a multiple of 16 (three even RoPE axes, 1:3:3 like Flux), got {head_dim}")
    rope = (head_dim // 4, head_dim * 3 // 8, head_dim * 3 // 8)  # Flux.1: (16, 56, 56) of 128
    torch.manual_seed(seed)
    model = FluxTransformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=head_dim, num_attention_heads=num_heads, joint_attention_dim=TEXT_DIM,
        pooled_projection_dim=TEXT_DIM, guidance_embeds=guidance_embeds, axes_dims_rope=rope,
    )
    perturb_parameters(model, seed + 1)
    return model.eval()


def flux_inputs(batch: int, height: int, width: int, text_len: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Random transformer inputs for a ``height x width`` grid of packed latent tokens.

    Image ids are the pipeline's (0, row, col); text ids are zeros, as FluxPipeline makes them.
    """
    g = torch.Generator().manual_seed(seed)
    num_image = height * width
    rows, cols = torch.meshgrid(torch.arange(height), torch.arange(width), indexing="ij")
    img_ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(num_image, 3).float()
    return {
        "hidden_states": torch.randn(batch, num_image, 4 * LATENT_CHANNELS, generator=g),
        "encoder_hidden_states": torch.randn(batch, text_len, TEXT_DIM, generator=g),
        "pooled_projections": torch.randn(batch, TEXT_DIM, generator=g),
        "timestep": torch.rand(batch, generator=g),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(text_len, 3),
    }


def _tokenizers(max_length: int):
    """CLIP (BPE) and T5 (unigram) tokenizers over single characters, built without any file."""
    from transformers import CLIPTokenizer, T5TokenizerFast

    clip_vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for c in _CHARS:
        clip_vocab.setdefault(c, len(clip_vocab))
        clip_vocab.setdefault(c + "</w>", len(clip_vocab))
    clip = CLIPTokenizer(vocab=clip_vocab, merges=[], model_max_length=max_length)
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)] + [(c, -2.0) for c in _CHARS]
    t5 = T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=max_length)
    return clip, t5


def _text_encoders(clip_vocab: int, t5_vocab: int, max_length: int, seed: int):
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    torch.manual_seed(seed)
    clip = CLIPTextModel(CLIPTextConfig(
        vocab_size=clip_vocab, hidden_size=TEXT_DIM, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, max_position_embeddings=max_length, projection_dim=TEXT_DIM,
        bos_token_id=0, eos_token_id=1, pad_token_id=1,
    ))
    t5 = T5EncoderModel(T5Config(
        vocab_size=t5_vocab, d_model=TEXT_DIM, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
        pad_token_id=0, eos_token_id=1,
    ))
    return clip.eval(), t5.eval()


def tiny_vae(num_blocks: int = 2, seed: int = 0) -> AutoencoderKL:
    """An ``AutoencoderKL`` with ``num_blocks`` levels: one latent pixel per ``2 ** (num_blocks - 1)`` pixels."""
    torch.manual_seed(seed)
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * num_blocks, up_block_types=("UpDecoderBlock2D",) * num_blocks,
        block_out_channels=(8,) + (16,) * (num_blocks - 1), norm_num_groups=4, sample_size=32,
        scaling_factor=1.0, shift_factor=0.0,
    )
    return vae.eval()


def tiny_flux_pipeline(
    vae_blocks: int = 2, num_heads: int = 4, head_dim: int = 16, max_text_len: int = 16, seed: int = 0,
) -> FluxPipeline:
    """A complete ``FluxPipeline`` (dev: guidance embedding) of tiny random models, float32 on CPU.

    Image sizes must be multiples of ``2 ** vae_blocks``; the transformer then sees
    ``(height / 2 ** vae_blocks) * (width / 2 ** vae_blocks)`` image tokens. Call it with
    ``max_sequence_length <= max_text_len``.
    """
    clip_tok, t5_tok = _tokenizers(max_text_len)
    clip, t5 = _text_encoders(len(clip_tok), len(t5_tok), max_text_len, seed + 10)
    scheduler = FlowMatchEulerDiscreteScheduler(
        shift=3.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=1.15,
        base_image_seq_len=16, max_image_seq_len=4096,
    )
    return FluxPipeline(
        scheduler=scheduler, vae=tiny_vae(vae_blocks, seed + 20), text_encoder=clip, tokenizer=clip_tok,
        text_encoder_2=t5, tokenizer_2=t5_tok,
        transformer=tiny_flux_transformer(num_heads, head_dim, seed=seed + 30),
    )
