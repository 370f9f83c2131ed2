"""Tiny randomly initialised Flux.2 transformers and a ``Flux2Pipeline``, built in code for tests and examples.

Layout: packed latents (batch, tokens, 4 * latent_channels): the target image's 2x2-patchified
latent row-major, then any reference images' (editing); text embeddings (batch, text_len,
text_dim); position ids as ``Flux2Pipeline`` makes them, (batch, tokens, 4), axes (t, h, w, l):
image (0, h, w, 0), the k-th reference image (10 k, h, w, 0), text (0, 0, 0, l).

Nothing is downloaded: the pipeline's text encoder is a 3-layer ``Mistral3ForConditionalGeneration``
(and a 1-layer Pixtral vision tower it never calls), its "tokenizer" a character tokenizer with a
Mistral-like chat template (``[SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]``), all built
here. FLUX.2-dev's tokenizer slot holds a ``PixtralProcessor``; the pipeline calls only its
``apply_chat_template``, which a tokenizer has too (PixtralProcessor itself needs torchvision,
not installed here). Every process that calls a builder with the same arguments gets
bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import Flux2Transformer2DModel

from usp_dit.demo.tiny_video import _perturb

TEXT_DIM = 48  # joint_attention_dim (FLUX.2-dev: 15360, three Mistral layers of 5120 stacked)
MISTRAL_DIM = TEXT_DIM // 3  # the tiny Mistral's width: the pipeline stacks three of its layers' hidden states
MISTRAL_LAYERS = (1, 2, 3)  # the layers stacked: pass as text_encoder_out_layers (FLUX.2-dev: (10, 20, 30))
LATENT_CHANNELS = 4  # the tiny VAE's latent channels (FLUX.2: 32); the transformer sees 4x (2x2 patches)

# Variants of the family, tiny versions of released configs.
FLUX2_VARIANTS = {
    "dev": dict(guidance_embeds=True),  # FLUX.2-dev: guidance-distilled, guidance embedded
    "klein": dict(guidance_embeds=False),  # FLUX.2-klein: no guidance embedding (true CFG or distilled steps)
}


def tiny_flux2(
    variant: str = "dev", num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, num_single_layers: int = 2,
    seed: int = 0, mlp_ratio: float = 3.0,
) -> Flux2Transformer2DModel:
    """A small ``Flux2Transformer2DModel`` (``num_heads * head_dim`` wide, MLPs ``int(width * mlp_ratio)``:
    FLUX.2's 3.0), float32, eval mode.

    RoPE: four axes of ``head_dim / 4`` each, as FLUX.2's (32, 32, 32, 32) of 128. Every parameter
    is perturbed with seeded noise (``tiny_video._perturb``).

    Raises:
        ValueError: ``variant`` is not one of ``FLUX2_VARIANTS``, or ``head_dim`` is not a multiple of 8.
    """
    if variant not in FLUX2_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(FLUX2_VARIANTS)}, got {variant!r}")
    if head_dim % 8:
        raise ValueError(f"head_dim must be a multiple of 8 (four even RoPE axes), got {head_dim}")
    torch.manual_seed(seed)
    model = Flux2Transformer2DModel(
        patch_size=1, in_channels=4 * LATENT_CHANNELS, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=head_dim, num_attention_heads=num_heads, joint_attention_dim=TEXT_DIM,
        timestep_guidance_channels=32, axes_dims_rope=(head_dim // 4,) * 4, mlp_ratio=mlp_ratio,
        **FLUX2_VARIANTS[variant],
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class Flux2Inputs:
    """Keyword arguments of one ``Flux2Transformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, N, 4 * latent_channels)
    encoder_hidden_states: torch.Tensor  # (B, T, text_dim)
    timestep: torch.Tensor  # (B,) in [0, 1]
    img_ids: torch.Tensor  # (B, N, 4)
    txt_ids: torch.Tensor  # (B, T, 4)
    guidance: torch.Tensor | None  # (B,) or None (klein)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def flux2_ids(images: list[tuple[int, int]], text_len: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(img_ids (B, N, 4), txt_ids (B, T, 4))`` as ``Flux2Pipeline`` makes them: the target image
    (0, h, w, 0), then reference image k at t = 10 k (``_prepare_image_ids``), text (0, 0, 0, l)."""
    img = [torch.cartesian_prod(torch.tensor([10 * k]), torch.arange(h), torch.arange(w), torch.arange(1))
           for k, (h, w) in enumerate(images)]
    txt = torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(text_len))
    return torch.cat(img).expand(batch, -1, -1), txt.expand(batch, -1, -1)


def flux2_inputs(
    model: Flux2Transformer2DModel, images: list[tuple[int, int]], text_len: int = 6, batch: int = 2, seed: int = 0,
) -> Flux2Inputs:
    """Seeded inputs: a different prompt, latent and timestep per batch element; guidance 2.5 to 4.0 over
    the batch where the model embeds it. ``images``: the (h, w) patch grids of the target, then reference images."""
    g = torch.Generator().manual_seed(seed)
    img_ids, txt_ids = flux2_ids(images, text_len, batch)
    x = torch.randn(batch, img_ids.shape[1], model.config.in_channels, generator=g)
    text = torch.randn(batch, text_len, model.config.joint_attention_dim, generator=g)
    timestep = torch.rand(batch, generator=g)
    guidance = torch.linspace(2.5, 4.0, batch) if model.config.guidance_embeds else None
    return Flux2Inputs(x, text, timestep, img_ids, txt_ids, guidance)


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_flux2_vae(seed: int = 0, latent_channels: int = LATENT_CHANNELS):
    """An ``AutoencoderKLFlux2`` of ``latent_channels``, 2x spatial compression, its batch-norm
    statistics (which the pipeline un-normalises latents with) set away from 0 / 1."""
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(seed)
    vae = AutoencoderKLFlux2(
        in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(8, 16), layers_per_block=1,
        latent_channels=latent_channels, norm_num_groups=4, sample_size=32,
    )
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        vae.bn.running_mean.copy_(0.1 * torch.randn(vae.bn.running_mean.shape, generator=g))
        vae.bn.running_var.copy_(1.0 + 0.1 * torch.rand(vae.bn.running_var.shape, generator=g))
    return vae.eval()


def tiny_mistral_tokenizer():
    """A tokenizer over single characters (a unigram vocabulary written here, no file) with a
    Mistral-like chat template for ``Flux2Pipeline``'s ``[system, user]`` messages (their content a
    list of one ``{"type": "text"}`` item). The system message alone is about 170 tokens."""
    import string

    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(c, -2.0) for c in string.ascii_letters + string.digits + string.punctuation + "\n"]
    tokenizer = T5TokenizerFast(
        vocab=pieces, extra_ids=0,
        additional_special_tokens=["[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[INST]", "[/INST]"],
    )
    tokenizer.chat_template = (
        "{%- for m in messages -%}{%- if m['role'] == 'system' -%}"
        "[SYSTEM_PROMPT]{{ m['content'][0]['text'] }}[/SYSTEM_PROMPT]"
        "{%- else -%}[INST]{{ m['content'][0]['text'] }}[/INST]{%- endif -%}{%- endfor -%}"
    )
    return tokenizer


def tiny_mistral3_text_encoder(vocab_size: int, seed: int = 0):
    """A 3-layer ``Mistral3ForConditionalGeneration`` of width ``MISTRAL_DIM`` (and a 1-layer Pixtral
    vision tower the pipeline never calls), float32, eval mode, every weight perturbed."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        text_config=dict(
            model_type="mistral", vocab_size=vocab_size, hidden_size=MISTRAL_DIM, intermediate_size=32,
            num_hidden_layers=len(MISTRAL_LAYERS), num_attention_heads=4, num_key_value_heads=2, head_dim=4,
            max_position_embeddings=512, pad_token_id=0,
        ),
        vision_config=dict(model_type="pixtral", hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                           num_attention_heads=2, image_size=32, patch_size=16, head_dim=8),
        spatial_merge_size=1,
    )
    torch.manual_seed(seed)
    encoder = Mistral3ForConditionalGeneration(config)
    _perturb(encoder, seed + 1, std=0.02)
    return encoder.eval()


