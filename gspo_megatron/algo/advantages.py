"""Group-relative advantages (GRPO / GSPO): A_i = (r_i - mean(r_group)) / (std(r_group) + eps)."""

from __future__ import annotations

import torch

__all__ = ["group_advantages"]


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    normalize_std: bool = True,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Advantages of G responses per prompt relative to their own group.

    rewards: [B], B = num_groups * group_size, groups contiguous (group g is rows g*G .. g*G+G-1).
    Returns [B] float: (r - group mean) / (group std + eps), or r - group mean when normalize_std=False.

    The std is torch.std's default, the *unbiased* (Bessel-corrected, divide by G-1) estimate, as TRL and verl
    use. A group whose rewards are all equal carries no learning signal and gets advantage exactly 0 (not a
    rounding residue of r - mean); with group_size=1 every group is such a group.
    Integer or bool rewards are promoted to the default float dtype.
    """
    if not isinstance(rewards, torch.Tensor):
        raise TypeError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [B], got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be an int >= 1, got {group_size!r}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"rewards has {rewards.numel()} elements, not divisible by group_size={group_size}"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.get_default_dtype())
    bad = (~torch.isfinite(rewards)).nonzero()
    if bad.numel() > 0:
        index = int(bad[0, 0])
        raise ValueError(f"rewards must be finite; rewards[{index}] = {rewards[index].item()}")

    groups = rewards.view(-1, group_size)  # [num_groups, G]
    if group_size == 1:
        # The unbiased std of one sample is undefined (0/0); the group is trivially all-equal.
        return torch.zeros_like(rewards)
    centered = groups - groups.mean(dim=-1, keepdim=True)
    if normalize_std:
        centered = centered / (groups.std(dim=-1, keepdim=True) + eps)
    all_equal = (groups == groups[:, :1]).all(dim=-1, keepdim=True)
    return torch.where(all_equal, torch.zeros_like(centered), centered).view(-1)
