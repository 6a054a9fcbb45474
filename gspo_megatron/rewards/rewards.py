"""Rewards: verifiers of a response against its label, user functions, and scoring a batch safely.

A reward function is ``fn(prompt: str, response: str, label) -> float`` (``label``: the answer, or whatever the
data set attaches to the prompt). Built in (``load_reward_fn`` by name):

    math          1.0 if the final answer (the last \\boxed{...}, else a final expression) equals the label by
                  math-verify: LaTeX and sympy equivalence (``math_answer``)
    exact_match   1.0 if the stripped response equals the stripped label
    synthetic     the CPU example's tasks (``synthetic.position_credit``): partial credit in [0, 1]
    code_tests    the fraction of the prompt's tests the response's program passes, run in a sandbox
                  (``code_tests``, ``sandbox``)

Per-segment rewards (GSPO-token's per-token advantages, ``algo.token_advantages=segments``) come from
``fn(prompt: str, response_tokens: list[str], label) -> [(end, reward), ...]``: ``end`` counts the response
tokens up to and including the segment's last one (rising, at most the response length). Built in:
``synthetic`` (``synthetic.position_credit_segments``: each character's credit on its token).

User functions are given as ``"package.module:function"``. ``score`` never lets a bad reward through: a function
that raises or returns a non-finite (or non-numeric) value is a ``RewardError`` naming the sample, or, with
``on_error="mask"`` (the trainer's ``data.on_reward_error``), that sample's reward is 0 and its ``valid`` flag False,
for the trainer to drop it from the loss (so no NaN ever reaches it; ``MaskedRewardGuard`` stops a run whose rewards
are mostly masked). The trainer scores through a ``reward_pool.RewardPool`` (``data.reward_workers``
processes, ``data.reward_timeout_s`` per call): a call that hangs or crashes its worker is masked and counted.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from ..rollout.errors import RewardError
from ..rollout.types import Sample
from .synthetic import position_credit, position_credit_segments
from .user_code import load_named

RewardFn = Callable[[str, str, Any], float]

def math_reward(prompt: str, response: str, label) -> float:
    """1.0 if the response's final answer equals the label by math-verify (``math_answer``, imported at the first
    call: sympy and its warm-up take ~3 s, which only a math reward should pay)."""
    from .math_answer import math_reward as verified

    return verified(prompt, response, label)


def exact_match(prompt: str, response: str, label) -> float:
    return float(response.strip() == str(label).strip())


def synthetic_reward(prompt: str, response: str, label) -> float:
    return position_credit(response, str(label))


def code_tests(prompt: str, response: str, label) -> float:
    from .code_tests import code_tests_reward

    return code_tests_reward(prompt, response, label)


BUILTIN: dict[str, RewardFn] = {"math": math_reward, "exact_match": exact_match, "synthetic": synthetic_reward,
                                "code_tests": code_tests}
NEEDS_LABEL = ("math", "exact_match", "code_tests")  # built-ins that score against the record's label


SegmentRewardFn = Callable[[str, list, Any], Sequence]
BUILTIN_SEGMENTS: dict[str, SegmentRewardFn] = {
    "synthetic": lambda prompt, response_tokens, label: position_credit_segments(response_tokens, str(label)),
}


def load_reward_fn(spec: str, builtin: dict | None = None) -> RewardFn:
    """A built-in name (``math``, ``exact_match``, ``synthetic``; ``builtin`` replaces that table, e.g.
    ``BUILTIN_SEGMENTS``) or ``"module:function"``."""
    return load_named(spec, BUILTIN if builtin is None else builtin, "reward", "module:function", "callable")


@dataclass
class Rewards:
    values: torch.Tensor  # [N] float32, finite
    valid: torch.Tensor  # [N] bool: False where the reward failed and was masked
    errors: list[str] = field(default_factory=list)  # one line per masked sample
    timed_out: int = 0  # calls past their time limit (a RewardPool's), masked
    crashed: int = 0  # calls whose worker process died, masked

    def metrics(self, prefix: str = "reward/") -> dict[str, float]:
        v = self.values[self.valid]
        return {f"{prefix}mean": float(v.mean()) if v.numel() else float("nan"),
                f"{prefix}max": float(v.max()) if v.numel() else float("nan"),
                f"{prefix}masked": float((~self.valid).sum())}


def _name(fn) -> str:
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


class PooledReward:
    """A reward run elsewhere (``reward_pool.RewardPool``: worker processes with a time limit per call), which
    ``score`` and ``score_segments`` hand the whole batch: ``map(calls)`` -> an outcome per call, and its ``name``.
    Defined here, below the pool, so that scoring needs no import of it (the pool's workers import this module)."""


def score(fn, samples: Sequence[Sample], labels: Sequence[Any], prompt_texts: Sequence[str],
          response_texts: Sequence[str], on_error: str = "raise") -> Rewards:
    """Reward of every sample (``labels``/texts aligned with ``samples``). ``on_error``: "raise" or "mask".

    ``fn``: a reward function, called here, or a ``RewardPool`` (worker processes, a time limit per call). A call
    that timed out or crashed its worker is always masked and counted (``Rewards.timed_out`` / ``crashed``): the
    step goes on without it; one that raised or returned a non-number follows ``on_error``."""
    if on_error not in ("raise", "mask"):
        raise ValueError(f"reward on_error={on_error!r} must be 'raise' or 'mask'")
    if not len(samples) == len(labels) == len(prompt_texts) == len(response_texts):
        raise ValueError(f"score: {len(samples)} samples but {len(labels)} labels, {len(prompt_texts)} prompts, "
                         f"{len(response_texts)} responses")
    calls = list(zip(prompt_texts, response_texts, labels))
    if isinstance(fn, PooledReward):
        outcomes, name = fn.map(calls), fn.name
    else:
        outcomes, name = [_call(fn, *call) for call in calls], _name(fn)
    values, valid, errors, timed_out, crashed = [], [], [], 0, 0
    for sample, label, response, (value, problem) in zip(samples, labels, response_texts, outcomes):
        infrastructure = problem is not None and problem.startswith(("timed out", "crashed"))
        if problem is None:
            if not isinstance(value, numbers.Real) and not (isinstance(value, torch.Tensor) and value.numel() == 1):
                problem = f"returned {value!r} ({type(value).__name__}), not a number"
            else:
                value = float(value)
                if not math.isfinite(value):
                    problem = f"returned {value}"
        if problem is not None:
            message = (f"reward {name} {problem} for sample {sample.name} "
                       f"(response {response[:80]!r}, label {str(label)[:80]!r})")
            if on_error == "raise" and not infrastructure:
                raise RewardError(message + "; set data.on_reward_error=mask to drop such samples from the loss "
                                            "instead")
            timed_out += problem.startswith("timed out")
            crashed += problem.startswith("crashed")
            values.append(0.0)
            valid.append(False)
            errors.append(message)
        else:
            values.append(value)
            valid.append(True)
    return Rewards(torch.tensor(values, dtype=torch.float32), torch.tensor(valid, dtype=torch.bool), errors,
                   timed_out, crashed)


def _call(fn, prompt: str, response: str, label) -> tuple:
    """(value, None), or (None, what went wrong)."""
    try:
        return fn(prompt, response, label), None
    except Exception as e:  # a user function may raise anything: report it with the sample
        return None, f"raised {type(e).__name__}: {e}"


def _segment_problem(segments, num_tokens: int) -> str | None:
    """Why ``segments`` is not a rising list of (end, finite reward) within the response, or None."""
    if not isinstance(segments, (list, tuple)):
        return f"returned {segments!r} ({type(segments).__name__}), not a list of (end, reward)"
    last = 0
    for item in segments:
        if not (isinstance(item, (list, tuple)) and len(item) == 2):
            return f"returned the segment {item!r}, not (end, reward)"
        end, value = item
        if isinstance(end, bool) or not isinstance(end, numbers.Integral) or not last < end <= num_tokens:
            return f"returned the segment end {end!r}: ends must rise within 1..{num_tokens} (response tokens)"
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
            return f"returned the segment reward {value!r}, not a finite number"
        last = end
    return None


def score_segments(fn, samples: Sequence[Sample], labels: Sequence[Any],
                   prompt_texts: Sequence[str], token_texts: Sequence[list], on_error: str = "raise"):
    """Per-segment rewards of every sample: (list of [(end, reward)] per sample, valid [N] bool). A function that
    raises or returns a malformed list is a ``RewardError`` naming the sample, or with ``on_error="mask"`` that
    sample gets no segments and valid False (the trainer drops it, as ``score`` does). ``fn`` may be a
    ``RewardPool`` (``builtin="BUILTIN_SEGMENTS"``): a call that timed out or crashed is masked, as in ``score``."""
    if on_error not in ("raise", "mask"):
        raise ValueError(f"reward on_error={on_error!r} must be 'raise' or 'mask'")
    calls = [(prompt, list(tokens), label) for prompt, tokens, label in zip(prompt_texts, token_texts, labels)]
    if isinstance(fn, PooledReward):
        outcomes, name = fn.map(calls), fn.name
    else:
        outcomes, name = [_call(fn, *call) for call in calls], _name(fn)
    out, valid = [], []
    for sample, label, (segments, problem) in zip(samples, labels, outcomes):
        infrastructure = problem is not None and problem.startswith(("timed out", "crashed"))
        if problem is None:
            problem = _segment_problem(segments, len(sample.response_ids))
        if problem is not None:
            message = f"segment reward {name} {problem} for sample {sample.name} (label {str(label)[:80]!r})"
            if on_error == "raise" and not infrastructure:
                raise RewardError(message + "; set data.on_reward_error=mask to drop such samples from the loss "
                                            "instead")
            out.append([])
            valid.append(False)
        else:
            out.append([(int(end), float(value)) for end, value in segments])
            valid.append(True)
    return out, torch.tensor(valid, dtype=torch.bool)
