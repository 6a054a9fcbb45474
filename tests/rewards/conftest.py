"""The rewards tests' settings: one torch thread, as the rollout tests' (the multi-turn tests run tiny models on the
local engine and the session's SGLang server)."""

from tests.rollout.conftest import one_torch_thread  # noqa: F401  (an autouse fixture: imported, it applies here)
