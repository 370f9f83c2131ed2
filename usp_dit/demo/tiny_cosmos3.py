"""Tiny randomly initialised Cosmos 3 Omni transformers, inputs and pipelines, for tests and the video example.

Layout: the transformer's packed call (``Cosmos3OmniTransformer.forward``): ``input_ids``
(und_len,); vision items (1, C, T, H, W) latents in a list; sound items (sound_dim, T_sound);
action items (T_action, action_dim); ``position_ids`` (3, N) mRoPE positions of the packed
sequence ``[text ; vision items ; sound ; action]`` of N tokens; timesteps one per noisy token.

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

import math
import string
from dataclasses import dataclass, field

import torch
from diffusers.models.transformers.transformer_cosmos3 import Cosmos3OmniTransformer

from usp_dit.demo.tiny_video import _perturb

LATENT_CHANNELS = 4  # the tiny stand-in for Wan 2.2's VAE's 48
PATCH = 2  # latent_patch_size, as released

# Variants, each a tiny version of a released config's choices (ratios kept: 4 query heads over 2
# K/V heads as 32 over 8; head_dim 16, rope_axes_dim (4, 2, 2) summing to head_dim / 2 as (24, 20, 20)
# to 64).
COSMOS3_VARIANTS = {
    # The Qwen3-style dense backbone (silu MLP, RMSNorm, q/k norms on both streams).
    "qwen3": dict(hidden_act="silu"),
    # The Nemotron-style backbone (relu2 MLP, Nemotron RMSNorm), no q/k norm on the text stream but
    # its own key norm for the gen stream's view of the text keys; sound and action heads.
    "nemotron-omni": dict(hidden_act="relu2", qk_norm_for_text=False, use_und_k_norm_for_gen=True,
                          sound_gen=True, sound_dim=6, action_gen=True, action_dim=5, num_embodiment_domains=3),
}


def tiny_cosmos3(variant: str = "qwen3", vocab_size: int = 128, seed: int = 0) -> Cosmos3OmniTransformer:
    """A 2-layer ``Cosmos3OmniTransformer`` (64 wide: 4 heads x 16, 2 K/V heads), float32, eval mode,
    every parameter perturbed with seeded noise (``tiny_video._perturb``: no norm weight or zero
    modality embedding keeps a constant that could hide a token on the wrong rank).

    Raises:
        ValueError: ``variant`` is not one of ``COSMOS3_VARIANTS``.
    """
    if variant not in COSMOS3_VARIANTS:
        raise ValueError(f"variant must be one of {sorted(COSMOS3_VARIANTS)}, got {variant!r}")
    config = dict(
        head_dim=16, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, latent_channel=LATENT_CHANNELS, latent_patch_size=PATCH,
        patch_latent_dim=PATCH * PATCH * LATENT_CHANNELS, rope_axes_dim=(4, 2, 2), vocab_size=vocab_size,
        rope_theta=10000.0,
    )
    config.update(COSMOS3_VARIANTS[variant])
    torch.manual_seed(seed)
    model = Cosmos3OmniTransformer(**config)
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class Cosmos3Inputs:
    """Keyword arguments of one ``Cosmos3OmniTransformer.forward`` call (``kwargs()``)."""

    call: dict = field(default_factory=dict)
    gen_tokens: int = 0  # tokens of the gen stream (what is split)

    def kwargs(self) -> dict:
        return dict(self.call)


def cosmos3_inputs(
    model: Cosmos3OmniTransformer, text_len: int, vision: list[tuple[int, int, int]], sound_len: int = 0,
    action_len: int = 0, seed: int = 0,
) -> Cosmos3Inputs:
    """A packed call: ``text_len`` text tokens, one vision item per ``(T, H, W)`` latent size (odd
    sizes are padded to the patch inside the model), optionally sound and action tokens.

    Item i conditions its first i frames (clean: no timestep, no prediction), the rest are noisy,
    each noisy token with its own random timestep; positions are random integers per axis (a table
    cut unlike the tokens would rotate the wrong positions); action items take domain 1.
    """
    cfg = model.config
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, cfg.vocab_size, (text_len,), generator=g)
    tokens, shapes, noisy, mse = [], [], [], []
    cur = text_len
    for i, (t, h, w) in enumerate(vision):
        tokens.append(torch.randn(1, cfg.latent_channel, t, h, w, generator=g))
        grid = (t, math.ceil(h / PATCH), math.ceil(w / PATCH))
        shapes.append(grid)
        frames = torch.arange(min(i, t - 1), t)
        noisy.append(frames)
        per_frame = grid[1] * grid[2]
        mse += [cur + f * per_frame + j for f in frames.tolist() for j in range(per_frame)]
        cur += math.prod(grid)
    num_vision = cur - text_len
    call = dict(
        input_ids=input_ids, text_indexes=torch.arange(text_len), und_len=text_len,
        vision_tokens=tokens, vision_token_shapes=shapes,
        vision_sequence_indexes=torch.arange(text_len, cur), vision_mse_loss_indexes=torch.tensor(mse),
        vision_timesteps=torch.rand(len(mse), generator=g) * 1000, vision_noisy_frame_indexes=noisy,
    )
    if sound_len:
        idx = torch.arange(cur, cur + sound_len)
        call.update(sound_tokens=[torch.randn(cfg.sound_dim, sound_len, generator=g)],
                    sound_token_shapes=[(sound_len, 1, 1)], sound_sequence_indexes=idx, sound_mse_loss_indexes=idx,
                    sound_timesteps=torch.rand(sound_len, generator=g) * 1000,
                    sound_noisy_frame_indexes=[torch.arange(sound_len)])
        cur += sound_len
    if action_len:
        idx = torch.arange(cur, cur + action_len)
        noisy_action = torch.arange(1, action_len)  # the first action conditioned
        call.update(action_tokens=[torch.randn(action_len, cfg.action_dim, generator=g)],
                    action_token_shapes=[(action_len, 1, 1)], action_sequence_indexes=idx,
                    action_mse_loss_indexes=idx[noisy_action],
                    action_timesteps=torch.rand(action_len - 1, generator=g) * 1000,
                    action_noisy_frame_indexes=[noisy_action], action_domain_ids=[torch.tensor([1])])
        cur += action_len
    call.update(sequence_length=cur, position_ids=torch.randint(0, 4 * cur, (3, cur), generator=g).float())
    assert num_vision + sound_len + action_len == cur - text_len
    return Cosmos3Inputs(call, cur - text_len)


def cosmos3_output(out) -> torch.Tensor:
    """Every prediction of a call (``return_dict=False``: vision, sound and action lists), flattened
    and concatenated into one vector (what the tests compare)."""
    return torch.cat([t.flatten() for part in out if part is not None for t in part])


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_cosmos3_tokenizer():
    """A tokenizer over single characters (a unigram vocabulary written here, no file) with Qwen's
    chat and vision tokens and a Qwen-like chat template for ``Cosmos3OmniPipeline``'s
    ``[system, user]`` messages (``add_vision_id`` ignored)."""
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(c, -2.0) for c in string.ascii_letters + string.digits + string.punctuation + "\n"]
    tokenizer = T5TokenizerFast(vocab=pieces, extra_ids=0,
                                additional_special_tokens=["<|im_start|>", "<|im_end|>", "<|vision_start|>"])
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    return tokenizer


def tiny_cosmos3_pipeline(seed: int = 0, variant: str = "qwen3"):
    """A ``Cosmos3OmniPipeline`` of tiny random models, float32: the tokenizer above, a 2-layer
    ``tiny_cosmos3`` transformer, a tiny ``AutoencoderKLWan`` (8x spatial, 4x temporal: the real
    one is Wan 2.2's, 16x spatial), UniPC, no safety checker and no sound tokenizer.

    ``height x width x num_frames`` gives ``((num_frames - 1) / 4 + 1) * ceil(height / 16) *
    ceil(width / 16)`` vision tokens; e.g. 48 x 80 x 9 frames -> 3 * 3 * 5 = 45 tokens.
    """
    from diffusers import Cosmos3OmniPipeline, UniPCMultistepScheduler

    from usp_dit.demo.tiny_wan import tiny_wan_vae

    tokenizer = tiny_cosmos3_tokenizer()
    transformer = tiny_cosmos3(variant, vocab_size=len(tokenizer), seed=seed + 30)
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    return Cosmos3OmniPipeline(
        transformer=transformer, text_tokenizer=tokenizer, vae=tiny_wan_vae(LATENT_CHANNELS, seed=seed + 20),
        scheduler=scheduler, enable_safety_checker=False,
    )
