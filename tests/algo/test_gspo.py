import math

import pytest
import torch

from gspo_megatron.algo import group_advantages, gspo_loss, gspo_sequence_objective, kl_penalty

from .batches import grad_of, random_batch, response_mask

NEG_INF = float("-inf")
F64 = torch.float64


def test_sequence_objective_quadrants_hand_values():
    seq_log_ratio = torch.tensor([0.5, 0.5, -0.5, -0.5, 0.0, 0.1], dtype=F64)
    adv = torch.tensor([1.0, -1.0, 1.0, -1.0, 3.0, 0.0], dtype=F64)
    obj, low, high = gspo_sequence_objective(seq_log_ratio, adv, eps_low=0.2, eps_high=0.3, max_log_ratio=10.0)
    expected = [
        1.3 * 1.0,  # s = e^0.5 > 1.3, A > 0: clipped at 1 + eps_high
        -math.exp(0.5),  # A < 0, s above the interval: the min keeps s * A (pessimistic), unclipped
        math.exp(-0.5),  # A > 0, s below the interval: unclipped
        0.8 * -1.0,  # s = e^-0.5 < 0.8, A < 0: clipped at 1 - eps_low
        3.0,
        0.0,
    ]
    torch.testing.assert_close(obj, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-12)
    assert low.tolist() == [False, False, False, True, False, False]
    assert high.tolist() == [True, False, False, False, False, False]


def test_default_eps_are_the_papers():
    seq_log_ratio = torch.tensor([5e-4, 3.5e-4, -3.5e-4, -2.5e-4], dtype=F64)
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0], dtype=F64)
    obj, low, high = gspo_sequence_objective(seq_log_ratio, adv)
    expected = [1.0004, math.exp(3.5e-4), -(1 - 3e-4), -math.exp(-2.5e-4)]
    torch.testing.assert_close(obj, torch.tensor(expected, dtype=F64), rtol=0, atol=1e-15)
    assert high.tolist() == [True, False, False, False] and low.tolist() == [False, False, True, False]


def _hand_batch():
    # row 0: log-ratios (0.1, 0.3), A=1; row 1: (-0.5, -0.5, -0.2), A=-2; row 2: empty, A=5 (must be ignored).
    logprobs = torch.tensor(
        [[-1.0, -2.0, NEG_INF], [-1.5, -1.5, -0.7], [NEG_INF, NEG_INF, NEG_INF]], dtype=F64, requires_grad=True
    )
    old = torch.tensor([[-1.1, -2.3, 0.0], [-1.0, -1.0, -0.5], [0.0, 0.0, 0.0]], dtype=F64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0]])
    adv = torch.tensor([1.0, -2.0, 5.0], dtype=F64)
    return logprobs, old, adv, mask


def test_hand_values_loss_grad_and_metrics():
    logprobs, old, adv, mask = _hand_batch()
    loss, metrics = gspo_loss(logprobs, old, adv, mask, eps_low=0.2, eps_high=0.3)
    s0, s1 = math.exp(0.2), math.exp(-0.4)  # s1 < 0.8 with A < 0: clipped low, contributes 0.8 * -2
    torch.testing.assert_close(loss, torch.tensor(-(s0 * 1.0 + 0.8 * -2.0) / 2, dtype=F64), rtol=0, atol=1e-12)

    # d(-J)/d logp = -(1/N) A s / |y| on the unclipped row 0; clipped and empty rows get none.
    grad = grad_of(loss, logprobs)
    g = -(1 / 2) * 1.0 * s0 / 2
    torch.testing.assert_close(
        grad, torch.tensor([[g, g, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]], dtype=F64), rtol=0, atol=1e-12
    )

    token_log_ratios = [0.1, 0.3, -0.5, -0.5, -0.2]
    expected_kl = sum(math.exp(d) - d - 1 for d in token_log_ratios) / 5
    expected = {
        "clip_frac": 0.5,
        "clip_frac_low": 0.5,
        "clip_frac_high": 0.0,
        "seq_ratio_min": s1,
        "seq_ratio_mean": (s0 + s1) / 2,
        "seq_ratio_max": s0,
        "approx_kl": expected_kl,
        "num_sequences": 2.0,
    }
    assert set(metrics) == set(expected)
    for name, value in expected.items():
        assert isinstance(metrics[name], float)
        assert metrics[name] == pytest.approx(value, rel=0, abs=1e-12), name


