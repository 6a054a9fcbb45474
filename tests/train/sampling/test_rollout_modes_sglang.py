"""rollout.mode one_step_off and async through the real loop, against the real SGLang CPU server it launches.

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

from tests import warm_cli
from tests.rollout.helpers import require_sglang

pytestmark = pytest.mark.megatron  # trains the Megatron policy through the CLI

ROOT = Path(__file__).resolve().parents[3]


def _train(tmp_path: Path, name: str, *extra: str) -> list[dict]:
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
           "train.steps=4", "train.eval_every=0", "model.warm_start_steps=5", "rollout.prompts_per_step=4",
           "parallel.micro_batch_size=8", f"model.hf_dir={tmp_path / 'model'}", f"logging.dir={tmp_path / name}",
           "checkpoint.dir=", "logging.plot_every=0", *extra]
    env = dict(os.environ, WORLD_SIZE="1", OMP_NUM_THREADS="1")
    out = warm_cli.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    return [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]


def test_one_step_off_and_async_against_sglang(tmp_path):
    require_sglang()
    records = _train(tmp_path, "one_step_off", "rollout.mode=one_step_off")
    assert [(r["staleness_mean"], r["staleness_max"]) for r in records] == [(0, 0)] + [(1, 1)] * 3, records
    assert [r["weight_version_min"] for r in records] == [0, 0, 1, 2]
    assert records[0]["logprob_diff_max"] < 1e-4, records[0]  # version 0's samples, trained by version 0
    assert all(r["weight_sync/tensors"] > 0 for r in records)
    assert all(r["samples_across_syncs"] == 0 for r in records)  # the server's own version agrees

    records = _train(tmp_path, "async", "rollout.mode=async", "rollout.max_staleness=2")
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert all(0 <= r["staleness_mean"] <= r["staleness_max"] <= 2 for r in records), records
    print("async:", [(r["staleness_max"], r["samples_across_syncs"], r["weight_sync/paused"]) for r in records])
    # Generation really ran ahead of training (sync would give 0 throughout), and the syncs that had requests in
    # flight held them on the server (pause / continue) rather than waiting for them.
    assert max(r["staleness_max"] for r in records) >= 1, records
    assert sum(r["weight_sync/paused"] for r in records) >= 1, records
    assert all(r["weight_sync/tensors"] > 0 for r in records)


def test_partial_rollouts_against_sglang(tmp_path):
    """rollout.partial_chunk_tokens against the real server: chunks continued from token ids (prompt + response so
    far) under the next step's weights. With partial_mask=old_tokens the loss and the log-prob gap cover only the
    tokens recorded as the current version's: they equal the trainer's recomputation to fp32 rounding at every step,
    so each token's recorded version is the one the server sampled it with (older tokens differ by ~0.5)."""
    require_sglang()
    records = _train(tmp_path, "partial", "train.steps=3", "rollout.partial_chunk_tokens=2",
                     "rollout.partial_mask=old_tokens")
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["logprob_diff_max"] < 1e-4 for r in records), [r["logprob_diff_max"] for r in records]
    assert max(r["partial/max_versions_spanned"] for r in records) == 2
    assert any(r["partial/samples_spanning_versions"] > 0 and r["staleness_max"] == 1 for r in records)
