"""Run a function on N local ranks (spawned processes, gloo on CPU / NCCL on GPU) and collect results.

Tests and benchmarks use this to run real Megatron-Core under a parallel layout without torchrun::

    results = run_on_ranks(check_tp2, world_size=2, layout=Layout(tensor=2, sequence_parallel=True))

``fn`` must be importable (a module-level function). It runs after torch.distributed and Megatron's
process groups are up, and its return value (anything ``torch.save`` can write) comes back per rank.

Where the ranks come from (``GSPO_RANK_WORKERS``):
- ``fresh`` (the default): spawned processes, each a new interpreter. Start-up dominates (import torch, megatron-core
  and transformers: ~8 s for 2 ranks on 2 cores), so put many checks in one function and return them together.
- ``warm``: processes forked from a server that imported those once (multiprocessing's forkserver, ``WARM_IMPORTS``
  preloaded), so a call pays for the fork and its own process groups only. Each rank is still a new process that
  exits after its call: nothing a call leaves (process groups, threads, module state) reaches the next. It starts
  from the caller's environment as it is at the call. The test suite uses it (tests/conftest.py).
``fresh=True`` on a call forces spawned processes: for tests of the launch itself.
"""

from __future__ import annotations

import importlib
import os
import tempfile
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.multiprocessing as mp

from gspo_megatron.parallel.groups import Layout, free_port

# What the warm ranks' server imports once (a forked rank then finds them loaded).
WARM_IMPORTS = ["torch", "torch.distributed", "megatron.core", "megatron.core.models.gpt", "megatron.core.optimizer",
                "megatron.core.dist_checkpointing", "megatron.core.pipeline_parallel", "transformers",
                "transformers.models.qwen3_moe.modeling_qwen3_moe", "patches.megatron_cpu", "gspo_megatron.model",
                "gspo_megatron.parallel.groups"]
_warm_context = None  # the forkserver context, made on first use (its server starts with the first rank)

# Set by a rank's job when GSPO_RANK_PROBE names a probe (module:object with start() and stop()): each rank's
# stop() value of the calls made since the caller last cleared it. The test suite's conftest reads it to learn
# what a test did inside its ranks (whether it built a Megatron model); it is the caller's to clear.
probe_reports: list[Any] = []


class RankFailed(RuntimeError):
    """A rank raised, crashed or hung; the message carries that rank's traceback."""


def quiet_rank_warnings() -> None:
    """megatron-core warns about every missing GPU library at import, on every rank; the parent's test output
    should show failures, not N copies of those."""
    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


