"""KL estimators against a reference policy (Schulman, "Approximating KL Divergence", 2020).

With tokens sampled from pi_theta and log_ratio = log pi_theta(y) - log pi_ref(y), each estimator is token-wise
and its expectation relates to KL(pi_theta || pi_ref):
    k1 = log_ratio                              unbiased, high variance, can be negative
    k2 = 0.5 * log_ratio^2                      biased, low variance, >= 0
    k3 = exp(-log_ratio) + log_ratio - 1        unbiased, low variance, >= 0
"""

from __future__ import annotations

import math

import torch

from ._checks import check_token_inputs
from .aggregation import Denominator, aggregate, check_aggregation
from .defaults import KL_ESTIMATOR, MAX_LOG_RATIO
from .masking import masked_token_log_ratio

__all__ = ["KL_ESTIMATORS", "kl_k1", "kl_k2", "kl_k3", "kl_loss_term", "kl_penalty"]


def _k1(log_ratio: torch.Tensor) -> torch.Tensor:
    return log_ratio


def _k2(log_ratio: torch.Tensor) -> torch.Tensor:
    return 0.5 * log_ratio.square()


def _k3(log_ratio: torch.Tensor) -> torch.Tensor:
    # expm1(-x) + x == exp(-x) - 1 + x without the cancellation that makes the naive form slightly negative
    # for |x| near machine epsilon.
    return torch.expm1(-log_ratio) + log_ratio


# Estimators as functions of log_ratio = logp - ref_logp.
KL_ESTIMATORS = {"k1": _k1, "k2": _k2, "k3": _k3}


def kl_k1(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k1 = logp - ref. [B, T] x2 -> [B, T]."""
    return _k1(logprobs - ref_logprobs)


def kl_k2(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k2 = 0.5 * (logp - ref)^2. [B, T] x2 -> [B, T]."""
    return _k2(logprobs - ref_logprobs)


def kl_k3(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """k3 = exp(ref - logp) - (ref - logp) - 1 >= 0. [B, T] x2 -> [B, T]."""
    return _k3(logprobs - ref_logprobs)


def _check_estimator(estimator: str) -> None:
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"kl_estimator must be one of {tuple(KL_ESTIMATORS)}, got {estimator!r}")


def kl_penalty(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor,
    response_mask: torch.Tensor,
    estimator: str = KL_ESTIMATOR,
    aggregation: str = "seq-mean-token-mean",
    max_log_ratio: float = MAX_LOG_RATIO,
    num_tokens: Denominator = None,
    num_sequences: Denominator = None,
) -> torch.Tensor:
    """Masked mean of a token-wise KL estimator: [B, T] x3 -> scalar.

    aggregation: "seq-mean-token-mean" (default; each sequence weighs the same) or "token-mean"; num_tokens /
    num_sequences override the denominator as in the losses. The log-ratio is clamped to +-max_log_ratio
    first so k3's exp cannot overflow; masked positions (which may hold -inf) contribute exact 0.
    """
    _check_estimator(estimator)
    check_aggregation(aggregation)
    mask = check_token_inputs(logprobs, ref_logprobs, response_mask)
    log_ratio = masked_token_log_ratio(logprobs, ref_logprobs, mask).clamp(-max_log_ratio, max_log_ratio)
    return aggregate(KL_ESTIMATORS[estimator](log_ratio), mask, aggregation, num_tokens, num_sequences)


def kl_loss_term(
    logprobs: torch.Tensor,
    ref_logprobs: torch.Tensor | None,
    response_mask: torch.Tensor,
    kl_coef: float,
    estimator: str,
    aggregation: str,
    max_log_ratio: float,
    num_tokens: Denominator = None,
    num_sequences: Denominator = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(kl_coef * penalty or None, penalty.detach() or None) for the losses' optional KL term.

    The penalty is computed (for the metric) whenever ref_logprobs is given; it joins the loss only when
    kl_coef != 0. kl_coef != 0 without ref_logprobs is an error rather than a silently dropped term.
    """
    _check_estimator(estimator)
    if not (math.isfinite(kl_coef) and kl_coef >= 0.0):
        raise ValueError(f"kl_coef must be finite and >= 0, got {kl_coef}")
    if ref_logprobs is None:
        if kl_coef != 0.0:
            raise ValueError(f"kl_coef={kl_coef} needs ref_logprobs (got None)")
        return None, None
    penalty = kl_penalty(
        logprobs, ref_logprobs, response_mask, estimator, aggregation, max_log_ratio, num_tokens, num_sequences
    )
    term = kl_coef * penalty if kl_coef != 0.0 else None
    return term, penalty.detach()
