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

from usp_dit.pipelines import families  # noqa: F401  (registers every family's adapter)
from usp_dit.pipelines.base import registered_adapters
from usp_dit.pipelines.refusals import NO_ADAPTER, refusal_reason  # noqa: F401  (NO_ADAPTER: re-exported)


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
    sys.stdout.write(markdown(coverage()))
