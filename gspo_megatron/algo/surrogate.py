"""The clipped importance-weighted surrogate shared by GSPO (per sequence) and GRPO / GSPO-token (per token).

    objective = min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A),   r = exp(clamp(log_r, +-max_log_ratio))

Written as an explicit select rather than torch.minimum: torch.minimum splits the gradient on ties, and the
select makes "clipped" a named boolean that metrics can count. Clipped elements (the min picks the bound and it
differs from r * A) get zero gradient w.r.t. r; this is exactly the PPO/GSPO min in value and gradient.
"""

from __future__ import annotations

import torch

__all__ = ["clipped_surrogate"]


def clipped_surrogate(
    log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float,
    eps_high: float,
    max_log_ratio: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Elementwise clipped surrogate; log_ratio and advantages broadcast to a common shape S.

    Returns (objective [S], clipped_low [S] bool, clipped_high [S] bool):
      clipped_high: A > 0 and r > 1 + eps_high (the update would push a good sample further up);
      clipped_low:  A < 0 and r < 1 - eps_low  (the update would push a bad sample further down).
    The clamp of the log-ratio before exp keeps r finite (<= e^max_log_ratio) so r * A never overflows to inf
    and 0 * inf never produces NaN; beyond the clamp the gradient is 0.
    """
    ratio = torch.exp(log_ratio.clamp(-max_log_ratio, max_log_ratio))
    clipped_high = (advantages > 0) & (ratio > 1.0 + eps_high)
    clipped_low = (advantages < 0) & (ratio < 1.0 - eps_low)
    bounded = ratio.clamp(1.0 - eps_low, 1.0 + eps_high)  # constant (zero grad) wherever it differs from ratio
    objective = torch.where(clipped_low | clipped_high, bounded * advantages, ratio * advantages)
    return objective, clipped_low, clipped_high
