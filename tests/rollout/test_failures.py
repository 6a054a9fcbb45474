"""Failures against real SGLang servers: a transient 5xx is retried, a persistent one fails the request, a hung
server or one killed mid-rollout gives a clear error within a bounded time (never a partial batch), and Ctrl-C
shuts the servers down."""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import replace

import psutil
import pytest

from gspo_megatron.parallel.groups import free_port
from gspo_megatron.rollout import (RequestFailed, SamplingParams, ServerDied, ServerUnresponsive, SGLangConfig,
                                   SGLangEngine)

from tests.processes import still_running
from tests.sglang_servers import pair_config

from .helpers import prompts
from .proxy import FailingProxy

LONG = SamplingParams(max_new_tokens=400, ignore_eos=True)  # a rollout that takes a few seconds on CPU


def _attached(config, url, **overrides) -> SGLangConfig:
    return replace(config, urls=(url,), model_path="", **overrides)


def test_http_5xx_is_retried(started_servers, engine):
    config, _ = started_servers
    with FailingProxy(engine.worker_urls[0], failures=2, status=503) as proxy:
        attached = SGLangEngine(_attached(config, proxy.url, prompts_per_request=8))
        groups = attached.generate(prompts(4), n=2, sampling=SamplingParams(max_new_tokens=4))
        attached.close()
    assert proxy.failed == 2 and len(groups) == 4 and all(len(g.samples) == 2 for g in groups)


def test_persistent_5xx_fails_after_bounded_retries(started_servers, engine):
    config, _ = started_servers
    with FailingProxy(engine.worker_urls[0], failures=-1, status=500) as proxy:
        attached = SGLangEngine(_attached(config, proxy.url, prompts_per_request=8, max_retries=2))
        start = time.monotonic()
        with pytest.raises(RequestFailed, match="HTTP 500.*after 2 retries|after 2 retries.*HTTP 500"):
            attached.generate(prompts(2), n=2, sampling=SamplingParams(max_new_tokens=4))
        assert time.monotonic() - start < 10
    assert proxy.failed == 3  # the first attempt and two retries


def test_attached_server_that_is_not_there(started_servers):
    config, _ = started_servers
    start = time.monotonic()
    with pytest.raises(ServerDied, match="refuses connections"):
        SGLangEngine(_attached(config, f"http://127.0.0.1:{free_port()}", max_retries=1))
    assert time.monotonic() - start < 10


def _after(seconds, action):
    timer = threading.Timer(seconds, action)
    timer.start()
    return timer


@pytest.mark.destroys_server
def test_hung_server_is_reported_within_bounded_time(engine, monkeypatch):
    """SIGSTOP the whole server mid-rollout: health probes time out, the rollout fails (not hangs) in about
    health_failures x (health_interval + health_timeout) seconds, and the server recovers after SIGCONT."""
    monkeypatch.setattr(engine, "config", replace(engine.config, health_interval_s=1.0, health_timeout_s=2.0,
                                                  health_failures=2, max_server_restarts=0))  # (test_restart.py)
    server = engine.servers[0]
    try:
        timer = _after(1.0, lambda: os.killpg(server.process.pid, signal.SIGSTOP))
        start = time.monotonic()
        with pytest.raises(ServerUnresponsive, match="missed 2 health probes"):
            engine.generate(prompts(8), n=4, sampling=LONG)
        elapsed = time.monotonic() - start
        timer.join()
        assert elapsed < 30, elapsed
    finally:
        os.killpg(server.process.pid, signal.SIGCONT)
    # Still usable afterwards (the aborted requests do not come back as samples).
    groups = engine.generate(prompts(2), n=2, sampling=SamplingParams(max_new_tokens=4))
    assert [len(g.samples) for g in groups] == [2, 2]


@pytest.mark.destroys_server
def test_killed_server_is_reported_with_its_log(engine, monkeypatch):
    monkeypatch.setattr(engine, "config", replace(engine.config, max_server_restarts=0))  # (test_restart.py)
    server = engine.servers[0]
    timer = _after(1.0, lambda: os.killpg(server.process.pid, signal.SIGKILL))
    start = time.monotonic()
    with pytest.raises(ServerDied, match=r"killed by signal 9.*last lines of .*sglang_server_0\.log"):
        engine.generate(prompts(8), n=4, sampling=LONG)
    timer.join()
    assert time.monotonic() - start < 15


@pytest.mark.destroys_server
def test_ctrl_c_shuts_the_servers_down(started_servers):
    config, started = started_servers
    engine = SGLangEngine(pair_config(config), servers=started["pair"][1:])  # (after the two-server tests)
    server = engine.servers[0]
    assert os.getpgid(server.process.pid) != os.getpgid(0)  # its own session: a terminal Ctrl-C reaches us only
    tree = [server.process.pid] + [p.pid for p in psutil.Process(server.process.pid).children(recursive=True)]
    assert len(tree) >= 3  # the HTTP server, its scheduler and detokenizer processes
    # Ctrl-C (a real SIGINT to this process, as a terminal sends) 0.1 s into the rollout, sent again every 0.2 s
    # until the rollout has ended: a SIGINT that lands while the main thread runs a finalizer is dropped by Python
    # ("Exception ignored in ..."). Once the rollout has ended, SIGINT is ignored until the sender has stopped: the
    # shut-down under test runs uninterrupted, and no late press escapes the test. The rollout, 32 x 200 tokens
    # through a KV cache of PAIR_KV_TOKENS, takes seconds. Python's own Ctrl-C handler is installed for the test: a
    # process started as a background job of a non-interactive shell (as CI can be) starts with SIGINT ignored, and
    # Python leaves it so (CI on 4a01b6f and on 94bfd82: the handler was SIG_IGN, every press dropped).
    ended, presses = threading.Event(), []

    def press_until_ended():
        for wait in [0.1] + [0.2] * 100:
            if ended.wait(wait):
                return
            presses.append(time.monotonic() - began)
            os.kill(os.getpid(), signal.SIGINT)

    presser = threading.Thread(target=press_until_ended)
    handler, groups, interrupted, took = signal.getsignal(signal.SIGINT), None, False, None
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        with engine:
            began = time.monotonic()
            presser.start()
            try:
                groups = engine.generate(prompts(8), n=4, sampling=SamplingParams(max_new_tokens=200, ignore_eos=True))
            finally:
                signal.signal(signal.SIGINT, signal.SIG_IGN)
                took = time.monotonic() - began
                ended.set()
                presser.join()
    except KeyboardInterrupt:
        interrupted = True
    finally:
        signal.signal(signal.SIGINT, handler)
    assert interrupted, (f"no KeyboardInterrupt: the rollout returned after {took:.2f} s, Ctrl-C pressed at "
                         f"{[round(t, 2) for t in presses]} s; response lengths "
                         f"{[len(s.response_ids) for g in groups for s in g.samples]}")
    alive = still_running(tree, seconds=10)
    assert not alive, f"processes of the interrupted engine's server still running: {alive}"
