"""A user's mistakes never train silently, through the command line as a user runs it (a process of its own, real
files, the local engine at world 1): a reward that fails on every sample stops the run with its own error, even with
data.on_reward_error=mask (and a failure share over a window of steps does too)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from gspo_megatron.train.resilience.faults import MaskedRewardGuard
from gspo_megatron.rollout.errors import RewardError
from tests import warm_cli

ROOT = Path(__file__).resolve().parents[2]
# Builds and trains the policy only with the calls of the plain loop's test (which runs on megatron-core 0.19 too).
COVERED = pytest.mark.megatron_covered_by("tests/train/test_loop.py::test_train_logs_plots_and_resumes_exactly")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """The CPU example's tiny model (random weights: what it says does not matter here)."""
    from gspo_megatron.rollout.synthetic import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0, vocab_size=128, hidden_size=128,
                           num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, num_experts=4, top_k=2,
                           moe_intermediate_size=64)


def train(model_dir: Path, run: Path, *extra: str, cwd: Path = ROOT, config: str | None = None):
    """``gspo-megatron train`` on the CPU example at world 1 with the local engine, 2 prompts x 8 a step."""
    args = [sys.executable, "-m", "gspo_megatron.cli", "train", config or str(ROOT / "examples/tiny_moe_cpu.yaml"),
            "rollout.engine=local", "train.steps=3", "train.eval_every=0", f"model.hf_dir={model_dir}",
            f"logging.dir={run}", "checkpoint.dir=", "logging.plot_every=0", "rollout.prompts_per_step=2",
            "parallel.micro_batch_size=8", *extra]
    env = dict(os.environ, WORLD_SIZE="1", PYTHONPATH=str(ROOT))
    return warm_cli.run(args, capture_output=True, text=True, cwd=cwd, env=env, timeout=600)


def test_the_masked_reward_guard_counts_steps_and_shares():
    import torch

    guard = MaskedRewardGuard(max_share=0.5, window=3)
    half = torch.tensor([True, False])
    for step in (1, 2):  # 50 % masked: not more than the share, and the window is not full yet
        guard.check(step, half, ["reward r raised KeyError: 'x' for sample 0"])
    guard.check(2, torch.tensor([True, True]), [])  # step 2 sampled again (a resync): it counts once
    guard.check(3, half, [])  # 2 of 6 masked over steps 1-3
    with pytest.raises(RewardError, match=r"steps 2-4: 56% of the rewards failed .* "
                                          r"data.max_masked_reward_share=0.5 .* the last: reward r raised KeyError"):
        guard.check(4, torch.tensor([False] * 4 + [True]), [])  # 0 + 1 + 4 of 2 + 2 + 5
    with pytest.raises(RewardError, match=r"step 1: every reward \(2 of 2\) failed"):
        MaskedRewardGuard(max_share=1.0, window=10).check(1, torch.tensor([False, False]), ["boom"])


@pytest.mark.megatron
@COVERED
def test_a_reward_that_always_fails_stops_the_run_even_when_masked(model_dir, tmp_path):
    out = train(model_dir, tmp_path / "run", "data.reward=tests.rollout.user_rewards:known_answers",
                "data.on_reward_error=mask", "data.reward_workers=1")
    assert out.returncode == 1, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "RewardError" in line]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert ("gspo-megatron train: RewardError: step 1: every reward (16 of 16) failed and was masked" in lines[0]
            and "reward tests.rollout.user_rewards:known_answers raised KeyError" in lines[0]), lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()

    # raise (the default): the first failure's own error, naming the real field that would mask it
    out = train(model_dir, tmp_path / "raise", "data.reward=tests.rollout.user_rewards:known_answers",
                "data.reward_workers=0")
    assert out.returncode == 1, out.stderr[-3000:]
    assert "set data.on_reward_error=mask to drop such samples" in out.stderr and "Traceback" not in out.stderr
