"""A step's rewards -> the advantages the loss uses, as ``algo.token_advantages`` says.

    sequence   [N]: A_i, group-relative over each prompt's valid samples (``algo.group_advantages``)
    segments   [N, S]: per token, from the samples' per-segment rewards (``algo.segment_advantages``), aligned
               with ``labels`` like the log-probs: response token j of a sample with a P-token prompt is position
               P - 1 + j
    turns      [N, S]: the same with a multi-turn trajectory's turns as the segments (``rollout.env``'s turn
               rewards, each ending at its turn's last model token), discounted by ``algo.gamma``; observation
               tokens are outside loss_mask and get 0

Samples whose reward failed and was masked (``data.on_reward_error=mask``) take no part in their group's
statistics and get advantage 0 (the loop also drops them from the loss).
"""

from __future__ import annotations

import torch

from gspo_megatron.algo import group_advantages, segment_advantages
from gspo_megatron.train.startup.config import Config


def segment_tensors(segments: list, prompt_lengths: torch.Tensor, shape: tuple[int, int], valid: torch.Tensor):
    """[(end, reward), ...] per sample -> (rewards [N, S] float32, ends [N, S] bool): a segment's reward sits on
    its last response token's position; invalid samples have none."""
    rewards = torch.zeros(shape, dtype=torch.float32)
    ends = torch.zeros(shape, dtype=torch.bool)
    for row, (sample_segments, prompt_length) in enumerate(zip(segments, prompt_lengths.tolist())):
        if not valid[row]:
            continue
        for end, reward in sample_segments:
            rewards[row, prompt_length - 2 + end] = reward
            ends[row, prompt_length - 2 + end] = True
    return rewards, ends


def advantages(rollout, cfg: Config) -> torch.Tensor:
    """[N] sequence advantages, or [N, S] per-token ones with algo.token_advantages=segments."""
    group, normalize = cfg.rollout.group_size, cfg.algo.normalize_advantage_std
    valid = rollout.reward_valid
    if cfg.algo.token_advantages == "sequence":
        return group_advantages(rollout.rewards, group, normalize_std=normalize, valid=valid)
    batch = rollout.batch
    rewards, ends = segment_tensors(rollout.segments, batch["prompt_lengths"], tuple(batch["loss_mask"].shape), valid)
    gamma = cfg.algo.gamma if cfg.algo.token_advantages == "turns" else 1.0
    return segment_advantages(rewards, ends, batch["loss_mask"], group, normalize_std=normalize, valid=valid,
                              gamma=gamma)
