"""Why ``enable_usp`` refuses a transformer class: the reasons beyond "no adapter written yet".

Layout: no tensors. ``base.find_adapter`` raises with ``refusal_reason``; ``coverage`` prints it
in docs/COVERAGE.md. Data only, so that the machinery below the families can import it.
"""
from __future__ import annotations

NO_ADAPTER = "no adapter yet: its token split, positional tables and masks are not mapped"

# Classes refused for a reason beyond "not written yet".
_REASONS = {
    "PriorTransformer": "not a DiT over latent tokens (unCLIP prior over a few embeddings): nothing to split",
    "T5FilmDecoder": "spectrogram diffusion decoder over a short fixed sequence: nothing worth splitting",
    "RFD4ProteinaTransformer": "protein structure model, not an image or video DiT",
    "DualTransformer2DModel": "a pair of UNet attention blocks (Versatile Diffusion), not a pipeline's transformer",
    "TransformerTemporalModel": "a UNet's temporal attention block, not a pipeline's transformer",
    "Transformer2DModel": "a UNet attention block (and the legacy DiT/PixArt class), not a pipeline's transformer",
    "MiniMaxMusic3RVQDepthDecoder": "an audio codec's depth decoder over a few tokens: nothing to split",
    "HunyuanVideoFramepackTransformer3DModel": (
        f"{NO_ADAPTER} (FramePack's history latents and clean-latent RoPE differ from HunyuanVideo's)"),
    "QwenImage21Transformer2DModel": f"{NO_ADAPTER} (a different class from Qwen-Image's)",
}


def refusal_reason(cls: type) -> str:
    """Why ``enable_usp`` refuses ``cls`` (a class no registered adapter handles)."""
    return _REASONS.get(cls.__name__, NO_ADAPTER)
