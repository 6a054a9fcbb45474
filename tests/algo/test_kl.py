import math

import pytest
import torch

from gspo_megatron.algo import kl_k1, kl_k2, kl_k3, kl_penalty

from .batches import grad_of

NEG_INF = float("-inf")
F64 = torch.float64


def test_estimator_hand_values():
    logprobs = torch.tensor([[-1.0, -2.0, -0.3]], dtype=F64)
    ref = torch.tensor([[-1.5, -1.0, -0.3]], dtype=F64)  # logp - ref = (0.5, -1.0, 0.0)
    torch.testing.assert_close(kl_k1(logprobs, ref), torch.tensor([[0.5, -1.0, 0.0]], dtype=F64), rtol=0, atol=1e-15)
    torch.testing.assert_close(kl_k2(logprobs, ref), torch.tensor([[0.125, 0.5, 0.0]], dtype=F64), rtol=0, atol=1e-15)
    # k3 = exp(ref - logp) - (ref - logp) - 1
    k3 = [math.exp(-0.5) + 0.5 - 1, math.exp(1.0) - 1.0 - 1, 0.0]
    torch.testing.assert_close(kl_k3(logprobs, ref), torch.tensor([k3], dtype=F64), rtol=0, atol=1e-15)


def test_k3_gradient():
    logprobs = torch.tensor([[-1.0, -2.0]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=F64)
    grad = grad_of(kl_k3(logprobs, ref).sum(), logprobs)  # d/dlogp = 1 - exp(ref - logp)
    torch.testing.assert_close(grad, torch.tensor([[1 - math.exp(-0.5), 1 - math.e]], dtype=F64), rtol=0, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_k3_is_nonnegative(dtype):
    gen = torch.Generator().manual_seed(0)
    scales = torch.logspace(-18, 1, 40, dtype=F64)
    diff = (torch.randn(40, 50, generator=gen, dtype=F64) * scales[:, None]).to(dtype)
    logprobs = torch.full_like(diff, -2.0)
    assert (kl_k3(logprobs, logprobs + diff) >= 0).all()
    assert (kl_k3(logprobs, logprobs - diff) >= 0).all()
    # Dense small |x|: the naive exp(x) - x - 1 goes negative here in float32 (thousands of points).
    small = torch.linspace(-1e-3, 1e-3, 20001, dtype=dtype)
    assert (kl_k3(torch.zeros_like(small), small) >= 0).all()


def test_penalty_hand_values_and_aggregations():
    # row 0 log-ratios (0.5, -1.0), row 1 (0.2,); masked positions hold -inf.
    logprobs = torch.tensor([[-1.0, -2.0, NEG_INF], [NEG_INF, -0.8, NEG_INF]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0, NEG_INF], [0.0, -1.0, float("nan")]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [0, 1, 0]], dtype=torch.float32)
    k1_seq = kl_penalty(logprobs, ref, mask, estimator="k1")
    torch.testing.assert_close(k1_seq, torch.tensor(((0.5 - 1.0) / 2 + 0.2) / 2, dtype=F64), rtol=0, atol=1e-15)
    k1_tok = kl_penalty(logprobs, ref, mask, estimator="k1", aggregation="token-mean")
    torch.testing.assert_close(k1_tok, torch.tensor((0.5 - 1.0 + 0.2) / 3, dtype=F64), rtol=0, atol=1e-15)

    k3 = [math.exp(-d) + d - 1 for d in (0.5, -1.0, 0.2)]
    k3_seq = kl_penalty(logprobs, ref, mask)  # defaults: k3, seq-mean-token-mean
    torch.testing.assert_close(k3_seq, torch.tensor(((k3[0] + k3[1]) / 2 + k3[2]) / 2, dtype=F64), rtol=0, atol=1e-15)
    grad = grad_of(k3_seq, logprobs)
    assert torch.isfinite(grad).all() and (grad[~mask.bool()] == 0).all()


def test_penalty_extremes_and_empty_are_finite():
    logprobs = torch.tensor([[0.0, -1e4], [NEG_INF, NEG_INF]], dtype=F64, requires_grad=True)
    ref = torch.tensor([[-1e4, 0.0], [NEG_INF, 0.0]], dtype=F64)
    mask = torch.tensor([[1, 1], [0, 0]])
    for estimator in ("k1", "k2", "k3"):
        value = kl_penalty(logprobs, ref, mask, estimator=estimator)
        assert torch.isfinite(value) and torch.isfinite(grad_of(value, logprobs)).all()
    # Clamped at +-10: k3 of the two tokens is (e^-10 + 10 - 1) and (e^10 - 10 - 1), mean over row 0 only.
    expected = (math.exp(-10) + 9 + math.exp(10) - 11) / 2
    torch.testing.assert_close(kl_penalty(logprobs, ref, mask), torch.tensor(expected, dtype=F64), rtol=1e-12, atol=0)
    empty = kl_penalty(logprobs, ref, torch.zeros_like(mask))
    assert empty.item() == 0.0 and torch.equal(grad_of(empty, logprobs), torch.zeros_like(logprobs))


def test_penalty_errors():
    x = torch.zeros(1, 2)
    with pytest.raises(ValueError, match="kl_estimator must be one of"):
        kl_penalty(x, x, torch.ones(1, 2), estimator="k5")
    with pytest.raises(ValueError, match="aggregation must be one of"):
        kl_penalty(x, x, torch.ones(1, 2), aggregation="mean")
