"""The multi-rank harness: results come back per rank; a failing or hung rank is reported, never hangs."""

from __future__ import annotations

import time

import pytest
import torch

from gspo_megatron.parallel.launch import RankFailed, run_on_ranks


def _rank_and_sum():
    rank = torch.distributed.get_rank()
    t = torch.tensor([float(rank + 1)])
    torch.distributed.all_reduce(t)
    return {"rank": rank, "world": torch.distributed.get_world_size(), "sum": t.item()}


def _rank1_raises_rank0_waits():
    if torch.distributed.get_rank() == 1:
        raise ValueError("boom on purpose")
    torch.distributed.barrier()  # would wait forever for rank 1


def _everyone_sleeps():
    time.sleep(60)


def test_results_per_rank():
    results = run_on_ranks(_rank_and_sum, 2, None)
    assert results == [{"rank": r, "world": 2, "sum": 3.0} for r in range(2)]


def test_failing_rank_is_named_with_its_traceback():
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2 failed.*ValueError: boom on purpose"):
        run_on_ranks(_rank1_raises_rank0_waits, 2, None, timeout=60)


def test_hung_ranks_time_out():
    start = time.monotonic()
    with pytest.raises(RankFailed, match="timed out"):
        run_on_ranks(_everyone_sleeps, 2, None, timeout=8)
    assert time.monotonic() - start < 40