def tiny_qwen3_tokenizer():
    """A tokenizer over single characters (a unigram vocabulary written here, no file) with Qwen's
    chat tokens and a Qwen-like chat template for ``Flux2KleinPipeline``'s one user message (its
    content a string; ``enable_thinking`` ignored): ``<|im_start|>user\n...<|im_end|>\n
    <|im_start|>assistant\n``, about 30 tokens besides the prompt."""
    import string

    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(c, -2.0) for c in string.ascii_letters + string.digits + string.punctuation + "\n"]
    tokenizer = T5TokenizerFast(vocab=pieces, extra_ids=0, additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tokenizer


def tiny_qwen3_text_encoder(vocab_size: int, seed: int = 0):
    """A 3-layer ``Qwen3ForCausalLM`` of width ``MISTRAL_DIM`` (FLUX.2-klein's text encoder is a
    Qwen3; the pipeline stacks three of its layers' hidden states as the Mistral's are), float32,
    eval mode, every weight perturbed."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=MISTRAL_DIM, intermediate_size=32, num_hidden_layers=len(MISTRAL_LAYERS),
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=512, pad_token_id=0,
        bos_token_id=None, eos_token_id=1,
    )
    torch.manual_seed(seed)
    encoder = Qwen3ForCausalLM(config)
    _perturb(encoder, seed + 1, std=0.02)
    return encoder.eval()


def tiny_flux2_klein_pipeline(seed: int = 0):
    """A ``Flux2KleinPipeline`` (the base, non-distilled Klein: true CFG, two transformer calls a
    step at ``guidance_scale > 1``, the negative prompt the empty one) of tiny random models
    (Qwen3-like text encoder, character tokenizer with a chat template, VAE, the "klein"
    transformer: no guidance embedding), float32.

    Call it with ``text_encoder_out_layers=MISTRAL_LAYERS`` and a ``max_sequence_length`` of 40 or
    more (the template takes about 30 tokens; every prompt is padded to that length and the
    transformer attends to every text token). ``height x width`` gives ``(height / 4) * (width / 4)``
    image tokens, as ``tiny_flux2_pipeline``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    tokenizer = tiny_qwen3_tokenizer()
    return Flux2KleinPipeline(
        scheduler=scheduler, vae=tiny_flux2_vae(seed + 20), tokenizer=tokenizer,
        text_encoder=tiny_qwen3_text_encoder(len(tokenizer), seed + 10),
        transformer=tiny_flux2("klein", seed=seed + 30), is_distilled=False,
    )


def tiny_flux2_pipeline(seed: int = 0):
    """A ``Flux2Pipeline`` (dev: guidance-distilled) of tiny random models (Mistral-3-like text
    encoder, character tokenizer with a chat template, VAE, transformer), float32.

    Call it with ``text_encoder_out_layers=MISTRAL_LAYERS`` and ``max_sequence_length`` of about
    200 (the template's system message is ~170 tokens; the prompt is padded to that length, and
    the transformer attends to every text token). VAE 2x compression and 2x2 patches: ``height x
    width`` gives ``(height / 4) * (width / 4)`` image tokens; e.g. 12 x 20 -> 15.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2Pipeline

    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    tokenizer = tiny_mistral_tokenizer()
    return Flux2Pipeline(
        scheduler=scheduler, vae=tiny_flux2_vae(seed + 20), tokenizer=tokenizer,
        text_encoder=tiny_mistral3_text_encoder(len(tokenizer), seed + 10), transformer=tiny_flux2(seed=seed + 30),
    )
