"""Session fixtures, also used by tests/tools (its conftest imports them): built or launched once per session."""

import pytest

from tests.model import hf_tiny, rank_checks


@pytest.fixture(scope="session")
def hf_models(tmp_path_factory):
    """{variant: HF model directory} for every tiny variant, with reference logits beside each."""
    return hf_tiny.build_all(tmp_path_factory.getbasetemp() / "hf_models")


@pytest.fixture(scope="session")
def hybrid_models(tmp_path_factory):
    """{variant: HF model directory} for the gated-DeltaNet hybrids (``hf_tiny.HYBRID_VARIANTS``), references beside."""
    directory = tmp_path_factory.getbasetemp() / "hybrid_models"
    return {v: hf_tiny.save_variant(v, directory, seed=20 + i) for i, v in enumerate(hf_tiny.HYBRID_VARIANTS)}


@pytest.fixture(scope="session")
def rank_work(tmp_path_factory):
    """Where the shared launch writes its checkpoints (megatron/, hf_back/, ...)."""
    return tmp_path_factory.getbasetemp() / "rank_checks"


@pytest.fixture(scope="session")
def rank_results(hf_models, rank_work):
    """Per-rank results of every multi-rank case (``rank_checks``): one 2-rank launch per session."""
    return rank_checks.shared_results(hf_models, rank_work)
