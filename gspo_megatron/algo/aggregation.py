"""Reducing per-token / per-sequence loss terms to a scalar, with caller-controlled denominators.

When one rollout batch is split across microbatches or data-parallel ranks, each piece must divide by the
*global* count (num_tokens / num_sequences) so that the summed gradient equals the full-batch gradient and every
sequence (or token) weighs the same. Defaults use the local count, which is right for a single piece.
"""

from __future__ import annotations

import torch

from .masking import zero_masked

__all__ = [
    "AGGREGATIONS",
    "aggregate",
    "check_aggregation",
    "seq_mean_token_mean",
    "sequence_mean",
    "token_mean",
]

# "token-mean": every token weighs the same (long sequences dominate, the bias TRL warns about).
# "seq-mean-token-mean": every sequence weighs the same, tokens weigh 1/|y_i| within their sequence.
AGGREGATIONS = ("token-mean", "seq-mean-token-mean")

Denominator = float | int | torch.Tensor | None


def check_aggregation(aggregation: str) -> None:
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def _denominator(override: Denominator, local_count: torch.Tensor, name: str) -> torch.Tensor | float:
    """override if given (a global count), else the local count clamped to >= 1 so empty input gives 0, not NaN."""
    if override is None:
        return local_count.clamp(min=1)
    if isinstance(override, torch.Tensor):
        # A tensor (e.g. an all-reduced count) is trusted as is: checking it would force a device sync.
        return override.to(local_count.dtype)
    if isinstance(override, bool) or not override > 0:
        raise ValueError(f"{name} must be a positive number, got {override!r}")
    return float(override)


def sequence_mean(per_sequence: torch.Tensor, valid: torch.Tensor, num_sequences: Denominator = None) -> torch.Tensor:
    """sum_i [valid_i] x_i / num_sequences (default: number of valid sequences). [B], bool [B] -> scalar."""
    total = zero_masked(per_sequence, valid).sum()
    return total / _denominator(num_sequences, valid.sum().to(per_sequence.dtype), "num_sequences")


def token_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens: Denominator = None) -> torch.Tensor:
    """sum over response tokens / num_tokens (default: number of response tokens). [B, T], bool [B, T] -> scalar."""
    total = zero_masked(values, mask).sum()
    return total / _denominator(num_tokens, mask.sum().to(values.dtype), "num_tokens")


def seq_mean_token_mean(values: torch.Tensor, mask: torch.Tensor, num_sequences: Denominator = None) -> torch.Tensor:
    """Mean over each sequence's response tokens, then sequence_mean over non-empty sequences. [B, T] -> scalar."""
    counts = mask.sum(dim=-1).to(values.dtype)
    per_sequence = zero_masked(values, mask).sum(dim=-1) / counts.clamp(min=1)
    return sequence_mean(per_sequence, counts > 0, num_sequences)


def aggregate(
    values: torch.Tensor,
    mask: torch.Tensor,
    aggregation: str,
    num_tokens: Denominator = None,
    num_sequences: Denominator = None,
) -> torch.Tensor:
    """Dispatch on `aggregation` (see AGGREGATIONS). A denominator that the mode does not use is an error,
    because passing one means the caller expects a normalisation that would silently not happen."""
    check_aggregation(aggregation)
    if aggregation == "token-mean":
        if num_sequences is not None:
            raise ValueError("num_sequences applies only to aggregation='seq-mean-token-mean'; pass num_tokens")
        return token_mean(values, mask, num_tokens)
    if num_tokens is not None:
        raise ValueError("num_tokens applies only to aggregation='token-mean'; pass num_sequences")
    return seq_mean_token_mean(values, mask, num_sequences)
