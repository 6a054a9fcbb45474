"""Multi-turn, tool-using rollouts: the model talks to an environment, turn by turn, token-exactly.

An environment is a class (``rollout.env: module:Class``, or a built-in name) with one instance per trajectory:

    class MyEnv:
        def reset(self, prompt):                  # prompt.ids, prompt.text, prompt.label (the data record)
            self.answer = prompt.label
        def step(self, text, token_ids) -> Step:  # the model's turn, as the engine sampled it
            return Step(observation="<result>14</result>", reward=0.0, done=False)

A trajectory is prompt, turn 1, observation 1, turn 2, ... Each turn is generated from the token ids of
everything before it (``engine.generate`` with ids, never re-tokenised text), so the trainer scores exactly the
tokens the engine sampled. An observation (text: tokenised on its own, no special tokens; or token ids) is
appended as is. The result is one ``Sample`` whose ``response_ids`` hold turns and observations in order,
``response_mask`` True on the model's tokens (observations get no loss, log-prob 0), ``turns`` the (end, reward)
of each turn, and reward the sum of the turn rewards. A trajectory ends when the environment says done
("stop"), after ``max_turns`` turns, or when ``max_tokens`` response tokens (turns + observations) leave no room
for another model token ("length"). ``concurrency`` trajectories are in flight at once (threads; a server
batches their requests). With rollout routing replay the engine's routes of every call are assembled into the
trajectory's (each position's from the call that first routed it).

Built in: ``calculator`` (``CalculatorEnv``), ``python`` (``PythonEnv``: code run in ``rewards.sandbox``).

One module although over 350 lines: the built-in environments are the worked examples of the ``Env`` / ``Step``
protocol the trajectory loop defines, read beside it (their sandbox, the heavy part, is ``rewards.sandbox``).
"""

from __future__ import annotations

import ast
import math
import numbers
import operator
import re
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Protocol, Sequence

import torch

from ..rollout.errors import RewardError
from ..rollout.types import Group, Sample, SamplingParams
from .rewards import Rewards, math_reward
from .sandbox import Limits, run_python
from .tool_calls import calculator_observation
from .user_code import load_named


@dataclass
class Step:
    """What the environment answers to one turn."""

    observation: str | list[int] = ""  # appended after the turn (ignored when done)
    reward: float = 0.0  # this turn's reward; the trajectory's is the sum
    done: bool = False


class Env(Protocol):
    def reset(self, prompt: Any) -> None: ...

    def step(self, text: str, token_ids: list[int]) -> Step: ...


