"""Masking that keeps autograd NaN-free.

Masked positions of log-prob tensors may hold -inf or garbage (padding, prompt tokens). Multiplying by a 0/1
mask turns -inf into NaN (0 * inf), and even `torch.where` applied *after* a nonlinearity leaks NaN into the
backward pass (the unselected branch's gradient is 0 * NaN). So every function here zeroes masked positions
with `torch.where` on the raw inputs, before any arithmetic.
"""

from __future__ import annotations

import torch

__all__ = ["masked_token_log_ratio", "to_compute_dtype", "zero_masked"]


def to_compute_dtype(values: torch.Tensor | None) -> torch.Tensor | None:
    """Promote half precision to float32 (float64 stays); the graph to the caller's tensor is kept.

    GSPO's clip interval is [1 - 3e-4, 1 + 4e-4]: in bf16, 1 + 4e-4 rounds to 1, so ratios and clipping must be
    computed in at least float32 whatever dtype the model's log-probs come in.
    """
    if values is None:
        return None
    return values.to(torch.promote_types(values.dtype, torch.float32))


def zero_masked(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """values [B, T] with masked-out positions replaced by exact 0; their gradient is 0, never NaN.

    mask: bool [B, T], True on response tokens.
    """
    return torch.where(mask, values, torch.zeros((), dtype=values.dtype, device=values.device))


def masked_token_log_ratio(logprobs: torch.Tensor, other_logprobs: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """log pi(y_t) - log pi_other(y_t) on response tokens, exact 0 elsewhere; >= float32. [B, T] -> [B, T]."""
    return to_compute_dtype(zero_masked(logprobs, mask)) - to_compute_dtype(zero_masked(other_logprobs, mask))
