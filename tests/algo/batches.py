"""Small deterministic [B, T] batches for the algo tests (float64 so gradients compare at 1e-10..1e-12)."""

from __future__ import annotations

import torch


def response_mask(lengths: list[int], T: int, prompt_len: int = 1) -> torch.Tensor:
    """Bool [B, T]: each row has `prompt_len` masked prompt positions, then `length` response tokens, then padding."""
    mask = torch.zeros(len(lengths), T, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, prompt_len : prompt_len + n] = True
    return mask


def random_batch(
    lengths: list[int], T: int, log_ratio_scale: float, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprobs leaf requiring grad, old_logprobs, mask), logprobs - old ~ log_ratio_scale * N(0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(len(lengths), T, generator=gen, dtype=torch.float64) * 3.0 - 0.05
    new = old + log_ratio_scale * torch.randn(len(lengths), T, generator=gen, dtype=torch.float64)
    return new.requires_grad_(True), old, response_mask(lengths, T)


def grad_of(loss: torch.Tensor, leaf: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad(loss, leaf)
    return grad
