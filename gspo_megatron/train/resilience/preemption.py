"""Preemption: SIGTERM or SIGUSR1 stops the run at the next step boundary, every rank at the same step, saved.

A scheduler about to take the machines signals the job (SLURM: SIGTERM at the end of the time limit, or
``--signal=USR1@120`` ahead of it; Kubernetes: SIGTERM on eviction). ``install`` (the CLI calls it before anything
starts) makes the first SIGTERM or SIGUSR1 only set a flag; the loop asks ``stop_agreed`` once per step, after the
update, the weight sync and the eval, and the flag is max-reduced over the control group (gloo, one small
all-reduce), so a signal that reached one rank stops all of them after the same step. They then save a checkpoint
of that step (``latest``), stop the servers and exit 0; ``--resume`` continues exactly as if nothing had happened
(the step's weights, optimizer, RNG and data position are in the checkpoint). A second signal on the same rank
exits at once, as before (``SystemExit``: the loop's ``finally`` still stops the servers it launched).
"""

from __future__ import annotations

import signal
import sys

import torch
import torch.distributed as dist

from gspo_megatron.parallel import control

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
_requested: int | None = None  # the signal this rank got first


def _handler(signum, frame) -> None:
    global _requested
    if _requested is not None:  # the second: the caller wants out now
        sys.exit(128 + signum)
    _requested = signum
    print(f"gspo-megatron: {signal.Signals(signum).name}: stopping after this step with a checkpoint "
          "(send it again to stop at once)", file=sys.stderr, flush=True)


def install() -> None:
    """Catch SIGTERM and SIGUSR1 in this process from now on (main thread only)."""
    for number in SIGNALS:
        signal.signal(number, _handler)


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
