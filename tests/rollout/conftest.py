"""Real SGLang servers on 127.0.0.1 for the rollout tests, started once for this package (torn down after its
last test).

Two servers of the tiny random Qwen3-MoE model (fp32, so train/inference log-probs agree to ~1e-6) are started
together on first use, so their start-ups (~40 CPU-seconds each) overlap: ``main`` serves the generation,
weight-sync and routing-replay tests (it is started with --enable-return-routed-experts), and is then hung
(SIGSTOP) and killed by the failure tests, then restarted and killed by the restart tests (``test_restart.py``),
which are marked ``destroys_server`` and so run at the end of the session; ``interrupt`` is shut down by the
Ctrl-C test. The restart tests therefore start from a killed server whose last sync may have been distributed
(``test_weight_sync.py``): the first one syncs before it generates, which restarts it at its weights.

If sglang is not installed the server tests skip, except under CI=true, where they fail: CI must run them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

import pytest
import torch

from gspo_megatron.rollout import SGLangConfig, SGLangEngine
from gspo_megatron.rollout import server as server_mod
from gspo_megatron.rollout import synthetic

from .helpers import require_sglang

def pytest_configure(config):
    config.addinivalue_line("markers", "destroys_server: hangs or stops the shared server; runs last")


def pytest_collection_modifyitems(config, items):
    """Within this package, tests that hang, kill or shut down a shared server run after every test that needs it
    (stable order); the package's items stay where they were in the session."""
    here = Path(__file__).parent
    slots = [i for i, item in enumerate(items) if here in Path(str(item.path)).parents]
    ours = [items[i] for i in slots]
    ours.sort(key=lambda item: item.get_closest_marker("destroys_server") is not None)
    for i, item in zip(slots, ours):
        items[i] = item


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


@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tiny models run far faster on one thread than on two contended ones (the servers use one too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="package")
def tiny_model_dir(tmp_path_factory):
    return synthetic.save_tiny_model(tmp_path_factory.mktemp("tiny_qwen3_moe"), seed=0)


@pytest.fixture(scope="package")
def started_servers(tiny_model_dir, tmp_path_factory):
    require_sglang()
    log_dir = tmp_path_factory.mktemp("sglang_logs")
    config = server_config(tiny_model_dir, log_dir)
    started = {}
    try:
        for name in ("main", "interrupt"):
            # main also captures the experts it routes to (rollout routing replay's tests ask for them)
            extra = ("--enable-return-routed-experts",) if name == "main" else ()
            started[name] = server_mod.start_servers(replace(config, log_dir=str(log_dir / name), extra_args=extra))
        yield config, started
    finally:
        for servers in started.values():
            for server in servers:
                server.shutdown()


@pytest.fixture(scope="package")
def engine(started_servers):
    config, started = started_servers
    with SGLangEngine(config, servers=started["main"]) as engine:
        yield engine


@dataclass
class Trainer:
    """The in-process policy whose weights the main server serves (tests that sync weights update it)."""

    model: torch.nn.Module


@pytest.fixture(scope="package")
def trainer(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), dtype=torch.float32).eval()
    return Trainer(model)
