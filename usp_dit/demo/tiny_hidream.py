"""Tiny randomly initialised HiDream-I1 transformers and a ``HiDreamImagePipeline``, built in code for tests and examples.

Layout: latents (batch, channels, height, width), patch 2: ``(height / 2) * (width / 2)`` image
tokens, row-major. A square latent is patchified as it is; a non-square one is padded to the
model's ``max_seq`` tokens with a (batch, max_seq) token mask (HiDream's own ``patchify``). Text
inputs as the pipeline makes them: T5 (batch, t5_len, t5_dim); Llama 3.1's hidden states stacked
(llama_layers, batch, llama_len, llama_dim) (**the batch on dim 1**); pooled CLIP-L + CLIP-G
(batch, 2 * clip_dim); timesteps (batch,) in [0, 1000].

Nothing is downloaded: tokenizers over single characters, four text encoders (two CLIPs with
projection, T5, a Llama), VAE and transformer from small configs, seeded. Every process that calls
a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import HiDreamImageTransformer2DModel

from usp_dit.demo.tiny_video import _perturb

T5_DIM = 32  # caption_channels[0] (HiDream-I1: T5-XXL's 4096)
LLAMA_DIM = 24  # caption_channels[1] (Llama 3.1 8B's 4096)
CLIP_DIM = 16  # each CLIP's projection; text_emb_dim = 2 * CLIP_DIM (HiDream-I1: 768 + 1280 = 2048)
LLAMA_LAYERS = 3  # the tiny Llama's layers: its hidden states 1..3 are the transformer's llama inputs
LATENT_CHANNELS = 4  # the tiny stand-in for the real VAE's 16
MAX_RESOLUTION = (13, 12)  # latent pixels; max_seq = 13 * 12 / 4 = 39 tokens (a non-square latent is padded to it)
# The tiny pipeline's default_sample_size (latent pixels a side): it rescales every image to this area,
# 20 x 20 pixels (the real one: 128, 1024 x 1024 pixels), so 25 tokens when square.
TINY_SAMPLE_SIZE = 10


def tiny_hidream(
    num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, num_single_layers: int = 2,
    num_routed_experts: int = 4, seed: int = 0,
) -> HiDreamImageTransformer2DModel:
    """A small ``HiDreamImageTransformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode.

    HiDream-I1's structure: double-stream then single-stream blocks, an MoE feed-forward of
    ``num_routed_experts`` experts (2 active) beside a shared expert (0: a dense SwiGLU), RoPE over
    three axes (0, row, col) splitting ``head_dim`` 2:1:1 as its (64, 32, 32) of 128, and one Llama
    layer per block (``llama_layers``: layers 0, 1, 2, 0 of the tiny Llama's 3 for 2 + 2 blocks).
    Every parameter is perturbed (``tiny_video._perturb``).

    Raises:
        ValueError: ``head_dim`` is not a multiple of 8.
    """
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 (three even RoPE axes, 2:1:1), got {head_dim}")
    torch.manual_seed(seed)
    blocks = num_layers + num_single_layers
    model = HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=LATENT_CHANNELS, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=head_dim, num_attention_heads=num_heads, caption_channels=[T5_DIM, LLAMA_DIM],
        text_emb_dim=2 * CLIP_DIM, num_routed_experts=num_routed_experts, num_activated_experts=2,
        axes_dims_rope=(head_dim // 2, head_dim // 4, head_dim // 4), max_resolution=MAX_RESOLUTION,
        llama_layers=[i % LLAMA_LAYERS for i in range(blocks)],
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class HiDreamInputs:
    """Keyword arguments of one ``HiDreamImageTransformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, C, H, W)
    timesteps: torch.Tensor  # (B,)
    encoder_hidden_states_t5: torch.Tensor  # (B, T5, t5_dim)
    encoder_hidden_states_llama3: torch.Tensor  # (llama_layers, B, L, llama_dim)
    pooled_embeds: torch.Tensor  # (B, 2 * clip_dim)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def hidream_tokens(model: HiDreamImageTransformer2DModel, height: int, width: int) -> int:
    """The image tokens the blocks see for a ``height x width`` latent: ``(h / 2) * (w / 2)`` when
    square, else the model's ``max_seq`` (HiDream pads a non-square latent's tokens to it)."""
    return (height // 2) * (width // 2) if height == width else model.max_seq


def hidream_inputs(
    model: HiDreamImageTransformer2DModel, height: int, width: int, batch: int = 2, t5_len: int = 5,
    llama_len: int = 3, seed: int = 0,
) -> HiDreamInputs:
    """Seeded inputs for a ``height x width`` latent; a different prompt (every text input) and
    timestep per element."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, LATENT_CHANNELS, height, width, generator=g)
    timesteps = torch.rand(batch, generator=g) * 1000
    t5 = torch.randn(batch, t5_len, T5_DIM, generator=g)
    llama = torch.randn(LLAMA_LAYERS, batch, llama_len, LLAMA_DIM, generator=g)
    pooled = torch.randn(batch, 2 * CLIP_DIM, generator=g)
    return HiDreamInputs(x, timesteps, t5, llama, pooled)


# ---- the whole pipeline ---------------------------------------------------------------------------


def _llama(vocab: int, seed: int):
    """A ``LlamaForCausalLM`` of ``LLAMA_LAYERS`` layers, ``LLAMA_DIM`` wide (the pipeline reads
    every hidden state after the embedding)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    llama = LlamaForCausalLM(LlamaConfig(
        vocab_size=vocab, hidden_size=LLAMA_DIM, intermediate_size=48, num_hidden_layers=LLAMA_LAYERS,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=3,
        bos_token_id=1, eos_token_id=2,
    ))
    _perturb(llama, seed + 1, std=0.02)
    return llama.eval()


def tiny_hidream_pipeline(max_text_len: int = 16, seed: int = 0):
    """A ``HiDreamImagePipeline`` of tiny random models, float32: CLIP-L and CLIP-G stand-ins (with
    projection: the pooled embedding), T5, a Llama (its hidden states, one per block), the 2x VAE
    (``tiny_flux.tiny_vae``) and ``tiny_hidream``. Tokenizers over single characters.

    The pipeline rescales every image to the area of ``default_sample_size`` latent pixels a side
    (keeping the aspect ratio, sides multiples of 4 pixels); here ``TINY_SAMPLE_SIZE``: 20 x 20
    pixels, 5 x 5 = 25 image tokens when square; a non-square image (e.g. 20 x 28 -> 16 x 20) is
    padded by the transformer to ``max_seq`` = 39 tokens. Call it with ``max_sequence_length <=
    max_text_len``: T5 and the Llama give that many tokens each (padded), and the transformer sees
    T5 + 2 x Llama text tokens.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, HiDreamImagePipeline

    from usp_dit.demo.tiny_flux import _tokenizers, tiny_vae
    from usp_dit.demo.tiny_hunyuan_video import _tokenizers as _llama_tokenizers
    from usp_dit.demo.tiny_sd3 import _clip_with_projection, _t5

    clip_tok, t5_tok = _tokenizers(max_text_len)
    clip_tok_2, _ = _tokenizers(max_text_len)
    llama_tok, _ = _llama_tokenizers(max_text_len)
    pipe = HiDreamImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=tiny_vae(2, seed + 20),
        text_encoder=_clip_with_projection(len(clip_tok), max_text_len, seed + 10), tokenizer=clip_tok,
        text_encoder_2=_clip_with_projection(len(clip_tok_2), max_text_len, seed + 12), tokenizer_2=clip_tok_2,
        text_encoder_3=_t5(len(t5_tok), seed + 14), tokenizer_3=t5_tok,
        text_encoder_4=_llama(len(llama_tok), seed + 16), tokenizer_4=llama_tok,
        transformer=tiny_hidream(seed=seed + 30),
    )
    pipe.default_sample_size = TINY_SAMPLE_SIZE
    return pipe
