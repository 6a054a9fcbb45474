"""GSPO math: pure tensor functions (no torch.distributed), shapes in each docstring.

Modules: advantages (group-relative A_i), ratios (sequence log-ratio and its CP-reducible partial sums),
surrogate (the clipped min shared by all losses), gspo (GSPO and GSPO-token), grpo (token-level baseline),
kl (reference-policy KL estimators), aggregation (denominators), metrics (diagnostics), correction (the
behaviour weight between the trainer's pi_old and the engine's log-probs: the mismatch, samples from older weights),
defaults (the algorithms' names, clip ranges and other constants: the one place they live).
"""

from .advantages import group_advantages, segment_advantages
from .aggregation import AGGREGATIONS, aggregate, seq_mean_token_mean, sequence_mean, token_mean
from .grpo import grpo_loss, grpo_terms
from .correction import (CORRECTION_STATS, Correction, CorrectionTerms, correction_stats, correction_weights,
                         corrected_advantages, log_weights, rollout_correction, weight_sums)
from .defaults import ALGORITHMS, CLIP_RANGES, CORRECTION_HIGH, CORRECTION_LOW, GRPO_AGGREGATION, KL_ESTIMATOR, MAX_LOG_RATIO
from .gspo import (GSPOTerms, TokenTerms, gspo_loss, gspo_loss_from_sums, gspo_sequence_objective, gspo_token_loss,
                   gspo_token_terms)
from .metrics import SEQUENCE_STATS, correction_metrics, mismatch_metrics, sequence_stats, update_metrics
from .kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3, kl_penalty
from .ratios import masked_log_ratio_sums, sequence_log_ratio, sequence_log_ratio_from_sums
from .surrogate import clipped_surrogate

__all__ = [
    "AGGREGATIONS",
    "ALGORITHMS",
    "CLIP_RANGES",
    "CORRECTION_HIGH",
    "CORRECTION_LOW",
    "CORRECTION_STATS",
    "Correction",
    "CorrectionTerms",
    "GRPO_AGGREGATION",
    "GSPOTerms",
    "SEQUENCE_STATS",
    "TokenTerms",
    "KL_ESTIMATOR",
    "KL_ESTIMATORS",
    "MAX_LOG_RATIO",
    "aggregate",
    "clipped_surrogate",
    "corrected_advantages",
    "correction_metrics",
    "correction_stats",
    "correction_weights",
    "group_advantages",
    "grpo_loss",
    "grpo_terms",
    "gspo_loss",
    "gspo_loss_from_sums",
    "gspo_sequence_objective",
    "gspo_token_loss",
    "gspo_token_terms",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "kl_penalty",
    "log_weights",
    "masked_log_ratio_sums",
    "mismatch_metrics",
    "rollout_correction",
    "segment_advantages",
    "sequence_stats",
    "seq_mean_token_mean",
    "sequence_log_ratio",
    "sequence_log_ratio_from_sums",
    "sequence_mean",
    "token_mean",
    "update_metrics",
    "weight_sums",
]
