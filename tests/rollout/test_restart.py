"""Rollout server fault tolerance against the real CPU server: a launched server SIGKILLed mid-generation is
restarted on its port, brought back to the current weights (the last disk sync's snapshot) and the unanswered
requests are resent, with the same (greedy) samples as an undisturbed run (also when it hangs: SIGSTOP); more
restarts than ``max_server_restarts`` within the window fail naming the server; an attached server that goes away
is waited for up to ``attached_wait_s``, then named in the error; after a distributed sync a restarted server is
stale until the next sync."""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from dataclasses import replace

import pytest

from gspo_megatron.rollout import SamplingParams, SGLangEngine, StaleWeights, TooManyRestarts
from gspo_megatron.rollout import hf_weights

from .helpers import prompts
from .proxy import FailingProxy

# Greedy: the servers are not started with --enable-deterministic-inference, without which SGLang 0.5.23 ignores
# sampling_seed (sampling_batch_info.py), so a resent request samples anew; top_k=1 (greedy) tokens are
# reproducible.
LONG = SamplingParams(max_new_tokens=400, ignore_eos=True, top_k=1)  # a few seconds on CPU
QUICK = SamplingParams(max_new_tokens=8, top_k=1)


def _tokens(groups):
    return [[(s.response_ids, s.weight_version) for s in g.samples] for g in groups]


def test_attached_server_that_goes_away_is_waited_for(started_servers, engine):
    config, _ = started_servers
    proxy = FailingProxy(engine.worker_urls[0], failures=0).__enter__()
    port = int(proxy.url.rsplit(":", 1)[1])
    attached = SGLangEngine(replace(config, urls=(proxy.url,), model_path="", max_retries=1, attached_wait_s=30))
    expected = _tokens(attached.generate(prompts(4), n=2, sampling=QUICK))
    proxy.__exit__()  # connections refused from now on
    back = []
    timer = threading.Timer(2.0, lambda: back.append(
        FailingProxy(engine.worker_urls[0], failures=0, port=port).__enter__()))
    timer.start()
    try:
        start = time.monotonic()
        assert _tokens(attached.generate(prompts(4), n=2, sampling=QUICK)) == expected
        assert 1.5 < time.monotonic() - start < 30
        metrics = attached.fault_metrics()
        assert metrics["rollout/server_restarts"] == 0 and metrics["rollout/seconds_lost"] > 1.0
    finally:
        timer.join()
        for p in back:
            p.__exit__()
    start = time.monotonic()  # gone for good: named after attached_wait_s
    with pytest.raises(TooManyRestarts, match=rf"attached server {proxy.url} did not answer again within "
                                              r"attached_wait_s=2 s"):
        replace_wait = replace(attached.config, attached_wait_s=2.0)
        attached.config = replace_wait
        attached.generate(prompts(2), n=2, sampling=QUICK)
    assert time.monotonic() - start < 15
    attached.close()


@pytest.mark.destroys_server
def test_killed_server_is_restarted_at_the_current_weights(engine, trainer):
    """SIGKILL the launched server mid-rollout: restarted, back at the disk-synced version, and the resent requests
    give exactly the undisturbed run's (greedy) tokens."""
    # A sync first: it restarts the server if an earlier test left it dead, and brings it to this version even when
    # that restart is stale (the suite's last sync was a distributed one), which a generate would refuse.
    version = f"restart-{uuid.uuid4().hex[:6]}"
    engine.update_weights(hf_weights.checkpoint_tensors(trainer.model), version, method="disk")
    start = time.monotonic()
    expected = engine.generate(prompts(8), n=4, sampling=LONG)
    undisturbed = time.monotonic() - start
    before = engine.fault_metrics()
    server = engine.servers[0]
    timer = threading.Timer(min(1.0, undisturbed / 3), lambda: os.killpg(server.process.pid, signal.SIGKILL))
    timer.start()
    groups = engine.generate(prompts(8), n=4, sampling=LONG)
    timer.join()
    after = engine.fault_metrics()
    assert after["rollout/server_restarts"] - before["rollout/server_restarts"] == 1
    assert after["rollout/seconds_lost"] - before["rollout/seconds_lost"] > 1.0
    assert engine.servers[0].process.pid != server.process.pid and engine.servers[0].url == server.url
    assert engine.weight_version() == version
    assert {s.weight_version for g in groups for s in g.samples} == {version}
    assert _tokens(groups) == _tokens(expected)  # same weights, greedy: the same samples
    for g, e in zip(groups, expected):
        for s, t in zip(g.samples, e.samples):
            assert max(abs(a - b) for a, b in zip(s.logprobs, t.logprobs)) < 1e-4


