"""Diagnostics for the policy losses: clip fractions, ratio ranges, approximate KL(pi_old || pi_theta).

Everything here runs under no_grad. The losses' own metrics reduce to 0-d tensors; `to_floats` converts them
with one device transfer. Empty selections report 0.0, never NaN, so an all-masked microbatch logs cleanly.

The trainer's metrics have one definition each, over whole minibatches gathered from every rank:
`sequence_stats` turns one micro batch into a few numbers per sequence (columns of SEQUENCE_STATS), which
concatenate over micro batches and ranks, and `update_metrics` / `mismatch_metrics` reduce them.
"""

from __future__ import annotations

import torch

from .correction import CORRECTION_STATS
from .defaults import MAX_LOG_RATIO
from .kl import KL_ESTIMATORS
from .masking import masked_token_log_ratio

__all__ = ["LOSS_STATS", "MAX_STATS", "SEQUENCE_STATS", "approx_kl", "clip_fractions", "correction_metrics",
           "masked_stats", "mismatch_metrics", "sequence_stats", "to_floats", "update_metrics"]


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
    k3 = _kl_old_new(logprobs, old_logprobs, mask, max_log_ratio)
    return k3.sum() / _count(mask, k3.dtype).clamp(min=1)


def _kl_old_new(logprobs, old_logprobs, mask, max_log_ratio) -> torch.Tensor:
    """Per token k3 of KL(pi_old || pi_theta), 0 where masked: the one definition of approx_kl. [B, T]."""
    old_minus_new = masked_token_log_ratio(old_logprobs.detach(), logprobs.detach(), mask)
    return KL_ESTIMATORS["k3"](old_minus_new.clamp(-max_log_ratio, max_log_ratio))


# Per-sequence columns: response tokens; sum of token log-ratios (log pi_theta - log pi_old); response tokens whose
# gradient is clipped, low / high side (GSPO: every token of a clipped sequence); the sequence clipped (GSPO) or
# holding a clipped token (token-level losses), low / high; sum of k3 KL(pi_old || pi_theta) over its tokens; sum
# and max of |log pi_theta - log pi_old| (the rollout-vs-trainer mismatch when pi_old is the rollout's).
SEQUENCE_STATS = ("tokens", "log_ratio_sum", "clipped_tokens_low", "clipped_tokens_high", "clipped_low",
                  "clipped_high", "kl_sum", "abs_diff_sum", "abs_diff_max")
# The columns that combine over slices of a sequence (context parallelism) by max; the others add up.
MAX_STATS = ("clipped_low", "clipped_high", "abs_diff_max")
# The loss's per-sequence stats: these, then the correction's (``correction.CORRECTION_STATS``; 0 without one).
LOSS_STATS = SEQUENCE_STATS + CORRECTION_STATS


@torch.no_grad()
def sequence_stats(logprobs: torch.Tensor, old_logprobs: torch.Tensor, mask: torch.Tensor,
                   clipped_low: torch.Tensor | None = None, clipped_high: torch.Tensor | None = None,
                   max_log_ratio: float = MAX_LOG_RATIO) -> torch.Tensor:
    """One micro batch -> [B, len(SEQUENCE_STATS)] (columns in SEQUENCE_STATS order), >= float32.

    logprobs, old_logprobs, mask: [B, T] (mask bool); clipped_low / clipped_high: bool [B] (sequence-level
    clipping, GSPO) or [B, T] (token-level: GRPO, GSPO-token), None when nothing is clipped (a pure log-prob
    comparison). Under context parallelism the caller sums the columns over CP ranks (max for abs_diff_max)
    where they are partial; token counts and log-ratio sums may already be whole.
    """
    mask = mask.bool()
    diff = masked_token_log_ratio(logprobs.detach(), old_logprobs.detach(), mask)
    tokens = mask.sum(dim=-1).to(diff.dtype)
    none = torch.zeros_like(mask)
    clip = []
    for clipped in (clipped_low if clipped_low is not None else none,
                    clipped_high if clipped_high is not None else none):
        if clipped.dim() == 1:  # the sequence's clip covers all its tokens
            clip.append((clipped & (tokens > 0)).to(diff.dtype) * tokens)
        else:
            clip.append((clipped & mask).sum(dim=-1).to(diff.dtype))
    return torch.stack([
        tokens, diff.sum(dim=-1), clip[0], clip[1], (clip[0] > 0).to(diff.dtype), (clip[1] > 0).to(diff.dtype),
        _kl_old_new(logprobs, old_logprobs, mask, max_log_ratio).sum(dim=-1),
        diff.abs().sum(dim=-1), diff.abs().amax(dim=-1) if diff.shape[-1] else tokens * 0,
    ], dim=-1)


