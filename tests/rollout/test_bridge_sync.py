"""The trainer's Megatron policy, built through the HF <-> Megatron bridge, against the real SGLang server.

Under expert parallelism (EP=2 on 2 gloo ranks): the fused-op log-likelihood of SGLang's samples inside
Megatron's schedule (``logprob_pass``) equals SGLang's ``output_token_logprobs`` (fp32: <= 1e-3 per token)
before and after a GSPO ``update_step`` followed by a distributed weight sync from ``Bridge.export_hf_weights``
(experts all-gathered over EP into HF names), and the server reports the new version. The same export fed
to a ``LocalEngine`` gives samples whose log-probs Megatron reproduces too.
"""

from __future__ import annotations


from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.rollout import hf_weights
from gspo_megatron.rollout.weight_sync import save_checkpoint

from .bridge_ranks import bridge_sync
from .helpers import TOLERANCE


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
