import math

import pytest
import torch

from gspo_megatron.algo import group_advantages, segment_advantages

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


def test_a_failed_reward_leaves_its_group():
    """A masked sample (its reward failed; score() gives it 0.0) must not move its group's mean and std."""
    rewards = torch.tensor([1.0, 0.0, 3.0, 5.0, 2.0, 2.0], dtype=torch.float64)
    valid = torch.tensor([True, False, True, True, True, True])
    adv = group_advantages(rewards, group_size=3, valid=valid)
    # group 0 over its valid samples [1, 3]: mean 2, unbiased std sqrt(2); the masked one gets exactly 0.
    std = math.sqrt(2.0)
    expected = [-1 / (std + EPS), 0.0, 1 / (std + EPS)] + group_advantages(rewards[3:], 3).tolist()
    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    # A group with one valid sample has no signal; an invalid sample's non-finite reward is never read.
    adv = group_advantages(torch.tensor([4.0, float("nan"), 0.0, 1.0]), 2, valid=torch.tensor([True, False, True, True]))
    assert torch.equal(adv[:2], torch.zeros(2)) and adv[2] < 0 < adv[3]
    with pytest.raises(ValueError, match=r"valid must be a bool tensor of shape \[B\]"):
        group_advantages(rewards, 3, valid=torch.ones(5, dtype=torch.bool))


def test_segment_advantages_hand_values_and_one_segment_is_the_sequence_advantage():
    # Two samples (one group), response tokens at positions 1..3; sample 0 has segments ending at 1 and 3
    # (rewards 1, 0), sample 1 one segment ending at 2 (reward 2). Group segment rewards [1, 0, 2]: mean 1,
    # unbiased std 1 -> normalised [0, -1, 1].
    mask = torch.tensor([[False, True, True, True], [False, True, True, False]])
    rewards = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 2.0, 0.0]], dtype=torch.float64)
    ends = torch.tensor([[False, True, False, True], [False, False, True, False]])
    adv = segment_advantages(rewards, ends, mask, group_size=2, eps=0.0)
    # Sum over segments ending at or after each token: sample 0: t1 -> 0 + -1, t2, t3 -> -1; sample 1: t1, t2 -> 1.
    expected = torch.tensor([[0.0, -1.0, -1.0, -1.0], [0.0, 1.0, 1.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)

    # One segment per response, ending at its last token: every token gets the sequence's group advantage.
    g = torch.Generator().manual_seed(0)
    lengths = torch.tensor([3, 5, 1, 4, 2, 6, 3, 2])
    mask = torch.arange(8).unsqueeze(0) < lengths.unsqueeze(1)
    sequence_rewards = torch.rand(8, generator=g, dtype=torch.float64)
    rewards = torch.zeros(8, 8, dtype=torch.float64)
    ends = torch.zeros(8, 8, dtype=torch.bool)
    ends[torch.arange(8), lengths - 1] = True
    rewards[torch.arange(8), lengths - 1] = sequence_rewards
    valid = torch.tensor([True] * 5 + [False] + [True] * 2)
    adv = segment_advantages(rewards, ends, mask, group_size=4, valid=valid)
    expected = group_advantages(sequence_rewards, 4, valid=valid).unsqueeze(1) * mask
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-12)


def test_segment_advantages_errors_name_the_argument():
    mask = torch.tensor([[True, True]])
    with pytest.raises(ValueError, match="segments end on response tokens"):
        segment_advantages(torch.zeros(1, 2), torch.tensor([[True, True]]), torch.tensor([[True, False]]), 1)
    with pytest.raises(ValueError, match="not divisible by group_size=2"):
        segment_advantages(torch.zeros(1, 2), torch.zeros(1, 2, dtype=torch.bool), mask, 2)
    with pytest.raises(ValueError, match="must be finite"):
        segment_advantages(torch.tensor([[float("nan"), 0.0]]), torch.tensor([[True, False]]), mask, 1)
