"""Two real SGLang servers on 127.0.0.1 (the session's ``pair``, tests/sglang_servers.py: each with a KV cache of 1024
tokens) and the trainer's side of them.

Rollout requests sized from the servers' capacity: one ``generate`` call of 8 prompts x 8 samples x (prompt + 40
tokens, every response at full length) is ~2.9k tokens, about three of either server's KV caches. The engine
reads each server's capacity from /server_info, splits the call into requests that fit one cache and keeps no more
in flight on a server than its cache holds (peak <= capacity); every group comes back whole. One prompt whose 24
samples alone exceed a cache is sent alone, with a time-out of two waves.

The weight sync from two pipeline-stage senders (PP2 on 2 gloo ranks, ``train.weight_sync.sync.sync_weights``, the loop's
own path) to two servers: each server takes one update call at a time and broadcasts on that call's group, so if
the stages sent at once, the two servers could take their buckets in opposite orders and each wait in one stage's
broadcast for the other. A proxy in front of each server records the update calls in the order it forwards them
and holds one back for HOLD_S: at server 0 the second stage's first bucket, at server 1 the first stage's, which
makes stages sending at once take opposite orders. On NCCL (a ring broadcast: each receiver forwards to the next)
that is the deadlock, until ``weight_sync.timeout_s``; gloo's broadcast sends from the root to each receiver
directly, so here it finishes, with the orders crossed (measured with the stages unordered: server 0 took
0, 1, 0, 1, ..., server 1 1, 0, 0, 1, ...): the test checks the order. Forming the groups has the same hazard
on every backend (a server joins one group at a time; two senders forming theirs at once were joined in opposite
orders by the two servers in CI, each waiting in one group for the other until the time-out): the proxies hold
back server 0's first join and server 1's second, and both servers must join stage 0's group, then stage 1's.
The stages send one after another, so both servers must see every bucket of stage 0, then every bucket of
stage 1, the same sequence; the update finishes and both servers serve the trainer's weights:
SGLang's log-probs equal the trainer's (<= 1e-3 per token, fp32; ~1e-6 measured) on every rank, from both servers.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

import pytest

from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.rollout import SamplingParams, SGLangEngine
from gspo_megatron.rollout import server as server_mod
from gspo_megatron.rollout.sglang_engine import request_tokens

from .bridge_ranks import stage_senders_sync
from tests.sglang_servers import PAIR_KV_TOKENS, pair_config
from .helpers import TOLERANCE, prompts
from .proxy import FailingProxy

SYNC_TIMEOUT_S = 90.0  # one bucket's call + broadcast; a deadlock between the stages fails after this
HOLD_S = 5.0
KV_TOKENS = PAIR_KV_TOKENS  # each server's KV cache: a third of the rollout call below


@pytest.fixture(scope="module")
def two_servers(started_servers):
    """The session's ``pair`` (tests/sglang_servers.py): two servers with KV caches of ``KV_TOKENS``."""
    config, started = started_servers
    servers = started["pair"]
    server_mod.wait_all_ready(servers, config.startup_timeout_s)
    return pair_config(config), [s.url for s in servers]


def _recording(server: int, order: list, joins: list):
    """``on_request`` for server ``server``'s proxy: records each update call's group, holding back the first call of
    stage 1 - server (rank 0's sender is stage 0, its group has no ``_r<rank>`` tag), and the order in which it is
    asked to join the senders' groups, holding back stage ``server``'s: senders forming their groups at once would
    have the two servers join them in opposite orders, each then waiting in one group for the other."""
    held = []

    def on_request(path, body):
        if path == "/init_weights_update_group":
            stage = 1 if "_r" in json.loads(body)["group_name"] else 0
            if stage == server:
                time.sleep(HOLD_S)
            joins.append(stage)
            return
        if path != "/update_weights_from_distributed":
            return
        group = json.loads(body)["group_name"]
        stage = 1 if "_r" in group else 0
        if stage == 1 - server and not held:
            held.append(group)
            time.sleep(HOLD_S)
        order.append(stage)

    return on_request


@pytest.mark.megatron
def test_two_stage_senders_update_two_servers_in_one_order(two_servers, tiny_model_dir, record_property):
    _, urls = two_servers
    sync = dict(bucket_bytes=4096, timeout_s=SYNC_TIMEOUT_S)
    orders, joins = [[], []], [[], []]
    with FailingProxy(urls[0], fail_paths=(), on_request=_recording(0, orders[0], joins[0])) as p0, \
            FailingProxy(urls[1], fail_paths=(), on_request=_recording(1, orders[1], joins[1])) as p1:
        results = run_on_ranks(stage_senders_sync, 2, Layout(pipeline=2), str(tiny_model_dir), [p0.url, p1.url],
                               "pp2-two-servers", sync, timeout=600)
    print(f"update calls by stage, per server: {orders}; groups joined: {joins}")
    assert joins == [[0, 1], [0, 1]], joins  # the groups formed one after another, in stage order, on both
    assert orders[0] == orders[1] == sorted(orders[0]), orders  # one order, stage by stage, on both servers
    assert 0 < orders[0].count(0) < len(orders[0]), orders  # both stages sent
    metrics = results[0]["sync"]
    record_property("sync", metrics)
    print(f"two servers, two stage senders: {metrics}")
    assert metrics["weight_sync/senders"] == 2.0
    assert metrics["weight_sync/buckets"] >= 20, metrics  # small buckets: the streams would interleave unordered
    assert metrics["weight_sync/seconds"] < SYNC_TIMEOUT_S, metrics
    for rank, r in enumerate(results):
        assert r["before"]["mismatch/token_max_abs"] <= TOLERANCE, (rank, r["before"])
        assert r["stale"]["mismatch/token_max_abs"] > 100 * TOLERANCE, (rank, r["stale"])
        assert r["after"]["mismatch/token_max_abs"] <= TOLERANCE, (rank, r["after"])
        assert r["versions"] == ["pp2-two-servers"]


def test_requests_are_sized_from_the_servers_kv_cache(two_servers):
    config, urls = two_servers
    sampling = SamplingParams(max_new_tokens=40, ignore_eos=True, seed=3)
    batch = prompts(8, seed=5)
    with SGLangEngine(replace(config, urls=tuple(urls), prompts_per_request=8, concurrency=8)) as engine:
        capacity = engine.capacities
        assert set(capacity) == set(urls) and all(0 < c <= KV_TOKENS for c in capacity.values()), capacity
        call = request_tokens(batch, 8, sampling.max_new_tokens)
        assert call > 2.5 * max(capacity.values()), (call, capacity)  # a cache holds a fraction of the call
        start = time.monotonic()
        groups = engine.generate(batch, n=8, sampling=sampling)
        seconds = time.monotonic() - start
        peak = engine.peak_tokens_in_flight
        print(f"capacity {capacity}, call {call} tokens, peak in flight {peak}, {seconds:.1f} s")
        assert [len(g.samples) for g in groups] == [8] * 8
        assert all(len(s.response_ids) == 40 == len(s.logprobs) for g in groups for s in g.samples)
        assert all(0 < peak[u] <= capacity[u] for u in urls), (peak, capacity)  # both servers used, never over
        # one prompt whose 24 samples (24 x (prompt + 40)) exceed a cache: alone on a server, two waves' time-out
        big = [list(range(3, 12))]
        assert capacity[urls[0]] < request_tokens(big, 24, 40) <= 2 * min(capacity.values())
        (group,) = engine.generate(big, n=24, sampling=sampling)
        assert len(group.samples) == 24 and all(len(s.response_ids) == 40 for s in group.samples)
