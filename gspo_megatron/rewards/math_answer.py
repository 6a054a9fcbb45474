"""The ``math`` reward: a response's final answer against the label, compared by math-verify (LaTeX and plain
expressions parsed to sympy: ``x^2+1`` equals ``1+x^2``, ``\\sqrt{4}`` equals ``2``, ``0.50`` equals ``\\frac12``).

The answer is what math-verify extracts: the last ``\\boxed{}`` first, else a final LaTeX or plain expression; a
response it finds nothing in (one cut off inside ``\\boxed{``) falls back to its last number. A label is read as
LaTeX (``$...$`` is added unless it has ``$`` or ``\\boxed``).

Time limits. math-verify limits each parse and each comparison to ``TIMEOUT_S`` with SIGALRM, which Python allows
only in a process's main thread. There (a reward pool's worker, the default; the trainer itself with
``data.reward_workers: 0`` and synchronous rollouts) an answer whose parse or comparison runs past it scores 0.0:
not verified. In any other thread (with ``data.reward_workers: 0`` the rollout-ahead thread of one_step_off and
async rollouts, a multi-turn environment's trajectory threads) no alarm can be set and the call runs to its end.
A signal cannot interrupt one long C call either (sympy multiplying out ``10^{10^{10}}``): what bounds those is
the reward pool's limit, ``data.reward_timeout_s``, whose timed-out call is masked (``reward_pool``).

Importing this module warms math-verify up (its first parse and comparison take ~2 s of grammar and sympy set-up),
so that the time limit measures the response; the reward pool's fork server imports it before its workers start.
"""

from __future__ import annotations

import functools
import logging
import re
import threading

import math_verify

TIMEOUT_S = 5  # per parse and per comparison, whole seconds (signal.alarm); math-verify's own default

# math-verify logs each timed-out response in full, and once that its time limit is off in a thread: both are this
# module's documented behaviour, not news for a training log.
logging.getLogger("math_verify").setLevel(logging.ERROR)

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:/\d+)?|-?\.\d+")


def _time_limit() -> int | None:
    """``TIMEOUT_S`` where SIGALRM can be used (a process's main thread), else None (math-verify refuses a limit in
    other threads: its alarm would raise there)."""
    return TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


@functools.lru_cache(maxsize=4096)  # a prompt's label is parsed once for all its group's samples
def _parse_label(label: str, limit: int | None) -> list:
    latex = label if "$" in label or "\\boxed" in label else f"${label}$"
    return math_verify.parse(latex, parsing_timeout=limit) or math_verify.parse(label, parsing_timeout=limit)


def _parse_answer(response: str, limit: int | None) -> list:
    answer = math_verify.parse(response, parsing_timeout=limit)
    if not answer:
        numbers = _NUMBER.findall(response)
        answer = math_verify.parse(f"${numbers[-1]}$", parsing_timeout=limit) if numbers else []
    return answer


def math_reward(prompt: str, response: str, label) -> float:
    """1.0 if the response's final answer equals ``label`` (math-verify's equivalence), else 0.0 (also without a
    label, an answer or a verdict within the time limit)."""
    if label is None:
        return 0.0
    limit = _time_limit()
    gold, answer = _parse_label(str(label), limit), _parse_answer(response, limit)
    return float(bool(gold and answer) and math_verify.verify(gold, answer, timeout_seconds=limit))


# The warm-up (see the module's docstring): a symbolic comparison, whose first run sets up most of sympy, with no
# time limit and past the label cache (which must not keep a verdict that a cold start's slowness decided).
math_verify.verify(math_verify.parse("$1+x^2$", parsing_timeout=None),
                   math_verify.parse("\\boxed{x^2+1}", parsing_timeout=None), timeout_seconds=None)
