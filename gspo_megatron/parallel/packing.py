"""Packed sequences: a micro batch's b sequences back to back in one row of N tokens, no padding between them.

A padded micro batch is [b, S] (each row one sequence of ``seq_lengths[i]`` tokens, then padding). Packed, the
model sees [1, N] with N = sum(seq_lengths) rounded up to ``multiple`` (the trailing padding is one more,
ignored, segment); each sequence attends only to itself:

- TransformerEngine attention: megatron's ``PackedSeqParams`` (qkv_format "thd", cu_seqlens over the segments);
  megatron's RoPE restarts at each ``cu_seqlens`` offset.
- megatron's local attention (CPU): a block-diagonal causal mask [1, 1, N, N] (True = masked). RoPE then runs
  over the row's positions 0..N-1, but attention scores depend only on relative positions inside a block, so a
  packed row equals its unpacked sequences up to rounding. ``position_ids`` restart at 0 per sequence either way
  (what learned absolute position embeddings would need).

Per-token results on the packed row come back to the padded [b, S] layout with ``unpack`` (a differentiable
gather): the losses, sequence sums and metrics then run unchanged on [b, S] tensors.
"""

from __future__ import annotations

import torch

# Per-token tensors that become the packed row (the model's inputs and the loss op's targets).
PACKED_KEYS = ("input_ids", "labels")
# What a packed micro batch holds for the model only (the loss reads the padded per-sequence tensors).
MODEL_KEYS = PACKED_KEYS + ("position_ids", "cu_seqlens", "cu_seqlens_unpadded", "max_seqlen", "unpack_index",
                            "attention_mask", "packed_seq_params", "sequence_parallel", "rollout_routing",
                            "cp_segments")