@pytest.mark.destroys_server
def test_hung_server_is_restarted(engine, monkeypatch):
    """SIGSTOP the launched server mid-rollout: after health_failures missed probes it is killed, started again and
    the requests resent; the tokens equal the undisturbed run's (greedy)."""
    monkeypatch.setattr(engine, "config", replace(engine.config, health_interval_s=1.0, health_timeout_s=2.0,
                                                  health_failures=2, max_server_restarts=10))
    expected = engine.generate(prompts(8), n=4, sampling=LONG)
    before = engine.fault_metrics()["rollout/server_restarts"]
    server = engine.servers[0]
    timer = threading.Timer(1.0, lambda: os.killpg(server.process.pid, signal.SIGSTOP))
    timer.start()
    try:
        groups = engine.generate(prompts(8), n=4, sampling=LONG)
    finally:
        timer.join()
        if server.alive():
            os.killpg(server.process.pid, signal.SIGCONT)
    assert engine.fault_metrics()["rollout/server_restarts"] == before + 1
    assert not server.alive() and engine.servers[0].alive()
    assert _tokens(groups) == _tokens(expected)


@pytest.mark.destroys_server
def test_after_a_distributed_sync_a_restarted_server_waits_for_the_next_sync(engine, trainer, monkeypatch):
    """The weights came by broadcast, which only the trainer can repeat: a server killed between rollouts is
    restarted, generation refuses (StaleWeights) until the next sync: a disk sync serves its version, and so does
    the next distributed one, which forms a new group with the restarted server."""
    monkeypatch.setattr(engine, "config", replace(engine.config, max_server_restarts=10))
    engine.generate(prompts(1), n=1, sampling=QUICK)
    synced = f"dist-{uuid.uuid4().hex[:6]}"
    engine.update_weights(hf_weights.checkpoint_tensors(trainer.model), synced, method="distributed")
    server = engine.servers[0]
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=10)
    with pytest.raises(StaleWeights, match=rf"restarted and serve their launch weights, not version '{synced}'"):
        engine.generate(prompts(2), n=2, sampling=QUICK)
    assert engine.servers[0].alive() and engine.servers[0].process.pid != server.process.pid
    on_disk = f"{synced}-disk"  # every worker loads the whole snapshot: none is stale any more
    engine.update_weights(hf_weights.checkpoint_tensors(trainer.model), on_disk, method="disk")
    groups = engine.generate(prompts(2), n=2, sampling=QUICK)
    assert {s.weight_version for g in groups for s in g.samples} == {on_disk}
    resynced = f"{synced}-resync0"
    engine.update_weights(hf_weights.checkpoint_tensors(trainer.model), resynced, method="distributed")
    groups = engine.generate(prompts(2), n=2, sampling=QUICK)
    assert {s.weight_version for g in groups for s in g.samples} == {resynced}


@pytest.mark.destroys_server
def test_restarts_beyond_the_bound_fail_naming_the_server(engine, monkeypatch):
    """Killed between rollouts once more than max_server_restarts allows within the window: a clear error, no
    restart (so no server start either)."""
    server = engine.servers[0]
    done = engine.restarts_in_window(server.name)
    assert done >= 1  # the test above restarted it
    monkeypatch.setattr(engine, "config", replace(engine.config, max_server_restarts=done))
    os.killpg(server.process.pid, signal.SIGKILL)
    server.process.wait(timeout=10)
    with pytest.raises(TooManyRestarts, match=rf"sglang server 0 at {server.url} failed again after {done} restarts "
                                              rf"within 3600 s \(max_server_restarts={done}.*killed by signal 9"):
        engine.generate(prompts(2), n=2, sampling=QUICK)
