"""Multi-turn rollouts (``rewards.multiturn``): token-exact trajectories from the local engine and a real SGLang
server, environment loading and errors, the calculator tool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from gspo_megatron.rewards import synthetic
from gspo_megatron.rewards.multiturn import (CalculatorEnv, TurnLimits, generate_trajectories, load_env, safe_eval,
                                             turn_metrics)
from gspo_megatron.rollout import (LocalEngine, RewardError, SamplingParams, ServerDied, flatten, logprob_mismatch,
                                   samples_to_batch)
from tests.rollout.helpers import fused_logprobs, prompts

from .user_envs import OBSERVATION_IDS, BadRewardEnv, FailingEnv, ScriptedEnv


@dataclass
class Record:
    ids: list[int]
    text: str = ""
    label: Any = None


class Recording:
    """An engine that records every generate call: (input ids, sampled ids, their log-probs)."""

    def __init__(self, engine):
        self.engine, self.calls = engine, []

    def generate(self, prompts, n, sampling):
        groups = self.engine.generate(prompts, n, sampling)
        for p, g in zip(prompts, groups):
            for s in g.samples:
                self.calls.append((list(p), list(s.response_ids), list(s.logprobs)))
        return groups


def check_token_exact(engine, model, tokenizer, tolerance: float, concurrency: int):
    """3 prompts x 2 trajectories of ScriptedEnv (3 turns: text, ids, text observations); returns the samples."""
    recording = Recording(engine)
    envs = []

    def make_env():
        envs.append(ScriptedEnv(turns=3))
        return envs[-1]

    records = [Record(p) for p in prompts(3, seed=5)]
    sampling = SamplingParams(max_new_tokens=4, temperature=1.0, seed=11, ignore_eos=True)
    groups, rewards = generate_trajectories(recording, records, 2, sampling, make_env, tokenizer,
                                            TurnLimits(max_turns=4, max_tokens=64, concurrency=concurrency))
    samples = flatten(groups)
    calls = {(tuple(c[0]), tuple(c[1])): c[2] for c in recording.calls}
    assert len(calls) == len(recording.calls) == 3 * 2 * 3
    for s in samples:
        context, k, logprobs = list(s.prompt_ids), 0, []
        env = next(e for e in envs if e.prompt == s.prompt_ids and e.seen[0] == s.response_ids[:4])
        for turn in range(3):  # the next turn is generated from the token ids of everything before it
            sampled = env.seen[turn]  # what the env saw was sampled by a call on exactly this context
            lps = calls.pop((tuple(context), tuple(sampled)))
            assert len(sampled) == 4
            context += sampled
            logprobs += lps
            if turn < 2:
                obs = env.observations[turn]
                obs_ids = obs if isinstance(obs, list) else tokenizer(obs, add_special_tokens=False)["input_ids"]
                context += obs_ids
                logprobs += [0.0] * len(obs_ids)
        assert s.prompt_ids + s.response_ids == context  # exactly: sampled ids + observation ids, in order
        assert s.logprobs == logprobs
        assert OBSERVATION_IDS == s.response_ids[8 + len(tokenizer("<r1>", add_special_tokens=False)["input_ids"]):][:3]
        assert sum(s.response_mask) == 12 and s.finish_reason == "stop"
        assert [r for _, r in s.turns] == [0.5, 1.0, 1.5]
    assert not calls  # every call is one turn of one trajectory
    assert rewards.values.tolist() == [3.0] * 6 and rewards.valid.all()
    # the G trajectories of one prompt are sampled independently (distinct seeds per trajectory and turn)
    assert all(g.samples[0].response_ids[:4] != g.samples[1].response_ids[:4] for g in groups)
    batch = samples_to_batch(samples)
    assert int(batch["loss_mask"].sum()) == 6 * 12
    with torch.no_grad():
        trainer = fused_logprobs(model, batch)
    metrics = logprob_mismatch(trainer, batch["rollout_logprobs"], batch["loss_mask"])
    assert metrics["mismatch/token_max_abs"] < tolerance, metrics
    print(f"multi-turn {type(engine).__name__}: |trainer - engine| per model token max "
          f"{metrics['mismatch/token_max_abs']:.2e}")
    assert turn_metrics(samples) == {"turns_mean": 3.0, "turns_max": 3.0,
                                     "observation_tokens_mean": float(len(samples[0].response_ids) - 12),
                                     "observed_frac": 1.0, "env_done_frac": 1.0}
    return samples


@pytest.fixture(scope="module")
def local():
    from transformers import Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(synthetic.tiny_qwen3_moe_config()).eval()
    return model, synthetic.char_tokenizer()


def test_local_engine_trajectories_are_token_exact(local):
    model, tokenizer = local
    check_token_exact(LocalEngine(model, tokenizer, seed=0), model, tokenizer, tolerance=1e-4, concurrency=1)


def test_sglang_trajectories_are_token_exact(engine, trainer):
    tokenizer = synthetic.char_tokenizer()
    check_token_exact(engine, trainer.model, tokenizer, tolerance=1e-4, concurrency=6)  # SGLang fp32: ~1e-6


def test_limits_and_env_errors(local):
    model, tokenizer = local
    engine = LocalEngine(model, tokenizer, seed=0)
    sampling = SamplingParams(max_new_tokens=4, ignore_eos=True, seed=1)
    records = [Record([5, 6, 7])]
    # the turn limit: a trajectory that never ends stops after max_turns, without the last observation
    groups, rewards = generate_trajectories(engine, records, 2, sampling, lambda: ScriptedEnv(turns=99), tokenizer,
                                            TurnLimits(max_turns=2, max_tokens=100, concurrency=1))
    for s in flatten(groups):
        assert len(s.turns) == 2 and s.finish_reason == "length" and s.response_mask[-1]
        assert s.response_ids[4:7] != OBSERVATION_IDS or len(s.response_ids) == 4 + 4 + 4
    # the token limit: turns + observations stay within max_tokens
    groups, _ = generate_trajectories(engine, records, 2, sampling, lambda: ScriptedEnv(turns=99), tokenizer,
                                      TurnLimits(max_turns=10, max_tokens=13, concurrency=1))
    for s in flatten(groups):
        assert len(s.response_ids) <= 13 and s.finish_reason == "length" and s.response_mask[-1]
    with pytest.raises(RewardError, match="prompt 0, sample 0: step.. raised KeyError: 'tool crashed'"):
        generate_trajectories(engine, records, 2, sampling, FailingEnv, tokenizer, TurnLimits(concurrency=1))
    groups, rewards = generate_trajectories(engine, records, 2, sampling, FailingEnv, tokenizer,
                                            TurnLimits(concurrency=1), on_error="mask")
    assert not rewards.valid.any() and len(rewards.errors) == 2
    assert all(s.response_ids == [] for s in flatten(groups))
    assert "FailingEnv, prompt 0, sample 1: step() raised KeyError" in rewards.errors[1]
    # a malformed answer is the environment's error too; an engine's error is not caught
    groups, rewards = generate_trajectories(engine, records, 2, sampling, lambda: BadRewardEnv(), tokenizer,
                                            TurnLimits(concurrency=1), on_error="mask")
    assert "not a finite number" in rewards.errors[0]

    class Broken:
        def generate(self, *args):
            raise ServerDied("gone")

    with pytest.raises(ServerDied):
        generate_trajectories(Broken(), records, 2, sampling, ScriptedEnv, tokenizer, TurnLimits(), on_error="mask")


def test_load_env():
    assert load_env("calculator") is CalculatorEnv
    assert load_env("tests.rewards.user_envs:ScriptedEnv") is ScriptedEnv
    for spec, match in [("nope", "neither a built-in"), ("no_such_module_xyz:Env", "cannot import"),
                        ("tests.rewards.user_envs:Missing", "no class"),
                        ("tests.rewards.user_envs:NotAnEnv", "no class")]:
        with pytest.raises(ValueError, match=match):
            load_env(spec)


def test_calculator():
    assert safe_eval("2+3*4") == 14 and safe_eval("-(7 // 2) + 2**10 % 7") == -3 + 2**10 % 7
    assert safe_eval("7/2") == 3.5
    for bad in ["__import__('os')", "a+1", "2**100000", "10**30", "1/0", "(1).real", "[1]", "x" * 300, "2+"]:
        with pytest.raises((ValueError, ZeroDivisionError)):
            safe_eval(bad)
    env = CalculatorEnv()
    env.reset(Record([1], label="14"))
    step = env.step("let me <calc>2+3*4</calc>", [])
    assert step.observation == "<result>14</result>" and not step.done and step.reward == 0
    assert env.step("<calc>1/0</calc>", []).observation.startswith("<result>error: ")
    assert env.step("<calc>7/2</calc>", []).observation == "<result>3.5</result>"
    final = env.step("the answer is 14", [])
    assert final.done and final.reward == 1.0
    assert env.step("the answer is 15", []).reward == 0.0



def test_mul_demonstrations_are_calculator_transcripts():
    """The mul task's warm-start demonstrations replayed against CalculatorEnv: turns trained, observations not,
    each observation what the calculator answers to the turn before it, the last turn done. The deliberate mistakes
    (tool skipped, one digit of the result miscopied) come at the rates synthetic names, within 0.04 of 2000."""
    skipped = miscopied = 0
    for p in synthetic.make_problems("mul", 2000, seed=3):
        a, b = map(int, p.prompt.removesuffix("=").split("*"))
        assert p.answer == str(a * b) and 100 <= a <= 999 and 10 <= b <= 99
        transcript = synthetic.demonstration(p)
        assert transcript[0] == (p.prompt, False)
        turns, observations = transcript[1::2], transcript[2::2]
        assert all(trained and text.endswith(synthetic.EOS) for text, trained in turns)
        assert not any(trained for _, trained in observations) and len(turns) in (1, 2)
        env = CalculatorEnv()
        env.reset(Record([1], label=p.answer))
        steps = [env.step(text.removesuffix(synthetic.EOS), []) for text, _ in turns]
        assert [s.observation for s in steps[:-1]] == [text for text, _ in observations]
        assert [s.done for s in steps] == [False] * len(observations) + [True]
        skipped += len(turns) == 1
        miscopied += len(turns) == 2 and steps[-1].reward == 0.0
    assert abs(skipped / 2000 - synthetic.MUL_SKIP_TOOL) < 0.04
    assert abs(miscopied / (2000 - skipped) - synthetic.MUL_MISCOPY) < 0.04
