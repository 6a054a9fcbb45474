"""Rewards: the math verifier (math-verify's equivalence), exact match, the synthetic tasks, user functions, and
failures never reaching the loss as NaN."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.rewards import load_reward_fn, score
from gspo_megatron.rewards.rewards import math_reward
from gspo_megatron.rewards.synthetic import TASKS, make_problems, position_credit
from gspo_megatron.rollout import RewardError, Sample


@pytest.mark.parametrize("response, label, expected", [
    ("so the answer is \\boxed{42}.", "42", 1.0),
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("\\boxed{0.50}", "1/2", 1.0),
    ("\\boxed{\\dfrac12}", "\\frac{1}{2}", 1.0),
    ("first 3 then \\boxed{7} and later 9", "7", 1.0),  # the boxed answer wins over the last number
    ("\\boxed{x^{2}+1}", "x^{2} + 1", 1.0),  # nested braces, spaces
    ("\\boxed{1,000}", "1000", 1.0),
    ("$\\boxed{\\text{B}}$", "b", 1.0),
    ("we get 12, then 13.", "13", 1.0),  # no box: the last number
    ("we get -3", "-3", 1.0),
    ("\\boxed{41}", "42", 0.0),
    ("no answer here", "42", 0.0),
    ("\\boxed{5", "5", 1.0),  # unbalanced box: falls back to the last number
    # Equivalence, not equal strings (math-verify): the first four scored 0.0 with the regular expressions before it
    ("\\boxed{x^2+1}", "1+x^2", 1.0),
    ("\\boxed{\\sqrt{4}}", "2", 1.0),
    ("\\boxed{2}", "\\sqrt{4}", 1.0),
    ("the answer is $x^2+1$.", "1+x^2", 1.0),  # no box: the final expression
    ("\\boxed{0.333}", "1/3", 0.0),  # rounding is not equality
    ("\\boxed{x^2+2}", "1+x^2", 0.0),
    ("\\boxed{1}", None, 0.0),  # no label (a math record without one is refused before training)
])
def test_math_reward(response, label, expected):
    assert math_reward("", response, label) == expected


def test_math_reward_time_limit_in_the_main_thread_and_none_in_others(monkeypatch):
    """math-verify's SIGALRM limit where a signal can be set (a process's main thread: a reward pool's worker): a
    comparison past it scores 0.0; in another thread (multi-turn trajectories, the rollout-ahead thread without
    reward workers) the call runs without one, to its end. The comparison is made slow here (sympy's slow ones
    depend on the hash seed), in Python code as sympy's are, so that the alarm interrupts it."""
    import threading
    import time

    import math_verify.grader

    from gspo_megatron.rewards import math_answer

    def slow_equal(*args, **kwargs):
        time.sleep(2.5)
        return True

    monkeypatch.setattr(math_answer, "TIMEOUT_S", 1)
    monkeypatch.setattr(math_verify.grader, "sympy_expr_eq", slow_equal)
    start = time.monotonic()
    assert math_reward("", "\\boxed{3+4}", "7") == 0.0  # (as strings they differ: only sympy could say equal)
    assert time.monotonic() - start < 2.4  # stopped by the 1 s alarm, not the comparison's end
    scores = {}
    thread = threading.Thread(target=lambda: scores.update(threaded=math_reward("", "\\boxed{3+4}", "7")))
    start = time.monotonic()
    thread.start()
    thread.join(60)
    assert scores == {"threaded": 1.0} and time.monotonic() - start >= 2.5  # no alarm: the comparison's verdict
    monkeypatch.undo()
    assert math_reward("", "\\boxed{x^2+1}", "1+x^2") == 1.0  # the process goes on after an alarm


def test_exact_match_and_synthetic():
    assert load_reward_fn("exact_match")("", " abc\n", "abc") == 1.0
    assert load_reward_fn("exact_match")("", "abd", "abc") == 0.0
    assert position_credit("cba", "cba") == 1.0
    assert position_credit("cbx", "cba") == pytest.approx(0.6)
    assert position_credit("xba", "cba") == pytest.approx(0.6)  # each position counts, not only a prefix
    assert position_credit("cb", "cba") == pytest.approx(0.6)
    assert position_credit("cbaa", "cba") == pytest.approx(0.675)  # right answer, then more: over 4 characters
    assert position_credit("cccccc", "cc") == pytest.approx(0.3)  # padding does not pay
    assert position_credit("", "cba") == 0.0
    for task in TASKS:
        problems = make_problems(task, 5, seed=1)
        assert problems == make_problems(task, 5, seed=1)
        for p in problems:
            assert load_reward_fn("synthetic")(p.prompt, p.answer, p.answer) == 1.0
    assert make_problems("count", 1, seed=0)[0].answer.replace("a", "").replace("b", "") != ""
    assert all(64 <= len(p.answer) <= 72 and p.prompt == f"copy {p.answer}=" for p in make_problems("copy_long", 20))


