"""Which Diffusers transformer classes usp_dit runs sequence-parallel, and why the others are refused.

Layout: no tensors; rows of (class, family or None, test file or reason).

``coverage()`` walks every class ``diffusers.models.transformers`` exports and asks the registered
adapters (``usp_dit.pipelines.base``) which one handles it, by exact class: a subclass of a supported
model may change what its forward does, so it is refused until an adapter names it. A supported
class's evidence is its adapter module's test file, ``tests/test_pipeline_<module>.py``; a refused
class carries the reason ``enable_usp`` gives (``find_adapter`` raises ``NotImplementedError``
with it). ``python -m usp_dit.pipelines.coverage`` prints the table of docs/COVERAGE.md, and
tests/test_coverage.py checks that the file is that output.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import diffusers.models.transformers as diffusers_transformers

from usp_dit.pipelines.base import registered_adapters

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
    "WanVACETransformer3DModel": f"{NO_ADAPTER} (VACE's control blocks and hints beside Wan's)",
    "WanAnimateTransformer3DModel": f"{NO_ADAPTER} (face and pose conditioning beside Wan's)",
    "WanAnimate2Transformer3DModel": f"{NO_ADAPTER} (face and pose conditioning beside Wan's)",
    "QwenImage21Transformer2DModel": f"{NO_ADAPTER} (a different class from Qwen-Image's)",
}


@dataclass(frozen=True)
class Row:
    """One exported transformer class: supported by ``family`` (with ``test``) or refused for ``reason``."""

    model_class: str
    family: str | None
    test: str | None
    reason: str | None


def _adapter_for(cls: type):
    for adapter in registered_adapters():
        if getattr(adapter, "model_class", None) is cls:
            return adapter
    return None


def refusal_reason(cls: type) -> str:
    """Why ``enable_usp`` refuses ``cls`` (a class no registered adapter handles)."""
    return _REASONS.get(cls.__name__, NO_ADAPTER)


def test_file(adapter) -> str:
    """The test file of an adapter's family, by convention ``tests/test_pipeline_<family module>.py``
    (a ``PlanAdapter`` names its family's module; other adapters live in it)."""
    module = getattr(adapter, "family_module", None) or type(adapter).__module__
    return f"tests/test_pipeline_{module.rsplit('.', 1)[-1]}.py"


def coverage() -> list[Row]:
    """Every class ``diffusers.models.transformers`` exports, sorted by name."""
    rows = []
    for name in sorted(dir(diffusers_transformers)):
        cls = getattr(diffusers_transformers, name)
        if not (isinstance(cls, type) and name[0].isupper()):
            continue
        adapter = _adapter_for(cls)
        if adapter is None:
            rows.append(Row(name, None, None, refusal_reason(cls)))
        else:
            rows.append(Row(name, adapter.name, test_file(adapter), None))
    return rows


def markdown(rows: list[Row]) -> str:
    """docs/COVERAGE.md: a count, then one table row per class."""
    import diffusers

    supported = sum(r.family is not None for r in rows)
    lines = [
        "# Model coverage",
        "",
        f"Every transformer class exported by `diffusers.models.transformers` (Diffusers {diffusers.__version__}):",
        f"{supported} of {len(rows)} run sequence-parallel under `enable_usp`; `enable_usp` on any other raises",
        "`NotImplementedError` with the reason below. Made by `python -m usp_dit.pipelines.coverage`;",
        "tests/test_coverage.py fails when this file is out of date.",
        "",
        "| class | status | evidence or reason |",
        "| --- | --- | --- |",
    ]
    for r in rows:
        if r.family is not None:
            lines.append(f"| `{r.model_class}` | supported ({r.family}) | `{r.test}` |")
        else:
            lines.append(f"| `{r.model_class}` | refused | {r.reason} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    import usp_dit.pipelines  # noqa: F401  (registers every adapter)

    sys.stdout.write(markdown(coverage()))