def run_job(rank, world_size, port, layout, seed, fn, args, kwargs, out_dir, threads, dist_timeouts, probe) -> bool:
    """One call on this rank: torch.distributed and Megatron's groups up, ``fn``, its result saved to
    ``out_dir/rank{rank}.pt``, the groups down. False after writing ``rank{rank}.err`` if anything raised."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(threads)
    out = Path(out_dir)
    try:
        from gspo_megatron.parallel import groups

        probe = load_probe(probe)
        if probe is not None:
            probe.start()
        groups.init_distributed(**(dist_timeouts or {}))
        if layout is not None:
            groups.init_model_parallel(layout, seed=seed)
        result = fn(*args, **kwargs)
        report = probe.stop() if probe is not None else None
        torch.save({"result": result, "probe": report}, out / f"rank{rank}.pt")
        groups.destroy()
        return True
    except BaseException:
        (out / f"rank{rank}.err").write_text(traceback.format_exc())
        return False


def load_probe(spec: str | None):
    if not spec:
        return None
    module, _, name = spec.partition(":")
    return getattr(importlib.import_module(module), name)


def _rank_main(env: dict | None, *job) -> None:
    quiet_rank_warnings()
    if env is not None:  # a forked rank: the caller's environment now, not its server's at its start
        os.environ.clear()
        os.environ.update(env)
    if not run_job(*job):
        raise SystemExit(1)


def warm_ranks() -> bool:
    """Whether calls get warm ranks (``GSPO_RANK_WORKERS=warm``)."""
    return os.environ.get("GSPO_RANK_WORKERS", "fresh") == "warm"


def context(warm: bool):
    """The multiprocessing context of fresh (spawn) or warm (forkserver, ``WARM_IMPORTS`` preloaded) processes."""
    global _warm_context
    if not warm:
        return mp.get_context("spawn")
    if _warm_context is None:
        _warm_context = mp.get_context("forkserver")
        _warm_context.set_forkserver_preload(WARM_IMPORTS)
    return _warm_context


def collect(out_dir: Path, world_size: int, exitcodes: list[int | None], timed_out: bool,
            killed: frozenset[int] = frozenset()) -> list[Any]:
    """Each rank's result from ``out_dir``; RankFailed naming the first rank that failed (its traceback), or the
    rank that exited or hung without one. ``killed``: the ranks we stopped after a peer failed (never the cause)."""
    errors = sorted(out_dir.glob("rank*.err"), key=lambda f: f.stat().st_mtime_ns)
    died = [] if timed_out else [r for r in range(world_size)  # (the ranks of a time-out are killed by us)
                                 if exitcodes[r] not in (None, 0) and r not in killed
                                 and not (out_dir / f"rank{r}.err").exists()]
    if died:
        # A rank that exited without a traceback (os._exit, a signal) is the cause: its peers fail on it after.
        others = sorted(int(e.stem.removeprefix("rank")) for e in errors)
        also = f" (then ranks {others} failed too)" if others else ""
        raise RankFailed(f"rank {died[0]} of {world_size} exited with code {exitcodes[died[0]]}{also}")
    if errors:
        # The first rank to fail is the cause; its peers then fail on closed connections.
        first = int(errors[0].stem.removeprefix("rank"))
        others = sorted(int(e.stem.removeprefix("rank")) for e in errors[1:])
        also = f" (then ranks {others} failed too)" if others else ""
        raise RankFailed(f"rank {first} of {world_size} failed{also}:\n{errors[0].read_text()}")
    for rank in range(world_size):
        if not (out_dir / f"rank{rank}.pt").exists() or exitcodes[rank] not in (None, 0):
            reason = "timed out" if timed_out else f"exited with code {exitcodes[rank]}"
            raise RankFailed(f"rank {rank} of {world_size} {reason} after its peers stopped or hung")
    saved = [torch.load(out_dir / f"rank{rank}.pt", weights_only=False) for rank in range(world_size)]
    probe_reports.extend(s["probe"] for s in saved if s["probe"] is not None)
    return [s["result"] for s in saved]


def run_on_ranks(
    fn: Callable[..., Any],
    world_size: int,
    layout: Layout | None = Layout(),
    *args,
    seed: int = 1234,
    timeout: float = 600.0,
    dist_timeouts: dict | None = None,
    fresh: bool = False,
    **kwargs,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks under ``layout``; return each rank's result.

    ``layout=None`` starts torch.distributed only (no Megatron groups). ``dist_timeouts``: ``timeout_s`` /
    ``control_timeout_s`` for ``groups.init_distributed`` (torch's defaults if None). Raises ``RankFailed`` naming the
    first failing rank with its traceback, or after ``timeout`` seconds if a rank hangs (the others are
    then killed, so a deadlocked collective cannot hang the test session). ``fresh``: new processes even when
    ``GSPO_RANK_WORKERS=warm`` (see the module docstring).
    """
    threads = max(1, (os.cpu_count() or 1) // world_size)
    probe = os.environ.get("GSPO_RANK_PROBE")
    warm = not fresh and warm_ranks()
    ctx = context(warm)
    env = dict(os.environ) if warm else None
    with tempfile.TemporaryDirectory(prefix="gspo_ranks_") as out_dir:
        port = free_port()
        procs = [
            ctx.Process(target=_rank_main, daemon=False,
                        args=(env, rank, world_size, port, layout, seed, fn, args, kwargs, out_dir, threads,
                              dist_timeouts, probe))
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
            # A rank that failed leaves its peers blocked in a collective: stop them all (and remember which, so
            # that a peer killed before it wrote its own error is not taken for the cause).
            killed = frozenset(r for r, p in enumerate(procs) if p.is_alive())
            for r in killed:
                procs[r].kill()
            for p in procs:
                p.join()
        return collect(Path(out_dir), world_size, [p.exitcode for p in procs], time.monotonic() > deadline, killed)