def test_gradient_matches_paper_analytic_gradient():
    lengths = [3, 5, 1, 0, 7, 4, 2, 6]
    logprobs, old, mask = random_batch(lengths, T=9, log_ratio_scale=1e-3, seed=1)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.7, 1.3, -1.2, 0.9], dtype=F64)
    eps_low, eps_high = 3e-4, 4e-4
    loss, metrics = gspo_loss(logprobs, old, adv, mask, eps_low=eps_low, eps_high=eps_high)
    grad = grad_of(loss, logprobs)

    with torch.no_grad():
        n = mask.sum(-1).to(F64)
        s = torch.exp(((logprobs - old) * mask).sum(-1) / n.clamp(min=1))
        clipped = ((adv > 0) & (s > 1 + eps_high)) | ((adv < 0) & (s < 1 - eps_low))
        valid = n > 0
        N = valid.sum().item()
        per_seq = torch.where(clipped | ~valid, torch.zeros_like(s), -(1 / N) * adv * s / n.clamp(min=1))
        expected = per_seq[:, None] * mask
    assert clipped[valid].any() and (~clipped[valid]).any(), "the case must mix clipped and unclipped sequences"
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-10)
    assert metrics["clip_frac"] == pytest.approx(clipped[valid].sum().item() / N, abs=1e-12)


def test_zero_advantage_group_gives_zero_gradient():
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0], dtype=F64)
    adv = group_advantages(rewards, group_size=4)
    logprobs, old, mask = random_batch([2, 3, 4, 5, 2, 3, 4, 5], T=6, log_ratio_scale=1e-5, seed=2)
    grad = grad_of(gspo_loss(logprobs, old, adv, mask)[0], logprobs)
    assert torch.equal(grad[:4], torch.zeros_like(grad[:4]))
    assert (grad[4:][mask[4:]] != 0).all()  # small ratios: nothing clipped, the other group does learn


def test_extreme_log_ratios_and_garbage_stay_finite():
    old = torch.tensor([[-1.0, -1.0, NEG_INF], [-2.0, -2.0, NEG_INF], [NEG_INF] * 3, [-1.0, -0.5, NEG_INF]], dtype=F64)
    logprobs = torch.tensor(
        [[1e4 - 1.0, 1e4 - 1.0, NEG_INF], [-2.0 - 1e4, -2.0 - 1e4, float("nan")], [NEG_INF] * 3, [-0.9, -0.5, NEG_INF]],
        dtype=F64,
        requires_grad=True,
    )
    mask = response_mask([2, 2, 0, 2], T=3, prompt_len=0)
    adv = torch.tensor([-1.0, 1.0, 1.0, 1.0], dtype=F64)  # A < 0 with s huge and A > 0 with s tiny: both unclipped
    loss, metrics = gspo_loss(logprobs, old, adv, mask, eps_low=0.2, eps_high=0.3)
    # Clamped at +-10: s_0 = e^10, s_1 = e^-10, s_3 = e^0.05.
    expected = -(-math.exp(10.0) + math.exp(-10.0) + math.exp(0.05)) / 3
    torch.testing.assert_close(loss, torch.tensor(expected, dtype=F64), rtol=1e-12, atol=0)
    grad = grad_of(loss, logprobs)
    assert torch.isfinite(grad).all()
    assert torch.equal(grad[:3], torch.zeros_like(grad[:3]))  # beyond the clamp, and empty: no gradient
    assert all(math.isfinite(v) for v in metrics.values())
    assert metrics["seq_ratio_max"] == pytest.approx(math.exp(10.0), rel=1e-12)


def test_all_masked_batch_gives_attached_zero_loss():
    logprobs = torch.full((2, 3), NEG_INF, dtype=F64, requires_grad=True)
    old = torch.full((2, 3), float("nan"), dtype=F64)
    mask = torch.zeros(2, 3)
    loss, metrics = gspo_loss(logprobs, old, torch.tensor([1.0, -1.0], dtype=F64), mask)
    assert loss.item() == 0.0 and loss.requires_grad
    assert torch.equal(grad_of(loss, logprobs), torch.zeros(2, 3, dtype=F64))
    assert all(v == 0.0 for v in metrics.values()), metrics


