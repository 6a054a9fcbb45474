"""Multi-turn rollouts in the trainer: config validation names the field, and the loop runs with rollout.env (local
engine, world=1) logging the turn metrics."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from gspo_megatron.train.startup.config import ConfigError, load_config
from gspo_megatron.train.startup.validate import validate
from tests import warm_cli

ROOT = Path(__file__).resolve().parents[3]
ENV = "tests.rewards.user_envs:ScriptedEnv"


@pytest.mark.parametrize("overrides, message", [
    (["rollout.env=no_such_module_xyz:Env"], r"rollout.env='no_such_module_xyz:Env': cannot import"),
    (["rollout.env=tests.rewards.user_envs:Missing"], r"rollout.env=.*no class 'Missing'"),
    (["rollout.env=calculatorr"], r"rollout.env='calculatorr' is neither a built-in"),
    ([f"rollout.env={ENV}", "rollout.max_turns=0"], r"rollout.max_turns=0 must be > 0"),
    (["algo.token_advantages=turns", "algo.name=gspo_token"], r"algo.token_advantages='turns' needs rollout.env"),
    ([f"rollout.env={ENV}", "algo.token_advantages=turns"], r"set algo.name=gspo_token"),
    (["algo.gamma=0.9"], r"algo.gamma=0.9 applies to algo.token_advantages='turns' only"),
    ([f"rollout.env={ENV}", "algo.token_advantages=turns", "algo.name=grpo", "algo.gamma=0"], r"algo.gamma=0.0 must"),
    (["rollout.env=python", "rollout.env_args={cpu_seconds: 0}"], r"rollout.env_args.cpu_seconds=0 must be"),
    (["rollout.env=python", "rollout.env_args={memory_mb: 8}"], r"rollout.env_args.memory_mb=8 must be"),
    (["rollout.env=python", "rollout.env_args={cpu_secs: 2}"],
     r"rollout.env_args=.* for rollout.env=python: .*unexpected keyword argument 'cpu_secs'"),
    (["rollout.env=calculator", "rollout.env_args={x: 1}"], r"rollout.env=calculator: CalculatorEnv\(\) takes no"),
])
def test_env_config_errors_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message):
        validate(load_config(None, ["data.task=count", *overrides]), 1)


def test_env_config_accepted():
    validate(load_config(None, ["data.task=count", "rollout.env=calculator"]), 1)
    validate(load_config(None, ["data.task=count", "rollout.env=python",
                                "rollout.env_args={cpu_seconds: 2, memory_mb: 256, output_bytes: 512, "
                                "wall_seconds: 4}"]), 1)
    validate(load_config(None, ["data.task=count", f"rollout.env={ENV}", "algo.name=gspo_token",
                                "algo.token_advantages=turns", "algo.gamma=0.9"]), 1)


def test_plan_sizes_trajectories():
    from gspo_megatron.plan.memory import padded_length

    single = load_config(None, ["rollout.max_prompt_tokens=16", "rollout.max_new_tokens=8"])
    multi = load_config(None, ["rollout.max_prompt_tokens=16", "rollout.max_new_tokens=8", "rollout.env=calculator",
                               "rollout.max_trajectory_tokens=100"])
    assert (padded_length(single), padded_length(multi)) == (24, 116)


@pytest.mark.megatron  # trains the Megatron policy through the CLI
def test_loop_runs_multiturn_rollouts(tmp_path):
    run = tmp_path / "run"
    command = [sys.executable, "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
               "rollout.engine=local", "train.steps=2", "train.eval_every=0", "model.warm_start_steps=0",
               f"model.hf_dir={tmp_path / 'model'}", f"logging.dir={run}", "checkpoint.dir=", "logging.plot_every=0",
               "rollout.prompts_per_step=2", "rollout.group_size=2", "parallel.micro_batch_size=2",
               "rollout.max_new_tokens=3", f"rollout.env={ENV}", "rollout.env_args={turns: 2}",
               "rollout.max_turns=3", "algo.name=gspo_token", "algo.token_advantages=turns", "algo.gamma=0.9"]
    out = warm_cli.run(command, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, WORLD_SIZE="1"),
                     timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    for r in records:
        assert r["turns_mean"] == 2.0 and r["turns_max"] == 2.0 and r["env_done_frac"] == 1.0
        assert r["observation_tokens_mean"] > 0 and r["reward_mean"] == 1.5  # 0.5 + 1.0
        assert r["logprob_diff_max"] < 1e-4  # the trainer's log-probs of the model's tokens equal the engine's


def test_warm_start_trains_the_model_turns_only():
    """demonstration_batch: labels are the ids on the model's turns (EOS included) and -100 on the prompt, the
    calculator's observations and the padding; a single-turn task's rows are prompt + answer + EOS as before."""
    from gspo_megatron.rewards.synthetic import EOS, Problem, char_tokenizer, make_problems
    from gspo_megatron.train.startup.bootstrap import demonstration_batch

    tokenizer = char_tokenizer(128)
    call = Problem("12*34=", "408", (("<calc>12*34</calc>" + EOS, True), ("<result>408</result>", False),
                                     ("408" + EOS, True)))
    ids, labels = demonstration_batch([call, Problem("rev ab=", "ba")], tokenizer)
    text = "12*34=<calc>12*34</calc><|endoftext|><result>408</result>408<|endoftext|>"
    assert tokenizer.decode(ids[0]) == text and ids.shape == (2, len("12*34=<calc>12*34</calc>") + 1 + 20 + 4)
    trained = [t for t, label in zip(ids[0].tolist(), labels[0].tolist()) if label != -100]
    assert tokenizer.decode(trained) == "<calc>12*34</calc><|endoftext|>408<|endoftext|>"
    assert (labels[0] == -100).sum() == len("12*34=") + len("<result>408</result>")
    assert tokenizer.decode(ids[1][:len("rev ab=ba") + 1]) == "rev ab=ba<|endoftext|>"
    assert labels[1].tolist() == [-100] * 7 + [ids[1][7].item(), ids[1][8].item(), 0] + [-100] * (ids.shape[1] - 10)
    problems = make_problems("mul", 64, seed=0)
    ids, labels = demonstration_batch(problems, tokenizer)
    assert ids.shape[0] == 64 and ((labels == -100) | (labels == ids)).all()
