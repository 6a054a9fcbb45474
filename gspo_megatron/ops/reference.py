"""The naive formula the fused op must equal: full logits, log_softmax, gather. For tests and benchmarks only.

It materialises [T, V] logits (and autograd keeps [T, V] more), which is what ``vocab_parallel_logprobs`` avoids.
"""

from __future__ import annotations

import torch

__all__ = ["naive_logprobs"]


def naive_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    temperature: float = 1.0,
    vocab_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(log p(target), entropy), each of ``targets``' shape, from the full (unsharded) output layer.

    hidden: [..., H]; weight: [V, H] all rows (only the first ``vocab_size`` take part); targets: [...] ids.
    Logits are computed in the inputs' dtype promoted to at least fp32.
    """
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    w = weight if vocab_size is None else weight[:vocab_size]
    logits = hidden.to(dtype) @ w.to(dtype).T / temperature  # [..., V]
    logp_all = torch.log_softmax(logits, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=-1)
    return logp, entropy
