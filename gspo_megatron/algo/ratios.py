"""Length-normalised sequence importance ratio (GSPO eq. for s_i), in log space.

    log s_i = (1/|y_i|) * sum_t [log pi_theta(y_it) - log pi_old(y_it)]

It is the *mean* of token log-ratios, not the sum: exp(sum) explodes or vanishes with length (a known peer bug).
The computation is split into per-sequence partial sums (masked_log_ratio_sums) and the division
(sequence_log_ratio_from_sums) so that a context-parallel caller can all-reduce the two [B] partial sums across
ranks, with autograd, and then run the same math as the single-rank path.
"""

from __future__ import annotations

import torch

from ._checks import check_token_inputs
from .masking import masked_token_log_ratio

__all__ = ["masked_log_ratio_sums", "sequence_log_ratio", "sequence_log_ratio_from_sums"]


def masked_log_ratio_sums(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sequence partial sums of the GSPO ratio: (sum_t mask * (logp - old) [B], token count [B]).

    logprobs, old_logprobs: [B, T] float; response_mask: [B, T] 0/1 or bool. Masked positions may hold
    -inf/NaN; they contribute exact 0 to the sum and 0 to the gradient. Both are computed in >= float32 (the
    count in the sum's dtype, so the two can be all-reduced together).
    """
    mask = check_token_inputs(logprobs, old_logprobs, response_mask)
    log_ratio_sum = masked_token_log_ratio(logprobs, old_logprobs, mask).sum(dim=-1)
    return log_ratio_sum, mask.sum(dim=-1).to(log_ratio_sum.dtype)


def sequence_log_ratio_from_sums(log_ratio_sum: torch.Tensor, token_count: torch.Tensor) -> torch.Tensor:
    """log s_i = log_ratio_sum_i / token_count_i, and 0 for sequences with no response tokens. [B], [B] -> [B]."""
    ratio = log_ratio_sum / token_count.clamp(min=1)
    return torch.where(token_count > 0, ratio, torch.zeros_like(ratio))


def sequence_log_ratio(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
) -> torch.Tensor:
    """Mean over response tokens of (logprobs - old_logprobs): [B, T] x3 -> [B].

    Sequences with no response tokens give 0; losses must exclude them (they do, via the token count).
    """
    return sequence_log_ratio_from_sums(*masked_log_ratio_sums(logprobs, old_logprobs, response_mask))
