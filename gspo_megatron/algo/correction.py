"""Importance corrections for samples the trainer did not generate: the engine's log-probs differ from the trainer's
(training-inference mismatch: bf16 or FP8 rollouts, other kernels, experts routed differently), and a sample from
older weights has a behaviour policy older than the trainer's (``rollout.mode`` one_step_off / async, partial
rollouts). The behaviour weight of a response token is

    w_t = pi_old(y_t) / pi_engine(y_t)        (pi_old: the trainer's old-policy pass; with
                                               rollout.reuse_rollout_logprobs, the current policy, detached)

taken at one of three levels: ``token`` (w_t; slime's and verl's TIS), ``sequence`` (prod_t w_t = exp(sum log w_t))
or ``geometric`` (exp(mean_t log w_t): GSPO's length normalisation, AReaL's "GSPO semantics"). The weight is a
constant of the update and >= 0, so w * min(r A, clip(r) A) = min(r w A, clip(r) w A): a correction is the
ordinary loss with advantages w A (per token for GRPO and GSPO-token; GSPO's sequence term takes the token mean of
w, which for the sequence levels is the sequence's weight). The weight is then

- ``truncate``d: min(w, high) (TIS), or
- ``mask``ed: 0 outside [low, high] (IcePop, MIS); the token still counts in the loss's denominator.

Rejection drops whole sequences from the loss (their tokens leave the denominator too, slime PR 657 / verl's
rollout_rs): a sequence statistic of the token log-weights (``max`` |log w_t|, ``mean`` or ``sum`` of log w_t for
the ``k1`` estimator; of k3 = w_t - 1 - log w_t for ``k3``) outside [rejection_low, rejection_high], or any token
with w_t < ``veto`` (slime's veto of catastrophic tokens).

Samples from older weights (``algo.decoupled_clip``: AReaL's decoupled PPO, arXiv 2505.24298 sec. 5) are the same
concept: they keep the trainer's pass as pi_old (the proximal policy they clip around) and this weight corrects for
their behaviour policy, the engine's.

Everything here is a pure function of [B, T] log-probs. Context-parallel callers compute ``weight_sums`` on their
slice, reduce its columns over the CP group (``WEIGHT_MAX_SUMS`` by max, the rest by sum), and go on with the whole
sequences' sums, as ``rollout_correction`` does on one rank.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from ._checks import check_token_inputs
from .defaults import CORRECTION_HIGH, CORRECTION_LOW, MAX_LOG_RATIO
from .masking import masked_token_log_ratio

__all__ = ["CORRECTION_LEVELS", "CORRECTION_MODES", "CORRECTION_STATS", "CORRECTION_MAX_STATS", "Correction",
           "CorrectionTerms", "REJECTIONS", "REJECTION_ESTIMATORS", "WEIGHT_MAX_SUMS", "WEIGHT_SUMS",
           "correction_stats", "correction_weights", "corrected_advantages", "log_weights", "rollout_correction",
           "weight_sums"]

CORRECTION_LEVELS = ("token", "sequence", "geometric")
CORRECTION_MODES = ("truncate", "mask")
REJECTIONS = ("max", "mean", "sum")
REJECTION_ESTIMATORS = ("k1", "k3")


@dataclass(frozen=True)
class Correction:
    """One correction (the config's ``correction`` section); the default corrects nothing."""

    level: str | None = None  # token, sequence, geometric; None: no weight
    mode: str = "truncate"  # truncate (min(w, high)) or mask (0 outside [low, high])
    low: float = CORRECTION_LOW
    high: float = CORRECTION_HIGH
    rejection: str | None = None  # max, mean, sum; None: no rejection by a statistic
    rejection_estimator: str = "k1"  # k1 (log w) or k3 (w - 1 - log w)
    rejection_low: float | None = None  # reject a sequence whose statistic is below (None: no bound)
    rejection_high: float | None = None  # reject a sequence whose statistic is above (None: no bound)
    veto: float | None = None  # reject a sequence holding a token with w < veto (None: no veto)

    def __post_init__(self):
        for name, value, allowed in (("level", self.level, CORRECTION_LEVELS), ("mode", self.mode, CORRECTION_MODES),
                                     ("rejection", self.rejection, REJECTIONS),
                                     ("rejection_estimator", self.rejection_estimator, REJECTION_ESTIMATORS)):
            if value is not None and value not in allowed:
                raise ValueError(f"correction.{name}={value!r} is not one of {allowed}")
        if not (0 <= self.low < self.high and math.isfinite(self.high)):
            raise ValueError(f"correction.low={self.low} and correction.high={self.high} must satisfy "
                             "0 <= low < high < inf")
        if self.rejection is not None and self.rejection_low is None and self.rejection_high is None:
            raise ValueError(f"correction.rejection={self.rejection!r} needs correction.rejection_low or "
                             "correction.rejection_high (the statistic's bounds)")
        if (self.rejection_low is not None and self.rejection_high is not None
                and not self.rejection_low < self.rejection_high):
            raise ValueError(f"correction.rejection_low={self.rejection_low} must be below "
                             f"correction.rejection_high={self.rejection_high}")
        if self.veto is not None and not 0 < self.veto < 1:
            raise ValueError(f"correction.veto={self.veto} must lie in (0, 1): a token weight below it rejects "
                             "its sequence")

    @property
    def enabled(self) -> bool:
        return self.level is not None or self.rejection is not None or self.veto is not None


# Per-sequence sums of the token log-weights over a slice of a sequence: response tokens, sum of log w, sum of k3,
# max |log w|, max k3, max -log w (the veto's smallest weight). The columns of WEIGHT_MAX_SUMS combine by max.
WEIGHT_SUMS = ("tokens", "log_weight_sum", "k3_sum", "abs_log_weight_max", "k3_max", "neg_log_weight_max")
WEIGHT_MAX_SUMS = ("abs_log_weight_max", "k3_max", "neg_log_weight_max")


def log_weights(target_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor,
                response_mask: torch.Tensor) -> torch.Tensor:
    """log w_t = log pi_old(y_t) - log pi_engine(y_t) on response tokens, 0 elsewhere; detached, >= float32.
    [B, T] x3 -> [B, T]."""
    mask = check_token_inputs(target_logprobs, rollout_logprobs, response_mask)
    return masked_token_log_ratio(target_logprobs.detach(), rollout_logprobs.detach(), mask)


def _k3(log_weight: torch.Tensor, max_log_ratio: float) -> torch.Tensor:
    """k3 of KL(engine || trainer) per token from samples of the engine: w - 1 - log w >= 0 (0 where log w = 0)."""
    x = log_weight.clamp(-max_log_ratio, max_log_ratio)
    return torch.expm1(x) - x


@torch.no_grad()
def weight_sums(log_weight: torch.Tensor, mask: torch.Tensor, max_log_ratio: float = MAX_LOG_RATIO) -> torch.Tensor:
    """[B, T] log-weights (``log_weights``), bool mask -> [B, len(WEIGHT_SUMS)] (0 for a sequence without tokens)."""
    mask = mask.bool()
    tokens = mask.sum(dim=-1).to(log_weight.dtype)
    k3 = torch.where(mask, _k3(log_weight, max_log_ratio), torch.zeros_like(log_weight))
    none = torch.zeros_like(tokens)

    def largest(values):  # masked positions hold 0 and every column here is >= 0 on a sequence with tokens
        return torch.where(mask, values, torch.zeros_like(values)).amax(dim=-1) if values.shape[-1] else none

    return torch.stack([tokens, log_weight.sum(dim=-1), k3.sum(dim=-1), largest(log_weight.abs()), largest(k3),
                        largest(-log_weight).clamp(min=0)], dim=-1)


class CorrectionTerms(NamedTuple):
    """What a correction does to one batch of sequences (all [B, T] tensors False / 0 off the response)."""

    weights: torch.Tensor  # [B, T] the token's weight after truncation or masking (1 with no level)
    keep: torch.Tensor  # [B] bool: not rejected (sequences without tokens are kept: they weigh nothing anyway)
    truncated: torch.Tensor  # [B, T] bool: the weight was above high and truncated
    masked: torch.Tensor  # [B, T] bool: the weight fell outside [low, high] and is 0


def _column(sums: torch.Tensor, name: str) -> torch.Tensor:
    return sums[:, WEIGHT_SUMS.index(name)]


@torch.no_grad()
def correction_weights(log_weight: torch.Tensor, sums: torch.Tensor, mask: torch.Tensor, correction: Correction,
                       max_log_ratio: float = MAX_LOG_RATIO) -> CorrectionTerms:
    """The correction of sequences whose token log-weights on this slice are ``log_weight`` [B, T] and whose
    whole-sequence ``weight_sums`` are ``sums`` [B, len(WEIGHT_SUMS)]. Log-weights are clamped to +-max_log_ratio
    before exp (a sequence-level weight of 500 tokens would overflow)."""
    mask = mask.bool()
    tokens = _column(sums, "tokens")
    level = correction.level
    if level == "token":
        log_w = log_weight
    elif level in ("sequence", "geometric"):
        total = _column(sums, "log_weight_sum")
        log_w = (total if level == "sequence" else total / tokens.clamp(min=1)).unsqueeze(-1).expand_as(log_weight)
    else:
        log_w = torch.zeros_like(log_weight)
    w = torch.exp(log_w.clamp(-max_log_ratio, max_log_ratio))
    none = torch.zeros_like(mask)
    truncated = masked = none
    if level is not None and correction.mode == "truncate":
        truncated = (w > correction.high) & mask
        w = w.clamp(max=correction.high)
    elif level is not None:
        masked = ((w < correction.low) | (w > correction.high)) & mask
        w = torch.where(masked, torch.zeros_like(w), w)
    weights = torch.where(mask, w, torch.zeros_like(w))

    rejected = torch.zeros_like(tokens, dtype=torch.bool)
    if correction.rejection is not None:
        k1 = correction.rejection_estimator == "k1"
        total = _column(sums, "log_weight_sum" if k1 else "k3_sum")
        statistic = {"sum": total, "mean": total / tokens.clamp(min=1),
                     "max": _column(sums, "abs_log_weight_max" if k1 else "k3_max")}[correction.rejection]
        if correction.rejection_low is not None:
            rejected |= statistic < correction.rejection_low
        if correction.rejection_high is not None:
            rejected |= statistic > correction.rejection_high
    if correction.veto is not None:
        rejected |= _column(sums, "neg_log_weight_max") > -math.log(correction.veto)
    return CorrectionTerms(weights, ~(rejected & (tokens > 0)), truncated, masked)


def corrected_advantages(advantages: torch.Tensor, weights: torch.Tensor, sequence_weight: torch.Tensor | None
                         ) -> torch.Tensor:
    """The loss's advantages with the behaviour weight folded in (w >= 0 is a constant of the update).

    advantages: [B] or [B, T]. With ``sequence_weight`` [B] (GSPO's sequence term: the token mean of the weights
    over the whole sequence) -> [B] advantages * sequence_weight; else -> [B, T] advantages * weights (GRPO,
    GSPO-token; a [B] advantage is broadcast over the tokens)."""
    if sequence_weight is not None:
        return advantages * sequence_weight.to(advantages.dtype)
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1)
    return advantages * weights.to(advantages.dtype)


