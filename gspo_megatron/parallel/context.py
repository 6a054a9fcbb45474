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

# Recorded per rank for Routing Replay: already this rank's tokens, never split again.
_LOCAL_KEYS = ("routing", "old_routing")


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


def split_batch(batch: dict, group) -> dict:
    """This CP rank's tokens of every per-token tensor of a micro batch (those shaped [b, S, ...] like
    ``input_ids``); per-sequence values ([b]) as they are. A group of one returns ``batch`` itself."""
    cp, rank = _size_and_rank(group)
    if cp == 1:
        return batch
    b, seq_len = batch["input_ids"].shape[:2]
    index = token_index(seq_len, cp, rank, device=batch["input_ids"].device)

    def split(key, value):
        if key in _LOCAL_KEYS or not torch.is_tensor(value) or value.dim() < 2 or tuple(value.shape[:2]) != (b, seq_len):
            return value
        return value.index_select(1, index.to(value.device))

    return {key: split(key, value) for key, value in batch.items()}


def gather_sequence(local: torch.Tensor, group) -> torch.Tensor:
    """The inverse of ``split_batch`` for one tensor: [b, S / cp, ...] on each CP rank -> [b, S, ...] on all.
    No autograd (the trainer gathers results, never gradients)."""
    cp, _ = _size_and_rank(group)
    if cp == 1:
        return local
    parts = [torch.empty_like(local) for _ in range(cp)]
    dist.all_gather(parts, local.contiguous(), group=group)
    seq_len = local.shape[1] * cp
    full = local.new_empty((local.shape[0], seq_len) + tuple(local.shape[2:]))
    for rank, part in enumerate(parts):
        full[:, token_index(seq_len, cp, rank, device=local.device)] = part
    return full
