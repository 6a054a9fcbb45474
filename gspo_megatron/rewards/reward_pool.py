"""Reward calls in worker processes, each with a time limit: a reward that hangs or crashes never stalls a step.

    pool = RewardPool("math", workers=2, timeout_s=30)
    pool.map([(prompt, response, label), ...]) -> [(value, None) or (None, "timed out after 30 s ..."), ...]

Each worker (a process forked from multiprocessing's fork server, which imported the rewards once) loads the
reward by its spec (``load_reward_fn``: a built-in name or ``module:function``) and takes one call at a time. A call
that runs past ``timeout_s`` gets its worker killed (SIGKILL; a sandboxed program it started dies with it) and a
fresh worker takes the worker's place; a worker that exits mid-call (a segfault, ``os._exit``, the OOM killer) is
replaced the same way. Both come back as a problem string, which ``rewards.score`` always masks (the response, not
the reward's code, is usually what hangs a verifier); an exception the function raises comes back as a problem too,
handled as ``on_error`` says. Workers start on the first ``map`` (only the rank that scores has any), ignore
SIGTERM/SIGINT/SIGUSR1 (the trainer's to handle: train.resilience.preemption) and end with the trainer (``close`` at its exit,
or PR_SET_PDEATHSIG if it dies). The worst case of one ``map`` is ceil(calls / workers) x ``timeout_s``.
"""

from __future__ import annotations

import multiprocessing as mp
import multiprocessing.util as mp_util
import time
from collections import deque
from multiprocessing.connection import wait

from .rewards import PooledReward

STARTUP_S = 300.0  # a worker's start (the fork server's imports, loading the reward)
MAX_START_FAILURES = 8  # workers that die before they are ready (each is replaced) before the pool gives up


def _serve(spec: str, builtin: str, conn) -> None:
    """A worker: (index, args) in, (index, value, problem) out, until None or the trainer's end."""
    import ctypes
    import signal

    from . import rewards

    # A scheduler's SIGTERM (or Ctrl-C's SIGINT) reaching the whole process group is the trainer's to handle (it
    # finishes its step, which may still need rewards); a worker dies with the trainer instead (PR_SET_PDEATHSIG),
    # or is killed by ``RewardPool.close`` (at the trainer's exit).
    for number in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):
        signal.signal(number, signal.SIG_IGN)
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)

    try:
        fn = rewards.load_reward_fn(spec, getattr(rewards, builtin))
    except BaseException as e:
        conn.send(("error", f"{type(e).__name__}: {e}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # the trainer has gone
            return
        if message is None:
            return
        index, args = message
        try:
            value = fn(*args)
            value = float(value) if hasattr(value, "__float__") and not isinstance(value, str) else value
            conn.send((index, value, None))
        except BaseException as e:  # a user function may raise anything: report it with the sample
            conn.send((index, None, f"raised {type(e).__name__}: {e}"))


class _Worker:
    def __init__(self, ctx, spec: str, builtin: str):
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(spec, builtin, child), daemon=True)
        self.process.start()
        child.close()
        self.ready = False  # once it has loaded the reward (its imports do not count against a call's limit)
        self.task: tuple[int, float] | None = None  # (call index, start time)

    def started(self, spec: str) -> bool:
        """Take the worker's first message: True when ready, False when it died first; a reward it could not load
        is an error."""
        try:
            kind, detail = self.conn.recv()
        except (EOFError, OSError):
            return False
        if kind != "ready":
            raise ValueError(f"reward {spec!r}: a reward worker could not load it: {detail}")
        self.ready = True
        return True

    def kill(self) -> None:
        self.process.kill()
        self.process.join()
        self.conn.close()


class RewardPool(PooledReward):
    def __init__(self, spec: str, workers: int, timeout_s: float, builtin: str = "BUILTIN"):
        if workers < 1 or not timeout_s > 0:
            raise ValueError(f"RewardPool needs workers >= 1 and timeout_s > 0, got {workers}, {timeout_s}")
        self.spec, self.builtin, self.size, self.timeout_s = spec, builtin, workers, timeout_s
        # Workers fork from a clean server process that imported the rewards once (a spawned worker would import
        # torch and the rest again: seconds each, and again for every replacement).
        self._ctx = mp.get_context("forkserver")
        # The math reward's math-verify too (its import and warm-up, ~3 s, then paid once, not per worker).
        self._ctx.set_forkserver_preload(["gspo_megatron.rewards.rewards"]
                                         + (["gspo_megatron.rewards.math_answer"] if spec == "math" else []))
        self._workers: list[_Worker] = []
        self._start_failures = 0
        self._at_exit = None

    @property
    def name(self) -> str:
        return self.spec

    def map(self, calls: list[tuple]) -> list[tuple]:
        """(value, None) or (None, problem) per call, in order."""
        if not self._workers and self._at_exit is None:
            # Before multiprocessing's exit handler terminates daemonic children (SIGTERM: the workers ignore it) and
            # joins them forever: a finalizer with a priority runs first, at a process's exit (atexit in a main
            # process, multiprocessing's own bootstrap in a child such as a rank of ``parallel.launch``).
            self._at_exit = mp_util.Finalize(None, self.close, exitpriority=100)
        while len(self._workers) < self.size:
            self._workers.append(_Worker(self._ctx, self.spec, self.builtin))
        pending, results = deque(enumerate(calls)), [None] * len(calls)
        while pending or any(w.task for w in self._workers):
            for worker in self._workers:
                if worker.ready and worker.task is None and pending:
                    index, args = pending.popleft()
                    try:
                        worker.conn.send((index, args))
                    except OSError:  # it died while idle: the call goes to its replacement
                        pending.appendleft((index, args))
                        self._replace(worker)
                        continue
                    worker.task = (index, time.monotonic())
            busy = [w for w in self._workers if w.task]
            starting = [w for w in self._workers if not w.ready]
            timeout = min(w.task[1] for w in busy) + self.timeout_s - time.monotonic() if busy else STARTUP_S
            ready = wait([w.conn for w in busy + starting], timeout=max(0.0, timeout))
            for worker in starting:
                if worker.conn in ready and not worker.started(self.spec):
                    self._start_failures += 1
                    if self._start_failures > MAX_START_FAILURES:
                        raise RuntimeError(f"reward {self.spec!r}: {self._start_failures} reward workers died while "
                                           f"starting (last exit code {worker.process.exitcode})")
                    self._replace(worker)
            if not busy and not ready:
                raise RuntimeError(f"reward {self.spec!r}: no reward worker started within {STARTUP_S} s")
            for worker in busy:
                index, started = worker.task
                if worker.conn in ready:
                    try:
                        got, value, problem = worker.conn.recv()
                        results[got] = (value, problem)
                        worker.task = None
                        continue
                    except (EOFError, OSError):
                        worker.process.join(1)
                        results[index] = (None, f"crashed (its worker process exited with code "
                                                f"{worker.process.exitcode})")
                elif time.monotonic() - started >= self.timeout_s:
                    results[index] = (None, f"timed out after {self.timeout_s:g} s (data.reward_timeout_s)")
                else:
                    continue
                self._replace(worker)
        return results

    def _replace(self, worker: _Worker) -> None:
        worker.kill()
        self._workers[self._workers.index(worker)] = _Worker(self._ctx, self.spec, self.builtin)

    def close(self) -> None:
        """Stop the workers (SIGKILL: they ignore SIGTERM, and a call in progress is not worth waiting for)."""
        for worker in self._workers:
            worker.kill()
        self._workers = []
        if self._at_exit is not None:
            self._at_exit.cancel()
            self._at_exit = None
