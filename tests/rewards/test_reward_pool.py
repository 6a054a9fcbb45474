"""Rewards that misbehave, and the code-execution reward's sandbox.

The reward pool (``rewards.reward_pool``): a reward that hangs is killed at its time limit, one that kills its own
process is noticed, both masked and counted whatever ``on_error`` says, the other samples of the batch scored, and
the pool goes on with fresh workers. ``code_tests`` (``rewards.code_tests``, ``rewards.sandbox``): right 1.0, wrong
0.0, partly right the fraction; an infinite loop, a memory bomb and endless output are stopped by their limits.
What a hostile program tries is in test_sandbox.py.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from gspo_megatron.rewards import score
from gspo_megatron.rewards.code_tests import code_tests_reward, extract_program
from gspo_megatron.rewards.reward_pool import RewardPool
from gspo_megatron.rewards.sandbox import Limits, network_isolation, run_python
from gspo_megatron.rollout import RewardError, Sample

TIMEOUT_S = 1.5


def _samples(count):
    return [Sample([1], [2], [-0.1], "stop", "v", i, 0) for i in range(count)]


def test_hanging_and_crashing_rewards_are_masked_counted_and_never_stall():
    pool = RewardPool("tests.rewards.user_rewards:misbehaves", workers=2, timeout_s=TIMEOUT_S)
    try:
        assert pool.map([("p", "ab", None)]) == [(0.2, None)]  # workers up (their start does not count)
        responses = ["abc", "hang", "crash", "raise", "abcd", "hang", "a"]
        start = time.monotonic()
        out = score(pool, _samples(len(responses)), [None] * len(responses), ["p"] * len(responses), responses,
                    on_error="mask")
        seconds = time.monotonic() - start
        assert out.valid.tolist() == [True, False, False, False, True, False, True]
        assert out.values.tolist() == pytest.approx([0.3, 0, 0, 0, 0.4, 0, 0.1])
        assert (out.timed_out, out.crashed, len(out.errors)) == (2, 1, 4)
        assert "timed out after 1.5 s (data.reward_timeout_s) for sample prompt 1" in out.errors[0]
        assert "crashed (its worker process exited with code 3)" in out.errors[1]
        # Two workers, two hangs: each costs its worker one time limit, and the rest goes on beside it (a fresh
        # worker's start, ~seconds of imports, is not counted against the calls it then takes).
        assert seconds < 2 * TIMEOUT_S + 30, seconds
        # Timeouts and crashes are masked under on_error=raise too; what the function raises is not.
        out = score(pool, _samples(2), [None] * 2, ["p"] * 2, ["hang", "abcde"], on_error="raise")
        assert out.valid.tolist() == [False, True] and out.timed_out == 1
        with pytest.raises(RewardError, match=r"misbehaves raised KeyError: 'bad' for sample prompt 0"):
            score(pool, _samples(1), [None], ["p"], ["raise"], on_error="raise")
        # A worker that died between calls (the OOM killer, say): its next call goes to a replacement.
        pool._workers[0].process.kill()
        pool._workers[0].process.join()
        assert pool.map([("p", "a", None), ("p", "ab", None), ("p", "abc", None)]) == [(0.1, None), (0.2, None),
                                                                                       (0.3, None)]
    finally:
        pool.close()


def test_segment_rewards_in_the_pool_are_masked_the_same_way():
    from gspo_megatron.rewards.rewards import BUILTIN_SEGMENTS, score_segments

    pool = RewardPool("tests.rewards.user_rewards:segments_misbehave", workers=2, timeout_s=TIMEOUT_S,
                      builtin="BUILTIN_SEGMENTS")
    try:
        samples = _samples(3)
        segments, valid = score_segments(pool, samples, ["ok", "hang", "crash"], ["p"] * 3, [["a"]] * 3,
                                         on_error="raise")
        assert valid.tolist() == [True, False, False] and segments == [[(1, 1.0)], [], []]
    finally:
        pool.close()
    builtin = RewardPool("synthetic", workers=1, timeout_s=30, builtin="BUILTIN_SEGMENTS")  # a built-in, by name
    try:
        segments, valid = score_segments(builtin, samples[:1], ["a"], ["p"], [["a"]])
        assert valid.tolist() == [True] and segments == [list(BUILTIN_SEGMENTS["synthetic"]("p", ["a"], "a"))]
    finally:
        builtin.close()


def test_a_reward_the_workers_cannot_load_is_an_error():
    pool = RewardPool("tests.rewards.user_rewards:missing", workers=1, timeout_s=5)
    with pytest.raises(ValueError, match="could not load it: ValueError: .* no callable 'missing'"):
        pool.map([("p", "r", None)])
    pool.close()


ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]
IO_TESTS = [{"input": "1 2\n", "output": "3"}, {"input": "5 5\n", "output": "10"}]
LIMITS = Limits(wall_s=5, cpu_s=1, memory_bytes=256 << 20, output_bytes=1 << 14)


@pytest.mark.parametrize("response, tests, expected", [
    ("Here:\n```python\ndef add(a, b):\n    return a + b\n```\n", ADD_TESTS, 1.0),
    ("```python\ndef add(a, b):\n    return a - b\n```", ADD_TESTS, 0.0),
    ("```python\ndef add(a, b):\n    return 0\n```", ADD_TESTS, 1 / 3),  # add(-1, 1) == 0 only
    ("```python\nprint('0 1 2')\ndef add(a, b):\n    return 0\n```", ADD_TESTS, 1 / 3),  # printing is not passing
    ("```python\nimport sys\nsys.exit(0)\n```", ADD_TESTS, 0.0),
    ("```\na, b = map(int, input().split())\nprint(a + b)\n```", IO_TESTS, 1.0),
    ("```\nprint(3)\n```", IO_TESTS, 0.5),
    ("x = 1", '{"tests": ["assert x == 1", "assert x == 2"]}', 0.5),  # a JSON label; no fence: the whole response
])
def test_code_tests_score_the_fraction_passed(response, tests, expected):
    assert code_tests_reward("", response, tests, LIMITS) == pytest.approx(expected)


# The CPU limit's case gets a long wall limit: on a loaded machine (CI's 2 cores shared) a second of CPU time can
# take more than LIMITS' 5 s of wall time, and the wall limit would then stop the loop first.
CPU_BOUND = Limits(wall_s=60, cpu_s=1, memory_bytes=256 << 20, output_bytes=1 << 14)


@pytest.mark.parametrize("program, killed_by, limits", [
    ("def add(a, b):\n    while True:\n        pass", "cpu", CPU_BOUND),  # the tests call it: an infinite loop
    ("x = bytearray(1 << 40)", "memory", LIMITS),
    ("while True:\n    print('x' * 1000)", "output", LIMITS),
])
def test_runaway_programs_are_stopped_by_their_limits(program, killed_by, limits):
    start = time.monotonic()
    assert code_tests_reward("", f"```python\n{program}\n```", ADD_TESTS, limits) == 0.0
    result = run_python(program + "\nadd(1, 2)" * ("def add" in program), limits=limits)
    assert result.killed_by == killed_by and not result.ok
    assert len(result.stdout) <= limits.output_bytes
    assert time.monotonic() - start < 2 * limits.wall_s


def test_sandbox_wall_limit_environment_and_network():
    result = run_python("import time; time.sleep(60)", limits=Limits(wall_s=0.5))
    assert result.killed_by == "wall"
    result = run_python("import os; print(sorted(os.environ)); print(os.getcwd())", limits=LIMITS)
    names, cwd = result.stdout.splitlines()
    assert names == "['HOME', 'LANG', 'PATH', 'PYTHONIOENCODING', 'TMPDIR']" and cwd == "/scratch"
    program = "import socket\nsocket.create_connection(('127.0.0.1', 9), timeout=2)"
    result = run_python(program, limits=LIMITS)
    assert result.network_isolated and result.confined  # no interface is up, not even loopback
    assert "Network is unreachable" in result.stderr or "Errno 101" in result.stderr, result.stderr
    result = run_python(program, limits=LIMITS, mode="unconfined")
    assert result.network_isolated == network_isolation() and not result.confined
    assert extract_program("a ```py\nx\n``` b ```\ny\n```") == "y\n"


def test_a_trainer_that_fails_still_exits():
    """Workers ignore SIGTERM (a scheduler's is the trainer's to handle), so multiprocessing's exit handler, which
    SIGTERMs daemonic children and waits, would hang: the pool kills them at exit first."""
    import subprocess
    import sys

    code = ("from gspo_megatron.rewards.reward_pool import RewardPool\n"
            "pool = RewardPool('tests.rewards.user_rewards:misbehaves', workers=2, timeout_s=5)\n"
            "assert pool.map([('p', 'ab', None)]) == [(0.2, None)]\n"
            "raise RuntimeError('the trainer fails')\n")
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "the trainer fails" in out.stderr, out.stderr[-2000:]


def test_the_math_reward_in_the_pool_verifies_by_equivalence():
    """The default path of ``data.reward: math``: a pool worker's main thread, where math-verify's own time limit
    (SIGALRM) can be set; the fork server imported and warmed math-verify before the worker started."""
    pool = RewardPool("math", workers=1, timeout_s=60)
    try:
        responses = ["\\boxed{x^2+1}", "so \\boxed{\\sqrt{4}}.", "\\boxed{3}"]
        out = score(pool, _samples(3), ["1+x^2", "2", "2"], ["p"] * 3, responses, on_error="raise")
        assert out.values.tolist() == [1.0, 1.0, 0.0] and out.valid.all() and out.timed_out == 0
    finally:
        pool.close()
