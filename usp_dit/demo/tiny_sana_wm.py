"""Tiny randomly initialised SANA-WM transformers and their inputs, built in code for tests and examples.

Layout: latents (batch, LATENT_CHANNELS, frames, height, width), patch (1, 1, 1) as released:
``tokens = frames * height * width``, frame-major; text embeddings (batch, 1, text_len, TEXT_DIM)
with a 0/1 mask (batch, text_len) (the model requires one); per-frame timesteps (batch, 1, frames);
camera conditions (batch, frames, 20) (camera-to-world 4 x 4 flattened, then fx, fy, cx, cy);
Plucker rays (batch, PLUCKER_CHANNELS, frames, height, width); a per-frame validity mask (batch, frames).

Every process that calls a builder with the same arguments gets bit-identical weights and inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from diffusers import SanaWMTransformer3DModel

from usp_dit.demo.tiny_video import _perturb

LATENT_CHANNELS = 4  # (released: 128, the LTX-2 VAE's)
TEXT_DIM = 16  # (released: Gemma-2's 2304)
PLUCKER_CHANNELS = 6  # (released: 48 = 6 x the VAE's temporal stride 8)
VARIANTS = ("released", "gdn", "softmax")


def tiny_sana_wm(
    variant: str = "released", num_layers: int = 2, seed: int = 0, caption_channels: int = TEXT_DIM,
    plucker_channels: int = PLUCKER_CHANNELS, in_channels: int = LATENT_CHANNELS,
) -> SanaWMTransformer3DModel:
    """A small ``SanaWMTransformer3DModel`` (64 wide: 4 self-attention heads of 16), float32, eval mode.
    ``caption_channels``: the text embeddings' width; ``plucker_channels``: the Plucker rays' (6 x the
    VAE's temporal stride; ``tiny_sana_wm_pipeline`` builds it with its encoder's and VAE's);
    ``in_channels``: the latents' (with ``data_info["image_vae_embeds"]``: theirs and the image
    latents' together; the output has as many).

    ``"released"``: block ``i`` runs softmax attention when ``(i + 1) % 2 == 0`` (released: every
    4th), the bidirectional gated delta rule (GDN) otherwise, the short temporal conv on K only
    (``k_conv_only``, as released); ``"gdn"``: every block GDN, the short convs on Q, K and V;
    ``"softmax"``: every block softmax. Cross-attention has 2 heads of 32.
    Every parameter is perturbed (``tiny_video._perturb``), the zero-initialised Plucker embedder
    and the short convs included.

    Raises:
        ValueError: an unknown ``variant``.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}; use one of {VARIANTS}")
    torch.manual_seed(seed)
    model = SanaWMTransformer3DModel(
        in_channels=in_channels, num_layers=num_layers, hidden_size=64, num_attention_heads=2,
        softmax_every_n={"released": 2, "gdn": 0, "softmax": 1}[variant], linear_head_dim=16, conv_kernel_size=4,
        k_conv_only=variant != "gdn",
        chunk_plucker_channels=plucker_channels, chunk_plucker_post_attn_blocks=-1, caption_channels=caption_channels,
        mlp_ratio=2.0, image_size=64,
    )
    _perturb(model, seed + 1)
    return model.eval()


@dataclass
class SanaWMInputs:
    """Keyword arguments of one ``SanaWMTransformer3DModel.forward`` call."""

    hidden_states: torch.Tensor  # (B, LATENT_CHANNELS, F, H, W)
    timestep: torch.Tensor  # (B, 1, F)
    encoder_hidden_states: torch.Tensor  # (B, 1, L, TEXT_DIM)
    mask: torch.Tensor  # (B, L) 0 / 1
    camera_conditions: torch.Tensor | None = None  # (B, F, 20)
    chunk_plucker: torch.Tensor | None = None  # (B, PLUCKER_CHANNELS, F, H, W)
    frame_valid_mask: torch.Tensor | None = None  # (B, F) 0 / 1
    data_info: dict | None = None  # {"image_vae_embeds": (B, C', F, H, W)}: concatenated to the latents' channels

    def kwargs(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if v is not None}


def _cameras(batch: int, frames: int, height: int, width: int, g: torch.Generator) -> torch.Tensor:
    """(batch, frames, 20): random rotations (QR of a Gaussian) and translations, pinhole intrinsics in pixels."""
    rot, _ = torch.linalg.qr(torch.randn(batch, frames, 3, 3, generator=g))
    c2w = torch.eye(4).repeat(batch, frames, 1, 1)
    c2w[..., :3, :3] = rot
    c2w[..., :3, 3] = torch.randn(batch, frames, 3, generator=g)
    focal = (0.8 + 0.4 * torch.rand(batch, frames, 2, generator=g)) * torch.tensor([width, height])
    centre = (0.4 + 0.2 * torch.rand(batch, frames, 2, generator=g)) * torch.tensor([width, height])
    return torch.cat([c2w.flatten(-2), focal, centre], dim=-1)


