"""The model coverage table: every Diffusers transformer class is supported (with its test) or refused
(with the reason ``enable_usp`` gives), and docs/COVERAGE.md is exactly what the code says; the
README's table of supported families (between ``<!-- families:begin -->`` and ``<!-- families:end -->``)
is exactly ``families_markdown(supported_families())``.

No processes: the table is derived from the registered adapters and checked against the file;
enabling a refused class is checked on a one-rank mesh (the refusal comes before any communication).
"""
from __future__ import annotations

import pathlib

import pytest
import torch

import usp_dit
import usp_dit.pipelines  # noqa: F401  (registers every adapter)
from usp_dit import single_rank_mesh
from usp_dit.pipelines.base import registered_adapters
from usp_dit.pipelines.coverage import (
    FAMILY_PIPELINES,
    NO_ADAPTER,
    FamilyPipelines,
    coverage,
    families_markdown,
    markdown,
    supported_families,
)

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_docs_coverage_is_the_generated_table():
    text = (ROOT / "docs" / "COVERAGE.md").read_text()
    assert text == markdown(coverage()), "docs/COVERAGE.md is stale: python -m usp_dit.pipelines.coverage > docs/COVERAGE.md"


FAMILIES_BEGIN, FAMILIES_END = "<!-- families:begin -->\n", "<!-- families:end -->"


def test_readme_families_table_is_the_generated_table():
    text = (ROOT / "README.md").read_text()
    assert text.count(FAMILIES_BEGIN) == 1 and text.count(FAMILIES_END) == 1, "README.md lost its families markers"
    table = text.split(FAMILIES_BEGIN, 1)[1].split(FAMILIES_END, 1)[0]
    assert table == families_markdown(supported_families()), (
        "README.md's families table is stale: replace the lines between its markers with the output of "
        "python -m usp_dit.pipelines.coverage --families"
    )


def test_families_table_rows_follow_the_plans():
    rows = {r.family: r for r in supported_families()}
    assert set(rows) == {a.name for a in registered_adapters()}
    for adapter in registered_adapters():
        row = rows[adapter.name]
        assert row.model_class == adapter.model_class.__name__
        assert row.cfg.startswith("two calls a step") == bool(adapter.cfg_branch_args), row
        # Every supported family's VAE has a recipe, or the table says why it decodes whole.
        whole = FAMILY_PIPELINES[adapter.name].whole_vae
        assert row.vae.startswith("yes (") or (whole and whole in row.vae), row


def test_families_table_refuses_a_pipeline_of_another_family_and_a_missing_family(monkeypatch):
    monkeypatch.setitem(FAMILY_PIPELINES, "Flux", FamilyPipelines("x", ("MochiPipeline",)))
    wrong = "MochiPipeline's transformer is .*MochiTransformer3DModel.*not FluxTransformer2DModel"
    with pytest.raises(ValueError, match=wrong):
        supported_families()
    monkeypatch.delitem(FAMILY_PIPELINES, "Flux")
    with pytest.raises(ValueError, match="must name every registered family"):
        supported_families()


def test_every_registered_adapter_is_in_the_table_with_a_test_that_names_its_class():
    rows = {r.model_class: r for r in coverage()}
    for adapter in registered_adapters():
        row = rows[adapter.model_class.__name__]
        assert row.family == adapter.name
        test = ROOT / row.test
        assert test.is_file(), f"{adapter.name}: no {row.test}"
        assert adapter.model_class.__name__ in test.read_text() or adapter.name in test.read_text()


def test_refused_rows_have_reasons_and_supported_rows_none():
    rows = coverage()
    assert len(rows) > 50  # diffusers 0.42 exports ~76 classes: the walk found them
    for r in rows:
        assert (r.family is None) == (r.reason is not None) == (r.test is None), r


class _Refused(torch.nn.Module):
    """Stands in for a transformer class no adapter handles."""


class _SubclassOfSupported(registered_adapters()[0].model_class):
    """A subclass of a supported model (it may change the forward): refused too."""

    def __init__(self) -> None:  # no weights needed: refused before anything runs
        torch.nn.Module.__init__(self)


@pytest.mark.parametrize("model", [_Refused(), _SubclassOfSupported()], ids=["unknown-class", "subclass"])
def test_enable_usp_on_a_refused_class_names_it_and_the_reason(model):
    with pytest.raises(NotImplementedError) as info:
        usp_dit.enable_usp(model, mesh=single_rank_mesh())
    message = str(info.value)
    assert type(model).__name__ in message and NO_ADAPTER in message and "supported model families" in message


def test_a_refused_diffusers_class_gets_its_specific_reason():
    from diffusers import PriorTransformer

    with pytest.raises(NotImplementedError, match="PriorTransformer.*not a DiT over latent tokens"):
        usp_dit.pipelines.find_adapter(PriorTransformer(num_attention_heads=2, attention_head_dim=4, num_layers=1,
                                                        embedding_dim=8, num_embeddings=2, additional_embeddings=1))


def test_an_fsdp2_wrapped_model_matches_the_class_it_wraps():
    """fully_shard turns a module's class into a generated ``FSDP<Name>`` subclass; enable_usp
    after shard_transformer must still find the model's adapter (the exact-class rule unwraps it)."""
    from torch.distributed.fsdp import FSDPModule

    from usp_dit.pipelines.base import find_adapter, model_class_of

    adapter = registered_adapters()[0]
    wrapped_class = type(f"FSDP{adapter.model_class.__name__}", (FSDPModule, adapter.model_class), {})
    model = object.__new__(wrapped_class)  # FSDPModule.__new__ would build the real (default-config) model
    assert model_class_of(model) is adapter.model_class
    assert find_adapter(model) is adapter