@dataclass(frozen=True)
class TurnLimits:
    max_turns: int = 4  # model turns per trajectory
    max_tokens: int = 1024  # response tokens per trajectory (model turns + observations), the prompt excluded
    concurrency: int = 32  # trajectories in flight

    def __post_init__(self):
        for name in ("max_turns", "max_tokens", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1")


# ---- loading ------------------------------------------------------------------------------------------------


def load_env(spec: str):
    """The environment class of ``rollout.env``: a built-in name (``BUILTIN_ENVS``) or ``"module:Class"``."""
    cls = load_named(spec, BUILTIN_ENVS, "rollout.env", "module:Class", "class")
    missing = [m for m in ("reset", "step") if not callable(getattr(cls, m, None))]
    if missing:
        raise ValueError(f"rollout.env={spec!r}: {cls.__name__} lacks {missing} (an environment has reset(prompt) and "
                         "step(text, token_ids) -> Step)")
    return cls


# ---- running trajectories -----------------------------------------------------------------------------------


def _turn_seed(seed: int | None, prompt: int, sample: int, turn: int) -> int | None:
    """A distinct, reproducible sampling seed per (trajectory, turn): the G trajectories of a prompt start from the
    same context, so one seed for all would sample them identically."""
    if seed is None:
        return None
    return hash((int(seed), prompt, sample, turn)) % (2**31 - 1)


_TOKENIZER = threading.Lock()  # a Hugging Face fast tokenizer shared by threads can fail with "Already borrowed"


def _observation_ids(observation, tokenizer, where: str) -> list[int]:
    if isinstance(observation, str):
        if not observation:
            return []
        if tokenizer is None:
            raise EnvError(f"{where}: a text observation needs a tokenizer")
        with _TOKENIZER:
            return list(tokenizer(observation, add_special_tokens=False)["input_ids"])
    if isinstance(observation, (list, tuple)) and all(isinstance(t, numbers.Integral) and t >= 0 for t in observation):
        return [int(t) for t in observation]
    raise EnvError(f"{where}: observation {observation!r} is neither text nor a list of token ids")


def _decode(tokenizer, ids: list[int]) -> str | None:
    if tokenizer is None:
        return None
    with _TOKENIZER:
        return tokenizer.decode(ids, skip_special_tokens=True)


class EnvError(RewardError):
    """The environment raised or answered something malformed; the message names it and the sample."""


def _env_call(where: str, fn, *args, **kwargs):
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # a user environment may raise anything: report it with the sample
        raise EnvError(f"{where}: {getattr(fn, '__name__', 'env')}() raised {type(e).__name__}: {e}") from e


def run_trajectory(engine, prompt, prompt_index: int, sample_index: int, env, sampling: SamplingParams,
                   tokenizer, limits: TurnLimits) -> Sample:
    """One trajectory (see the module docstring). ``EnvError`` when the environment fails, the engine's own errors
    unchanged."""
    where = f"rollout.env {type(env).__name__}, prompt {prompt_index}, sample {sample_index}"
    _env_call(where, env.reset, prompt)
    prompt_ids = [int(t) for t in prompt.ids]
    response: list[int] = []
    mask: list[bool] = []
    logprobs: list[float] = []
    turns: list[tuple[int, float]] = []
    routes = None  # rollout routing replay: [positions routed so far, layers, top-k]
    version, finish = None, "length"
    for turn in range(limits.max_turns):
        budget = limits.max_tokens - len(response)
        if budget < 1:
            break
        params = replace(sampling, max_new_tokens=min(sampling.max_new_tokens, budget),
                         seed=_turn_seed(sampling.seed, prompt_index, sample_index, turn))
        out = engine.generate([prompt_ids + response], 1, params)[0].samples[0]  # token ids in, never text
        version = version or out.weight_version
        routes = _extend_routes(routes, out.rollout_routing)
        response += out.response_ids
        mask += [True] * len(out.response_ids)
        logprobs += out.logprobs
        text = out.text if out.text is not None else _decode(tokenizer, out.response_ids)
        step = _env_call(where, env.step, text, list(out.response_ids))
        if not isinstance(step, Step):
            raise EnvError(f"{where}: step() returned {step!r}, not a Step")
        if isinstance(step.reward, bool) or not isinstance(step.reward, numbers.Real) or not math.isfinite(step.reward):
            raise EnvError(f"{where}: step() returned reward {step.reward!r}, not a finite number")
        reward = float(step.reward)
        turns.append((len(response), reward))
        if step.done:
            finish = "stop"
            break
        if turn == limits.max_turns - 1:
            break  # no turn follows: the observation would train nothing
        observation = _observation_ids(step.observation, tokenizer, where)
        if len(response) + len(observation) >= limits.max_tokens:
            break  # no room left for a model token after it
        response += observation
        mask += [False] * len(observation)
        logprobs += [0.0] * len(observation)
    return Sample(prompt_ids, response, logprobs, finish, str(version), prompt_index, sample_index,
                  _decode(tokenizer, response), rollout_routing=routes, response_mask=mask, turns=turns)


def _extend_routes(routes: torch.Tensor | None, turn: torch.Tensor | None) -> torch.Tensor | None:
    """A trajectory's routed experts after one more turn. A turn's call routes its whole context and its sampled
    tokens but the last ([context + sampled - 1, L, k]); the positions routed before keep the routes of the call that
    routed them first (a model token: the decode step that sampled the next one), the rest (the previous turn's
    last token, the observation, this turn's tokens) come from this call."""
    if turn is None:
        return routes
    if routes is None:
        return turn
    return torch.cat([routes, turn[routes.shape[0]:]])


def generate_trajectories(engine, prompts: Sequence, n: int, sampling: SamplingParams, env_class, tokenizer,
                          limits: TurnLimits, on_error: str = "raise", env_args: dict | None = None):
    """n trajectories per prompt (objects with ``ids``, ``text``, ``label``), ``limits.concurrency`` at a time.

    Returns (groups: one Group of n Samples per prompt, prompt-major; rewards: ``Rewards``, each sample's sum of
    turn rewards). An environment that raises is a ``RewardError`` naming the sample, or with ``on_error="mask"``
    that sample is an empty trajectory with reward 0 and valid False (the trainer drops it)."""
    if on_error not in ("raise", "mask"):
        raise ValueError(f"on_error={on_error!r} must be 'raise' or 'mask'")
    jobs = [(p, s) for p in range(len(prompts)) for s in range(n)]

    def one(job):
        p, s = job
        where = f"rollout.env {getattr(env_class, '__name__', env_class)}, prompt {p}, sample {s}"
        try:
            env = _env_call(where, env_class, **(env_args or {}))
            return run_trajectory(engine, prompts[p], p, s, env, sampling, tokenizer, limits), None
        except EnvError as e:  # the engine's own failures (a dead or hung server) propagate unchanged
            if on_error == "raise":
                raise EnvError(f"{e}; set data.on_reward_error=mask to drop such trajectories instead") from e
            return None, str(e)

    with ThreadPoolExecutor(max_workers=min(limits.concurrency, len(jobs)), thread_name_prefix="trajectory") as pool:
        results = list(pool.map(one, jobs))
    samples, values, valid, errors = [], [], [], []
    # Rollout routing replay: a dropped trajectory (no response) still needs routes for its prompt: any k distinct
    # experts (it trains nothing; the batch needs one routes shape).
    routed = next((r.rollout_routing for r, _ in results if r is not None and r.rollout_routing is not None), None)
    for (p, s), (sample, error) in zip(jobs, results):
        if sample is None:
            ids = [int(t) for t in prompts[p].ids]
            routes = None
            if routed is not None:
                routes = torch.arange(routed.shape[-1], dtype=routed.dtype).expand(len(ids) - 1, *routed.shape[1:])
            sample = Sample(ids, [], [], "length", "", p, s, "", rollout_routing=routes, response_mask=[], turns=[])
            errors.append(error)
        samples.append(sample)
        values.append(sum(r for _, r in sample.turns))
        valid.append(error is None)
    groups = [Group(p, [int(t) for t in prompts[p].ids], samples[p * n:(p + 1) * n]) for p in range(len(prompts))]
    rewards = Rewards(torch.tensor(values, dtype=torch.float32), torch.tensor(valid, dtype=torch.bool), errors)
    return groups, rewards


def turn_metrics(samples: Sequence[Sample]) -> dict[str, float]:
    """turns_mean / turns_max per trajectory, observation tokens per trajectory, the fraction of trajectories with
    an observation (with a tool environment: that called the tool), the fraction the env finished."""
    turns = [len(s.turns or []) for s in samples]
    observed = [int((~s.mask_tensor()).sum()) for s in samples]
    return {"turns_mean": sum(turns) / len(turns), "turns_max": float(max(turns)),
            "observation_tokens_mean": sum(observed) / len(observed),
            "observed_frac": sum(n > 0 for n in observed) / len(observed),
            "env_done_frac": sum(s.finish_reason == "stop" for s in samples) / len(samples)}


# ---- built-in environments ----------------------------------------------------------------------------------

_CALC = re.compile(r"<calc>(.*?)</calc>", re.DOTALL)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
_UNARY = {ast.UAdd: operator.pos, ast.USub: operator.neg}
MAX_EXPRESSION_CHARS = 200
MAX_MAGNITUDE = 1e18
MAX_EXPONENT = 64


def safe_eval(expression: str) -> int | float:
    """Arithmetic (numbers, + - * / // % **, unary +-, parentheses) by walking Python's AST: no names, calls,
    attributes or eval. Bounded: 200 characters, |exponent| <= 64, every intermediate |value| <= 1e18.
    Raises ValueError (or ZeroDivisionError) on anything else."""
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression: {e.msg}") from None

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            out = node.value
        elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
            out = _UNARY[type(node.op)](value(node.operand))
        elif isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} beyond +-{MAX_EXPONENT}")
            out = _BINARY[type(node.op)](left, right)
        else:
            raise ValueError(f"{type(node).__name__} is not allowed (numbers and + - * / // % ** only)")
        if isinstance(out, complex) or not math.isfinite(out) or abs(out) > MAX_MAGNITUDE:
            raise ValueError(f"value {out} out of range")
        return out

    return value(tree.body)


