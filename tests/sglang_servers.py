"""The session's SGLang servers on 127.0.0.1 (a pytest plugin: tests/conftest.py loads it), started on first use
and shut down at the end of the run.

Three servers of the tiny random Qwen3-MoE model (fp32, so train/inference log-probs agree to ~1e-6) are started
together on first use, so their start-ups (~40 CPU-seconds each) overlap: ``main`` serves the generation,
weight-sync and routing-replay tests (it is started with --enable-return-routed-experts; idle, it takes no CPU),
and is then hung (SIGSTOP) and killed by the failure tests, then restarted and killed by the restart tests
(``tests/rollout/test_restart.py``), which are marked ``destroys_server`` and so run at the end of the session
(tests/conftest.py orders them). The ``pair``, two servers with small KV caches (``PAIR_KV_TOKENS``), serve the
two-server tests (``tests/rollout/test_two_servers.py``: requests sized from the caches, two stage senders); the
Ctrl-C test, run after them, then shuts the second one down. The restart tests therefore start
from a killed server whose last sync may have been distributed (``test_weight_sync.py``): the first one syncs
before it generates, which restarts it at its weights. A new test that needs a server uses ``engine`` (or
``started_servers``); one that serves weights of its own loads them into ``main`` through the engine
(``engine.update_weights(..., method="disk")``, or a distributed sync) when they have the tiny model's shapes, and
otherwise starts its own server.

If sglang is not installed the server tests skip, except under CI=true, where they fail: CI must run them.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from gspo_megatron.rewards import synthetic
from gspo_megatron.rollout import SGLangConfig, SGLangEngine
from gspo_megatron.rollout import server as server_mod
from tests.rollout.helpers import require_sglang


def server_config(model_dir, log_dir, **overrides) -> SGLangConfig:
    """A CPU server sized for the tests. Health probes are lenient (the machine's 2 cores may be shared and a
    starved server answers late); the hung-server test tightens them for itself."""
    base = SGLangConfig(model_path=str(model_dir), device="cpu", dtype="float32", max_total_tokens=16384,
                        max_running_requests=128, context_length=512, log_dir=str(log_dir),
                        startup_timeout_s=600, request_timeout_s=120, rollout_timeout_s=180,
                        health_interval_s=2.0, health_timeout_s=10.0, health_failures=5,
                        max_retries=3, backoff_s=0.2, backoff_max_s=1.0, prompts_per_request=4, concurrency=4,
                        cpu_threads=1)
    return replace(base, **overrides)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    return synthetic.save_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=0)


PAIR_KV_TOKENS = 1024  # each pair server's KV cache: a fraction of the two-server tests' rollout call


def pair_config(config: SGLangConfig) -> SGLangConfig:
    """The ``pair`` servers' configuration (the session's ``config`` with two servers of small KV caches)."""
    return replace(config, num_servers=2, max_total_tokens=PAIR_KV_TOKENS, context_length=256,
                   log_dir=str(Path(config.log_dir) / "pair"))


@contextlib.contextmanager
def own_engine(config: SGLangConfig):
    """An engine on servers of a test's own (a model the session's servers cannot load), shut down after it."""
    servers = server_mod.start_servers(config)
    try:
        with SGLangEngine(config, servers=servers) as engine:
            yield engine
    finally:
        for server in servers:
            server.shutdown()


@pytest.fixture(scope="session")
def started_servers(tiny_model_dir, tmp_path_factory):
    require_sglang()
    log_dir = tmp_path_factory.mktemp("sglang_logs")
    config = server_config(tiny_model_dir, log_dir)
    started = {}
    try:
        # main also captures the experts it routes to (rollout routing replay's tests ask for them)
        started["main"] = server_mod.start_servers(replace(config, log_dir=str(log_dir / "main"),
                                                           extra_args=("--enable-return-routed-experts",)))
        started["pair"] = server_mod.start_servers(pair_config(config))
        yield config, started
    finally:
        for servers in started.values():
            for server in servers:
                server.shutdown()


@pytest.fixture(scope="session")
def engine(started_servers):
    config, started = started_servers
    with SGLangEngine(config, servers=started["main"]) as engine:
        yield engine


@dataclass
class Trainer:
    """The in-process policy whose weights the main server serves (tests that sync weights update it)."""

    model: torch.nn.Module


@pytest.fixture(scope="session")
def trainer(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    return Trainer(model)
