"""Tiny randomly initialised Kandinsky 5 transformers and pipelines, for tests and the video example.

Layout: latents channels-last (batch, frames, height, width, channels) (an image: frames 1);
Qwen2.5-VL text embeddings (batch, text_seq, text_dim), no mask; CLIP pooled embeddings
(batch, pooled_dim); timestep (batch,); RoPE positions: three index vectors (frames,
height / 2, width / 2) for the video, one (text_seq,) for the text.

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import Kandinsky5Transformer3DModel

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 32  # width of the tiny Qwen2.5-VL (in_text_dim) and CLIP (in_text_dim2) encoders
LATENT_CHANNELS = 4  # the tiny stand-in for the real VAEs' 16

# Variants of the family, each a tiny version of a released checkpoint's config.
KANDINSKY5_VARIANTS = {
    # Kandinsky 5.0 T2V Lite 5 s, T2I: the latent alone.
    "t2v": dict(visual_cond=False),
    # Kandinsky 5.0 I2V / I2I (and the T2V Lite checkpoints' visual_cond): latent, condition latent
    # and its mask concatenated on channels (2 * 4 + 1 in).
    "i2v": dict(visual_cond=True),
}


def tiny_kandinsky5(
    variant: str = "t2v", num_heads: int = 4, head_dim: int = 16, num_visual_blocks: int = 2, seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Kandinsky5Transformer3DModel:
    """A ``Kandinsky5Transformer3DModel`` (2 text blocks, ``num_visual_blocks`` visual blocks,
    ``num_heads * head_dim`` wide), float32, eval mode, dense attention ("regular").

    RoPE axes (frame, height, width) split ``head_dim`` 1:1.5:1.5 as the release's (16, 24, 24) of
    64 (each even). Every parameter is perturbed with seeded noise (``tiny_video._perturb``): the
    modulations, zero at init, too.

    ``dtype=torch.float64``: every parameter float64 except where the stock code casts its input
    to float32 (the time embedding's sinusoids, the Q/K RMS norms), which stay float32 as the
    stock maths requires. Why float64 at all: Note [Kandinsky 5's bfloat16 RoPE].

    Note [Kandinsky 5's bfloat16 RoPE]
        The stock processor's ``apply_rotary`` returns ``x_out.to(torch.bfloat16)``, cast back to
        Q's dtype: in a float32 model every rotated Q/K value is rounded to bfloat16, and in
        backward every gradient through it too. A float32 GEMM's last bit depends on its shape
        (a shard's rows, a batch of one), and a last-bit change that crosses a bfloat16 rounding
        boundary moves that value by 2^-8. So the float32 stock model does not reproduce itself:
        the same inputs at batch 1 instead of 2 move its output by 6e-5 and its gradients by
        ~5e-3. In float64 the GEMMs' shape-dependent noise (1e-16) never crosses a bfloat16 or
        float32 boundary, and the sharded model must match one process to float64 rounding.

    Raises:
        ValueError: ``variant`` is not one of ``KANDINSKY5_VARIANTS``, or ``head_dim`` is not a multiple of 8.
    """
    if variant not in KANDINSKY5_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(KANDINSKY5_VARIANTS)}, got {variant!r}")
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 (three even RoPE axes, 2:3:3), got {head_dim}")
    frame_axis, spatial_axis = head_dim // 4, head_dim * 3 // 8
    torch.manual_seed(seed)
    model = Kandinsky5Transformer3DModel(
        in_visual_dim=LATENT_CHANNELS, in_text_dim=TEXT_DIM, in_text_dim2=TEXT_DIM, time_dim=32,
        out_visual_dim=LATENT_CHANNELS, patch_size=(1, 2, 2), model_dim=num_heads * head_dim, ff_dim=96,
        num_text_blocks=2, num_visual_blocks=num_visual_blocks, axes_dims=(frame_axis, spatial_axis, spatial_axis),
        **KANDINSKY5_VARIANTS[variant],
    )
    _perturb(model, seed + 1)
    if dtype == torch.float64:
        model.double()
        model.time_embeddings.float()  # its forward casts the timestep's sinusoids to float32
        for name, module in model.named_modules():
            if name.endswith(("query_norm", "key_norm")):  # called on Q.float() / K.float()
                module.float()
    elif dtype != torch.float32:
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    return model.eval()


@dataclass
class Kandinsky5Inputs:
    """Keyword arguments of one ``Kandinsky5Transformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, F, H, W, C)
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    timestep: torch.Tensor  # (B,)
    pooled_projections: torch.Tensor  # (B, pooled_dim)
    visual_rope_pos: list  # [(F,), (H/2,), (W/2,)] long
    text_rope_pos: torch.Tensor  # (T,) long
    scale_factor: tuple = (1.0, 2.0, 2.0)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def kandinsky5_tokens(model: Kandinsky5Transformer3DModel, frames: int, height: int, width: int) -> int:
    """Video tokens of a latent of this size: frames/p_t * height/p_h * width/p_w."""
    p_t, p_h, p_w = model.config.patch_size
    return (frames // p_t) * (height // p_h) * (width // p_w)


def kandinsky5_inputs(
    model: Kandinsky5Transformer3DModel, frames: int, height: int, width: int, batch: int = 2, text_len: int = 9,
    seed: int = 0,
) -> Kandinsky5Inputs:
    """Seeded inputs for ``model`` (latent sizes, the model's dtype); a different prompt and timestep
    per batch element and random RoPE positions (any index below the tables' 128 / 1024 rows), so that a table cut
    unlike the tokens cannot pass for a shifted one."""
    cfg = model.config
    dtype = model.visual_embeddings.in_layer.weight.dtype
    g = torch.Generator().manual_seed(seed)
    channels = 2 * cfg.in_visual_dim + 1 if cfg.visual_cond else cfg.in_visual_dim
    x = torch.randn(batch, frames, height, width, channels, generator=g, dtype=dtype)
    text = torch.randn(batch, text_len, cfg.in_text_dim, generator=g, dtype=dtype)
    pooled = torch.randn(batch, cfg.in_text_dim2, generator=g, dtype=dtype)
    timestep = torch.rand(batch, generator=g, dtype=dtype) * 1000
    p_t, p_h, p_w = cfg.patch_size
    visual_pos = [torch.randint(0, 128, (n,), generator=g) for n in (frames // p_t, height // p_h, width // p_w)]
    text_pos = torch.randint(0, 1024, (text_len,), generator=g)
    return Kandinsky5Inputs(x, text, timestep, pooled, visual_pos, text_pos)


# ---- whole pipelines -----------------------------------------------------------------------------

# The pipelines' templates are the real model's chat templates, cropped after their first 128 (video)
# or 40 (image) Qwen tokens; a tokenizer over single characters needs a shorter one, cropped after
# its system part as the real one is: "<|im_start|>" is one token, the rest one token a character.
TINY_TEMPLATE = "<|im_start|>system\nDescribe.<|im_end|>\n<|im_start|>user\n{}<|im_end|>"
TINY_TEMPLATE_CROP = 1 + len("system\nDescribe.") + 1 + 1  # <|im_start|>, the text, <|im_end|>, "\n"


def _text_encoders(seed: int):
    """``(qwen tokenizer, qwen, clip tokenizer, clip)``: Qwen2.5-VL-like (its last hidden states are
    the prompt embeddings) and CLIP (its pooled output), both ``TEXT_DIM`` wide, character tokenizers."""
    from usp_dit.demo.tiny_hunyuan_video import _text_encoders as hunyuan_encoders
    from usp_dit.demo.tiny_hunyuan_video import _tokenizers as hunyuan_tokenizers
    from usp_dit.demo.tiny_qwen_image import tiny_qwen_text_encoder, tiny_qwen_tokenizer

    qwen_tok = tiny_qwen_tokenizer()
    _, clip_tok = hunyuan_tokenizers(77)
    _, clip = hunyuan_encoders(8, len(clip_tok), seed + 1)  # (its Llama is not used)
    return qwen_tok, tiny_qwen_text_encoder(len(qwen_tok), seed), clip_tok, clip


def tiny_kandinsky5_pipeline(image: bool = False, seed: int = 0):
    """A ``Kandinsky5T2VPipeline`` (or, with ``image``, a ``Kandinsky5T2IPipeline``) of tiny random
    models, float32: the transformer above ("t2v"), Qwen2.5-VL-like and CLIP text encoders over
    characters (``TINY_TEMPLATE`` instead of the real chat template), FlowMatch Euler.

    Video: ``AutoencoderKLHunyuanVideo`` (the release's VAE class), 8x spatial and 4x temporal
    compression and patch (1, 2, 2): ``height x width x num_frames`` gives ``((num_frames - 1) / 4
    + 1) * (height / 16) * (width / 16)`` video tokens; e.g. 48 x 80 x 9 frames -> 45 tokens.
    Image: ``AutoencoderKL`` (Flux's class), 8x; the pipeline snaps (width, height) to one of its
    ``resolutions`` (the release's are 1024 x 1024 and up), which here are 80 x 48 (15 tokens)
    and 48 x 48.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, Kandinsky5T2IPipeline, Kandinsky5T2VPipeline

    qwen_tok, qwen, clip_tok, clip = _text_encoders(seed + 10)
    if image:
        from usp_dit.demo.tiny_flux import tiny_vae

        vae, cls = tiny_vae(num_blocks=4, seed=seed + 20), Kandinsky5T2IPipeline
    else:
        from usp_dit.demo.tiny_hunyuan_video import tiny_hunyuan_video_vae

        vae, cls = tiny_hunyuan_video_vae(seed + 20), Kandinsky5T2VPipeline
    pipe = cls(transformer=tiny_kandinsky5("t2v", seed=seed + 30), vae=vae, text_encoder=qwen, tokenizer=qwen_tok,
               text_encoder_2=clip, tokenizer_2=clip_tok, scheduler=FlowMatchEulerDiscreteScheduler(shift=5.0))
    pipe.prompt_template, pipe.prompt_template_encode_start_idx = TINY_TEMPLATE, TINY_TEMPLATE_CROP
    if image:
        pipe.resolutions = [(80, 48), (48, 48)]
    return pipe
