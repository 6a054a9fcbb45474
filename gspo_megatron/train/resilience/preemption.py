"""Preemption: SIGTERM, SIGUSR1 or Ctrl-C stops the run at the next step boundary, every rank at the same step, saved.

A scheduler about to take the machines signals the job (SLURM: SIGTERM at the end of the time limit, or
``--signal=USR1@120`` ahead of it; Kubernetes: SIGTERM on eviction); a user presses Ctrl-C (SIGINT to the process
group). ``install`` (the CLI calls it before anything starts) makes the first such signal only set a flag; the loop
asks ``stop_agreed`` once per step, after the update, the weight sync and the eval, and the flag is max-reduced over
the control group (gloo, one small all-reduce), so a signal that reached one rank stops all of them after the same step. They then save a checkpoint
of that step (``latest``), stop the servers and exit 0; ``--resume`` continues exactly as if nothing had happened
(the step's weights, optimizer, RNG and data position are in the checkpoint). A second signal on the same rank
exits at once (``SystemExit``: the loop's ``finally`` still stops the servers it launched; SGLang servers run in
sessions of their own and reward workers ignore these signals, so Ctrl-C reaches only the trainer).

Two ways a second Ctrl-C used to hang the run instead (both while megatron's async checkpoint writer forks its
workers): a forked child inherits this handler, so a worker got the second SIGINT, exited, and the trainer waited on
its queue forever; and a signal handled inside a fork callback raises its ``SystemExit`` where Python only prints
it ("Exception ignored in ..."), so the trainer went on. Forked children now ignore these signals (the trainer decides;
a writer finishes its piece), and a swallowed exit is delivered again.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import torch
import torch.distributed as dist

from gspo_megatron.parallel import control

SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
_requested: int | None = None  # the signal this rank got first
_hooks_installed = False


def describe(signum: int) -> str:
    return "Ctrl-C (SIGINT)" if signum == signal.SIGINT else signal.Signals(signum).name


def _handler(signum, frame) -> None:
    global _requested
    if _requested is not None:  # the second: the caller wants out now
        print(f"gspo-megatron: {describe(signum)} again: stopping now, without saving this step", file=sys.stderr,
              flush=True)
        sys.exit(128 + signum)
    _requested = signum
    again = "press Ctrl-C again" if signum == signal.SIGINT else "send it again"
    print(f"\ngspo-megatron: {describe(signum)}: finishing this step, then saving a checkpoint and stopping "
          f"({again} to stop at once)", file=sys.stderr, flush=True)


def _forked_child_ignores_stops() -> None:
    for number in SIGNALS:
        signal.signal(number, signal.SIG_IGN)


def _deliver_swallowed_exit_again(unraisable, previous=sys.unraisablehook) -> None:
    """A second signal's ``SystemExit`` raised where Python cannot raise (a fork callback, ``__del__``) is only
    printed; send the signal again once the main thread is out of there (a moment later, from another thread: raised
    from this hook, it would be swallowed too), so the handler raises it where it propagates."""
    previous(unraisable)
    exit_code = getattr(unraisable.exc_value, "code", None)
    if (_requested is not None and isinstance(unraisable.exc_value, SystemExit) and isinstance(exit_code, int)
            and exit_code - 128 in SIGNALS):
        threading.Timer(0.05, os.kill, (os.getpid(), exit_code - 128)).start()


def install() -> None:
    """Catch SIGTERM, SIGUSR1 and SIGINT (Ctrl-C: a terminal sends it to the whole process group, every rank) in this
    process from now on (main thread only). A SIGINT this process was started ignoring (a background job: ``&`` in a
    script, nohup) stays ignored. Children this process forks ignore all three."""
    global _hooks_installed
    for number in SIGNALS:
        if number == signal.SIGINT and signal.getsignal(number) == signal.SIG_IGN:
            continue
        signal.signal(number, _handler)
    if not _hooks_installed:
        os.register_at_fork(after_in_child=_forked_child_ignores_stops)
        sys.unraisablehook = _deliver_swallowed_exit_again
        _hooks_installed = True


def requested() -> int | None:
    """The signal this rank got, if any (this rank only; ``stop_agreed`` is what the loop asks)."""
    return _requested


def stop_agreed() -> bool:
    """True on every rank if any rank got a stop signal (collective over the control group)."""
    flag = torch.tensor([float(_requested is not None)])
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=control.group())
    return bool(flag.item())


def reset() -> None:
    """Forget a caught signal (tests; a process that trains again)."""
    global _requested
    _requested = None
