"""The README's CPU example config, with its real SGLang server on 127.0.0.1, under torchrun at TP=2 x EP=2.

A few steps only (learning is shown by the full run, whose numbers are in docs/examples.md): four gloo ranks build the
tiny Qwen3-MoE, rank 0 launches SGLang, every step syncs the updated shards back to it, and the rollout's
log-probs must match the trainer's, which they only do if the synced weights are the trained ones.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rollout.helpers import require_sglang

pytestmark = pytest.mark.megatron  # trains the Megatron policy through the CLI

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_example_under_torchrun_tp2_ep2(tmp_path):
    require_sglang()
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    cmd = [torchrun, "--standalone", "--nproc-per-node", "4", "-m", "gspo_megatron.cli", "train",
           str(ROOT / "examples/tiny_moe_cpu.yaml"), "parallel.tensor=2", "parallel.expert=2",
           "train.steps=3", "train.eval_every=2", "model.warm_start_steps=5", "rollout.prompts_per_step=4",
           "parallel.micro_batch_size=8",
           f"model.hf_dir={tmp_path / 'model'}", f"logging.dir={tmp_path}", f"checkpoint.dir={tmp_path / 'ck'}",
           "checkpoint.every=0", "logging.plot_every=3"]
    # One torch thread per rank: four ranks and the server share the machine's cores.
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    # Steps 2 and 3 roll out with weights synced from the TP x EP shards after an update: fp32 agreement.
    assert max(r["logprob_diff_max"] for r in records) < 1e-4, [r["logprob_diff_max"] for r in records]
    assert all(r["weight_sync/tensors"] > 0 for r in records)
    # Metrics over both data-parallel ranks' sequences, and expert volatility summed over TP x EP ranks' routers.
    assert all(0 < r["clip_frac_seqs"] < 1 and 0 <= r["expert_volatility"] <= 1 for r in records), records
    assert "eval_reward_mean" in records[1]
    assert (tmp_path / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "ck" / "latest").read_text() == "step_000003"
