"""The session fixtures of tests/model (tiny HF models, the one shared 2-rank launch), reused here."""

from tests.model.conftest import hf_models, hybrid_models, rank_results, rank_work  # noqa: F401