# Per-sequence statistics a correction logs, over a slice of a sequence (CP ranks add them up, CORRECTION_MAX_STATS
# by max): its response tokens before rejection, its tokens masked / truncated / rejected, the sum and max of its
# tokens' weights (kept tokens), and whether it holds a masked or truncated token or is rejected.
CORRECTION_STATS = ("correction_tokens", "masked_tokens", "truncated_tokens", "rejected_tokens", "weight_sum",
                    "weight_max", "masked", "truncated", "rejected")
CORRECTION_MAX_STATS = ("weight_max", "masked", "truncated", "rejected")


@torch.no_grad()
def correction_stats(terms: CorrectionTerms, mask: torch.Tensor) -> torch.Tensor:
    """[B, len(CORRECTION_STATS)] of one slice of sequences (``mask``: its response tokens before rejection)."""
    mask = mask.bool()
    dtype = terms.weights.dtype
    rejected = ~terms.keep
    kept = mask & terms.keep.unsqueeze(-1)
    tokens = mask.sum(dim=-1).to(dtype)
    weights = torch.where(kept, terms.weights, torch.zeros_like(terms.weights))
    return torch.stack([
        tokens, (terms.masked & kept).sum(dim=-1).to(dtype), (terms.truncated & kept).sum(dim=-1).to(dtype),
        rejected.to(dtype) * tokens, weights.sum(dim=-1),
        weights.amax(dim=-1) if weights.shape[-1] else tokens * 0,
        (terms.masked & kept).any(dim=-1).to(dtype), (terms.truncated & kept).any(dim=-1).to(dtype),
        (rejected & (tokens > 0)).to(dtype),
    ], dim=-1)