def format_number(x: int | float) -> str:
    if isinstance(x, float) and x.is_integer():
        x = int(x)
    return str(x) if isinstance(x, int) else f"{x:.10g}"


class CalculatorEnv:
    """A calculator tool. A turn holding ``<calc>2+3*4</calc>`` is a call: the observation is
    ``<result>14</result>`` (the last call's value; ``<result>error: ...</result>`` when it is not arithmetic),
    reward 0. A turn without a call is the answer: done, reward 1.0 if its final \\boxed{} or last number equals the
    label (``rewards.math_reward``), else 0."""

    def reset(self, prompt) -> None:
        self.label = prompt.label

    def step(self, text: str, token_ids: list[int]) -> Step:
        calls = _CALC.findall(text)
        if calls:
            try:
                result = format_number(safe_eval(calls[-1]))
            except (ValueError, ZeroDivisionError, OverflowError) as e:
                result = f"error: {e}"
            return Step(observation=calculator_observation(result))
        return answer_step(text, self.label)


def answer_step(text: str, label) -> Step:
    """A built-in tool's final turn (no tool call): done, reward 1.0 if its final \\boxed{} or last number equals
    ``label`` (``rewards.math_reward``), else 0 (also without a label)."""
    reward = math_reward("", text, label) if label is not None else 0.0
    return Step(reward=reward, done=True)


