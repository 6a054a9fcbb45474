"""The multi-rank harness: results come back per rank; a failing or hung rank is reported, never hangs."""

from __future__ import annotations

import os
import time

import pytest
import torch

from gspo_megatron.parallel.launch import RankFailed, collect, run_on_ranks


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


# The launch itself is under test here: fresh processes (as the score tool runs them) unless a test says warm.

def test_results_per_rank():
    results = run_on_ranks(_rank_and_sum, 2, None, fresh=True)
    assert results == [{"rank": r, "world": 2, "sum": 3.0} for r in range(2)]


def test_failing_rank_is_named_with_its_traceback():
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2 failed.*ValueError: boom on purpose"):
        run_on_ranks(_rank1_raises_rank0_waits, 2, None, timeout=60, fresh=True)


@pytest.mark.parametrize("fresh", [True, False])
def test_hung_ranks_time_out(fresh):
    start = time.monotonic()
    with pytest.raises(RankFailed, match="timed out"):
        run_on_ranks(_everyone_sleeps, 2, None, timeout=8, fresh=fresh)
    assert time.monotonic() - start < 40


def _job_state(key: str):
    """What a call's rank starts from: the caller's environment, default dtype and grad mode."""
    seen = (os.environ.get(key), torch.get_default_dtype(), torch.is_grad_enabled(), os.getpid())
    os.environ[key] = "left behind by this call"  # none of this may reach the next call
    torch.set_default_dtype(torch.float64)
    torch.set_grad_enabled(False)
    return seen


def _rank_exits():
    if torch.distributed.get_rank() == 1:
        os._exit(3)
    torch.distributed.barrier()


@pytest.mark.parametrize("workers", ["warm", "fresh"])
def test_calls_start_as_fresh_processes_would(workers, monkeypatch):
    """A warm rank (forked from the preloading server) starts as a spawned one does: from the caller's environment as it
    is at the call, float32, grad mode on, in a process of its own, whatever the previous call left."""
    monkeypatch.setenv("GSPO_RANK_WORKERS", workers)
    monkeypatch.setenv("GSPO_TEST_KEY", "first")
    first = run_on_ranks(_job_state, 2, None, "GSPO_TEST_KEY")
    monkeypatch.setenv("GSPO_TEST_KEY", "second")
    second = run_on_ranks(_job_state, 2, None, "GSPO_TEST_KEY")
    assert [s[0] for s in first] == ["first"] * 2 and [s[0] for s in second] == ["second"] * 2
    assert all(s[1:3] == (torch.float32, True) for s in first + second)
    assert len({s[3] for s in first + second} | {os.getpid()}) == 5


def test_warm_ranks_report_a_failed_or_dead_rank_and_go_on(monkeypatch):
    """On warm ranks a rank that raises or exits is named as on spawned ones, and the next call works."""
    monkeypatch.setenv("GSPO_RANK_WORKERS", "warm")
    with pytest.raises(RankFailed, match=r"(?s)rank 1 of 2 failed.*ValueError: boom on purpose"):
        run_on_ranks(_rank1_raises_rank0_waits, 2, None, timeout=60)
    assert run_on_ranks(_rank_and_sum, 2, None) == [{"rank": r, "world": 2, "sum": 3.0} for r in range(2)]
    with pytest.raises(RankFailed, match="rank 1 of 2 exited with code 3"):
        run_on_ranks(_rank_exits, 2, None, timeout=60)
    assert run_on_ranks(_rank_and_sum, 2, None) == [{"rank": r, "world": 2, "sum": 3.0} for r in range(2)]


def test_a_peer_killed_before_it_wrote_its_error_is_not_the_cause(tmp_path):
    """Under load the launcher can see rank 1's exit and kill rank 0 (-9) before rank 0 fails on the closed
    connection: the rank that died on its own is named, not the one we killed (CI once named rank 0)."""
    with pytest.raises(RankFailed, match=r"^rank 1 of 2 exited with code 3$"):
        collect(tmp_path, 2, [-9, 3], timed_out=False, killed=frozenset({0}))
    with pytest.raises(RankFailed, match=r"^rank 0 of 2 exited with code -9$"):  # a rank killed by something else
        collect(tmp_path, 2, [-9, None], timed_out=False)


def _groups_made_again_with_rank1_slow():
    """Tear the call's groups down, then make them again with rank 1 slow to finish each step: when does each rank
    come back from making them?"""
    from megatron.core import parallel_state

    from gspo_megatron.parallel import control, groups
    from gspo_megatron.parallel.groups import Layout, free_port

    rank = torch.distributed.get_rank()
    port = control.broadcast_from_rank0(free_port())
    groups.destroy()
    os.environ["MASTER_PORT"] = str(port)
    finished = {}

    def slow_on_rank1(step, name):
        def wrapped(*args, **kwargs):
            out = step(*args, **kwargs)
            if rank == 1:
                time.sleep(1.5)  # its handshakes still going on
            finished[name] = time.monotonic()  # (system-wide on Linux: comparable between the ranks)
            return out
        return wrapped

    control.init = slow_on_rank1(control.init, "control")
    parallel_state.initialize_model_parallel = slow_on_rank1(parallel_state.initialize_model_parallel, "megatron")
    groups.init_distributed()
    returned = {"control": time.monotonic()}
    groups.init_model_parallel(Layout(tensor=2))
    returned["megatron"] = time.monotonic()
    return finished, returned


def test_no_rank_returns_with_its_groups_before_every_rank_has_made_them(monkeypatch):
    """A rank back from making its groups may tear them down at once (a job with no collective, a refused input):
    had a peer not finished its own, its gloo handshake failed ("connectFullMesh failed ... Connection closed by
    peer", CI). So each rank returns from init_distributed and init_model_parallel only after rank 1, slow on
    purpose, has finished making them."""
    monkeypatch.setenv("GSPO_RANK_WORKERS", "warm")
    (_, rank0_returned), (rank1_finished, _) = run_on_ranks(_groups_made_again_with_rank1_slow, 2, None)
    for step in ("control", "megatron"):
        assert rank0_returned[step] >= rank1_finished[step], step


def test_free_ports_come_from_below_the_ephemeral_range_and_are_free(monkeypatch):
    """Outgoing connections take their local ports from ip_local_port_range: a port picked there can be gone before
    its owner binds it (CI on 65b8972: torchrun's store, EADDRINUSE). free_port picks below that range, a port free
    on every address, and not the same sequence in two processes seeded alike."""
    import random
    import socket

    from gspo_megatron.parallel import groups

    low = groups._ephemeral_low()
    ports = [groups.free_port() for _ in range(50)]
    assert all(1024 <= p < low for p in ports), (low, ports)
    assert len(set(ports)) > 40, ports  # spread over the range, not one port again and again
    picks = set()
    for _ in range(3):  # every rank seeds the module RNG alike: the picks must not follow it
        random.seed(0)
        picks.add(groups.free_port())
    assert len(picks) > 1, picks
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", ports[0]))  # bound on the loopback only, as a server or store binds it
        offered = iter(ports[:2])
        monkeypatch.setattr(groups._PICKER, "randrange", lambda low, high: next(offered))
        assert groups.free_port() == ports[1]  # the taken one is passed over
