"""Run a function on N local ranks (spawned processes, gloo on CPU / NCCL on GPU) and collect results.

Tests and benchmarks use this to run real Megatron-Core under a parallel layout without torchrun::

    results = run_on_ranks(check_tp2, world_size=2, layout=Layout(tensor=2, sequence_parallel=True))

``fn`` must be importable (a module-level function). It runs after torch.distributed and Megatron's
process groups are up, and its return value (anything ``torch.save`` can write) comes back per rank.
Start-up dominates (import megatron + process groups: ~10 s for 2 ranks on 2 cores), so put many checks in
one function and return them together.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from gspo_megatron.parallel.groups import Layout


class RankFailed(RuntimeError):
    """A rank raised, crashed or hung; the message carries that rank's traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world_size, port, layout, seed, fn, args, kwargs, out_dir, threads, dist_timeouts):
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    torch.set_num_threads(threads)
    # megatron-core warns about every missing GPU library at import, on every rank; the parent's test
    # output should show failures, not N copies of those.
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    out = Path(out_dir)
    try:
        from gspo_megatron.parallel import groups

        groups.init_distributed(**(dist_timeouts or {}))
        if layout is not None:
            groups.init_model_parallel(layout, seed=seed)
        result = fn(*args, **kwargs)
        torch.save(result, out / f"rank{rank}.pt")
        groups.destroy()
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        raise SystemExit(1)


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    layout: Layout | None = Layout(),
    *args,
    seed: int = 1234,
    timeout: float = 600.0,
    dist_timeouts: dict | None = None,
    **kwargs,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks under ``layout``; return each rank's result.

    ``layout=None`` starts torch.distributed only (no Megatron groups). ``dist_timeouts``: ``timeout_s`` /
    ``control_timeout_s`` for ``groups.init_distributed`` (torch's defaults if None). Raises ``RankFailed`` naming the
    first failing rank with its traceback, or after ``timeout`` seconds if a rank hangs (the others are
    then killed, so a deadlocked collective cannot hang the test session).
    """
    ctx = mp.get_context("spawn")
    threads = max(1, (os.cpu_count() or 1) // world_size)
    with tempfile.TemporaryDirectory(prefix="gspo_ranks_") as out_dir:
        port = free_port()
        procs = [
            ctx.Process(
                target=_worker,
                args=(rank, world_size, port, layout, seed, fn, args, kwargs, out_dir, threads, dist_timeouts),
                daemon=False,
            )
            for rank in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in procs):
                failed = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        finally:
            # A rank that failed leaves its peers blocked in a collective: stop them all.
            for p in procs:
                if p.is_alive():
                    p.kill()
            for p in procs:
                p.join()
        out = Path(out_dir)
        errors = sorted(out.glob("rank*.err"), key=lambda f: f.stat().st_mtime_ns)
        if errors:
            # The first rank to fail is the cause; its peers then fail on closed connections.
            first = int(errors[0].stem.removeprefix("rank"))
            others = sorted(int(e.stem.removeprefix("rank")) for e in errors[1:])
            also = f" (then ranks {others} failed too)" if others else ""
            raise RankFailed(f"rank {first} of {world_size} failed{also}:\n{errors[0].read_text()}")
        for rank, p in enumerate(procs):
            if p.exitcode != 0:
                reason = "timed out" if time.monotonic() > deadline else f"exited with code {p.exitcode}"
                raise RankFailed(f"rank {rank} of {world_size} {reason} after its peers stopped or hung")
        return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
