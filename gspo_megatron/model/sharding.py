"""The joins and splits of ``mapping`` as tensor functions (no process groups except in ``gather``).

A rank's Megatron tensor is ``join([shard(part) for part in hf_parts])``: each HF part is split over the
TP group first, then joined. ``unjoin`` is the inverse on a rank's tensor, and the full HF tensors are the
TP ranks' unjoined parts concatenated along the split dim.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .mapping import CAT, COLUMN, COPY, DOWN, GATED_QKV, GLU, NONE, PER_HEAD, QKV, ROW, VOCAB


def resolve(split: str, param: torch.Tensor) -> str:
    """A rule's split for this parameter: ``down`` is ``column`` where megatron made the layer tensor-parallel."""
    if split != DOWN:
        return split
    return COLUMN if getattr(param, "tensor_model_parallel", False) else NONE


def split_dim(split: str) -> int | None:
    return {NONE: None, COLUMN: 0, VOCAB: 0, ROW: 1}[split]


def local_index(split: str, shape: tuple[int, ...], size: int, rank: int,
                padded_rows: int | None = None) -> tuple[tuple[slice, ...], int]:
    """(index into the full HF tensor for TP rank ``rank`` of ``size``, zero rows to append after it).

    For ``vocab`` the tensor's rows are first padded to ``padded_rows``; a rank whose block lies (partly)
    beyond the real rows gets zero rows for the rest.
    """
    index = [slice(None)] * len(shape)
    dim = split_dim(split)
    if dim is None or size == 1 and split != VOCAB:
        return tuple(index), 0
    rows = padded_rows if split == VOCAB else shape[dim]
    if rows % size:
        raise ValueError(f"dim {dim} of size {rows} does not split over {size} ranks")
    block = rows // size
    start, end = rank * block, (rank + 1) * block
    real_end = min(end, shape[dim])
    real_start = min(start, real_end)
    index[dim] = slice(real_start, real_end)
    return tuple(index), (end - start) - (real_end - real_start)


def in_section(index: tuple[slice, ...], offset: int, rows: int) -> tuple[slice, ...]:
    """``index`` into a section of ``rows`` rows starting at row ``offset`` of the whole tensor, as an index into
    the whole tensor (``mapping.Part.sections``)."""
    first = index[0]
    start = offset + (first.start or 0)
    stop = offset + (rows if first.stop is None else first.stop)
    return (slice(start, stop),) + tuple(index[1:])


def pad_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    if rows == 0:
        return tensor
    return torch.cat([tensor, tensor.new_zeros((rows,) + tuple(tensor.shape[1:]))])


