"""GRPO / PPO token-level clipped loss: the paper's baseline for GSPO.

    -J = -agg_t min(r_it A_it, clip(r_it, 1 - eps_low, 1 + eps_high) A_it),   r_it = pi_theta(y_it) / pi_old(y_it)

Each token has its own ratio and is clipped on its own (contrast GSPO's one ratio per sequence).
"""

from __future__ import annotations

import torch

from ._checks import check_clip_range, check_sequence_vector, check_token_inputs
from .aggregation import Denominator, aggregate, check_aggregation
from .defaults import CLIP_RANGES, GRPO_AGGREGATION, KL_ESTIMATOR, MAX_LOG_RATIO
from .kl import kl_loss_term
from .masking import masked_token_log_ratio, to_compute_dtype, zero_masked
from .metrics import approx_kl, clip_fractions, masked_stats, to_floats
from .ratios import sequence_log_ratio_from_sums
from .gspo import TokenTerms
from .surrogate import clipped_surrogate

__all__ = ["grpo_loss", "grpo_terms"]


def _token_advantages(advantages: torch.Tensor, mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[B] (one advantage per sequence, broadcast over tokens) or [B, T] -> broadcastable to [B, T]."""
    if advantages.dim() == 1:
        check_sequence_vector("advantages", advantages, mask.shape[0])
        return advantages.to(dtype).unsqueeze(-1)
    if advantages.shape != mask.shape:
        raise ValueError(
            f"advantages must be [B] or [B, T] = {tuple(mask.shape)}, got shape {tuple(advantages.shape)}"
        )
    return zero_masked(advantages.to(dtype), mask)


def grpo_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    eps_low: float = CLIP_RANGES["grpo"][0],
    eps_high: float = CLIP_RANGES["grpo"][1],
    aggregation: str = GRPO_AGGREGATION,
    max_log_ratio: float = MAX_LOG_RATIO,
    num_tokens: Denominator = None,
    num_sequences: Denominator = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = KL_ESTIMATOR,
) -> TokenTerms:
    """grpo_loss without its metrics (no host transfer): the loss and the token clip masks."""
    check_aggregation(aggregation)
    check_clip_range(eps_low, eps_high, max_log_ratio)
    mask = check_token_inputs(logprobs, old_logprobs, response_mask, ref_logprobs=ref_logprobs)
    logprobs, old_logprobs = to_compute_dtype(logprobs), to_compute_dtype(old_logprobs)
    token_advantages = _token_advantages(advantages, mask, logprobs.dtype)

    token_log_ratio = masked_token_log_ratio(logprobs, old_logprobs, mask)
    objective, clipped_low, clipped_high = clipped_surrogate(
        token_log_ratio, token_advantages, eps_low, eps_high, max_log_ratio
    )
    loss = -aggregate(objective, mask, aggregation, num_tokens, num_sequences)
    kl_term, kl_value = kl_loss_term(
        logprobs, ref_logprobs, mask, kl_coef, kl_estimator, aggregation, max_log_ratio, num_tokens, num_sequences
    )
    if kl_term is not None:
        loss = loss + kl_term
    return TokenTerms(loss, clipped_low & mask, clipped_high & mask, kl_value)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    eps_low: float = CLIP_RANGES["grpo"][0],
    eps_high: float = CLIP_RANGES["grpo"][1],
    aggregation: str = GRPO_AGGREGATION,
    max_log_ratio: float = MAX_LOG_RATIO,
    num_tokens: Denominator = None,
    num_sequences: Denominator = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = KL_ESTIMATOR,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Token-level PPO-clip loss and metrics.

    logprobs, old_logprobs, response_mask, ref_logprobs: [B, T]; advantages: [B] or [B, T].
    aggregation: "token-mean" (sum over response tokens / num_tokens, default the local token count) or
    "seq-mean-token-mean" (token mean per sequence, then / num_sequences, default the local non-empty count).
    Passing the denominator of the other mode is an error. Token log-ratios are clamped to +-max_log_ratio.
    Half-precision inputs are computed in float32.
    KL (optional): + kl_coef * kl_penalty with the same aggregation and denominators.

    Metrics (floats): clip_frac/_low/_high (fractions of response tokens), ratio_min/mean/max (token ratios),
    seq_ratio_min/mean/max (the GSPO sequence ratio, for comparison), approx_kl (token mean of k3 for
    KL(pi_old || pi_theta)), num_sequences, num_tokens (local), kl_ref when ref_logprobs is given.
    """
    terms = grpo_terms(logprobs, old_logprobs, advantages, response_mask, eps_low, eps_high, aggregation,
                       max_log_ratio, num_tokens, num_sequences, ref_logprobs, kl_coef, kl_estimator)
    mask = response_mask.bool()
    logprobs, old_logprobs = to_compute_dtype(logprobs), to_compute_dtype(old_logprobs)
    with torch.no_grad():
        token_log_ratio = masked_token_log_ratio(logprobs.detach(), old_logprobs, mask)
        token_count = mask.sum(dim=-1).to(logprobs.dtype)
        seq_log_ratio = sequence_log_ratio_from_sums(token_log_ratio.sum(dim=-1), token_count)
        clamp = (-max_log_ratio, max_log_ratio)
        metrics = {
            **clip_fractions(terms.clipped_low, terms.clipped_high, mask, logprobs.dtype),
            **masked_stats(torch.exp(token_log_ratio.clamp(*clamp)), mask, "ratio"),
            **masked_stats(torch.exp(seq_log_ratio.clamp(*clamp)), token_count > 0, "seq_ratio"),
            "approx_kl": approx_kl(logprobs, old_logprobs, mask, max_log_ratio),
            "num_sequences": (token_count > 0).sum(),
            "num_tokens": mask.sum(),
        }
    if terms.kl is not None:
        metrics["kl_ref"] = terms.kl
    return terms.loss, to_floats(metrics)
