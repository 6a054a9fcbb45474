import math

import pytest
import torch

from gspo_megatron.algo import gspo_loss, gspo_token_loss

from .batches import grad_of, random_batch

NEG_INF = float("-inf")
F64 = torch.float64


def test_hand_values_with_per_token_advantages():
    # One sequence, log-ratios (0.1, 0.3): every token's ratio is s = e^0.2 > 1 + eps_high = 1.1.
    logprobs = torch.tensor([[-1.0, -2.0, NEG_INF]], dtype=F64, requires_grad=True)
    old = torch.tensor([[-1.1, -2.3, 0.0]], dtype=F64)
    mask = torch.tensor([[True, True, False]])
    token_adv = torch.tensor([[2.0, -1.0, float("nan")]], dtype=F64)  # garbage under the mask is ignored
    loss, metrics = gspo_token_loss(logprobs, old, token_adv, mask, eps_low=0.2, eps_high=0.1)
    s = math.exp(0.2)
    # token 0: A > 0, clipped to 1.1 * 2; token 1: A < 0 with s above the interval, unclipped: s * -1.
    torch.testing.assert_close(loss, torch.tensor(-(1.1 * 2.0 - s) / 2, dtype=F64), rtol=0, atol=1e-12)
    # d/dlogp_1 of -(1/2) * s_i1 * (-1) = s / 2; the clipped token gets none.
    expected_grad = torch.tensor([[0.0, s / 2, 0.0]], dtype=F64)
    torch.testing.assert_close(grad_of(loss, logprobs), expected_grad, rtol=0, atol=1e-12)
    assert metrics["clip_frac"] == pytest.approx(0.5, abs=1e-15)
    assert metrics["clip_frac_high"] == pytest.approx(0.5, abs=1e-15)
    assert metrics["clip_frac_low"] == 0.0


@pytest.mark.parametrize("seed", [0, 1])
def test_equals_gspo_in_value_and_gradient_with_clipping(seed):
    lengths = [3, 5, 1, 0, 7, 4, 2, 6]
    logprobs, old, mask = random_batch(lengths, T=9, log_ratio_scale=1e-3, seed=seed)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.7, 1.3, -1.2, 0.9], dtype=F64)
    token_adv = torch.where(mask, adv[:, None].expand_as(mask), torch.full_like(old, float("nan")))

    seq_loss, seq_metrics = gspo_loss(logprobs, old, adv, mask)
    tok_loss, tok_metrics = gspo_token_loss(logprobs, old, token_adv, mask)
    assert 0.0 < seq_metrics["clip_frac"] < 1.0, "the case must mix clipped and unclipped sequences"
    torch.testing.assert_close(tok_loss, seq_loss, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_of(tok_loss, logprobs), grad_of(seq_loss, logprobs), rtol=0, atol=1e-12)
    for name in ("seq_ratio_min", "seq_ratio_mean", "seq_ratio_max", "approx_kl", "num_sequences"):
        assert tok_metrics[name] == pytest.approx(seq_metrics[name], rel=0, abs=1e-12), name
    # Token clip fraction = token-weighted share of clipped sequences.
    token_weighted = sum(
        n for n, c in zip(lengths, _clipped_rows(logprobs, old, adv, mask)) if c
    ) / sum(lengths)
    assert tok_metrics["clip_frac"] == pytest.approx(token_weighted, abs=1e-12)


def _clipped_rows(logprobs, old, adv, mask, eps_low=3e-4, eps_high=4e-4):
    with torch.no_grad():
        n = mask.sum(-1).clamp(min=1)
        s = torch.exp(((logprobs - old) * mask).sum(-1) / n)
        return (((adv > 0) & (s > 1 + eps_high)) | ((adv < 0) & (s < 1 - eps_low))).tolist()


def test_extremes_and_all_masked_are_finite():
    old = torch.tensor([[-1.0, -1.0, NEG_INF], [-2.0, -2.0, NEG_INF], [NEG_INF] * 3], dtype=F64)
    logprobs = torch.tensor(
        [[1e4, 1e4, NEG_INF], [-1e4, -1e4, float("nan")], [NEG_INF] * 3], dtype=F64, requires_grad=True
    )
    mask = torch.tensor([[1, 1, 0], [1, 1, 0], [0, 0, 0]])
    token_adv = torch.tensor([[-1.0, 1.0, 0.0], [1.0, -1.0, 0.0], [1.0, 1.0, 1.0]], dtype=F64)
    loss, metrics = gspo_token_loss(logprobs, old, token_adv, mask)
    assert torch.isfinite(loss) and torch.isfinite(grad_of(loss, logprobs)).all()
    assert all(math.isfinite(v) for v in metrics.values())

    empty = torch.zeros_like(mask)
    loss, metrics = gspo_token_loss(logprobs, old, token_adv, empty)
    assert loss.item() == 0.0 and loss.requires_grad
    assert torch.equal(grad_of(loss, logprobs), torch.zeros_like(logprobs))
    assert all(v == 0.0 for v in metrics.values()), metrics


def test_num_sequences_override_reproduces_full_batch():
    logprobs, old, mask = random_batch([3, 5, 1, 2, 7, 4, 2, 6], T=9, log_ratio_scale=1e-3, seed=5)
    token_adv = torch.randn(8, 9, generator=torch.Generator().manual_seed(5), dtype=F64)
    full = gspo_token_loss(logprobs, old, token_adv, mask)[0]
    halves = sum(
        gspo_token_loss(logprobs[sl], old[sl], token_adv[sl], mask[sl], num_sequences=8)[0]
        for sl in (slice(0, 4), slice(4, 8))
    )
    torch.testing.assert_close(halves, full, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad_of(halves, logprobs), grad_of(full, logprobs), rtol=0, atol=1e-12)


def test_token_advantages_shape_error():
    logprobs, old, mask = random_batch([1, 2], T=3, log_ratio_scale=1e-3)
    with pytest.raises(ValueError, match="token_advantages must have the shape of logprobs"):
        gspo_token_loss(logprobs, old, torch.zeros(2, dtype=F64), mask)