def join(kind: str, parts: list[torch.Tensor], heads_per_group: int, head_dim: int,
         per_head: tuple[tuple[int, ...], ...] = ()) -> torch.Tensor:
    """HF parts (already this rank's shards) -> this rank's Megatron tensor. ``per_head``: for ``per_head``, each
    part's section sizes per key head."""
    if kind == COPY:
        (tensor,) = parts
        return tensor
    if kind in (GLU, CAT):
        return torch.cat(parts, dim=0)
    if kind == QKV:
        q, k, v = parts
        groups = k.shape[0] // head_dim
        rest = tuple(q.shape[1:])
        q = q.reshape((groups, heads_per_group * head_dim) + rest)
        k = k.reshape((groups, head_dim) + rest)
        v = v.reshape((groups, head_dim) + rest)
        return torch.cat([q, k, v], dim=1).reshape((-1,) + rest)
    if kind == GATED_QKV:
        # q_proj holds [q_h; gate_h] per head; megatron's group g: [its heads' queries; their gates; k_g; v_g]
        q_gate, k, v = parts
        groups = k.shape[0] // head_dim
        rest = tuple(q_gate.shape[1:])
        q_gate = q_gate.reshape((groups, heads_per_group, 2, head_dim) + rest)
        q = q_gate[:, :, 0].reshape((groups, heads_per_group * head_dim) + rest)
        gate = q_gate[:, :, 1].reshape((groups, heads_per_group * head_dim) + rest)
        return torch.cat([q, gate, k.reshape((groups, head_dim) + rest), v.reshape((groups, head_dim) + rest)],
                         dim=1).reshape((-1,) + rest)
    if kind == PER_HEAD:
        sections = []
        for part, sizes in zip(parts, per_head):
            rest = tuple(part.shape[1:])
            by_head = part.reshape((part.shape[0] // sum(sizes), sum(sizes)) + rest)
            sections += [s.reshape((-1,) + rest) for s in by_head.split(list(sizes), dim=1)]
        return torch.cat(sections, dim=0)
    raise ValueError(f"unknown join {kind!r}")


def unjoin(kind: str, tensor: torch.Tensor, heads_per_group: int, head_dim: int,
           rows: tuple[int, ...] = (), per_head: tuple[tuple[int, ...], ...] = ()) -> list[torch.Tensor]:
    """This rank's Megatron tensor -> its HF parts (views where possible). ``rows``: for ``cat`` and ``per_head``,
    each part's rows on this rank; ``per_head`` as for ``join``."""
    if kind == COPY:
        return [tensor]
    if kind == GLU:
        return list(tensor.chunk(2, dim=0))
    if kind == CAT:
        if sum(rows) != tensor.shape[0]:
            raise ValueError(f"parts of {rows} rows do not make a tensor of {tensor.shape[0]} rows")
        return list(tensor.split(list(rows), dim=0))
    if kind == QKV:
        rest = tuple(tensor.shape[1:])
        per_group = (heads_per_group + 2) * head_dim
        grouped = tensor.reshape((tensor.shape[0] // per_group, per_group) + rest)
        q, k, v = grouped.split([heads_per_group * head_dim, head_dim, head_dim], dim=1)
        return [p.reshape((-1,) + rest) for p in (q, k, v)]
    if kind == GATED_QKV:
        rest = tuple(tensor.shape[1:])
        per_group = (2 * heads_per_group + 2) * head_dim
        grouped = tensor.reshape((tensor.shape[0] // per_group, per_group) + rest)
        q, gate, k, v = grouped.split([heads_per_group * head_dim] * 2 + [head_dim, head_dim], dim=1)
        shape = (q.shape[0], heads_per_group, 1, head_dim) + rest
        q_gate = torch.cat([q.reshape(shape), gate.reshape(shape)], dim=2)
        return [q_gate.reshape((-1,) + rest), k.reshape((-1,) + rest), v.reshape((-1,) + rest)]
    if kind == PER_HEAD:
        rest = tuple(tensor.shape[1:])
        heads = [r // sum(sizes) for r, sizes in zip(rows, per_head)]
        sections = iter(tensor.split([h * size for h, sizes in zip(heads, per_head) for size in sizes], dim=0))
        return [torch.cat([next(sections).reshape((h, size) + rest) for size in sizes], dim=1).reshape((-1,) + rest)
                for h, sizes in zip(heads, per_head)]
    raise ValueError(f"unknown join {kind!r}")


def gather(tensor: torch.Tensor, split: str, group, size: int) -> torch.Tensor:
    """The full tensor from every rank's shard along the split dim (all-gather over ``group``)."""
    dim = split_dim(split)
    if dim is None or size == 1:
        return tensor
    shards = all_gather(tensor, group, size)
    return torch.cat(shards, dim=dim)


def all_gather(tensor: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """Every rank's equally shaped ``tensor``, in group-rank order."""
    tensor = tensor.contiguous()
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor, group=group)
    return out


def gather_to_first(tensor: torch.Tensor, split: str, group, size: int) -> torch.Tensor | None:
    """The full tensor on the group's first rank (a gather, not an all-gather), None on the others."""
    dim = split_dim(split)
    if dim is None or size == 1:
        return tensor if dist.get_rank(group) == 0 else None
    shards = gather_list_to_first(tensor, group, size)
    return None if shards is None else torch.cat(shards, dim=dim)


def gather_list_to_first(tensor: torch.Tensor, group, size: int) -> list[torch.Tensor] | None:
    """Every rank's equally shaped ``tensor``, in group-rank order, on the group's first rank; None elsewhere."""
    tensor = tensor.contiguous()
    first = dist.get_global_rank(group, 0)
    if dist.get_rank(group) == 0:
        out = [torch.empty_like(tensor) for _ in range(size)]
        dist.gather(tensor, out, dst=first, group=group)
        return out
    dist.gather(tensor, None, dst=first, group=group)
    return None
