"""GSPO loss (arXiv 2507.18071), sequence-level and GSPO-token forms.

    J(theta) = (1/N) sum_i min(s_i A_i, clip(s_i, 1 - eps_low, 1 + eps_high) A_i)
    s_i      = exp((1/|y_i|) sum_t [log pi_theta(y_it) - log pi_old(y_it)])

The loss is -J averaged over the N sequences that have at least one response token; every such sequence
weighs the same whatever its length. Clipping is per sequence: a clipped sequence contributes no gradient.
Unclipped, d(-J)/d logp_it = -(1/N) A_i s_i / |y_i|.

Context-parallel callers: compute `masked_log_ratio_sums` on each rank's shard, all-reduce the two [B] sums
(with autograd), then call `gspo_loss_from_sums`; that is the same math `gspo_loss` runs on one rank.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ._checks import check_clip_range, check_sequence_vector, check_token_inputs
from .aggregation import Denominator, seq_mean_token_mean, sequence_mean
from .defaults import CLIP_RANGES, KL_ESTIMATOR, MAX_LOG_RATIO
from .kl import kl_loss_term
from .masking import to_compute_dtype, zero_masked
from .metrics import approx_kl, clip_fractions, masked_stats, to_floats
from .ratios import masked_log_ratio_sums, sequence_log_ratio, sequence_log_ratio_from_sums
from .surrogate import clipped_surrogate

__all__ = ["GSPOTerms", "TokenTerms", "gspo_loss", "gspo_loss_from_sums", "gspo_sequence_objective",
           "gspo_token_loss", "gspo_token_terms"]


def gspo_sequence_objective(
    seq_log_ratio: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float = CLIP_RANGES["gspo"][0],
    eps_high: float = CLIP_RANGES["gspo"][1],
    max_log_ratio: float = MAX_LOG_RATIO,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sequence GSPO objective term min(s_i A_i, clip(s_i) A_i), s_i = exp(clamp(seq_log_ratio_i)).

    seq_log_ratio, advantages: [B] float. Returns (objective [B], clipped_low [B] bool, clipped_high [B] bool).
    This is the objective to *maximise*; sequences with no response tokens are not excluded here.
    """
    check_clip_range(eps_low, eps_high, max_log_ratio)
    if seq_log_ratio.dim() != 1:
        raise ValueError(f"seq_log_ratio must be [B], got shape {tuple(seq_log_ratio.shape)}")
    check_sequence_vector("advantages", advantages, seq_log_ratio.shape[0])
    return clipped_surrogate(seq_log_ratio, advantages.to(seq_log_ratio.dtype), eps_low, eps_high, max_log_ratio)


class GSPOTerms(NamedTuple):
    """Result of gspo_loss_from_sums: the scalar loss and the [B] pieces the metrics need."""

    loss: torch.Tensor  # scalar, -J
    seq_log_ratio: torch.Tensor  # [B], unclamped mean token log-ratio, 0 for empty sequences
    valid: torch.Tensor  # [B] bool, sequence has >= 1 response token
    clipped_low: torch.Tensor  # [B] bool
    clipped_high: torch.Tensor  # [B] bool


def gspo_loss_from_sums(
    log_ratio_sum: torch.Tensor,
    token_count: torch.Tensor,
    advantages: torch.Tensor,
    eps_low: float = CLIP_RANGES["gspo"][0],
    eps_high: float = CLIP_RANGES["gspo"][1],
    max_log_ratio: float = MAX_LOG_RATIO,
    num_sequences: Denominator = None,
) -> GSPOTerms:
    """GSPO loss from per-sequence partial sums (see ratios.masked_log_ratio_sums). All inputs [B].

    num_sequences: denominator override (the global count of non-empty sequences when a rollout batch is
    split across microbatches / data-parallel ranks); default is the local count of non-empty sequences.
    """
    seq_log_ratio = sequence_log_ratio_from_sums(log_ratio_sum, token_count)
    objective, clipped_low, clipped_high = gspo_sequence_objective(
        seq_log_ratio, advantages, eps_low, eps_high, max_log_ratio
    )
    valid = token_count > 0
    loss = -sequence_mean(objective, valid, num_sequences)
    return GSPOTerms(loss, seq_log_ratio, valid, clipped_low, clipped_high)


def _sequence_metrics(seq_log_ratio: torch.Tensor, valid: torch.Tensor, max_log_ratio: float) -> dict:
    seq_ratio = torch.exp(seq_log_ratio.detach().clamp(-max_log_ratio, max_log_ratio))
    return {**masked_stats(seq_ratio, valid, "seq_ratio"), "num_sequences": valid.sum()}


