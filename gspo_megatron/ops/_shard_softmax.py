"""Softmax over a vocabulary split across ranks: per-shard statistics and their exact combination (no collectives).

A rank holding the logits z[:, shard] of one chunk of tokens computes, per token and relative to its *own* max m_r,

    s_r = sum_{v in shard} exp(z_v - m_r)          u_r = sum_{v in shard} exp(z_v - m_r) (z_v - m_r)

and the target logit z_y if it owns y (0 otherwise). Because no shard needs another's max, the shards exchange
nothing until every chunk is done; the [tp, T, 4] statistics then combine exactly:

    lse = M + log sum_r s_r exp(m_r - M),  M = max_r m_r
    H   = lse - sum_v p_v z_v = sum_r exp(m_r - lse) (s_r (lse - m_r) - u_r)

(the second form uses sum_r exp(m_r - lse) s_r = 1; each of its terms is >= 0, so no cancellation for peaked p).
The shards can be any partition of the vocabulary: partial statistics of column blocks of one rank's shard merge
into that rank's (m_r, s_r, z_y, u_r) the same way (``merge_shard_stats``), with

    m = max_i m_i,  s = sum_i s_i exp(m_i - m),  u = sum_i exp(m_i - m) (u_i + (m_i - m) s_i),  z_y = sum_i z_y,i

Backward, per token, with log p_v = z_v - lse, upstream gradients g (log-prob) and g_H (entropy):

    dlogp_y / dz_v = [v = y] - p_v            dH / dz_v = -p_v (log p_v + H)

With a log-prob gradient alone (the policy update), the gradient w.r.t. the untempered logits x = z * temperature
is c ([v = y] - p_v), c = g / temperature, and one exp pass gives it up to a per-token sign:

    E_v = exp(z_v - lse + log|c|) = |c| p_v,    d/dx_v = -sign(c) (E_v - |c| [v = y])

so the sign can be applied to the [c, H] operands of the two gradient matmuls instead of to [c, V] logits.

When the gradient is formed right after the statistics, on the same chunk (the fused sequence loss), the chunk
already holds e_v = exp(z_v - m_r) and p_v = e_v exp(m_r - lse): one multiply pass turns it into -d/dx.
"""

from __future__ import annotations

import torch

__all__ = [
    "STAT_ENTROPY", "STAT_MAX", "STAT_SUMEXP", "STAT_TARGET", "combine_shard_stats", "logits_grad_",
    "logprob_grad_from_exp_", "logprob_grad_unsigned_", "merge_shard_stats", "shard_stats_",
]

# Columns of the per-token statistics tensor [T, 4].
STAT_MAX, STAT_SUMEXP, STAT_TARGET, STAT_ENTROPY = range(4)


