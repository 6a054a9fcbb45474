"""Group-relative advantages (GRPO / GSPO): A_i = (r_i - mean(r_group)) / (std(r_group) + eps), and per-token
advantages from per-segment rewards (GSPO-token, GRPO with process rewards)."""

from __future__ import annotations

import torch

__all__ = ["group_advantages", "segment_advantages"]


def _check_groups(rewards: torch.Tensor, group_size: int, name: str = "rewards") -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if rewards.shape[0] % group_size != 0:
        raise ValueError(f"{name} has {rewards.shape[0]} rows, not divisible by group_size={group_size}")


def _check_valid(valid: torch.Tensor | None, batch: int) -> torch.Tensor:
    if valid is None:
        return torch.ones(batch, dtype=torch.bool)
    if not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool or valid.shape != (batch,):
        raise ValueError(f"valid must be a bool tensor of shape [B] = ({batch},), got "
                         f"{getattr(valid, 'dtype', type(valid).__name__)} {tuple(getattr(valid, 'shape', ()))}")
    return valid


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    normalize_std: bool = True,
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Advantages of G responses per prompt relative to their own group.

    rewards: [B], B = num_groups * group_size, groups contiguous (group g is rows g*G .. g*G+G-1).
    valid: optional bool [B]; False marks a sample whose reward failed (``rewards.rewards.score`` with
    on_error="mask"): it takes no part in its group's mean and std and gets advantage 0.
    Returns [B] float: (r - group mean) / (group std + eps), or r - group mean when normalize_std=False.

    The std is torch.std's default, the *unbiased* (Bessel-corrected, divide by n-1) estimate over the group's
    valid samples, as TRL and verl use. A group whose valid rewards are all equal (or that has fewer than two
    valid samples) carries no learning signal and gets advantage exactly 0, not a rounding residue of r - mean.
    Integer or bool rewards are promoted to the default float dtype.
    """
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    _check_groups(rewards, group_size)
    valid = _check_valid(valid, rewards.numel())
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    bad = (valid & ~torch.isfinite(rewards)).nonzero()
    if bad.numel() > 0:
        index = int(bad[0, 0])
        raise ValueError(f"rewards must be finite; rewards[{index}] = {rewards[index].item()}")

    keep = valid.view(-1, group_size)  # [num_groups, G]
    groups = torch.where(keep, rewards.view(-1, group_size), torch.zeros((), dtype=rewards.dtype))
    count = keep.sum(dim=-1, keepdim=True)
    mean = groups.sum(dim=-1, keepdim=True) / count.clamp(min=1)
    centered = torch.where(keep, groups - mean, torch.zeros((), dtype=rewards.dtype))
    if normalize_std:
        # Unbiased std over the valid members (undefined for one: such a group is trivially all-equal below).
        std = (centered.square().sum(dim=-1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        centered = centered / (std + eps)
    first = groups.gather(1, keep.to(torch.int64).argmax(dim=-1, keepdim=True))  # a valid member's reward
    all_equal = ((groups == first) | ~keep).all(dim=-1, keepdim=True) | (count < 2)
    return torch.where(all_equal | ~keep, torch.zeros_like(centered), centered).view(-1)


def _discounted_to_go(rewards: torch.Tensor, ends: torch.Tensor, gamma: float) -> torch.Tensor:
    """[B, T]: at token t, sum_k gamma^k r_(j+k) over the segments j, j+1, ... ending at or after t (rewards and
    ends [B, T], rewards 0 off the ends). The recursion R_j = r_j + gamma R_(j+1) runs over segment indices."""
    B, T = rewards.shape
    before = ends.long().cumsum(-1) - ends.long()  # [B, T] segments ending before t: t's segment index
    K = int(ends.sum(-1).max()) if B else 0
    returns = torch.zeros(B, K + 1, dtype=rewards.dtype)  # column K: after the last segment, 0
    zero = torch.zeros((), dtype=rewards.dtype)
    returns.scatter_add_(1, torch.where(ends, before, K), torch.where(ends, rewards, zero))
    returns[:, K] = 0
    for k in range(K - 1, -1, -1):
        returns[:, k] += gamma * returns[:, k + 1]
    return returns.gather(1, before)


def segment_advantages(
    segment_rewards: torch.Tensor,
    segment_ends: torch.Tensor,
    response_mask: torch.Tensor,
    group_size: int,
    normalize_std: bool = True,
    eps: float = 1e-6,
    valid: torch.Tensor | None = None,
    gamma: float = 1.0,
) -> torch.Tensor:
    """Per-token advantages from per-segment rewards (DeepSeekMath's process supervision, arXiv 2402.03300 4.1.3).

    segment_rewards: [B, T] float, the reward of the segment that ends at token t (read where segment_ends);
    segment_ends: [B, T] bool, True at each segment's last token (a turn, a step, a character);
    response_mask: [B, T] bool, the response tokens; groups of ``group_size`` rows as in group_advantages.
    Every segment reward is normalised by the mean and (unbiased) std of all segment rewards of its group's valid
    samples; a token's advantage is the sum of the normalised rewards of the segments ending at or after it
    (its own segment's and every later one's), the k-th later one weighted gamma^k (``gamma`` in (0, 1]: turn-level
    discounting of multi-turn rollouts). Tokens after a sample's last segment, masked tokens (a multi-turn
    trajectory's observations) and invalid samples get 0. Returns [B, T] float.

    With one segment per response ending at its last token, every token gets the group-normalised sequence
    reward: exactly group_advantages broadcast over the response, so GSPO-token then equals GSPO.
    """
    if segment_rewards.dim() != 2 or segment_ends.shape != segment_rewards.shape:
        raise ValueError(f"segment_rewards and segment_ends must be [B, T] of one shape, got "
                         f"{tuple(segment_rewards.shape)} and {tuple(segment_ends.shape)}")
    if response_mask.shape != segment_rewards.shape:
        raise ValueError(f"response_mask must be [B, T] = {tuple(segment_rewards.shape)}, "
                         f"got {tuple(response_mask.shape)}")
    if (segment_ends & ~response_mask.bool()).any():
        raise ValueError("segment_ends marks a token outside response_mask: segments end on response tokens")
    _check_groups(segment_rewards, group_size, "segment_rewards")
    B, T = segment_rewards.shape
    valid = _check_valid(valid, B)
    ends = segment_ends & valid.unsqueeze(1)
    rewards = segment_rewards.to(torch.promote_types(segment_rewards.dtype, torch.float32))
    if (ends & ~torch.isfinite(rewards)).any():
        raise ValueError("segment_rewards must be finite at every segment end")
    zero = torch.zeros((), dtype=rewards.dtype)
    per_group = lambda x: x.reshape(-1, group_size * T)  # noqa: E731  [num_groups, G*T]
    keep, values = per_group(ends), per_group(torch.where(ends, rewards, zero))
    count = keep.sum(dim=-1, keepdim=True)
    centered = torch.where(keep, values - values.sum(dim=-1, keepdim=True) / count.clamp(min=1), zero)
    if normalize_std:
        std = (centered.square().sum(dim=-1, keepdim=True) / (count - 1).clamp(min=1)).sqrt()
        centered = centered / (std + eps)
    first = values.gather(1, keep.to(torch.int64).argmax(dim=-1, keepdim=True))
    all_equal = ((values == first) | ~keep).all(dim=-1, keepdim=True) | (count < 2)
    normalised = torch.where(all_equal, zero, centered).view(B, T)
    if not 0 < gamma <= 1:
        raise ValueError(f"gamma={gamma} must be in (0, 1]")
    if gamma == 1:
        to_go = normalised.flip(-1).cumsum(-1).flip(-1)  # sum over segments ending at or after t
    else:
        to_go = _discounted_to_go(normalised, ends, gamma)
    return torch.where(response_mask.bool() & valid.unsqueeze(1), to_go, zero)
