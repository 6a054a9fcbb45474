"""The built-in Python tool environment (``rollout.env: python``, ``multiturn.PythonEnv``): code in <python> tags runs
in the sandbox and its output (or error) comes back; a turn without code is the answer. Hand-driven, and one
trajectory through ``generate_trajectories`` with a scripted engine (no model, no server)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import pytest

from gspo_megatron.rewards import synthetic
from gspo_megatron.rewards.multiturn import (TRUNCATED, PythonEnv, Step, TurnLimits, generate_trajectories,
                                             load_env)
from gspo_megatron.rollout import SamplingParams, flatten
from gspo_megatron.rollout.types import Group, Sample


@dataclass
class Record:
    ids: list[int]
    text: str = ""
    label: Any = None


def env(label="42", **kwargs) -> PythonEnv:
    e = PythonEnv(**kwargs)
    e.reset(Record([1], label=label))
    return e


def test_code_runs_and_its_output_comes_back():
    assert load_env("python") is PythonEnv
    step = env().step("first <python>print(6 * 7)\nprint('ok')</python> then", [])
    assert step == Step(observation="<output>42\nok\n</output>", reward=0.0, done=False)
    # the last block of a turn runs; each call is a fresh process (nothing carries over)
    e = env()
    assert e.step("<python>x = 1</python> <python>print(2)</python>", []).observation == "<output>2\n</output>"
    assert "NameError" in e.step("<python>print(x)</python>", []).observation


def test_exception_gives_the_error_line():
    obs = env().step("<python>print('before')\n1 / 0</python>", []).observation
    assert obs == "<output>before\nerror: ZeroDivisionError: division by zero</output>"
    assert env().step("<python>def f(:</python>", []).observation.startswith("<output>error: SyntaxError")
    obs = env().step("<python>import sys; sys.exit(3)</python>", []).observation
    assert obs == "<output>error: exit status 3</output>"


def test_infinite_loop_is_stopped_by_the_limits():
    start = time.monotonic()
    obs = env(cpu_seconds=1, wall_seconds=8).step("<python>while True: pass</python>", []).observation
    assert obs in ("<output>error: CPU time limit (1 s) exceeded</output>",  # SIGXCPU after 1 CPU-second
                   "<output>error: time limit (8 s) exceeded</output>")  # a loaded machine: the wall limit
    assert time.monotonic() - start < 9
    start = time.monotonic()  # a sleeper uses no CPU: the wall limit stops it
    obs = env(wall_seconds=0.5).step("<python>import time; print('hi', flush=True); time.sleep(60)</python>", [])
    assert obs.observation == "<output>hi\nerror: time limit (0.5 s) exceeded</output>"
    assert time.monotonic() - start < 5


def test_huge_output_is_truncated():
    obs = env(output_bytes=100).step("<python>while True: print('x' * 50)</python>", []).observation
    body = obs.removeprefix("<output>").removesuffix("</output>")
    assert body.endswith("\n" + TRUNCATED) and len(body) <= 100 + 1 + len(TRUNCATED)
    assert body.startswith("x" * 50 + "\n")


def test_turn_without_code_is_the_answer():
    assert env(label="42").step("so the answer is 42", []) == Step(reward=1.0, done=True)
    assert env(label="42").step("the answer is \\boxed{41}", []) == Step(reward=0.0, done=True)
    assert env(label=None).step("42", []) == Step(reward=0.0, done=True)
    # an unclosed block (a turn cut by max_new_tokens) is no call: it is the answer
    assert env(label="42").step("<python>print(42)", []).done


@pytest.mark.parametrize("kwargs, message", [
    ({"cpu_seconds": 0}, r"rollout.env_args.cpu_seconds=0 must be an integer >= 1"),
    ({"cpu_seconds": 1.5}, r"rollout.env_args.cpu_seconds=1.5 must be an integer"),
    ({"memory_mb": 8}, r"rollout.env_args.memory_mb=8 must be an integer >= 64"),
    ({"output_bytes": "1k"}, r"rollout.env_args.output_bytes='1k' must be an integer"),
    ({"wall_seconds": 0}, r"rollout.env_args.wall_seconds=0 must be a number >= 0.1"),
    ({"wall_seconds": True}, r"rollout.env_args.wall_seconds=True"),
])
def test_env_args_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        PythonEnv(**kwargs)
    e = PythonEnv(cpu_seconds=2, memory_mb=256, output_bytes=2048, wall_seconds=3)
    assert (e.limits.cpu_s, e.limits.memory_bytes, e.limits.output_bytes, e.limits.wall_s) == (2, 256 << 20, 2048, 3.0)


class Scripted:
    """An engine that answers each generate call with the next of ``texts`` (char tokenizer ids, log-prob -1)."""

    def __init__(self, tokenizer, texts):
        self.tokenizer, self.texts, self.contexts = tokenizer, list(texts), []

    def generate(self, prompts, n, sampling):
        self.contexts.append(list(prompts[0]))
        text = self.texts.pop(0)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        return [Group(0, list(prompts[0]), [Sample(list(prompts[0]), ids, [-1.0] * len(ids), "stop", "1", 0, 0,
                                                   text)])]


def test_trajectory_through_generate_trajectories():
    tokenizer = synthetic.char_tokenizer()
    engine = Scripted(tokenizer, ["<python>print(6*7)</python>", "answer: 42"])
    prompt = Record(tokenizer("6*7=", add_special_tokens=False)["input_ids"], label="42")
    groups, rewards = generate_trajectories(engine, [prompt], 1, SamplingParams(max_new_tokens=64), load_env("python"),
                                            tokenizer, TurnLimits(max_turns=4, max_tokens=256, concurrency=1),
                                            env_args={"cpu_seconds": 2, "wall_seconds": 5})
    (s,) = flatten(groups)
    assert s.text == "<python>print(6*7)</python><output>42\n</output>answer: 42"
    call, obs = len("<python>print(6*7)</python>"), len("<output>42\n</output>")
    assert s.response_mask == [True] * call + [False] * obs + [True] * len("answer: 42")
    assert s.turns == [(call, 0.0), (call + obs + len("answer: 42"), 1.0)] and s.finish_reason == "stop"
    assert engine.contexts[1] == prompt.ids + s.response_ids[:call + obs]  # the second turn saw the output
    assert rewards.values.tolist() == [1.0] and rewards.valid.all()
