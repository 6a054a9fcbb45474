"""A launched SGLang server SIGKILLed inside a distributed weight update (the update open on it, the weights not
sent yet: ``train/resilience/fault_injection.py``'s ``weight_sync`` point) does not end the run: rank 0 restarts it, every rank
sends the whole update again, and the next rollouts come from the trained weights (the trainer's log-probs equal the
server's). Through the CLI at world=1 with the real CPU server, 3 steps, the kill in step 1's sync."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from gspo_megatron.train.resilience import fault_injection
from tests import warm_cli
from tests.rollout.helpers import require_sglang

pytestmark = pytest.mark.megatron  # trains the Megatron policy through the CLI

ROOT = Path(__file__).resolve().parents[3]


def test_server_killed_inside_a_weight_update_is_restarted_and_the_update_sent_again(tmp_path):
    require_sglang()
    scheduled = fault_injection.write(tmp_path / "faults.json",
                                      [{"at": "weight_sync", "step": 1, "action": "kill_server"}])
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
           "train.steps=3", "train.eval_every=0", "model.warm_start_steps=2", "rollout.prompts_per_step=4",
           "parallel.micro_batch_size=8", f"model.hf_dir={tmp_path / 'model'}", f"logging.dir={tmp_path / 'run'}",
           "checkpoint.dir=", "logging.plot_every=0", "logging.tensorboard=false", "data.reward_workers=0"]
    env = dict(os.environ, WORLD_SIZE="1", OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **scheduled)
    out = warm_cli.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]
    assert (tmp_path / "faults.json.fired.0").is_file()  # the kill happened, inside step 1's update
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[-1]["rollout/server_restarts"] == 1.0, records[-1]
    # Steps 2 and 3 roll out on the restarted server: with the trained weights, sent again (fp32 agreement).
    assert max(r["logprob_diff_max"] for r in records[1:]) < 1e-4, [r["logprob_diff_max"] for r in records]
