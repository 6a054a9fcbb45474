import math

import pytest
import torch

from gspo_megatron.algo import masked_log_ratio_sums, sequence_log_ratio, sequence_log_ratio_from_sums

from .batches import grad_of

NEG_INF = float("-inf")


def test_hand_values_with_garbage_and_empty_rows():
    # row 0: tokens 1,2 are response (log-ratios 0.1, 0.3); row 1: all three (-0.5, -0.5, -0.2); row 2: empty.
    logprobs = torch.tensor(
        [[NEG_INF, -1.0, -2.0, float("nan")], [-1.0, -1.5, -0.7, NEG_INF], [NEG_INF, NEG_INF, 3.0, 1e30]],
        dtype=torch.float64,
        requires_grad=True,
    )
    old = torch.tensor(
        [[0.0, -1.1, -2.3, NEG_INF], [-0.5, -1.0, -0.5, 0.0], [NEG_INF, 0.0, NEG_INF, 0.0]], dtype=torch.float64
    )
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 0], [0, 0, 0, 0]], dtype=torch.float32)
    seq = sequence_log_ratio(logprobs, old, mask)
    expected = torch.tensor([(0.1 + 0.3) / 2, (-0.5 - 0.5 - 0.2) / 3, 0.0], dtype=torch.float64)
    torch.testing.assert_close(seq, expected, rtol=0, atol=1e-12)

    grad = grad_of(seq.sum(), logprobs)
    assert torch.isfinite(grad).all()
    expected_grad = mask.to(torch.float64) / torch.tensor([[2.0], [3.0], [1.0]], dtype=torch.float64)
    torch.testing.assert_close(grad, expected_grad, rtol=0, atol=1e-15)


def test_sums_compose_to_the_mean():
    logprobs = torch.tensor([[-1.0, -2.0], [-3.0, -4.0]], dtype=torch.float64)
    old = torch.zeros(2, 2, dtype=torch.float64)
    mask = torch.tensor([[True, True], [False, True]])
    total, count = masked_log_ratio_sums(logprobs, old, mask)
    torch.testing.assert_close(total, torch.tensor([-3.0, -4.0], dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(count, torch.tensor([2.0, 1.0], dtype=torch.float64), rtol=0, atol=0)
    torch.testing.assert_close(
        sequence_log_ratio_from_sums(total, count), torch.tensor([-1.5, -4.0], dtype=torch.float64), rtol=0, atol=0
    )
    # A zero count gives 0 whatever the sum says.
    assert sequence_log_ratio_from_sums(torch.tensor([math.pi]), torch.tensor([0.0])).item() == 0.0


def test_mask_and_shape_errors():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="response_mask must contain only 0 and 1"):
        sequence_log_ratio(x, x, torch.full((2, 3), 0.5))
    with pytest.raises(ValueError, match="old_logprobs must have the shape of logprobs"):
        sequence_log_ratio(x, torch.zeros(2, 4), torch.ones(2, 3))
    with pytest.raises(ValueError, match="response_mask must have the shape"):
        sequence_log_ratio(x, x, torch.ones(3, 2))
    with pytest.raises(ValueError, match=r"logprobs must be \[B, T\]"):
        sequence_log_ratio(torch.zeros(3), torch.zeros(3), torch.ones(3))
