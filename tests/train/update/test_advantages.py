"""The loop's advantages from a rollout: masked rewards leave their group, per-segment rewards land on the tokens
the loss sees (labels-aligned), and one segment per response is the sequence advantage."""

from __future__ import annotations

import torch

from gspo_megatron.algo import group_advantages
from gspo_megatron.rollout import Sample, samples_to_batch
from gspo_megatron.train.update.advantages import advantages
from gspo_megatron.train.startup.config import load_config
from gspo_megatron.train.sampling.broadcast import Rollout


def _rollout(rewards, valid, segments=None) -> Rollout:
    # Prompts of 2 and 3 tokens, responses of 3 and 2 (one group of 4 would need 4 samples: groups of 2 here).
    shapes = [(2, 3), (3, 2), (2, 2), (3, 3)]
    samples = [Sample(list(range(1, p + 1)), list(range(10, 10 + r)), [-0.5] * r, "stop", "v", i // 2, i % 2)
               for i, (p, r) in enumerate(shapes)]
    return Rollout(samples, torch.tensor(rewards), torch.tensor(valid), samples_to_batch(samples), {}, segments)


def test_a_masked_reward_leaves_its_group():
    cfg = load_config(None, ["rollout.group_size=2", "data.task=reverse"])
    rollout = _rollout([1.0, 0.0, 0.2, 0.6], [True, False, True, True])  # sample 1's reward failed (score: 0.0)
    adv = advantages(rollout, cfg)
    # Group 0 has one valid sample left: no signal, rather than +A for sample 0 against the failed one's 0.0.
    assert torch.equal(adv[:2], torch.zeros(2))
    torch.testing.assert_close(adv[2:], group_advantages(torch.tensor([0.2, 0.6]), 2))


def test_segment_rewards_land_on_their_tokens():
    cfg = load_config(None, ["rollout.group_size=2", "data.task=reverse", "algo.name=gspo_token",
                             "algo.token_advantages=segments", "data.segment_reward=synthetic",
                             "algo.normalize_advantage_std=false"])
    # One segment per response ending at its last token: the sequence advantage on every response token.
    whole = [[(3, 1.0)], [(2, 0.0)], [(2, 0.2)], [(3, 0.6)]]
    rollout = _rollout([1.0, 0.0, 0.2, 0.6], [True] * 4, whole)
    adv = advantages(rollout, cfg)
    mask = rollout.batch["loss_mask"]
    expected = group_advantages(rollout.rewards, 2, normalize_std=False).unsqueeze(1) * mask
    torch.testing.assert_close(adv, expected)
    # Sample 0 (prompt of 2: response token j is label position 1 + j): segments ending at tokens 1 and 3.
    split = [[(1, 1.0), (3, 0.0)], [(2, 0.0)], [(2, 0.2)], [(3, 0.6)]]
    adv = advantages(_rollout([1.0, 0.0, 0.2, 0.6], [True] * 4, split), cfg)
    # Group 0's segment rewards [1, 0, 0]: mean 1/3; token 1 gets both of its segments, tokens 2-3 the last one.
    torch.testing.assert_close(adv[0, 1:4], torch.tensor([2 / 3 - 1 / 3, -1 / 3, -1 / 3]))
    assert torch.equal(adv[0, 4:], torch.zeros(adv.shape[1] - 4)) and adv[0, 0] == 0