def _samples(count):
    return [Sample([1], [2], [-0.1], "stop", "v", i, 0) for i in range(count)]


def test_user_function_by_module_path():
    fn = load_reward_fn("tests.rewards.user_rewards:length_reward")
    out = score(fn, _samples(2), [None, None], ["p", "p"], ["abcde", "ab"])
    assert out.values.tolist() == pytest.approx([0.5, 0.2]) and out.valid.all()


@pytest.mark.parametrize("spec, match", [
    ("nope", "neither a built-in"),
    ("tests.rewards.no_such_module:f", "cannot import"),
    ("tests.rewards.user_rewards:missing", "no callable"),
    ("tests.rewards.user_rewards:not_callable", "no callable"),
])
def test_bad_reward_specs(spec, match):
    with pytest.raises(ValueError, match=match):
        load_reward_fn(spec)


@pytest.mark.parametrize("name, responses, match", [
    ("raises", ["ok", "xx"], r"raised KeyError: 'no x allowed' for sample prompt 1, sample 0"),
    ("nan_for_b", ["a", "b"], r"returned nan for sample prompt 1, sample 0"),
    ("returns_text", ["a", "b"], r"returned '1.0' \(str\), not a number for sample prompt 0, sample 0"),
])
def test_bad_rewards_raise_naming_the_sample(name, responses, match):
    fn = load_reward_fn(f"tests.rewards.user_rewards:{name}")
    with pytest.raises(RewardError, match=match):
        score(fn, _samples(2), ["l", "l"], ["p", "p"], responses)


def test_bad_rewards_are_masked_when_configured():
    fn = load_reward_fn("tests.rewards.user_rewards:nan_for_b")
    out = score(fn, _samples(3), ["l"] * 3, ["p"] * 3, ["a", "b", "c"], on_error="mask")
    assert out.values.tolist() == [0.5, 0.0, 0.5] and out.valid.tolist() == [True, False, True]
    assert torch.isfinite(out.values).all() and len(out.errors) == 1 and "prompt 1" in out.errors[0]
    assert out.metrics()["reward/masked"] == 1.0


def test_score_checks_lengths():
    with pytest.raises(ValueError, match="2 samples but 1 labels"):
        score(load_reward_fn("exact_match"), _samples(2), ["a"], ["p", "p"], ["a", "b"])


@pytest.mark.parametrize("tokens, answer", [
    (["c", "b", "a", ""], "cba"),  # exact, then the end token (decodes to "")
    (["c", "a", "a", "x", "y"], "cba"),  # two characters in place, longer than the answer
    ([" ", "b", "c"], "bc"),  # a leading space is stripped, as position_credit does
    ([], "ab"),
])
def test_synthetic_segments_sum_to_the_sequence_reward(tokens, answer):
    from gspo_megatron.rewards.synthetic import position_credit_segments

    segments = position_credit_segments(tokens, answer)
    assert [end for end, _ in segments] == list(range(1, len(tokens) + 1))
    assert sum(r for _, r in segments) == pytest.approx(position_credit("".join(tokens), answer), abs=1e-12)
    if tokens[:3] == ["c", "a", "a"]:  # credit sits on the tokens that put an answer character in place
        longer = 5
        assert [r for _, r in segments] == pytest.approx([0.9 / longer, 0.0, 0.9 / longer, 0.0, 0.0])


def test_segment_rewards_are_checked_and_masked():
    from gspo_megatron.rewards.rewards import BUILTIN_SEGMENTS, score_segments

    samples = [Sample([1], [2, 3], [-0.1, -0.2], "stop", "v", i, 0) for i in range(4)]
    answers = {0: [(1, 0.5), (2, 1.0)], 1: [(2, 0.1), (1, 0.2)], 2: [(3, 1.0)], 3: [(2, float("nan"))]}
    fn = lambda prompt, tokens, label: answers[label]  # noqa: E731
    segments, valid = score_segments(fn, samples, [0, 1, 2, 3], [""] * 4, [["a", "b"]] * 4, on_error="mask")
    assert valid.tolist() == [True, False, False, False] and segments[0] == [(1, 0.5), (2, 1.0)]
    with pytest.raises(RewardError, match=r"segment end 1: ends must rise within 1..2 .* sample prompt 1, sample 0"):
        score_segments(fn, samples[1:2], [1], [""], [["a", "b"]])
    segments, valid = score_segments(BUILTIN_SEGMENTS["synthetic"], samples[:1], ["ab"], [""], [["a", "b"]])
    assert valid.tolist() == [True] and sum(r for _, r in segments[0]) == pytest.approx(1.0)
