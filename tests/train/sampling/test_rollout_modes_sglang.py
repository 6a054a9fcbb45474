"""rollout.mode one_step_off and async through the real loop, against the session's real SGLang CPU server
(attached by URL, as to servers started apart: tests/sglang_servers.py's ``main``, serving the session trainer's
weights, which each run starts from and which are put back after it).

one_step_off: step 1 trains on version 0's samples (the engine's log-probs equal the trainer's: fp32), every later
step on samples exactly one version old, and the server reports the version the trainer recorded (its weights
reached it by the distributed sync while nothing was generating). async (max_staleness 2): every weight sync runs
with the server paused (SGLang's pause / continue generation, retract mode) while the next batches are in flight;
none is lost and staleness stays within 2.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from gspo_megatron.rollout import hf_weights
from gspo_megatron.rollout.weight_sync import save_checkpoint
from tests import warm_cli

pytestmark = pytest.mark.megatron  # trains the Megatron policy through the CLI

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture
def attached(engine, trainer, tiny_model_dir, tmp_path):
    """A run of the CLI attached to the session's server: its model directory holds the weights the server serves;
    each run's syncs are undone after it, so the next run, and the session's later tests, start from the session
    trainer's weights again."""
    model = tmp_path / "model"
    save_checkpoint(hf_weights.checkpoint_tensors(trainer.model), model, tiny_model_dir, shard_bytes=1 << 30)

    def run(name: str, *extra: str) -> list[dict]:
        cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
               "train.steps=4", "train.eval_every=0", "rollout.prompts_per_step=4", "parallel.micro_batch_size=8",
               f"model.hf_dir={model}", f"rollout.urls=[{engine.worker_urls[0]}]", f"logging.dir={tmp_path / name}",
               "checkpoint.dir=", "logging.plot_every=0", *extra]
        env = dict(os.environ, WORLD_SIZE="1", OMP_NUM_THREADS="1")
        try:
            out = warm_cli.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
        finally:
            # By disk: this process's broadcast group with the server may be gone (in-process tests before this one
            # destroy torch.distributed's groups), and the run's own group left with it.
            version = f"restored-after-{tmp_path.name}-{name}"
            engine.update_weights(hf_weights.checkpoint_tensors(trainer.model), version, method="disk")
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
        return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]

    return run


def test_one_step_off_and_async_against_sglang(attached):
    records = attached("one_step_off", "rollout.mode=one_step_off")
    assert [(r["staleness_mean"], r["staleness_max"]) for r in records] == [(0, 0)] + [(1, 1)] * 3, records
    assert [r["weight_version_min"] for r in records] == [0, 0, 1, 2]
    assert records[0]["logprob_diff_max"] < 1e-4, records[0]  # version 0's samples, trained by version 0
    assert all(r["weight_sync/tensors"] > 0 for r in records)
    assert all(r["samples_across_syncs"] == 0 for r in records)  # the server's own version agrees

    records = attached("async", "rollout.mode=async", "rollout.max_staleness=2")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(0 <= r["staleness_mean"] <= r["staleness_max"] <= 2 for r in records), records
    print("async:", [(r["staleness_max"], r["samples_across_syncs"], r["weight_sync/paused"]) for r in records])
    # Generation really ran ahead of training (sync would give 0 throughout), and the syncs that had requests in
    # flight held them on the server (pause / continue) rather than waiting for them.
    assert max(r["staleness_max"] for r in records) >= 1, records
    assert sum(r["weight_sync/paused"] for r in records) >= 1, records
    assert all(r["weight_sync/tensors"] > 0 for r in records)


def test_partial_rollouts_against_sglang(attached):
    """rollout.partial_chunk_tokens against the real server: chunks continued from token ids (prompt + response so
    far) under the next step's weights. With partial_mask=old_tokens the loss and the log-prob gap cover only the
    tokens recorded as the current version's: they equal the trainer's recomputation to fp32 rounding at every step,
    so each token's recorded version is the one the server sampled it with (older tokens differ by ~0.5)."""
    records = attached("partial", "train.steps=3", "rollout.partial_chunk_tokens=2", "rollout.partial_mask=old_tokens")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["logprob_diff_max"] < 1e-4 for r in records), [r["logprob_diff_max"] for r in records]
    # Samples cut at a step's end continue under the next weights. How many versions one spans (2, or 3 when cut
    # twice: max_new_tokens 6 is three chunks) and how stale it is when trained on (1, or 2 when its group
    # completed as a surplus and waited a step) depend on where the server's samples stop, so the test holds any.
    assert max(r["partial/max_versions_spanned"] for r in records) >= 2
    spanning = [r for r in records if r["partial/samples_spanning_versions"] > 0]
    assert spanning and all(r["staleness_max"] >= 1 for r in spanning), records  # stale by its oldest token
