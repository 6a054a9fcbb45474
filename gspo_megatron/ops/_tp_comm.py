"""The collectives of the log-prob op, all over the tensor-parallel group it is given (None: a group of one).

Each is a no-op for a group of one, so the single-rank path issues no collectives at all. They are plain
functions, not autograd Functions: the op's own backward calls the adjoint explicitly
(gather_rows <-> reduce_scatter_rows, all_reduce_sum for the replicated-hidden case).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

__all__ = ["all_reduce_sum_", "gather_rows", "group_rank", "group_size", "reduce_scatter_rows"]


def group_size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group: dist.ProcessGroup | None) -> int:
    return 0 if group is None else dist.get_rank(group)


def gather_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """All-gather along dim 0 over ``group``: [n, ...] per rank -> [tp * n, ...], rank-major (every rank)."""
    tp = group_size(group)
    if tp == 1:
        return x
    out = x.new_empty((tp * x.shape[0], *x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def reduce_scatter_rows(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """Sum over ``group`` and keep this rank's block of dim 0: [tp * n, ...] -> [n, ...] (adjoint of gather_rows)."""
    tp = group_size(group)
    if tp == 1:
        return x
    out = x.new_empty((x.shape[0] // tp, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


def all_reduce_sum_(x: torch.Tensor, group: dist.ProcessGroup | None) -> torch.Tensor:
    """In-place SUM over ``group``; returns ``x``."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
    return x
