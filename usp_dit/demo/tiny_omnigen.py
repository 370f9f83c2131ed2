"""Tiny randomly initialised OmniGen transformers and an ``OmniGenPipeline``, for tests and examples.

Layout: latents (batch, 4, height, width), 2x2 patches: N = (height / 2) * (width / 2) output image
tokens; ``input_ids`` (batch, T) left-padded to the batch's longest, an input image's tokens
spliced in as ``input_image_sizes[b] = [[start, end], ...]`` with its latent in
``input_img_latents`` (a list over images, (1, 4, h, w) each); ``attention_mask`` (batch, T + 1 + N,
T + 1 + N) 0/1 and ``position_ids`` (batch, T + 1 + N), both made by Diffusers' own
``OmniGenCollator`` (causal over the condition, bidirectional within an image, padding masked as keys).

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import OmniGenTransformer2DModel

from usp_dit.demo.tiny_video import _perturb

VOCAB = 128  # the tiny transformer's embedding rows (the release: Phi-3's 32064)
LATENT_CHANNELS = 4  # the SDXL VAE's, as released


def tiny_omnigen(num_heads: int = 4, head_dim: int = 16, num_layers: int = 2, seed: int = 0) -> OmniGenTransformer2DModel:
    """A small ``OmniGenTransformer2DModel`` (``num_heads * head_dim`` wide, Phi-3 blocks), float32,
    eval mode; su-scaled RoPE factors that differ per frequency (the released ones do too). Every
    parameter is perturbed (``tiny_video._perturb``)."""
    half = head_dim // 2
    torch.manual_seed(seed)
    model = OmniGenTransformer2DModel(
        in_channels=LATENT_CHANNELS, patch_size=2, hidden_size=num_heads * head_dim, num_attention_heads=num_heads,
        num_key_value_heads=num_heads, intermediate_size=4 * num_heads * head_dim, num_layers=num_layers,
        pad_token_id=0, vocab_size=VOCAB, pos_embed_max_size=32, time_step_dim=32,
        rope_scaling={"short_factor": torch.linspace(1.0, 1.5, half).tolist(),
                      "long_factor": torch.linspace(1.0, 4.0, half).tolist()},
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class OmniGenInputs:
    """Keyword arguments of one ``OmniGenTransformer2DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, 4, 2h, 2w)
    timestep: torch.Tensor  # (B,)
    input_ids: torch.Tensor  # (B, T)
    input_img_latents: list  # (1, 4, h_i, w_i) per input image
    input_image_sizes: dict  # batch row -> [[start, end], ...] of its input images' tokens in input_ids
    attention_mask: torch.Tensor  # (B, L, L) 0/1
    position_ids: torch.Tensor  # (B, L)

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def omnigen_inputs(
    height: int, width: int, text_lens: tuple[int, ...], image: tuple[int, int] | None = None, seed: int = 0,
) -> OmniGenInputs:
    """Seeded inputs of ``height x width`` output patches: element b's prompt has ``text_lens[b]``
    tokens (left-padded to the longest); ``image = (h, w)``: element 0 also holds an input image of
    h x w patches, its tokens spliced in after its first two text tokens."""
    from diffusers.pipelines.omnigen.processor_omnigen import OmniGenCollator

    g = torch.Generator().manual_seed(seed)
    batch = len(text_lens)
    prompts, latents = [], []
    for b, n in enumerate(text_lens):
        ids = torch.randint(1, VOCAB, (n,), generator=g).tolist()
        sizes = None
        if image is not None and b == 0:
            tokens = image[0] * image[1]
            sizes = [[2, 2 + tokens]]
            ids = ids[:2] + [0] * tokens + ids[2:]
            latents.append(torch.randn(1, LATENT_CHANNELS, 2 * image[0], 2 * image[1], generator=g))
        prompts.append({"input_ids": ids, "pixel_values": None if sizes is None else [torch.zeros(1)], "image_sizes": sizes})
    collator = OmniGenCollator()
    # target sizes in pixels: the collator counts pixels // 16 per side (an 8x VAE, 2x2 patches)
    ids, position_ids, mask, _, _, image_sizes = collator.process_mllm_input(prompts, [[16 * height, 16 * width]] * batch)
    x = torch.randn(batch, LATENT_CHANNELS, 2 * height, 2 * width, generator=g)
    timestep = torch.rand(batch, generator=g)
    return OmniGenInputs(x, timestep, ids, latents, image_sizes, mask, position_ids)


