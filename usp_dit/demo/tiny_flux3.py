"""Tiny randomly initialised FLUX.3 transformers and their inputs, for tests and examples.

Layout: image tokens (batch, h * w, in_channels) row-major; reference-image tokens (batch, M,
cond_in_channels); text embeddings (batch, T, joint_attention_dim); position ids (tokens, 4) as
``(t, h, w, l)``: the image at t = 0 on its h x w grid, the references at t = 1 on theirs, the
text at the origin with l = its index (as FLUX.3's pipeline lays them out); timestep (batch,) in [0, 1].

Everything is built from a seed, in code, with no download: every rank that calls a builder with
the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import Flux3Transformer2DModel

from usp_dit.demo.tiny_video import _perturb, quiet_diffusers_log

TEXT_DIM = 32  # joint_attention_dim of the tiny transformers (the real one: 20480, stacked Qwen3-VL states)
CHANNELS = 8  # in_channels / cond_in_channels (the real ones: 128, packed latents)


def tiny_flux3(num_heads: int = 4, head_dim: int = 16, num_layers: int = 1, num_single_layers: int = 2,
               flow_map: bool = False, seed: int = 0) -> Flux3Transformer2DModel:
    """A small ``Flux3Transformer2DModel`` (``num_heads * head_dim`` wide), float32, eval mode; RoPE
    axes (t, h, w, l) of head_dim / 4 each, as the release's (32, 32, 32, 32) of 128. Every parameter
    is perturbed with seeded noise."""
    torch.manual_seed(seed)
    model = Flux3Transformer2DModel(
        in_channels=CHANNELS, cond_in_channels=CHANNELS, num_layers=num_layers, num_single_layers=num_single_layers,
        attention_head_dim=head_dim, num_attention_heads=num_heads, joint_attention_dim=TEXT_DIM,
        timestep_channels=32, axes_dims_rope=(head_dim // 4,) * 4, flow_map=flow_map,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class Flux3Inputs:
    """Keyword arguments of one ``Flux3Transformer2DModel.forward`` call."""

    hidden_states: torch.Tensor
    encoder_hidden_states: torch.Tensor
    timestep: torch.Tensor
    img_ids: torch.Tensor
    txt_ids: torch.Tensor
    image_cond_hidden_states: torch.Tensor | None = None
    image_cond_ids: torch.Tensor | None = None
    target_timestep: torch.Tensor | None = None

    def kwargs(self) -> dict:
        return dict(self.__dict__)


def _grid_ids(h: int, w: int, t: int) -> torch.Tensor:
    hh, ww = torch.meshgrid(torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([torch.full_like(hh, t), hh, ww, torch.zeros_like(hh)], -1).reshape(-1, 4)


def flux3_inputs(model: Flux3Transformer2DModel, batch: int, h: int, w: int, text_len: int,
                 reference: tuple[int, int] | None = None, seed: int = 0) -> Flux3Inputs:
    """Seeded inputs: an h x w image, ``text_len`` text tokens, an optional reference image (rh, rw);
    a different prompt and timestep per element."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, h * w, model.config.in_channels, generator=g)
    text = torch.randn(batch, text_len, model.config.joint_attention_dim, generator=g)
    timestep = torch.rand(batch, generator=g)
    txt_ids = torch.zeros(text_len, 4, dtype=torch.long)
    txt_ids[:, 3] = torch.arange(text_len)
    inputs = Flux3Inputs(x, text, timestep, _grid_ids(h, w, 0), txt_ids)
    if reference is not None:
        rh, rw = reference
        inputs.image_cond_hidden_states = torch.randn(batch, rh * rw, model.config.cond_in_channels, generator=g)
        inputs.image_cond_ids = _grid_ids(rh, rw, 1)
    if model.config.flow_map:
        inputs.target_timestep = inputs.timestep * torch.rand(batch, generator=g)
    return inputs


def tiny_flux3_pipeline(distilled: bool = False, guidance_scale: float = 4.0, seed: int = 0):
    """FLUX.3's stock modular pipeline of tiny random models, float32: ``Flux3ModularPipeline``
    (``Flux3AutoBlocks``: Qwen3-VL text encoder, VAE encode of reference images, the denoise loop
    with a ``ClassifierFreeGuidance`` guider, decode), or with ``distilled`` the step-distilled
    ``Flux3DistilledModularPipeline`` (a flow-map transformer, no guider).

    Diffusers' prompt upsampler (a 9 B Qwen3.5 that rewrites the prompt) is popped from the blocks,
    as its docstring says to encode the prompt as given. The text encoder is the 2-layer Qwen3-VL
    of ``usp_dit.demo.tiny_qwen_image21`` (width ``TEXT_DIM``): call the pipeline with
    ``text_encoder_out_layers=(2,)`` (the release stacks 8 of its 36 layers into 20480 channels).
    The VAE compresses 2x and the pipeline packs 2 x 2 latents: ``height`` and ``width`` multiples
    of 4 give ``(height / 4) * (width / 4)`` image tokens (36 x 52: 9 x 13 = 117)."""
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler
    from diffusers.modular_pipelines.flux3.image_processor import Flux3ImageProcessor
    from diffusers.modular_pipelines.flux3.modular_blocks_flux3 import Flux3AutoBlocks
    from diffusers.modular_pipelines.flux3.modular_blocks_flux3_distilled import Flux3DistilledAutoBlocks

    from usp_dit.demo.tiny_flux2 import tiny_flux2_vae
    from usp_dit.demo.tiny_qwen_image21 import tiny_qwen3_vl, tiny_qwen3_vl_processor

    processor = tiny_qwen3_vl_processor()
    components = dict(
        text_encoder=tiny_qwen3_vl(processor.tokenizer, seed=seed), tokenizer=processor,
        image_processor=Flux3ImageProcessor(vae_scale_factor=4, vae_latent_channels=CHANNELS // 4),
        vae=tiny_flux2_vae(seed=seed, latent_channels=CHANNELS // 4),
        transformer=tiny_flux3(flow_map=distilled, seed=seed), scheduler=FlowMatchEulerDiscreteScheduler(),
    )
    with quiet_diffusers_log():
        blocks = Flux3DistilledAutoBlocks() if distilled else Flux3AutoBlocks()
        blocks.sub_blocks.pop("prompt_upsampler", None)
        pipe = blocks.init_pipeline()
        if not distilled:
            components["guider"] = ClassifierFreeGuidance(guidance_scale=guidance_scale)
        pipe.update_components(**components)
    return pipe