def padded_lengths(seq_lengths: torch.Tensor, segment_multiple: int = 1) -> torch.Tensor:
    """Each sequence's segment in a packed row: its tokens rounded up to ``segment_multiple`` (2 * cp under
    context parallelism, where every segment is cut into 2 * cp equal chunks; else 1: no padding)."""
    return -(-seq_lengths.to(torch.int64) // segment_multiple) * segment_multiple


def packed_length(seq_lengths: torch.Tensor, multiple: int = 1, segment_multiple: int = 1) -> int:
    """Tokens of a packed row holding sequences of ``seq_lengths`` [b]: their segments (``padded_lengths``) summed
    and rounded up to ``multiple`` (a multiple of ``segment_multiple``)."""
    total = int(padded_lengths(seq_lengths, segment_multiple).sum())
    return -(-total // multiple) * multiple


def cu_seqlens(seq_lengths: torch.Tensor, length: int) -> torch.Tensor:
    """int32 [b + 1] segment offsets (0, then the end of each sequence), plus the trailing padding as a last
    segment when the row is longer than the sequences: [b + 2]."""
    ends = torch.cumsum(seq_lengths.to(torch.int64), 0)
    offsets = torch.cat([ends.new_zeros(1), ends])
    if length < int(offsets[-1]):
        raise ValueError(f"a packed row of {length} tokens cannot hold sequences of {int(offsets[-1])} tokens")
    if length > int(offsets[-1]):
        offsets = torch.cat([offsets, offsets.new_tensor([length])])
    return offsets.to(torch.int32)


def unpack_index(seq_lengths: torch.Tensor, width: int, starts: torch.Tensor | None = None) -> torch.Tensor:
    """[b, width] long: the packed position of each padded position (b, t), sequence i starting at ``starts[i]``
    (default: right after the previous one); padding maps to the sequence's last token (any real position would
    do: padded positions are never in a loss mask)."""
    if starts is None:
        starts = torch.cumsum(seq_lengths, 0) - seq_lengths
    t = torch.arange(width, device=seq_lengths.device).unsqueeze(0)
    return starts.unsqueeze(1) + torch.minimum(t, (seq_lengths - 1).clamp_min(0).unsqueeze(1))


def pack(batch: dict, length: int, segment_multiple: int = 1) -> dict:
    """The packed model inputs of a padded micro batch with ``seq_lengths`` [b]: ``input_ids`` / ``labels`` /
    ``position_ids`` [1, length] (and the engine's ``rollout_routing`` [1, length, L, k]), ``cu_seqlens``
    (int32 segment offsets), ``max_seqlen`` and ``unpack_index`` [b, S]. The per-sequence and other per-token
    tensors stay as they are (padded [b, S]). With ``segment_multiple`` > 1 each sequence's segment is padded to a
    multiple of it (``padded_lengths``; context parallelism) and ``cu_seqlens_unpadded`` holds the offsets of
    the sequences' own tokens (TransformerEngine's ``cu_seqlens_q``; ``cu_seqlens`` is its ``*_padded``).
    Pure, device-agnostic."""
    lengths = batch["seq_lengths"].to(batch["input_ids"].device)
    b, width = batch["input_ids"].shape[:2]
    if (lengths < 1).any() or (lengths > width).any():
        raise ValueError(f"seq_lengths {lengths.tolist()} must lie in [1, {width}]")
    keep = torch.arange(width, device=lengths.device).unsqueeze(0) < lengths.unsqueeze(1)  # [b, S]
    segments = padded_lengths(lengths, segment_multiple)
    offsets = cu_seqlens(segments, length)
    starts = offsets[:b].to(torch.int64)
    # Where each real token goes in the row: its sequence's segment start + its position.
    destination = (starts.unsqueeze(1) + torch.arange(width, device=lengths.device).unsqueeze(0))[keep]
    out = dict(batch)
    for key in PACKED_KEYS:
        if key in batch:
            row = batch[key].new_zeros(length)
            row[destination] = batch[key][keep]
            out[key] = row.unsqueeze(0)
    if "rollout_routing" in batch:  # the engine's experts [b, S, L, k] -> [1, length, L, k]
        routes = batch["rollout_routing"]
        # Padding has no route: any k distinct experts (a repeated expert would miscount the dispatch).
        row = torch.arange(routes.shape[-1], dtype=routes.dtype, device=routes.device).expand(
            (length,) + tuple(routes.shape[2:])).clone()
        row[destination] = routes[keep]
        out["rollout_routing"] = row.unsqueeze(0)
    segment_lengths = offsets.diff().to(torch.int64)
    segment_starts = torch.repeat_interleave(offsets[:-1].to(torch.int64), segment_lengths)
    out["position_ids"] = (torch.arange(length, device=lengths.device) - segment_starts).unsqueeze(0)
    out["cu_seqlens"] = offsets
    out["max_seqlen"] = int(segment_lengths.max())
    out["unpack_index"] = unpack_index(lengths, width, starts)
    if segment_multiple > 1:  # each segment's own tokens (the trailing padding segment counts as its own)
        real = torch.cat([lengths.to(torch.int64), segment_lengths[b:]])
        out["cu_seqlens_unpadded"] = torch.cat([real.new_zeros(1), torch.cumsum(real, 0)]).to(torch.int32)
    return out


def block_causal_mask(offsets: torch.Tensor, length: int) -> torch.Tensor:
    """[1, 1, length, length] bool, True where attention is masked: position q sees k <= q of its own segment."""
    segment_lengths = offsets.diff().to(torch.int64)
    segment = torch.repeat_interleave(torch.arange(segment_lengths.numel(), device=offsets.device), segment_lengths)
    position = torch.arange(length, device=offsets.device)
    visible = (segment.unsqueeze(1) == segment.unsqueeze(0)) & (position.unsqueeze(0) <= position.unsqueeze(1))
    return (~visible).view(1, 1, length, length)


def mask_segments(mask: torch.Tensor) -> torch.Tensor | None:
    """The segment offsets of a one-row ``block_causal_mask`` [1, 1, N, N] (what megatron's local attention gets
    for a packed row), int32 [segments + 1]: a segment starts where a token cannot see the one before it. None for
    any other mask, or one segment (a plain causal row): nothing to restart."""
    if mask is None or mask.dim() != 4 or mask.shape[:2] != (1, 1) or mask.dtype != torch.bool:
        return None
    length = mask.shape[-1]
    starts = mask[0, 0].diagonal(-1).nonzero().flatten() + 1
    if not starts.numel():
        return None
    edges = starts.new_tensor([0]), starts.new_tensor([length])
    return torch.cat([edges[0], starts, edges[1]]).to(torch.int32)


def packed_seq_params(offsets: torch.Tensor, max_seqlen: int, unpadded: torch.Tensor | None = None):
    """megatron's ``PackedSeqParams`` for TransformerEngine's THD attention over the segments ``offsets``
    (``cu_seqlens_*_padded``: where each segment starts, what RoPE and the CP split follow), of which the
    sequences' own tokens end at ``unpadded`` (``cu_seqlens_q/kv``; None: the segments are unpadded)."""
    from megatron.core.packed_seq_params import PackedSeqParams

    offsets = offsets.to(torch.int32)
    real = offsets if unpadded is None else unpadded.to(torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real,
                           cu_seqlens_q_padded=offsets, cu_seqlens_kv_padded=offsets,
                           max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen)


def unpack(packed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[1, N, ...] per-token values of a packed row -> [b, S, ...] in the padded layout (autograd flows back
    to the packed positions; padded positions repeat a real one and must stay out of every mask)."""
    row = packed[0]
    return row[index.reshape(-1)].reshape(tuple(index.shape) + tuple(row.shape[1:]))


def pack_rows(per_sequence: torch.Tensor, index: torch.Tensor, length: int,
              fill: torch.Tensor | None = None) -> torch.Tensor:
    """The inverse of ``unpack`` for a padded [b, S, ...] tensor whose real positions are those of ``index``:
    -> [1, length, ...] (each packed position from its sequence; positions no sequence maps to: ``fill``,
    broadcast, or zero). No autograd."""
    b, width = index.shape
    out = per_sequence.new_zeros((length,) + tuple(per_sequence.shape[2:]))
    if fill is not None:
        out[:] = fill
    real = index.diff(dim=1, prepend=index[:, :1] - 1) != 0  # the first visit of each packed position
    out[index[real]] = per_sequence[real]
    return out.unsqueeze(0)


# ---- token-budget micro batches ----


def _fits(loads: list[int], counts: list[int], budget: int) -> bool:
    """Every micro batch within ``budget`` tokens, but a lone sequence longer than it (its own micro batch)."""
    return all(load <= budget or count == 1 for load, count in zip(loads, counts))


def balance(lengths: torch.Tensor, count: int) -> tuple[list[torch.Tensor], list[int]]:
    """``lengths`` [n] sequences into ``count`` micro batches of near-equal tokens (longest first, each to the
    lightest micro batch: LPT, as verl's and slime's balancing). Returns (each micro batch's positions in
    ``lengths``, ascending; their token counts), micro batches ordered by their first position."""
    order = sorted(range(lengths.numel()), key=lambda i: (-int(lengths[i]), i))
    bins: list[list[int]] = [[] for _ in range(count)]
    loads = [0] * count
    for i in order:
        j = min(range(count), key=lambda b: (loads[b], b))
        bins[j].append(i)
        loads[j] += int(lengths[i])
    ranked = sorted((sorted(b), load) for b, load in zip(bins, loads) if b)
    return [torch.tensor(b, dtype=torch.long) for b, _ in ranked], [load for _, load in ranked]


def smallest_count(lengths: torch.Tensor, budget: int, at_least: int = 1) -> int:
    """The fewest micro batches (>= ``at_least``) that ``balance`` fits within ``budget`` tokens each."""
    if budget < 1:
        raise ValueError(f"a token budget of {budget} per micro batch holds no sequence")
    count = max(at_least, min(-(-int(lengths.sum()) // budget), lengths.numel()), 1)
    while count < lengths.numel():  # one sequence per micro batch always fits
        parts, loads = balance(lengths, count)
        if _fits(loads, [p.numel() for p in parts], budget):
            return count
        count += 1
    return count