# ---- the whole pipeline ---------------------------------------------------------------------------


def tiny_omnigen_tokenizer():
    """A tokenizer over single characters (a unigram vocabulary written here, no file) with Phi-3's
    chat tokens as special tokens: what ``OmniGenMultiModalProcessor`` needs of the Phi-3 tokenizer
    (its instruction template tokenized). Built as a ``T5TokenizerFast``."""
    import string

    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -1.0)]
    pieces += [(c, -2.0) for c in string.ascii_letters + string.digits + string.punctuation + "\n"]
    specials = ["<|user|>", "<|assistant|>", "<|diffusion|>", "<|end|>", "<img>", "</img>"]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, additional_special_tokens=specials)


def tiny_omnigen_vae(seed: int = 0):
    """An ``AutoencoderKL`` of 4 latent channels and 4 levels (8x, the 16 pixels a token the
    pipeline's collator assumes)."""
    from diffusers import AutoencoderKL

    torch.manual_seed(seed)
    return AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=LATENT_CHANNELS, layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        block_out_channels=(8,) * 4, norm_num_groups=1, sample_size=64, scaling_factor=0.5, shift_factor=0.1,
    ).eval()


def _without_torchvision() -> None:
    """``OmniGenPipeline`` imports ``OmniGenMultiModalProcessor`` only where torchvision is installed,
    and the processor builds its input-image transform from torchvision at ``__init__`` (used for
    input images only). Where torchvision is missing (this CPU test machine), give Diffusers'
    modules the two names they lack: the stock processor class, and a stand-in for
    ``torchvision.transforms`` with the four names it uses; the pipeline's and the processor's code
    run unchanged. With torchvision installed nothing is changed."""
    from diffusers.pipelines.omnigen import pipeline_omnigen, processor_omnigen

    if not hasattr(pipeline_omnigen, "OmniGenMultiModalProcessor"):
        pipeline_omnigen.OmniGenMultiModalProcessor = processor_omnigen.OmniGenMultiModalProcessor
    if hasattr(processor_omnigen, "transforms"):
        return

    class _Transforms:
        class Compose:
            def __init__(self, steps):
                self.steps = steps

            def __call__(self, x):
                for step in self.steps:
                    x = step(x)
                return x

        class Lambda:
            def __init__(self, fn):
                self.fn = fn

            def __call__(self, x):
                return self.fn(x)

        class ToTensor:
            def __call__(self, image):
                import numpy as np

                return torch.from_numpy(np.asarray(image, dtype=np.float32) / 255.0).permute(2, 0, 1)

        class Normalize:
            def __init__(self, mean, std, inplace=False):
                self.mean, self.std = torch.tensor(mean)[:, None, None], torch.tensor(std)[:, None, None]

            def __call__(self, x):
                return (x - self.mean) / self.std

    processor_omnigen.transforms = _Transforms


def tiny_omnigen_pipeline(seed: int = 0):
    """An ``OmniGenPipeline`` of tiny random models (character tokenizer, 8x VAE, transformer),
    float32. Text-to-image: the pipeline wraps the prompt in its instruction template (one token a
    character here: about 80 tokens with a short prompt) and batches [cond, uncond], the uncond
    being its long default negative prompt (about 450 tokens), so the cond is left-padded.
    ``height x width`` gives ``(height / 16) * (width / 16)`` image tokens; e.g. 48 x 80 -> 15."""
    from diffusers import FlowMatchEulerDiscreteScheduler, OmniGenPipeline

    _without_torchvision()
    tokenizer = tiny_omnigen_tokenizer()
    return OmniGenPipeline(
        transformer=tiny_omnigen(seed=seed + 30), scheduler=FlowMatchEulerDiscreteScheduler(),
        vae=tiny_omnigen_vae(seed + 20), tokenizer=tokenizer,
    )
