"""Per-sequence sums and the cross-rank reductions that turn them into GSPO's sequence ratios.

Each function names the group it reduces over. Sequence-level quantities are reduced as per-sequence
scalars (two numbers a sequence), never as gathered per-token tensors:

- context parallelism: every CP rank holds a slice of every sequence; `all_reduce_sequence_sums` sums each
  sequence's (masked log-ratio sum, token count) over the CP group in one all-reduce of 2*B floats, with
  autograd, so the gradient reaches every rank's own tokens;
- pipeline parallelism: the loss lives on the last stage; `broadcast_from_last_stage` makes its per-sequence
  results available on every pipeline rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def sequence_sums(
    values: torch.Tensor, mask: torch.Tensor, cu_seqlens: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of ``values`` over each sequence's masked (response) tokens, and the token counts.

    Padded batch: values, mask [B, T] -> sums [B], counts [B].
    Packed batch: values, mask [N] (sequences back to back) and cu_seqlens [B + 1] (start offsets, last = N)
    -> sums [B], counts [B].
    Masked positions may hold -inf or garbage: they are selected away, never multiplied by 0.
    """
    if values.shape != mask.shape:
        raise ValueError(f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must have the same shape")
    keep = mask.bool()
    picked = torch.where(keep, values, torch.zeros((), dtype=values.dtype, device=values.device))
    if cu_seqlens is None:
        if values.dim() != 2:
            raise ValueError(f"a padded batch is [B, T]; got values of shape {tuple(values.shape)}")
        return picked.sum(dim=-1), keep.sum(dim=-1).to(values.dtype)
    if values.dim() != 1:
        raise ValueError(f"a packed batch is [N] with cu_seqlens; got values of shape {tuple(values.shape)}")
    if cu_seqlens[0] != 0 or cu_seqlens[-1] != values.shape[0] or (cu_seqlens.diff() < 0).any():
        raise ValueError(
            f"cu_seqlens must rise from 0 to the packed length {values.shape[0]}; got {cu_seqlens.tolist()}"
        )
    lengths = cu_seqlens.diff()
    segment = torch.repeat_interleave(torch.arange(lengths.numel(), device=values.device), lengths)
    sums = torch.zeros(lengths.numel(), dtype=values.dtype, device=values.device).index_add(0, segment, picked)
    counts = torch.zeros(lengths.numel(), dtype=values.dtype, device=values.device).index_add(
        0, segment, keep.to(values.dtype)
    )
    return sums, counts


class _AllReduceSumIdentityBackward(torch.autograd.Function):
    """Forward: SUM over ``group``. Backward: identity.

    Every rank goes on to compute the same loss from the reduced sums, so each rank's gradient w.r.t. its
    partial sum is the gradient w.r.t. the total; summing the parameter gradients over the group (which the
    data-parallel/CP gradient reduction does) then gives the full gradient exactly once.
    """

    @staticmethod
    def forward(ctx, partial: torch.Tensor, group) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def all_reduce_sequence_sums(
    sums: torch.Tensor, counts: torch.Tensor, group=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum per-sequence partial sums [B] and token counts [B] over ``group`` (the CP group), with autograd.

    One all-reduce of a [2, B] tensor: the bytes moved are 2 * B * itemsize whatever the sequence length.
    A group of size 1 (or None with no process group) returns the inputs unchanged.
    """
    if group is None or dist.get_world_size(group) == 1:
        return sums, counts
    packed = torch.stack([sums, counts.to(sums.dtype)])
    total = _AllReduceSumIdentityBackward.apply(packed, group)
    return total[0], total[1].detach()


def broadcast_from_last_stage(tensors: dict[str, torch.Tensor] | None, pp_group) -> dict[str, torch.Tensor]:
    """Give every rank of the pipeline group the last stage's ``tensors`` (None on the other stages).

    Shapes and dtypes travel first as a small object broadcast, since the other stages cannot know them.
    """
    if pp_group is None or dist.get_world_size(pp_group) == 1:
        return dict(tensors or {})
    last = dist.get_global_rank(pp_group, dist.get_world_size(pp_group) - 1)
    is_last = dist.get_rank() == last
    meta = [{k: (tuple(v.shape), v.dtype) for k, v in tensors.items()} if is_last else None]
    dist.broadcast_object_list(meta, src=last, group=pp_group)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pp_group) == "nccl" else "cpu"
    out = {}
    for name, (shape, dtype) in meta[0].items():
        t = tensors[name].detach().contiguous() if is_last else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(t, src=last, group=pp_group)
        out[name] = t
    return out


@torch.no_grad()
def all_reduce_sequence_stats(stats: torch.Tensor, max_columns: tuple[int, ...], group=None) -> torch.Tensor:
    """Per-sequence statistics [B, K] whose columns are partial over ``group`` (the CP group: each rank saw a slice
    of every sequence) -> whole-sequence values on every rank: SUM for every column but ``max_columns`` (MAX).
    No autograd (metrics, and the correction's constant weights). A group of size 1 returns ``stats`` unchanged."""
    if group is None or dist.get_world_size(group) == 1:
        return stats
    total = stats.detach().clone()
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    if max_columns:
        columns = list(max_columns)
        largest = stats.detach()[:, columns].contiguous()
        dist.all_reduce(largest, op=dist.ReduceOp.MAX, group=group)
        total[:, columns] = largest
    return total


def all_gather_rows(local: torch.Tensor, group=None) -> torch.Tensor:
    """[n, ...] on each rank of ``group`` (equal n) -> [n * size, ...] on every rank, in group-rank order.
    No autograd; on the tensor's device."""
    if group is None or dist.get_world_size(group) == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)
    return torch.cat(parts)