def sana_wm_inputs(
    frames: int, height: int, width: int, prompt_lengths: list[int], valid_frames: list[int] | None = None,
    camera: bool = True, text_len: int = 6, batch: int = 2, seed: int = 0,
) -> SanaWMInputs:
    """Seeded inputs for a ``frames x height x width`` token grid: a different latent, prompt and
    per-frame timesteps per element (frame 0 at timestep 0, the pipeline's conditioning anchor);
    ``prompt_lengths[b]``: element b's valid text tokens (a prefix mask); ``valid_frames[b]``:
    element b's valid frames (a prefix ``frame_valid_mask``), ``None``: no mask; ``camera``: camera
    conditions and Plucker rays (the camera branch and the post-attention Plucker embedding)."""
    g = torch.Generator().manual_seed(seed)
    mask = (torch.arange(text_len)[None, :] < torch.tensor(prompt_lengths)[:, None]).long()
    timestep = torch.rand(batch, 1, frames, generator=g) * 1000
    timestep[:, :, 0] = 0
    frame_mask = None
    if valid_frames is not None:
        frame_mask = (torch.arange(frames)[None, :] < torch.tensor(valid_frames)[:, None]).float()
    return SanaWMInputs(
        hidden_states=torch.randn(batch, LATENT_CHANNELS, frames, height, width, generator=g),
        timestep=timestep, encoder_hidden_states=torch.randn(batch, 1, text_len, TEXT_DIM, generator=g), mask=mask,
        camera_conditions=_cameras(batch, frames, height, width, g) if camera else None,
        chunk_plucker=torch.randn(batch, PLUCKER_CHANNELS, frames, height, width, generator=g) if camera else None,
        frame_valid_mask=frame_mask,
    )


# ---- the whole pipeline ----------------------------------------------------------------------------

TINY_CHI_PROMPT = ["Enhance: "]  # the released chi prompt is ~1000 characters: as many tokens here


def tiny_sana_wm_pipeline(max_text_len: int = 16, seed: int = 0, variant: str = "released"):
    """A ``SanaWMPipeline`` of tiny random models (2-layer Gemma-2 of ``tiny_sana.TEXT_DIM`` with a
    character tokenizer, the tiny LTX-2 VAE of ``tiny_ltx2``, the ``variant`` transformer of
    ``tiny_sana_wm``), float32.

    The VAE has 32 pixels per latent pixel and 8 frames per latent frame, the patch is 1: a
    ``height x width x num_frames`` call gives ``((num_frames - 1) / 8 + 1) * (height / 32) *
    (width / 32)`` tokens (96 x 96 x 17 frames -> 3 x 3 x 3 = 27). The pipeline batches [uncond, cond]
    in one call when ``guidance_scale > 1``. Call it with ``max_sequence_length <= max_text_len``, an
    image (``tiny_video.gradient_image``), a trajectory (``c2w`` or ``action``, e.g. ``TINY_ACTION``),
    ``intrinsics`` and ``chi_prompt=TINY_CHI_PROMPT``.
    """
    from diffusers import FlowMatchEulerDiscreteScheduler, SanaWMPipeline

    from usp_dit.demo.tiny_ltx2 import tiny_ltx2_vae
    from usp_dit.demo.tiny_sana import TEXT_DIM as GEMMA_DIM
    from usp_dit.demo.tiny_sana import tiny_gemma2
    from usp_dit.demo.tiny_video import tiny_t5

    tokenizer, _ = tiny_t5(max_text_len)
    vae = tiny_ltx2_vae(seed + 20)
    transformer = tiny_sana_wm(variant, seed=seed + 30, caption_channels=GEMMA_DIM,
                               plucker_channels=6 * vae.temporal_compression_ratio)
    return SanaWMPipeline(tokenizer=tokenizer, text_encoder=tiny_gemma2(seed + 10), vae=vae, transformer=transformer,
                          scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0))


TINY_ACTION = "w-8,jw-8"  # 17 camera poses: forward, then forward turning left (cam_utils' action DSL)


def tiny_sana_wm_call(height: int = 96, width: int = 96, num_frames: int = 17, **kwargs) -> dict:
    """``SanaWMPipeline.__call__`` keywords for the tiny pipeline: a gradient first frame of the output's
    size, ``TINY_ACTION`` as trajectory, pinhole intrinsics of focal length ``width`` centred, and the
    short chi prompt; ``kwargs`` are added (the prompt, the steps, ...)."""
    from usp_dit.demo.tiny_video import gradient_image

    call = {"image": gradient_image(height, width), "action": TINY_ACTION, "height": height, "width": width,
            "num_frames": num_frames, "intrinsics": [float(width), float(width), width / 2, height / 2],
            "chi_prompt": TINY_CHI_PROMPT, "max_sequence_length": 16}
    return {**call, **kwargs}