@pytest.mark.parametrize("lengths", [[3, 5, 1, 2, 7, 4, 2, 6], [3, 0, 1, 2, 7, 0, 2, 6]])
def test_num_sequences_override_reproduces_full_batch(lengths):
    logprobs, old, mask = random_batch(lengths, T=9, log_ratio_scale=1e-3, seed=3)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.7, 1.3, -1.2, 0.9], dtype=F64)
    full = gspo_loss(logprobs, old, adv, mask)[0]
    n_global = sum(1 for n in lengths if n > 0)  # == B when no response is empty
    halves = sum(
        gspo_loss(logprobs[sl], old[sl], adv[sl], mask[sl], num_sequences=n_global)[0]
        for sl in (slice(0, 4), slice(4, 8))
    )
    torch.testing.assert_close(halves, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_of(halves, logprobs), grad_of(full, logprobs), rtol=0, atol=1e-12)
    # A tensor count (e.g. all-reduced) works the same.
    part = gspo_loss(logprobs[:4], old[:4], adv[:4], mask[:4], num_sequences=torch.tensor(float(n_global)))[0]
    torch.testing.assert_close(
        part, gspo_loss(logprobs[:4], old[:4], adv[:4], mask[:4], num_sequences=n_global)[0], rtol=0, atol=0
    )


def test_kl_term_is_added_with_its_coefficient():
    logprobs, old, mask = random_batch([3, 5, 1, 0], T=7, log_ratio_scale=1e-3, seed=4)
    ref = old - 0.1 * torch.arange(7, dtype=F64)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=F64)
    loss, metrics = gspo_loss(logprobs, old, adv, mask, ref_logprobs=ref, kl_coef=0.1, kl_estimator="k2")
    expected = gspo_loss(logprobs, old, adv, mask)[0] + 0.1 * kl_penalty(logprobs, ref, mask, estimator="k2")
    torch.testing.assert_close(loss, expected, rtol=0, atol=1e-14)
    torch.testing.assert_close(grad_of(loss, logprobs), grad_of(expected, logprobs), rtol=0, atol=1e-14)
    assert metrics["kl_ref"] == pytest.approx(kl_penalty(logprobs, ref, mask, estimator="k2").item(), abs=1e-14)


def test_argument_errors():
    logprobs, old, mask = random_batch([1, 2], T=3, log_ratio_scale=1e-3)
    adv = torch.zeros(2, dtype=F64)
    with pytest.raises(ValueError, match="kl_coef=0.1 needs ref_logprobs"):
        gspo_loss(logprobs, old, adv, mask, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        gspo_loss(logprobs, old, adv, mask, ref_logprobs=old, kl_estimator="k4")
    with pytest.raises(ValueError, match=r"advantages must be \[B\] with B=2"):
        gspo_loss(logprobs, old, torch.zeros(2, 3, dtype=F64), mask)
    with pytest.raises(ValueError, match="eps_low must be in"):
        gspo_loss(logprobs, old, adv, mask, eps_low=1.5)
    with pytest.raises(ValueError, match="num_sequences must be a positive number"):
        gspo_loss(logprobs, old, adv, mask, num_sequences=0)


def test_half_precision_inputs_are_computed_in_float32():
    # bf16 cannot tell 1 + 4e-4 from 1; the math must run in float32 on the (bf16-exact) input values.
    logprobs32, old32, mask = random_batch([3, 5, 1, 4], T=6, log_ratio_scale=1e-3, seed=9)
    logprobs = logprobs32.detach().to(torch.bfloat16).requires_grad_(True)
    old = old32.to(torch.bfloat16)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0])
    loss, metrics = gspo_loss(logprobs, old, adv, mask)
    reference, ref_metrics = gspo_loss(logprobs.detach().float(), old.float(), adv, mask)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, reference, rtol=0, atol=0)
    assert metrics == ref_metrics
    assert grad_of(loss, logprobs).dtype == torch.bfloat16