def _columns(stats: torch.Tensor, names: tuple[str, ...] = SEQUENCE_STATS) -> dict[str, torch.Tensor]:
    """The named columns of SEQUENCE_STATS ([N, len(SEQUENCE_STATS)]) or LOSS_STATS ([N, len(LOSS_STATS)]) stats."""
    if stats.dim() != 2 or stats.shape[-1] not in (len(SEQUENCE_STATS), len(LOSS_STATS)):
        raise ValueError(f"stats must be [N, {len(SEQUENCE_STATS)}] (SEQUENCE_STATS) or [N, {len(LOSS_STATS)}] "
                         f"(LOSS_STATS), got {tuple(stats.shape)}")
    if stats.shape[-1] < len(LOSS_STATS) and names is not SEQUENCE_STATS:
        raise ValueError(f"correction metrics need [N, {len(LOSS_STATS)}] (LOSS_STATS), got {tuple(stats.shape)}")
    stats = stats.double()
    return {name: stats[:, LOSS_STATS.index(name)] for name in names}


@torch.no_grad()
def update_metrics(stats: torch.Tensor, unit: str, max_log_ratio: float = MAX_LOG_RATIO) -> dict[str, float]:
    """The update's metrics from the per-sequence stats of every sequence it trained on (all micro batches,
    minibatches and ranks): [N, len(SEQUENCE_STATS)] -> floats.

    clip_frac_seqs(_low/_high): fraction of sequences clipped (token-level losses: holding a clipped token);
    clip_frac_tokens(_low/_high): fraction of response tokens whose gradient is clipped (the GSPO paper's
    comparison of GSPO with GRPO); clip_frac(_low/_high): the loss's own unit, ``unit`` "sequence" (GSPO) or
    "token" (GRPO, GSPO-token). seq_ratio_min/mean/max: the GSPO sequence ratio s_i over sequences with tokens;
    approx_kl: mean over response tokens of k3 for KL(pi_old || pi_theta).
    """
    if unit not in ("sequence", "token"):
        raise ValueError(f"unit must be 'sequence' or 'token', got {unit!r}")
    c = _columns(stats)
    valid = c["tokens"] > 0
    n, tokens = valid.sum().clamp(min=1), c["tokens"].sum().clamp(min=1)
    out = {}
    for side in ("_low", "_high"):
        out[f"clip_frac_seqs{side}"] = c[f"clipped{side}"][valid].sum() / n
        out[f"clip_frac_tokens{side}"] = c[f"clipped_tokens{side}"].sum() / tokens
    for kind in ("seqs", "tokens"):
        out[f"clip_frac_{kind}"] = out[f"clip_frac_{kind}_low"] + out[f"clip_frac_{kind}_high"]
    own = "seqs" if unit == "sequence" else "tokens"
    for side in ("", "_low", "_high"):
        out[f"clip_frac{side}"] = out[f"clip_frac_{own}{side}"]
    ratio = torch.exp((c["log_ratio_sum"][valid] / c["tokens"][valid]).clamp(-max_log_ratio, max_log_ratio))
    out.update(masked_stats(ratio, torch.ones_like(ratio, dtype=torch.bool), "seq_ratio"))
    out["approx_kl"] = c["kl_sum"].sum() / tokens
    return to_floats(out)


