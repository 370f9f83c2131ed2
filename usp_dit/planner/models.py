"""What the planner knows of a model family: its tokens at a size, heads, layers and parameters.

Layout: token counts per sample; the image / video tokens are what the grid splits, the text
tokens either join them in the split ("split" text: Flux.1, Flux.2, Chroma) or are replicated on
every rank and attended jointly ("joint" text), or are only attended to by a local
cross-attention ("cross" text: Wan, LTX-Video).

Note [model specs]
    Released configs (Diffusers 0.42 defaults or the checkpoints' transformer/config.json): the
    attention layers, heads x head_dim, text length and parameter count, and how the family's
    pipeline guides: "batched" (one call on a batch of both CFG branches: cfg_degree 2 splits it),
    "two_call" (one call per branch: usp_dit.pipelines.cfg_pair runs both at once on cfg 2) or
    "distilled" (guidance embedded, one branch: cfg_degree 2 has nothing to split at batch 1).
    ``other_rate`` is the flop rate of everything but attention (projections, MLPs, norms, RoPE)
    measured from the stock step on one H200 (shared/shapes.md, 2026-12-02): step time minus
    layers x the cuDNN attention call, against 2 x parameters x tokens flops. Families without a
    stock measurement take 550 TF/s (the measured ones span 400-740).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class ModelSpec:
    """One model at one size (Note [model specs])."""

    name: str
    tokens: int  # image / video tokens per sample
    text: int  # text tokens per sample
    text_mode: str  # "split", "joint" or "cross"
    heads: int
    kv_heads: int
    head_dim: int
    layers: int  # attention layers (self / joint)
    params: float
    guidance: str  # "batched", "two_call" or "distilled"
    other_rate: float = 550e12
    out_channels: int = 64  # per token, what the output gather moves

    @property
    def hidden(self) -> int:
        return self.heads * self.head_dim

    @property
    def sequence(self) -> int:
        """Tokens the grid splits: the image / video tokens, with the text where it is split too."""
        return self.tokens + (self.text if self.text_mode == "split" else 0)

    @property
    def joint(self) -> int:
        """Replicated text tokens every attention call attends jointly (0 unless "joint")."""
        return self.text if self.text_mode == "joint" else 0


def _patches(height: int, width: int, scale: int) -> int:
    return math.ceil(height / scale) * math.ceil(width / scale)


def flux(height=1024, width=1024, num_frames=None) -> ModelSpec:
    # Flux.1-dev: 19 double + 38 single blocks; other_rate: 172.7 ms - 57 x 0.42 ms over 2 x 11.9e9 x 4608.
    return ModelSpec("flux", _patches(height, width, 16), 512, "split", 24, 24, 128, 57, 11.9e9, "distilled",
                     736e12, 64)


def sd35(height=1024, width=1024, num_frames=None) -> ModelSpec:
    return ModelSpec("sd35", _patches(height, width, 16), 333, "joint", 38, 38, 64, 38, 8.1e9, "batched", out_channels=64)


def qwen_image(height=1328, width=1328, num_frames=None) -> ModelSpec:
    return ModelSpec("qwen_image", _patches(height, width, 16), 256, "joint", 24, 24, 128, 60, 20.4e9, "two_call",
                     out_channels=64)


def cogvideox(height=480, width=720, num_frames=49) -> ModelSpec:
    frames = (num_frames - 1) // 4 + 1
    # other_rate: 879.5 ms - 42 x 9.10 ms over 2 x 5.6e9 x 17776.
    return ModelSpec("cogvideox", frames * _patches(height, width, 16), 226, "joint", 48, 48, 64, 42, 5.6e9,
                     "batched", 400e12, 64)


def mochi(height=480, width=848, num_frames=163) -> ModelSpec:
    frames = (num_frames - 1) // 6 + 1
    # other_rate: 3688 ms - 48 x 42.8 ms over 2 x 10.0e9 x 44776.
    return ModelSpec("mochi", frames * _patches(height, width, 16), 256, "joint", 24, 24, 128, 48, 10.0e9,
                     "batched", 548e12, 48)


def wan(height=720, width=1280, num_frames=81) -> ModelSpec:
    frames = (num_frames - 1) // 4 + 1
    # Wan 2.1-14B; other_rate: 11899 ms - 40 x 207 ms over 2 x 14.0e9 x 76112.
    return ModelSpec("wan", frames * _patches(height, width, 16), 512, "cross", 40, 40, 128, 40, 14.0e9,
                     "two_call", 589e12, 64)


def hunyuan_video(height=720, width=1280, num_frames=129) -> ModelSpec:
    frames = (num_frames - 1) // 4 + 1
    # 20 double + 40 single blocks; guidance-distilled (true CFG is an option: two_call).
    return ModelSpec("hunyuan_video", frames * _patches(height, width, 16), 256, "joint", 24, 24, 128, 60, 12.8e9,
                     "distilled", out_channels=64)


def ltx_video(height=512, width=768, num_frames=121) -> ModelSpec:
    frames = (num_frames - 1) // 8 + 1
    return ModelSpec("ltx_video", frames * _patches(height, width, 32), 128, "cross", 32, 32, 64, 28, 1.9e9,
                     "batched", out_channels=128)


SPECS: dict[str, Callable[..., ModelSpec]] = {
    "flux": flux, "sd35": sd35, "qwen_image": qwen_image, "cogvideox": cogvideox, "mochi": mochi,
    "wan": wan, "hunyuan_video": hunyuan_video, "ltx_video": ltx_video,
}
# The Diffusers transformer class -> the spec builder that knows its sizes. By class name, so that
# the planner needs neither Diffusers nor the adapters above it (tests/test_planner.py checks that
# every class here is one a registered adapter runs).
CLASSES = {
    "FluxTransformer2DModel": "flux", "SD3Transformer2DModel": "sd35", "QwenImageTransformer2DModel": "qwen_image",
    "CogVideoXTransformer3DModel": "cogvideox", "MochiTransformer3DModel": "mochi", "WanTransformer3DModel": "wan",
    "HunyuanVideoTransformer3DModel": "hunyuan_video", "LTXVideoTransformer3DModel": "ltx_video",
}


def spec_for(model: str, height: int | None = None, width: int | None = None, num_frames: int | None = None) -> ModelSpec:
    """The released config of ``model`` (a key of ``SPECS``) at a size (defaults: the model's usual)."""
    if model not in SPECS:
        raise ValueError(f"model={model!r} is not one the planner knows; choose one of {sorted(SPECS)}")
    kwargs = {k: v for k, v in (("height", height), ("width", width), ("num_frames", num_frames)) if v is not None}
    return SPECS[model](**kwargs)


def spec_of_transformer(transformer, height=None, width=None, num_frames=None) -> ModelSpec:
    """A spec for an instantiated transformer: its family's size formula, with the heads, head_dim,
    layers and parameter count read from the object itself (its config may differ from the release)."""
    # The class itself, not a subclass: the adapters match exact classes too (a subclass may
    # change what its forward does). A PEFT or compile wrapper keeps the model's class.
    name = type(transformer).__name__
    if name not in CLASSES:
        raise ValueError(
            f"the planner cannot plan a {name}; it knows {sorted(CLASSES)} (families {sorted(set(CLASSES.values()))})"
        )
    base = spec_for(CLASSES[name], height, width, num_frames)
    cfg = transformer.config
    heads = int(getattr(cfg, "num_attention_heads", base.heads))
    head_dim = int(getattr(cfg, "attention_head_dim", base.head_dim))
    layers = sum(int(getattr(cfg, n, 0) or 0) for n in ("num_layers", "num_single_layers")) or base.layers
    params = float(sum(p.numel() for p in transformer.parameters()))
    return replace(base, heads=heads, kv_heads=heads, head_dim=head_dim, layers=layers, params=params)
