"""Argument validation shared by the algo functions: one place for shape, mask and clip-range errors.

Every error names the offending argument, so a misconfigured caller sees what to fix without reading the math.
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "check_clip_range",
    "check_sequence_vector",
    "check_token_inputs",
]


def _check_float_tensor(name: str, value: object) -> None:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    if not value.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")


def _as_bool_mask(response_mask: torch.Tensor) -> torch.Tensor:
    """0/1 (float, int or bool) mask -> bool mask; anything else would silently reweight tokens."""
    if response_mask.dtype == torch.bool:
        return response_mask
    if not bool(((response_mask == 0) | (response_mask == 1)).all()):
        raise ValueError("response_mask must contain only 0 and 1 (or be a bool tensor)")
    return response_mask != 0


def check_token_inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    **others: torch.Tensor | None,
) -> torch.Tensor:
    """Check [B, T] token tensors agree in shape and return the mask as bool [B, T].

    `others` are further [B, T] float tensors (e.g. ref_logprobs=...); None entries are skipped.
    """
    _check_float_tensor("logprobs", logprobs)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    named = {"old_logprobs": old_logprobs, **{k: v for k, v in others.items() if v is not None}}
    for name, value in named.items():
        _check_float_tensor(name, value)
        if value.shape != logprobs.shape:
            raise ValueError(
                f"{name} must have the shape of logprobs {tuple(logprobs.shape)}, got {tuple(value.shape)}"
            )
    if not isinstance(response_mask, torch.Tensor):
        raise TypeError(f"response_mask must be a torch.Tensor, got {type(response_mask).__name__}")
    if response_mask.shape != logprobs.shape:
        raise ValueError(
            f"response_mask must have the shape of logprobs {tuple(logprobs.shape)}, "
            f"got {tuple(response_mask.shape)}"
        )
    return _as_bool_mask(response_mask)


def check_sequence_vector(name: str, value: torch.Tensor, batch_size: int) -> None:
    """Check a per-sequence [B] float tensor."""
    _check_float_tensor(name, value)
    if value.shape != (batch_size,):
        raise ValueError(f"{name} must be [B] with B={batch_size}, got shape {tuple(value.shape)}")


def check_clip_range(eps_low: float, eps_high: float, max_log_ratio: float) -> None:
    """The clip interval [1 - eps_low, 1 + eps_high] must contain 1 and stay positive."""
    if not 0.0 <= eps_low < 1.0:
        raise ValueError(f"eps_low must be in [0, 1), got {eps_low}")
    if not (eps_high >= 0.0 and math.isfinite(eps_high)):
        raise ValueError(f"eps_high must be finite and >= 0, got {eps_high}")
    if not (max_log_ratio > 0.0 and math.isfinite(max_log_ratio)):
        raise ValueError(f"max_log_ratio must be finite and > 0, got {max_log_ratio}")