def gspo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    eps_low: float = CLIP_RANGES["gspo"][0],
    eps_high: float = CLIP_RANGES["gspo"][1],
    max_log_ratio: float = MAX_LOG_RATIO,
    num_sequences: Denominator = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = KL_ESTIMATOR,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Sequence-level GSPO loss -J and metrics.

    logprobs, old_logprobs, response_mask (0/1 float or bool), ref_logprobs: [B, T]; advantages: [B].
    Masked positions may hold -inf/garbage. The sequence log-ratio is clamped to +-max_log_ratio before exp.
    Half-precision inputs are computed in float32 (the loss is float32; gradients reach the caller's tensor).
    num_sequences: denominator override (see gspo_loss_from_sums). With no non-empty sequence the loss is an
    exact 0.0 still attached to the graph (backward gives zero grads).
    KL (optional): + kl_coef * kl_penalty(logprobs, ref_logprobs, mask, kl_estimator, "seq-mean-token-mean"),
    with the same num_sequences.

    Metrics (floats): clip_frac, clip_frac_low, clip_frac_high (fractions of non-empty sequences whose clipped
    term was selected), seq_ratio_min/mean/max (over non-empty sequences), approx_kl (token mean of k3
    for KL(pi_old || pi_theta), see metrics.approx_kl), num_sequences (local non-empty count), and kl_ref
    when ref_logprobs is given. All are 0.0 for all-masked input.
    """
    mask = check_token_inputs(logprobs, old_logprobs, response_mask, ref_logprobs=ref_logprobs)
    check_sequence_vector("advantages", advantages, logprobs.shape[0])
    logprobs, old_logprobs = to_compute_dtype(logprobs), to_compute_dtype(old_logprobs)
    terms = gspo_loss_from_sums(
        *masked_log_ratio_sums(logprobs, old_logprobs, mask),
        advantages,
        eps_low,
        eps_high,
        max_log_ratio,
        num_sequences,
    )
    kl_term, kl_value = kl_loss_term(
        logprobs, ref_logprobs, mask, kl_coef, kl_estimator, "seq-mean-token-mean", max_log_ratio,
        num_sequences=num_sequences,
    )
    loss = terms.loss if kl_term is None else terms.loss + kl_term

    metrics = {
        **clip_fractions(terms.clipped_low, terms.clipped_high, terms.valid, logprobs.dtype),
        **_sequence_metrics(terms.seq_log_ratio, terms.valid, max_log_ratio),
        "approx_kl": approx_kl(logprobs, old_logprobs, mask, max_log_ratio),
    }
    if kl_value is not None:
        metrics["kl_ref"] = kl_value
    return loss, to_floats(metrics)


class TokenTerms(NamedTuple):
    """The scalar loss of a token-level clip (GSPO-token, GRPO) and the [B, T] pieces the metrics need."""

    loss: torch.Tensor  # scalar, -J (+ the KL term)
    clipped_low: torch.Tensor  # [B, T] bool, masked positions False
    clipped_high: torch.Tensor  # [B, T] bool
    kl: torch.Tensor | None  # the KL penalty's value (detached) when ref_logprobs is given


def gspo_token_terms(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    token_advantages: torch.Tensor,
    response_mask: torch.Tensor,
    eps_low: float = CLIP_RANGES["gspo_token"][0],
    eps_high: float = CLIP_RANGES["gspo_token"][1],
    max_log_ratio: float = MAX_LOG_RATIO,
    num_sequences: Denominator = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = KL_ESTIMATOR,
) -> TokenTerms:
    """gspo_token_loss without its metrics (no host transfer): the loss and the token clip masks."""
    mask = check_token_inputs(
        logprobs, old_logprobs, response_mask, token_advantages=token_advantages, ref_logprobs=ref_logprobs
    )
    check_clip_range(eps_low, eps_high, max_log_ratio)
    logprobs, old_logprobs = to_compute_dtype(logprobs), to_compute_dtype(old_logprobs)
    seq_log_ratio = sequence_log_ratio(logprobs, old_logprobs, mask)
    safe_logprobs = zero_masked(logprobs, mask)
    token_log_ratio = seq_log_ratio.detach().unsqueeze(-1) + (safe_logprobs - safe_logprobs.detach())
    objective, clipped_low, clipped_high = clipped_surrogate(
        token_log_ratio, zero_masked(token_advantages.to(logprobs.dtype), mask), eps_low, eps_high, max_log_ratio
    )
    loss = -seq_mean_token_mean(objective, mask, num_sequences)
    kl_term, kl_value = kl_loss_term(
        logprobs, ref_logprobs, mask, kl_coef, kl_estimator, "seq-mean-token-mean", max_log_ratio,
        num_sequences=num_sequences,
    )
    if kl_term is not None:
        loss = loss + kl_term
    return TokenTerms(loss, clipped_low & mask, clipped_high & mask, kl_value)


def gspo_token_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    token_advantages: torch.Tensor,
    response_mask: torch.Tensor,
    eps_low: float = CLIP_RANGES["gspo_token"][0],
    eps_high: float = CLIP_RANGES["gspo_token"][1],
    max_log_ratio: float = MAX_LOG_RATIO,
    num_sequences: Denominator = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: str = KL_ESTIMATOR,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO-token loss: per-token advantages A_it with the sequence ratio as each token's ratio value.

        s_it = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)] = exp(sg[log s_i] + logp_it - sg[logp_it])
        -J   = -(1/N) sum_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it) A_it)

    s_it equals s_i in value, and d s_it / d logp_it = s_i, so with A_it = A_i for all t this equals gspo_loss
    in value, clipping and gradient. token_advantages: [B, T]; other arguments as in gspo_loss.

    Metrics as gspo_loss, except clip_frac/_low/_high are fractions of response *tokens* (clipping is per token
    here), as the paper counts them.
    """
    terms = gspo_token_terms(logprobs, old_logprobs, token_advantages, response_mask, eps_low, eps_high,
                             max_log_ratio, num_sequences, ref_logprobs, kl_coef, kl_estimator)
    mask = response_mask.bool()
    logprobs, old_logprobs = to_compute_dtype(logprobs), to_compute_dtype(old_logprobs)
    seq_log_ratio = sequence_log_ratio(logprobs.detach(), old_logprobs, mask)
    metrics = {
        **clip_fractions(terms.clipped_low, terms.clipped_high, mask, logprobs.dtype),
        **_sequence_metrics(seq_log_ratio, mask.any(dim=-1), max_log_ratio),
        "approx_kl": approx_kl(logprobs, old_logprobs, mask, max_log_ratio),
    }
    if terms.kl is not None:
        metrics["kl_ref"] = terms.kl
    return terms.loss, to_floats(metrics)
