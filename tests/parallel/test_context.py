"""The context-parallel split of a micro batch (``parallel.context``) and ``train.update.batch.batch_for_model``.

The split must be megatron's load-balanced layout (what its RoPE slicing and TransformerEngine's causal CP attention
assume), written here independently the way Megatron-LM's ``get_batch_on_this_cp_rank`` writes it (a view of
2*cp chunks, index_select of chunks r and 2*cp-1-r). The model path under CP=2 and TP2 x CP2 is compared with
world=1 in tests/train/update/test_schedules.py.
"""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.parallel.context import sequence_multiple, split_batch, token_index
from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks


def megatron_cp_slice(value: torch.Tensor, cp: int, rank: int, seq_dim: int = 1) -> torch.Tensor:
    """Megatron-LM's get_batch_on_this_cp_rank for one tensor."""
    shape = value.shape
    value = value.view(*shape[:seq_dim], 2 * cp, shape[seq_dim] // (2 * cp), *shape[seq_dim + 1:])
    index = torch.tensor([rank, 2 * cp - rank - 1])
    value = value.index_select(seq_dim, index)
    return value.view(*shape[:seq_dim], -1, *shape[seq_dim + 2:])


@pytest.mark.parametrize("cp,seq_len", [(2, 8), (2, 16), (4, 16), (4, 32), (8, 32)])
def test_token_index_is_megatrons_load_balanced_split(cp, seq_len):
    tokens = torch.arange(3 * seq_len).view(3, seq_len)
    covered = []
    for rank in range(cp):
        index = token_index(seq_len, cp, rank)
        assert torch.equal(tokens[:, index], megatron_cp_slice(tokens, cp, rank))
        covered.append(index)
    assert torch.equal(torch.cat(covered).sort().values, torch.arange(seq_len))  # each token on exactly one rank


def test_indivisible_length_is_refused_with_the_fix():
    with pytest.raises(ValueError, match=r"2 \* context_parallel_size = 4"):
        token_index(10, 2, 0)


def test_sequence_multiple():
    assert sequence_multiple() == 1
    assert sequence_multiple(tensor=2) == 1  # TP without sequence parallelism splits no sequence
    assert sequence_multiple(tensor=2, sequence_parallel=True) == 2
    assert sequence_multiple(context=2) == 4
    assert sequence_multiple(tensor=4, context=2, sequence_parallel=True) == 16


def test_split_without_context_parallelism_is_the_batch_itself():
    batch = {"input_ids": torch.zeros(2, 8, dtype=torch.long)}
    assert split_batch(batch, None) is batch


def _split_and_gather() -> dict:
    from megatron.core import parallel_state as ps

    from gspo_megatron.parallel.context import gather_sequence
    from gspo_megatron.train.update.batch import batch_for_model

    b, s = 3, 16
    g = torch.Generator().manual_seed(0)
    batch = {
        "input_ids": torch.randint(0, 100, (b, s), generator=g),
        "labels": torch.randint(0, 100, (b, s), generator=g),
        "loss_mask": torch.rand(b, s, generator=g) > 0.5,
        "old_logprobs": torch.randn(b, s, generator=g),
        "advantages": torch.randn(b, generator=g),  # per sequence: not split
        "old_routing": torch.randint(0, 4, (b, s, 4, 2), generator=g),  # recorded per rank: never split
    }
    local = batch_for_model(batch)
    return {
        "rank": ps.get_context_parallel_rank(),
        "local": local,
        "gathered": {k: gather_sequence(local[k], ps.get_context_parallel_group())
                     for k in ("input_ids", "loss_mask", "old_logprobs", "position_ids")},
        "batch": batch,
    }


def test_batch_for_model_splits_over_cp_ranks_and_gathers_back():
    results = run_on_ranks(_split_and_gather, 2, Layout(context=2))
    for r in results:
        batch, local, rank = r["batch"], r["local"], r["rank"]
        for key in ("input_ids", "labels", "loss_mask", "old_logprobs"):
            assert torch.equal(local[key], megatron_cp_slice(batch[key], 2, rank)), key
        # Positions are the tokens' places in the whole sequence (megatron slices RoPE the same way).
        assert torch.equal(local["position_ids"], megatron_cp_slice(torch.arange(16).expand(3, 16), 2, rank))
        assert torch.equal(local["advantages"], batch["advantages"])
        assert torch.equal(local["old_routing"], batch["old_routing"])
        for key in ("input_ids", "loss_mask", "old_logprobs"):
            assert torch.equal(r["gathered"][key], batch[key]), key
        assert torch.equal(r["gathered"]["position_ids"], torch.arange(16).expand(3, 16))


def thd_partitioned_indices(offsets: list[int], cp: int, rank: int) -> list[int]:
    """TransformerEngine's ``thd_get_partitioned_indices``, written out: per segment, megatron's split of it."""
    out = []
    for start, end in zip(offsets, offsets[1:]):
        segment = torch.arange(start, end).unsqueeze(0)
        out += megatron_cp_slice(segment, cp, rank)[0].tolist()
    return out


@pytest.mark.parametrize("cp", [2, 4])
def test_packed_rows_split_per_segment(cp, monkeypatch):
    """A packed row under CP: each segment (sequence, padded to 2*cp chunks) split as a sequence of its own; the
    per-sequence tensors take the same tokens, row by row; gathering the shares back restores every sequence."""
    from gspo_megatron.parallel import packing
    from gspo_megatron.parallel import context
    from gspo_megatron.parallel.context import packed_token_index, row_index, split_packed

    lengths = torch.tensor([5, 2 * cp, 1, 11])
    width = 16
    ids = torch.arange(1, 4 * width + 1).view(4, width)
    loss_mask = torch.arange(width).unsqueeze(0) < lengths.unsqueeze(1)
    batch = {"input_ids": ids, "labels": ids + 100, "loss_mask": loss_mask, "seq_lengths": lengths,
             "old_logprobs": ids.float(), "advantages": torch.tensor([1.0, 2.0, 3.0, 4.0])}
    row_length = packing.packed_length(lengths, 2 * cp, 2 * cp)
    packed = packing.pack(batch, row_length, segment_multiple=2 * cp)
    segments = packing.padded_lengths(lengths, 2 * cp)
    offsets = packed["cu_seqlens"].tolist()
    assert offsets[:5] == [0, *torch.cumsum(segments, 0).tolist()] and offsets[-1] == row_length
    assert packed["cu_seqlens_unpadded"].diff()[:4].tolist() == lengths.tolist()  # TE's cu_seqlens_q: own tokens
    for rank in range(cp):
        index = packed_token_index(packed["cu_seqlens"], cp, rank)
        assert index.tolist() == thd_partitioned_indices(offsets, cp, rank)
        monkeypatch.setattr(context, "_size_and_rank", lambda group: (cp, rank))  # no process group needed
        local = split_packed(packed, None)
        assert torch.equal(local["input_ids"], packed["input_ids"][:, index])
        # Unpacking the local row gives each sequence's share, as the per-sequence tensors hold it.
        unpacked = packing.unpack(local["input_ids"], local["unpack_index"])
        held = local["loss_mask"]
        assert torch.equal(unpacked[held], ids[torch.arange(4).unsqueeze(1).expand_as(held)[held],
                                               row_index(segments, width, cp, rank)[0][held]])
        assert torch.equal(local["old_logprobs"][held], unpacked[held].float())
        assert torch.equal(local["advantages"], batch["advantages"])
    # Every real token on exactly one rank.
    counts = torch.zeros(4, width, dtype=torch.long)
    for rank in range(cp):
        index, held = row_index(segments, width, cp, rank)
        rows = torch.arange(4).unsqueeze(1).expand_as(index)
        counts[rows[held], index[held]] += 1
    assert torch.equal(counts[loss_mask], torch.ones(int(loss_mask.sum()), dtype=torch.long))