def rollout_correction(target_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, response_mask: torch.Tensor,
                       advantages: torch.Tensor, correction: Correction, per_sequence: bool,
                       max_log_ratio: float = MAX_LOG_RATIO) -> tuple[torch.Tensor, torch.Tensor, CorrectionTerms]:
    """One rank's correction of whole sequences: (advantages, response mask, terms) to give the loss.

    target_logprobs (pi_old, or the current policy's), rollout_logprobs (the engine's), response_mask: [B, T];
    advantages [B] or [B, T]. per_sequence: the loss clips whole sequences (GSPO): its advantages stay [B] and take
    the token mean of the weights; else (GRPO, GSPO-token) they become [B, T]. The mask loses rejected sequences.
    """
    mask = check_token_inputs(target_logprobs, rollout_logprobs, response_mask)
    log_weight = log_weights(target_logprobs, rollout_logprobs, mask)
    sums = weight_sums(log_weight, mask, max_log_ratio)
    terms = correction_weights(log_weight, sums, mask, correction, max_log_ratio)
    sequence_weight = (terms.weights.sum(dim=-1) / _column(sums, "tokens").clamp(min=1)) if per_sequence else None
    return (corrected_advantages(advantages, terms.weights, sequence_weight), mask & terms.keep.unsqueeze(-1),
            terms)
