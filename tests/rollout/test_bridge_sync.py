"""The trainer's Megatron policy, built through the HF <-> Megatron bridge, against the real SGLang server.

Under expert parallelism (EP=2 on 2 gloo ranks): the fused-op log-likelihood of SGLang's samples inside
Megatron's schedule (``logprob_pass``) equals SGLang's ``output_token_logprobs`` (fp32: <= 1e-3 per token)
before and after a GSPO ``update_step`` followed by a distributed weight sync from ``Bridge.export_hf_weights``
(experts all-gathered over EP into HF names), and the server reports the new version. The same export fed
to a ``LocalEngine`` gives samples whose log-probs Megatron reproduces too.

The trainer's own sync (``train.weight_sync.sync.sync_weights``) from the loop's policy under PP=2 x EP=2 on 4 gloo ranks:
two senders (each stage's first rank, each in its own group with the server), experts gathered to them over EP,
the second data-parallel replica idle; after moving every weight and syncing, SGLang's log-probs equal the
trainer's again (<= 1e-3 per token, fp32) on every rank.
"""

from __future__ import annotations


import pytest

from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.rollout import hf_weights
from gspo_megatron.rollout.weight_sync import save_checkpoint

from .bridge_ranks import bridge_sync, stage_senders_sync
from .helpers import TOLERANCE

pytestmark = pytest.mark.megatron  # builds a Megatron model


def test_megatron_policy_through_bridge_matches_sglang_before_and_after_sync(engine, trainer, tiny_model_dir,
                                                                             tmp_path, record_property):
    # The server serves the session trainer's current weights (other tests may have synced some): start the
    # Megatron policy from exactly those.
    current = tmp_path / "current"
    save_checkpoint(hf_weights.checkpoint_tensors(trainer.model), current, tiny_model_dir, shard_bytes=1 << 30)
    try:
        results = run_on_ranks(bridge_sync, 2, Layout(expert=2), str(current), engine.worker_urls[0],
                               "megatron-ep2-1", timeout=300)
    finally:
        # Put the session trainer's weights back on the server for the tests that follow.
        engine.update_weights(hf_weights.checkpoint_tensors(trainer.model), "restored-after-bridge")
    for rank, r in enumerate(results):
        print(f"rank {rank}: before {r['before']} stale {r['stale']} after {r['after']}")
        record_property(f"rank{rank}", r)
        assert r["update_successful"]
        assert r["before"]["mismatch/token_max_abs"] <= TOLERANCE, r["before"]
        assert r["stale"]["mismatch/token_max_abs"] > 100 * TOLERANCE, r["stale"]  # the update moved the policy
        assert r["after"]["mismatch/token_max_abs"] <= TOLERANCE, r["after"]
        assert r["versions"] == ["megatron-ep2-1"]
        assert r["local"]["mismatch/token_max_abs"] <= TOLERANCE, r["local"]  # LocalEngine via the bridge
        assert r["local_versions"] == ["megatron-ep2-1-local"]
    assert results[0]["sync"]["version"] == "megatron-ep2-1"
    assert results[0]["sync"]["tensors"] == len(list(hf_weights.checkpoint_tensors(trainer.model)))


def test_stage_senders_sync_pp2_ep2(engine, trainer, tiny_model_dir, tmp_path, record_property):
    current = tmp_path / "current"
    save_checkpoint(hf_weights.checkpoint_tensors(trainer.model), current, tiny_model_dir, shard_bytes=1 << 30)
    try:
        results = run_on_ranks(stage_senders_sync, 4, Layout(pipeline=2, expert=2), str(current),
                               engine.worker_urls[0], "megatron-pp2-ep2", timeout=600)
    finally:
        engine.update_weights(hf_weights.checkpoint_tensors(trainer.model), "restored-after-stage-senders")
    sync = results[0]["sync"]
    print(f"stage senders: {sync}")
    record_property("sync", sync)
    for rank, r in enumerate(results):
        assert r["before"]["mismatch/token_max_abs"] <= TOLERANCE, (rank, r["before"])
        assert r["stale"]["mismatch/token_max_abs"] > 100 * TOLERANCE, (rank, r["stale"])
        assert r["after"]["mismatch/token_max_abs"] <= TOLERANCE, (rank, r["after"])
        assert r["versions"] == ["megatron-pp2-ep2"]
    assert sync["weight_sync/senders"] == 2.0
    assert sync["weight_sync/tensors"] == len(list(hf_weights.checkpoint_tensors(trainer.model)))
    assert sync["weight_sync/gb"] * 1e9 == sum(t.numel() * 4 for _, t in hf_weights.checkpoint_tensors(trainer.model))
