"""Context parallelism: which tokens of a sequence each CP rank holds, and the way back.

Megatron's load-balanced layout (Megatron-LM's ``get_batch_on_this_cp_rank``, which megatron-core's RoPE and
TransformerEngine's causal CP attention assume): a sequence of S tokens is cut into 2*cp equal chunks and CP rank
r holds chunks r and 2*cp-1-r, so every rank gets the same share of causal attention work. Per-sequence sums over
those tokens are then reduced as scalars (``parallel.reductions.all_reduce_sequence_sums``); per-token results
that the trainer keeps (old log-probs, entropies) are gathered back with ``gather_sequence``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

# The old-policy pass's record (Routing Replay, expert volatility): already this rank's tokens, never split again.
_LOCAL_KEYS = ("old_routing",)


def token_index(seq_len: int, cp: int, rank: int, device=None) -> torch.Tensor:
    """The positions [S / cp] of a length-``seq_len`` sequence that CP rank ``rank`` of ``cp`` holds."""
    if seq_len % (2 * cp):
        raise ValueError(f"a sequence of {seq_len} tokens cannot be split into 2 * context_parallel_size = {2 * cp} "
                         "equal chunks: pad it to a multiple (parallel.context.sequence_multiple)")
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device),
                      torch.arange(second, second + chunk, device=device)])


def sequence_multiple(tensor: int = 1, context: int = 1, sequence_parallel: bool = False) -> int:
    """What every padded sequence length must be a multiple of: 2 * cp chunks, each split over TP ranks under
    sequence parallelism."""
    return (2 * context if context > 1 else 1) * (tensor if sequence_parallel and tensor > 1 else 1)


def _size_and_rank(group) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def row_index(segments: torch.Tensor, width: int, cp: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Where CP rank ``rank``'s share of each row lies, row i cut into 2 * cp chunks of its first ``segments[i]``
    positions (packed rows: each sequence's own segment; padded rows: the whole width): ([b, width / cp] positions
    in the row, [b, width / cp] bool: held, else a filler column past the row's share)."""
    segments = segments.to(torch.int64)
    if (segments % (2 * cp)).any():
        raise ValueError(f"segments {segments.tolist()} cannot each be split into 2 * context_parallel_size = "
                         f"{2 * cp} equal chunks (pad each to a multiple: parallel.packing.padded_lengths)")
    chunk = (segments // (2 * cp)).unsqueeze(1)  # [b, 1]
    j = torch.arange(width // cp, device=segments.device).unsqueeze(0)
    first = j < chunk
    index = torch.where(first, rank * chunk + j, (2 * cp - 1 - rank) * chunk + j - chunk)
    held = j < 2 * chunk
    return torch.where(held, index, torch.zeros_like(index)), held


def packed_token_index(offsets: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    """The positions [N / cp] of a packed row of segments ``offsets`` (``cu_seqlens``, padded) that CP rank
    ``rank`` holds: chunks r and 2*cp-1-r of every segment, segment by segment (TransformerEngine's
    ``thd_get_partitioned_indices``, the layout its THD attention and megatron's THD RoPE expect): ``row_index``
    of the segments as rows, each shifted to its offset, held positions in row-major order."""
    offsets = offsets.to(torch.int64)
    segments = offsets.diff()
    if not segments.numel():
        return offsets[:0]
    index, held = row_index(segments, int(segments.max()), cp, rank)
    return (offsets[:-1, None] + index)[held]


def split_batch(batch: dict, group) -> dict:
    """This CP rank's tokens of every per-token tensor of a micro batch (those shaped [b, S, ...] like
    ``input_ids``); per-sequence values ([b]) as they are. A group of one returns ``batch`` itself."""
    cp, rank = _size_and_rank(group)
    if cp == 1:
        return batch
    b, seq_len = batch["input_ids"].shape[:2]
    index = token_index(seq_len, cp, rank, device=batch["input_ids"].device)

    def split(key, value):
        if (key in _LOCAL_KEYS or not torch.is_tensor(value) or value.dim() < 2
                or tuple(value.shape[:2]) != (b, seq_len)):
            return value
        return value.index_select(1, index.to(value.device))

    return {key: split(key, value) for key, value in batch.items()}


# The packed row's per-token tensors ([1, N, ...]); every other [b, S, ...] tensor is per sequence.
_ROW_KEYS = ("input_ids", "labels", "position_ids", "rollout_routing")


def split_packed(batch: dict, group) -> dict:
    """This CP rank's share of a packed micro batch (``parallel.packing.pack`` with segments of 2 * cp chunks):
    the row's tokens (``packed_token_index``), and of every per-sequence [b, S, ...] tensor the same tokens in
    each row's own split (``row_index``, width S / cp, ``loss_mask`` off past a row's share), with the
    ``unpack_index`` from one to the other and ``cp_segments`` [b] for ``gather_sequence``."""
    cp, rank = _size_and_rank(group)
    if cp == 1:
        return batch
    offsets = batch["cu_seqlens"].to(torch.int64)
    b, width = batch["unpack_index"].shape
    segments = offsets.diff()[:b]
    row = packed_token_index(offsets, cp, rank).to(batch["input_ids"].device)
    index, held = row_index(segments, width, cp, rank)
    rows = torch.arange(b, device=index.device).unsqueeze(1)
    out = dict(batch)
    for key, value in batch.items():
        if key in _ROW_KEYS and torch.is_tensor(value):
            out[key] = value.index_select(1, row.to(value.device))
        elif (key not in _LOCAL_KEYS and key != "unpack_index" and torch.is_tensor(value) and value.dim() >= 2
              and tuple(value.shape[:2]) == (b, width)):
            out[key] = value[rows.to(value.device), index.to(value.device)]
    if "loss_mask" in out:
        out["loss_mask"] = out["loss_mask"] & held.to(out["loss_mask"].device)
    starts = (offsets[:b] // cp).unsqueeze(1)
    local = torch.arange(width // cp, device=starts.device).unsqueeze(0)
    out["unpack_index"] = starts + torch.minimum(local, (segments // cp - 1).unsqueeze(1))
    out["cp_segments"] = segments
    return out


def gather_sequence(local: torch.Tensor, group, segments: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of ``split_batch`` (or, with each row's ``segments``, of ``split_packed``) for one tensor:
    [b, S / cp, ...] on each CP rank -> [b, S, ...] on all (positions no rank holds: zero). No autograd (the
    trainer gathers results, never gradients)."""
    cp, _ = _size_and_rank(group)
    if cp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    b, seq_len = local.shape[0], local.shape[1] * cp
    if segments is None:
        segments = torch.full((b,), seq_len, dtype=torch.int64)
    full = local.new_zeros((b, seq_len) + tuple(local.shape[2:]))
    rows = torch.arange(b, device=local.device).unsqueeze(1)
    for rank, part in enumerate(parts):
        index, held = row_index(segments.to(local.device), seq_len, cp, rank)
        full[rows.expand_as(index)[held], index[held]] = part[held]
    return full
