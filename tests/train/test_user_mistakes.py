"""A user's path through the command line as a user runs it (a process of its own, real files, the local engine at
world 1): a reward that fails on every sample stops the run with its own error, even with data.on_reward_error=mask
(and a failure share over a window of steps does too); a reward module beside the config is found from any folder,
and a prompt file without labels is warned of."""

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
    from gspo_megatron.rewards.synthetic import save_tiny_model

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
    out = train(model_dir, tmp_path / "run", "data.reward=tests.rewards.user_rewards:known_answers",
                "data.on_reward_error=mask", "data.reward_workers=1")
    assert out.returncode == 1, out.stderr[-3000:]
    lines = [line for line in out.stderr.splitlines() if "RewardError" in line]
    assert len(lines) == 1 and "Traceback" not in out.stderr, out.stderr[-3000:]
    assert ("gspo-megatron train: RewardError: step 1: every reward (16 of 16) failed and was masked" in lines[0]
            and "reward tests.rewards.user_rewards:known_answers raised KeyError" in lines[0]), lines[0]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not (tmp_path / "run" / "metrics.jsonl").read_text()

    # raise (the default): the first failure's own error, naming the real field that would mask it
    out = train(model_dir, tmp_path / "raise", "data.reward=tests.rewards.user_rewards:known_answers",
                "data.reward_workers=0")
    assert out.returncode == 1, out.stderr[-3000:]
    assert "set data.on_reward_error=mask to drop such samples" in out.stderr and "Traceback" not in out.stderr


REWARD_BESIDE = '''
from my_helpers import length_credit  # a module of the user's own, beside this one


def score(prompt, response, label):
    return length_credit(response)
'''


@pytest.mark.megatron
@COVERED
def test_a_reward_module_beside_the_config_and_a_prompt_file_without_labels(model_dir, tmp_path):
    """data.reward: my_rewards:score with my_rewards.py beside my_run.yaml, run from another folder, in the trainer
    and in a reward worker; the prompt file has no label field, which a custom reward is warned of, once."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "my_rewards.py").write_text(REWARD_BESIDE)
    (folder / "my_helpers.py").write_text("def length_credit(response):\n    return min(len(response), 4) / 4\n")
    (folder / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"rev {w}=", "solution": w[::-1]}) + "\n"
                                                  for w in ("abc", "bad", "cab", "dea")))
    example = (ROOT / "examples/tiny_moe_cpu.yaml").read_text()
    (folder / "my_run.yaml").write_text(example.replace("  task: reverse\n  reward: synthetic\n",
                                                        "  prompts: prompts.jsonl\n  reward: my_rewards:score\n"))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = train(model_dir, tmp_path / "run", "train.steps=1", "data.reward_workers=1", cwd=elsewhere,
                config=str(folder / "my_run.yaml"))
    assert out.returncode == 0, out.stderr[-3000:]
    warnings = [line for line in out.stderr.splitlines() if "has a label" in line]
    assert warnings == [f"gspo-megatron train: warning: no record of data.prompts='{folder / 'prompts.jsonl'}' has a "
                        "label (none of answer, label, tests, reward_model.ground_truth): data.reward="
                        f"'{folder / 'my_rewards.py'}:score' gets label=None (data.label_key names the field)"]
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["reward_masked"] == 0 and 0 <= record["reward_mean"] <= 1  # scored by my_rewards.score

    # not there: the message says where it looked
    (folder / "my_rewards.py").unlink()
    out = train(model_dir, tmp_path / "run2", cwd=elsewhere, config=str(folder / "my_run.yaml"))
    assert out.returncode == 2, out.stderr[-3000:]
    assert (f"data.reward='my_rewards:score': cannot import module 'my_rewards': no my_rewards.py (or package "
            f"my_rewards/) beside the config file (for a spec given in it), in the working directory {elsewhere} or "
            "on the Python path") in out.stderr, out.stderr[-3000:]


def test_code_named_in_a_config_resolves_beside_it(tmp_path):
    """rollout.env and data.reward modules beside the YAML become their files' paths; importable modules, built-ins
    and overrides stay as given."""
    from gspo_megatron.rewards.user_code import load_named
    from gspo_megatron.train.startup.config import load_config

    (tmp_path / "my_env.py").write_text("class MyEnv:\n    def reset(self, prompt): ...\n\n"
                                        "    def step(self, text, ids): ...\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "r.py").write_text("def score(p, r, l):\n    return 1.0\n")
    (tmp_path / "run.yaml").write_text("rollout:\n  env: my_env:MyEnv\ndata:\n  reward: sub/r.py:score\n"
                                       "  segment_reward: tests.rewards.user_rewards:length_reward\n")
    cfg = load_config(tmp_path / "run.yaml")
    assert cfg.rollout.env == f"{tmp_path / 'my_env.py'}:MyEnv"
    assert cfg.data.reward == f"{tmp_path / 'sub' / 'r.py'}:score"
    assert cfg.data.segment_reward == "tests.rewards.user_rewards:length_reward"
    assert load_named(cfg.data.reward, {}, "data.reward", "module:function", "callable")("", "", None) == 1.0
    assert load_named(cfg.rollout.env, {}, "rollout.env", "module:Class", "class").__name__ == "MyEnv"
    assert load_config(tmp_path / "run.yaml", ["data.reward=math"]).data.reward == "math"
