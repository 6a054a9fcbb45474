"""Train/inference mismatch: how far the trainer's log-probs of the sampled tokens are from the engine's.

Logged every step (peers' users fight drifting log-prob gaps between the rollout engine and the trainer). With
identical weights both compute log softmax(logits / T) of the same tokens, so every number here should be ~0 up
to kernel differences (fp32 on CPU: ~1e-6); a gap that grows means stale weights, a wrong temperature, or an
off-by-one alignment.
"""

from __future__ import annotations

import torch

from gspo_megatron.algo.metrics import mismatch_metrics, sequence_stats


@torch.no_grad()
def logprob_mismatch(trainer_logprobs: torch.Tensor, rollout_logprobs: torch.Tensor, mask: torch.Tensor,
                     prefix: str = "mismatch/") -> dict[str, float]:
    """trainer_logprobs, rollout_logprobs [B, S] (aligned with labels), mask [B, S] bool (response tokens).

    token_max_abs / token_mean_abs: |log pi_train - log pi_rollout| over response tokens;
    seq_log_ratio_max_abs: max_i |mean_t (log pi_train - log pi_rollout)|, the log of GSPO's sequence ratio if
    the rollout's log-probs were used as pi_old at unchanged weights (it must stay far below the clip range);
    kl_k3: mean over tokens of the k3 estimator of KL(rollout || train).
    """
    if not (trainer_logprobs.shape == rollout_logprobs.shape == mask.shape):
        raise ValueError(f"logprob_mismatch: shapes {tuple(trainer_logprobs.shape)}, {tuple(rollout_logprobs.shape)}, "
                         f"{tuple(mask.shape)} differ")
    # The trainer's definitions (algo.metrics), so these numbers are the ones the training run logs.
    m = mismatch_metrics(sequence_stats(trainer_logprobs.double(), rollout_logprobs.double(), mask.bool()))
    return {
        f"{prefix}token_max_abs": m["logprob_diff_max"],
        f"{prefix}token_mean_abs": m["logprob_diff_mean"],
        f"{prefix}seq_log_ratio_max_abs": m["logprob_diff_seq_log_ratio"],
        f"{prefix}kl_k3": m["logprob_diff_kl"],
    }
