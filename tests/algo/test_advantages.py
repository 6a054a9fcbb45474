import math

import pytest
import torch

from gspo_megatron.algo import group_advantages

EPS = 1e-6


def test_hand_values_unbiased_std():
    rewards = torch.tensor([1.0, 2.0, 3.0, 0.0, 0.0, 0.0, 4.0, 0.0], dtype=torch.float64)
    adv = group_advantages(rewards[:6], group_size=3)
    # group [1,2,3]: mean 2, unbiased std sqrt((1+0+1)/2) = 1
    expected = [-1 / (1 + EPS), 0.0, 1 / (1 + EPS), 0.0, 0.0, 0.0]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)

    # group [0,0,4,0]: mean 1, unbiased var (1+1+9+1)/3 = 4 -> std 2 (the biased std would be sqrt(3))
    adv = group_advantages(rewards[4:], group_size=4)
    expected = [v / (2.0 + EPS) for v in (-1.0, -1.0, 3.0, -1.0)]
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)


def test_two_element_group():
    adv = group_advantages(torch.tensor([0.0, 1.0], dtype=torch.float64), group_size=2)
    std = math.sqrt(0.5)  # unbiased: ((0.5^2 + 0.5^2) / 1) ** 0.5
    expected = torch.tensor([-0.5 / (std + EPS), 0.5 / (std + EPS)], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)


def test_mean_centering_only():
    rewards = torch.tensor([1.0, 2.0, 6.0, 3.0, 5.0, 7.0])
    adv = group_advantages(rewards, group_size=3, normalize_std=False)
    torch.testing.assert_close(adv, torch.tensor([-2.0, -1.0, 3.0, -2.0, 0.0, 2.0]), rtol=0, atol=1e-6)


@pytest.mark.parametrize("normalize_std", [True, False])
def test_all_equal_groups_are_exactly_zero(normalize_std):
    # 0.1 and 0.3 are not exact in binary: r - mean(r) would leave a rounding residue without the special case.
    rewards = torch.tensor([0.1, 0.1, 0.1, 0.3, 0.3, 0.3, 0.0, 1.0, 0.5], dtype=torch.float32)
    adv = group_advantages(rewards, group_size=3, normalize_std=normalize_std)
    assert torch.equal(adv[:6], torch.zeros(6))
    assert (adv[6:] != 0).sum() == 2  # the mixed group keeps its signal (its middle value is the mean)


def test_group_size_one_and_int_rewards():
    assert torch.equal(group_advantages(torch.tensor([1.0, 5.0]), 1), torch.zeros(2))
    adv = group_advantages(torch.tensor([0, 1, 1, 1]), group_size=2, normalize_std=False)
    assert adv.is_floating_point()
    torch.testing.assert_close(adv, torch.tensor([-0.5, 0.5, 0.0, 0.0]), rtol=0, atol=0)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match=r"not divisible by group_size=3"):
        group_advantages(torch.zeros(7), 3)
    with pytest.raises(ValueError, match=r"group_size must be an int >= 1"):
        group_advantages(torch.zeros(4), 0)
    with pytest.raises(ValueError, match=r"rewards\[2\] = nan"):
        group_advantages(torch.tensor([0.0, 1.0, float("nan"), 1.0]), 2)
    with pytest.raises(ValueError, match=r"rewards\[1\] = inf"):
        group_advantages(torch.tensor([0.0, float("inf")]), 2)
    with pytest.raises(ValueError, match=r"rewards must be \[B\]"):
        group_advantages(torch.zeros(2, 2), 2)
