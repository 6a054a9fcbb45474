"""Diagnostics for the policy losses: clip fractions, ratio ranges, approximate KL(pi_old || pi_theta).

Everything here runs under no_grad and reduces to 0-d tensors; `to_floats` converts them with one device
transfer. Empty selections report 0.0, never NaN, so an all-masked microbatch logs cleanly.
"""

from __future__ import annotations

import torch

from .kl import KL_ESTIMATORS
from .masking import masked_token_log_ratio

__all__ = ["approx_kl", "clip_fractions", "masked_stats", "to_floats"]


def _count(valid: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return valid.sum().to(dtype)


@torch.no_grad()
def masked_stats(values: torch.Tensor, valid: torch.Tensor, prefix: str) -> dict[str, torch.Tensor]:
    """{prefix_min, prefix_mean, prefix_max} of values where valid (any matching shapes); 0 when none valid."""
    values = values.detach()
    zero = values.new_zeros(())
    if values.numel() == 0:
        return {f"{prefix}_min": zero, f"{prefix}_mean": zero, f"{prefix}_max": zero}
    count = _count(valid, values.dtype)
    inf = torch.full((), float("inf"), dtype=values.dtype, device=values.device)
    any_valid = count > 0
    return {
        f"{prefix}_min": torch.where(any_valid, torch.where(valid, values, inf).amin(), zero),
        f"{prefix}_mean": torch.where(valid, values, zero).sum() / count.clamp(min=1),
        f"{prefix}_max": torch.where(any_valid, torch.where(valid, values, -inf).amax(), zero),
    }


@torch.no_grad()
def clip_fractions(
    clipped_low: torch.Tensor, clipped_high: torch.Tensor, valid: torch.Tensor, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """Fraction of valid elements clipped (the min picked the bound and it differed), split by side."""
    count = _count(valid, dtype).clamp(min=1)
    low = _count(clipped_low & valid, dtype) / count
    high = _count(clipped_high & valid, dtype) / count
    return {"clip_frac": low + high, "clip_frac_low": low, "clip_frac_high": high}


@torch.no_grad()
def approx_kl(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor, max_log_ratio: float
) -> torch.Tensor:
    """Mean over all response tokens of k3 estimating KL(pi_old || pi_theta) from tokens sampled by pi_old:
    exp(logp - old) - (logp - old) - 1 >= 0. Log-ratio clamped to +-max_log_ratio like the losses. -> 0-d."""
    old_minus_new = masked_token_log_ratio(old_logprobs.detach(), logprobs.detach(), mask)
    k3 = KL_ESTIMATORS["k3"](old_minus_new.clamp(-max_log_ratio, max_log_ratio))
    return k3.sum() / _count(mask, k3.dtype).clamp(min=1)


def to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """0-d tensors -> plain Python floats, in one host transfer."""
    names = list(metrics)
    if not names:
        return {}
    values = torch.stack([metrics[n].detach().to(torch.float64) for n in names]).tolist()
    return dict(zip(names, values))