_PYTHON = re.compile(r"<python>(.*?)</python>", re.DOTALL)
TRUNCATED = "[output truncated]"


class PythonEnv:
    """A Python tool. A turn holding ``<python>print(6*7)</python>`` is a call: the last block of the turn runs as a
    script in the sandbox (``rewards.sandbox.run_python``: its own process, CPU, memory, output and wall-time
    limits, a scratch directory, no network where ``unshare`` works) and the observation is
    ``<output>42\\n</output>``: its stdout (at most ``output_bytes``: a program printing more is stopped there and
    ``[output truncated]`` follows), then, if it failed, ``error: `` and the last line of its traceback
    (``error: ZeroDivisionError: division by zero``) or the limit that stopped it. Reward 0. Each call is a fresh
    process: nothing (variables, files) carries over between calls. A turn without a complete block is the answer,
    scored like the calculator's (``answer_step``).

    Keyword arguments (``rollout.env_args``): ``cpu_seconds`` (int, RLIMIT_CPU), ``memory_mb`` (int >= 64,
    RLIMIT_AS), ``output_bytes`` (int, stdout and stderr each), ``wall_seconds`` (number, the process group is
    killed after it). A bad value is a ``ValueError`` naming ``rollout.env_args.<name>``."""

    def __init__(self, cpu_seconds: int = 5, memory_mb: int = 512, output_bytes: int = 1024,
                 wall_seconds: float = 10.0):
        def check(name, value, minimum, integer=True):
            kinds = (numbers.Integral,) if integer else (numbers.Real,)
            if isinstance(value, bool) or not isinstance(value, kinds) or not math.isfinite(value) or value < minimum:
                raise ValueError(f"rollout.env_args.{name}={value!r} must be {'an integer' if integer else 'a number'}"
                                 f" >= {minimum}")

        check("cpu_seconds", cpu_seconds, 1)
        check("memory_mb", memory_mb, 64)  # the interpreter itself needs a few tens of MiB of address space
        check("output_bytes", output_bytes, 1)
        check("wall_seconds", wall_seconds, 0.1, integer=False)
        self.limits = Limits(wall_s=float(wall_seconds), cpu_s=int(cpu_seconds), memory_bytes=int(memory_mb) << 20,
                             output_bytes=int(output_bytes))

    def reset(self, prompt) -> None:
        self.label = prompt.label

    def step(self, text: str, token_ids: list[int]) -> Step:
        calls = _PYTHON.findall(text)
        if not calls:
            return answer_step(text, self.label)
        return Step(observation=f"<output>{self.run(calls[-1])}</output>")

    def run(self, code: str) -> str:
        """The observation's text for one program."""
        result = run_python(code, limits=self.limits)
        out = result.stdout
        if result.killed_by == "output":
            return _then(out, TRUNCATED)
        if result.ok:
            return out
        if result.killed_by == "wall":
            error = f"time limit ({self.limits.wall_s:g} s) exceeded"
        elif result.killed_by == "cpu":
            error = f"CPU time limit ({self.limits.cpu_s} s) exceeded"
        elif result.killed_by == "memory":
            error = f"MemoryError: memory limit ({self.limits.memory_bytes >> 20} MiB) exceeded"
        else:
            lines = [line for line in result.stderr.splitlines() if line.strip()]
            error = lines[-1].strip() if lines else f"exit status {result.returncode}"
        return _then(out, f"error: {error}")


def _then(out: str, line: str) -> str:
    """``line`` on a line of its own after ``out``."""
    return out + line if not out or out.endswith("\n") else f"{out}\n{line}"


BUILTIN_ENVS = {"calculator": CalculatorEnv, "python": PythonEnv}