@torch.no_grad()
def mismatch_metrics(stats: torch.Tensor, clip_range: tuple[float, float] | None = None) -> dict[str, float]:
    """Rollout-vs-trainer log-prob gap from per-sequence stats of (trainer log-probs, rollout log-probs) at the
    same weights: logprob_diff_max / _mean (|diff| per response token), logprob_diff_seq_log_ratio (the largest
    |mean token diff| of a sequence: GSPO's log sequence ratio were the rollout's log-probs pi_old),
    logprob_diff_kl and logprob_diff_kl_k1 (k3 and k1 of KL(rollout || trainer) per token: sampled by the engine,
    k1 = log pi_engine - log pi_trainer, k3 = w - 1 - log w with w = pi_trainer / pi_engine), and with
    ``clip_range`` (eps_low, eps_high) logprob_diff_beyond_clip: the share of sequences whose geometric-mean ratio
    exp(mean token diff) lies outside [1 - eps_low, 1 + eps_high] (clipped at unchanged weights, were the engine's
    log-probs GSPO's pi_old)."""
    c = _columns(stats)
    valid = c["tokens"] > 0
    tokens = c["tokens"].sum().clamp(min=1)
    mean_diff = c["log_ratio_sum"][valid] / c["tokens"][valid]
    zero = c["tokens"].new_zeros(())
    out = {
        "logprob_diff_max": c["abs_diff_max"].max() if valid.any() else zero,
        "logprob_diff_mean": c["abs_diff_sum"].sum() / tokens,
        "logprob_diff_seq_log_ratio": mean_diff.abs().max() if valid.any() else zero,
        "logprob_diff_kl": c["kl_sum"].sum() / tokens,
        "logprob_diff_kl_k1": -c["log_ratio_sum"].sum() / tokens,
    }
    if clip_range is not None:
        ratio = torch.exp(mean_diff)
        beyond = (ratio < 1 - clip_range[0]) | (ratio > 1 + clip_range[1])
        out["logprob_diff_beyond_clip"] = beyond.sum() / valid.sum().clamp(min=1)
    return to_floats(out)


@torch.no_grad()
def correction_metrics(stats: torch.Tensor) -> dict[str, float]:
    """What the correction did over every sequence of the update ([N, len(LOSS_STATS)]): the share of response
    tokens (correction_*_tokens) and of sequences (correction_*_seqs: holding such a token) masked, truncated and
    rejected, and the mean and max weight of the tokens kept (correction_weight_mean / _max)."""
    c = _columns(stats, CORRECTION_STATS)
    tokens = c["correction_tokens"].sum()
    valid = c["correction_tokens"] > 0
    seqs, kept = valid.sum().clamp(min=1), (tokens - c["rejected_tokens"].sum()).clamp(min=1)
    out = {}
    for name in ("masked", "truncated"):
        out[f"correction_{name}_tokens"] = c[f"{name}_tokens"].sum() / tokens.clamp(min=1)
        out[f"correction_{name}_seqs"] = c[name][valid].sum() / seqs
    out["correction_rejected_tokens"] = c["rejected_tokens"].sum() / tokens.clamp(min=1)
    out["correction_rejected_seqs"] = c["rejected"][valid].sum() / seqs
    out["correction_weight_mean"] = c["weight_sum"].sum() / kept
    out["correction_weight_max"] = c["weight_max"].max() if valid.any() else tokens.new_zeros(())
    return to_floats(out)


def to_floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """0-d tensors -> plain Python floats, in one host transfer."""
    names = list(metrics)
    if not names:
        return {}
    values = torch.stack([metrics[n].detach().to(torch.float64) for n in names]).tolist()
    return dict(zip(names, values))