def _owned(local_targets: torch.Tensor, shard_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(owned [c] bool, safe column [c, 1]): which targets fall in this shard, and an index valid everywhere."""
    owned = (local_targets >= 0) & (local_targets < shard_rows)
    return owned, torch.where(owned, local_targets, 0).unsqueeze(1)


def shard_stats_(
    z: torch.Tensor, local_targets: torch.Tensor, with_entropy: bool, out: torch.Tensor
) -> None:
    """Write (m_r, s_r, z_y or 0, u_r or 0) of one chunk to ``out`` [c, 4]. Consumes ``z`` (overwritten).

    z: [c, V_shard] tempered logits (logits / temperature) in the compute dtype. local_targets: [c] target ids
    minus this shard's first id (outside [0, V_shard): another rank owns it). Extra memory: one [c, V_shard]
    buffer with entropy, none without.
    """
    owned, col = _owned(local_targets, z.shape[1])
    m = z.amax(dim=1)
    out[:, STAT_TARGET] = torch.where(owned, z.gather(1, col).squeeze(1), 0)
    out[:, STAT_MAX] = m
    z.sub_(m.unsqueeze(1))  # z - m_r <= 0: exp cannot overflow
    if with_entropy:
        e = torch.exp(z)
        out[:, STAT_SUMEXP] = e.sum(dim=1)
        out[:, STAT_ENTROPY] = e.mul_(z).sum(dim=1)
    else:
        out[:, STAT_SUMEXP] = z.exp_().sum(dim=1)
        out[:, STAT_ENTROPY] = 0


def combine_shard_stats(stats: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[tp, T, 4] per-shard statistics -> (lse [T], target logit z_y [T], entropy H [T]); see the module docstring."""
    m, s, target, u = stats.unbind(dim=2)  # each [tp, T]
    top = m.amax(dim=0)
    lse = top + torch.log((s * torch.exp(m - top)).sum(dim=0))
    entropy = (torch.exp(m - lse) * (s * (lse - m) - u)).sum(dim=0)
    return lse, target.sum(dim=0), entropy


def merge_shard_stats(stats: torch.Tensor) -> torch.Tensor:
    """[n, T, 4] statistics of n disjoint column blocks (each with at least one column) -> [T, 4] of their union."""
    m, s, target, u = stats.unbind(dim=2)  # each [n, T]
    top = m.amax(dim=0)
    shift = m - top  # <= 0
    scale = torch.exp(shift)
    return torch.stack([top, (s * scale).sum(dim=0), target.sum(dim=0), (scale * (u + shift * s)).sum(dim=0)], dim=1)


def logits_grad_(
    z: torch.Tensor,
    local_targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor | None,
    grad_logprob: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """Gradient w.r.t. the *untempered* logits x = z * temperature of one chunk, written over ``z`` and returned.

    z: [c, V_shard] tempered logits; lse, entropy, grad_logprob, grad_entropy: [c] (a None gradient is zero;
    entropy is only read when grad_entropy is given). Extra memory: one [c, V_shard] buffer with an entropy
    gradient, none without.
    """
    logp = z.sub_(lse.unsqueeze(1))
    # d/dx = d/dz / temperature: fold -1/temperature into the per-token factors once, not into [c, V] passes.
    scale = -1.0 / temperature
    a = grad_logprob * scale if grad_logprob is not None else None
    if grad_entropy is None:
        grad = logp.exp_()  # p
        grad.mul_(a.unsqueeze(1)) if a is not None else grad.zero_()
    else:
        p = torch.exp(logp)
        grad = logp.add_(entropy.unsqueeze(1)).mul_((grad_entropy * scale).unsqueeze(1))
        if a is not None:
            grad.add_(a.unsqueeze(1))
        grad.mul_(p)
    if grad_logprob is not None:
        owned, col = _owned(local_targets, z.shape[1])
        grad.scatter_add_(1, col, torch.where(owned, -a, 0).unsqueeze(1))
    return grad


def logprob_grad_unsigned_(
    z: torch.Tensor, local_targets: torch.Tensor, lse: torch.Tensor, c: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(M [c, V_shard], sign [c, 1]) with d logp / d x = sign * M, for an upstream log-prob gradient alone.

    z: [c, V_shard] tempered logits, overwritten with M; lse: [c]; c: [c] upstream gradient / temperature. Two
    passes over the chunk (subtract, exp) and no extra memory; see the module docstring.
    """
    magnitude = c.abs()
    z.sub_((lse - torch.log(magnitude)).unsqueeze(1))  # a zero gradient gives -inf here and exactly 0 below
    grad = z.exp_()
    owned, col = _owned(local_targets, z.shape[1])
    grad.scatter_add_(1, col, torch.where(owned, -magnitude, 0).unsqueeze(1))
    return grad, -torch.sign(c).unsqueeze(1)


def logprob_grad_from_exp_(
    e: torch.Tensor, local_targets: torch.Tensor, shard_max: torch.Tensor, lse: torch.Tensor, c: torch.Tensor
) -> torch.Tensor:
    """-d logp / d x for one chunk, written over ``e`` (the chunk as ``shard_stats_`` left it: exp(z - m_r)).

    shard_max: [c] this shard's m_r; lse: [c] the combined log-sum-exp; c: [c] upstream gradient / temperature.
    One pass over the chunk (and a scatter): c p_v - c [v = y]. The caller negates on the [c, H] side.
    """
    e.mul_((c * torch.exp(shard_max - lse)).unsqueeze(1))
    owned, col = _owned(local_targets, e.shape[1])
    e.scatter_add_(1, col, torch.where(owned, -c, 0).unsqueeze(1))
    return e
