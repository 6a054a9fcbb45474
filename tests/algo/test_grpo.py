import math

import pytest
import torch

from gspo_megatron.algo import grpo_loss, kl_penalty

from .batches import grad_of, random_batch

NEG_INF = float("-inf")
F64 = torch.float64


def _hand_batch():
    # row 0: one token, log-ratio 0.1, A=1; row 1: three tokens, log-ratios (0, 0.5, -0.5), A=-1.
    old = torch.tensor([[-1.0, 0.0, 0.0, 0.0], [-1.0, -1.0, -1.0, NEG_INF]], dtype=F64)
    logprobs = torch.tensor([[-0.9, NEG_INF, NEG_INF, NEG_INF], [-1.0, -0.5, -1.5, NEG_INF]], dtype=F64)
    mask = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.float32)
    return logprobs.requires_grad_(True), old, torch.tensor([1.0, -1.0], dtype=F64), mask


# Per-token objectives with eps 0.2 / 0.27: r = e^0.1 (unclipped); 1 * -1; e^0.5 * -1 (A < 0, r above the
# interval: unclipped); e^-0.5 < 0.8 with A < 0: clipped to 0.8 * -1.
OBJ0 = [math.exp(0.1)]
OBJ1 = [-1.0, -math.exp(0.5), -0.8]


def test_token_mean_vs_seq_mean_token_mean_hand_values():
    logprobs, old, adv, mask = _hand_batch()
    token_loss, metrics = grpo_loss(logprobs, old, adv, mask, aggregation="token-mean")
    seq_loss, _ = grpo_loss(logprobs, old, adv, mask, aggregation="seq-mean-token-mean")
    expected_token = -(sum(OBJ0) + sum(OBJ1)) / 4
    expected_seq = -(sum(OBJ0) / 1 + sum(OBJ1) / 3) / 2
    assert abs(expected_token - expected_seq) > 0.1  # unequal lengths: the two aggregations really differ
    torch.testing.assert_close(token_loss, torch.tensor(expected_token, dtype=F64), rtol=0, atol=1e-12)
    torch.testing.assert_close(seq_loss, torch.tensor(expected_seq, dtype=F64), rtol=0, atol=1e-12)

    e1, e5 = math.exp(0.1), math.exp(0.5)
    torch.testing.assert_close(
        grad_of(token_loss, logprobs),
        torch.tensor([[-e1 / 4, 0, 0, 0], [1 / 4, e5 / 4, 0, 0]], dtype=F64),
        rtol=0,
        atol=1e-12,
    )
    torch.testing.assert_close(
        grad_of(seq_loss, logprobs),
        torch.tensor([[-e1 / 2, 0, 0, 0], [1 / 6, e5 / 6, 0, 0]], dtype=F64),
        rtol=0,
        atol=1e-12,
    )

    expected = {
        "clip_frac": 0.25,
        "clip_frac_low": 0.25,
        "clip_frac_high": 0.0,
        "ratio_min": math.exp(-0.5),
        "ratio_mean": (e1 + 1.0 + e5 + math.exp(-0.5)) / 4,
        "ratio_max": e5,
        "seq_ratio_min": 1.0,
        "seq_ratio_mean": (e1 + 1.0) / 2,
        "seq_ratio_max": e1,
        "approx_kl": sum(math.exp(d) - d - 1 for d in (0.1, 0.0, 0.5, -0.5)) / 4,
        "num_sequences": 2.0,
        "num_tokens": 4.0,
    }
    assert set(metrics) == set(expected)
    for name, value in expected.items():
        assert metrics[name] == pytest.approx(value, rel=0, abs=1e-12), name


def test_token_mean_gradient_matches_analytic():
    logprobs, old, mask = random_batch([3, 5, 1, 0, 7, 4], T=8, log_ratio_scale=0.3, seed=6)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.7, 1.3], dtype=F64)
    loss, _ = grpo_loss(logprobs, old, adv, mask)
    with torch.no_grad():
        r = torch.exp(logprobs - old)
        a = adv[:, None].expand_as(r)
        clipped = ((a > 0) & (r > 1.27)) | ((a < 0) & (r < 0.8))
        expected = torch.where(clipped | ~mask, torch.zeros_like(r), -a * r / mask.sum())
    assert clipped[mask].any() and (~clipped[mask]).any()
    torch.testing.assert_close(grad_of(loss, logprobs), expected, rtol=0, atol=1e-10)


def test_token_advantages_equal_broadcast_sequence_advantages():
    logprobs, old, mask = random_batch([3, 5, 1, 0], T=7, log_ratio_scale=0.3, seed=7)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=F64)
    for aggregation in ("token-mean", "seq-mean-token-mean"):
        a = grpo_loss(logprobs, old, adv, mask, aggregation=aggregation)[0]
        b = grpo_loss(logprobs, old, adv[:, None].expand(4, 7).clone(), mask, aggregation=aggregation)[0]
        torch.testing.assert_close(a, b, rtol=0, atol=1e-15)


@pytest.mark.parametrize(
    "aggregation, override", [("token-mean", "num_tokens"), ("seq-mean-token-mean", "num_sequences")]
)
def test_denominator_override_reproduces_full_batch(aggregation, override):
    lengths = [3, 5, 1, 2, 7, 4, 2, 6]
    logprobs, old, mask = random_batch(lengths, T=9, log_ratio_scale=0.3, seed=8)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.7, 1.3, -1.2, 0.9], dtype=F64)
    ref = old - 0.05
    kw = dict(aggregation=aggregation, kl_coef=0.2)
    full = grpo_loss(logprobs, old, adv, mask, ref_logprobs=ref, **kw)[0]
    global_count = sum(lengths) if override == "num_tokens" else len(lengths)
    halves = sum(
        grpo_loss(logprobs[sl], old[sl], adv[sl], mask[sl], ref_logprobs=ref[sl], **kw, **{override: global_count})[0]
        for sl in (slice(0, 4), slice(4, 8))
    )
    torch.testing.assert_close(halves, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_of(halves, logprobs), grad_of(full, logprobs), rtol=0, atol=1e-12)


def test_kl_uses_the_loss_aggregation():
    logprobs, old, adv, mask = _hand_batch()
    ref = old + 0.1
    loss = grpo_loss(logprobs, old, adv, mask, ref_logprobs=ref, kl_coef=0.5)[0]
    expected = grpo_loss(logprobs, old, adv, mask)[0] + 0.5 * kl_penalty(logprobs, ref, mask, aggregation="token-mean")
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-14)


def test_extremes_and_all_masked_are_finite():
    old = torch.tensor([[-1.0, -1.0, NEG_INF], [-2.0, NEG_INF, NEG_INF]], dtype=F64)
    logprobs = torch.tensor([[1e4, -1e4, NEG_INF], [-1e4, float("nan"), 0.0]], dtype=F64, requires_grad=True)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    adv = torch.tensor([-1.0, 1.0], dtype=F64)
    for aggregation in ("token-mean", "seq-mean-token-mean"):
        loss, metrics = grpo_loss(logprobs, old, adv, mask, aggregation=aggregation, ref_logprobs=old, kl_coef=0.1)
        assert torch.isfinite(loss) and torch.isfinite(grad_of(loss, logprobs)).all()
        assert all(math.isfinite(v) for v in metrics.values())

        loss, metrics = grpo_loss(logprobs, old, adv, torch.zeros_like(mask), aggregation=aggregation)
        assert loss.item() == 0.0 and loss.requires_grad
        assert torch.equal(grad_of(loss, logprobs), torch.zeros_like(logprobs))
        assert all(v == 0.0 for v in metrics.values()), metrics


def test_argument_errors():
    logprobs, old, adv, mask = _hand_batch()
    with pytest.raises(ValueError, match=r"aggregation must be one of \('token-mean', 'seq-mean-token-mean'\)"):
        grpo_loss(logprobs, old, adv, mask, aggregation="sum")
    with pytest.raises(ValueError, match="num_tokens applies only to aggregation='token-mean'"):
        grpo_loss(logprobs, old, adv, mask, aggregation="seq-mean-token-mean", num_tokens=4)
    with pytest.raises(ValueError, match="num_sequences applies only to aggregation='seq-mean-token-mean'"):
        grpo_loss(logprobs, old, adv, mask, num_sequences=2)
    with pytest.raises(ValueError, match=r"advantages must be \[B\] or \[B, T\]"):
        grpo_loss(logprobs, old, torch.zeros(2, 3, dtype=F64), mask)
