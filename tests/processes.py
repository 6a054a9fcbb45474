"""Whether processes still run, for tests that stop or kill them (a zombie has ended: only its parent's wait is
missing)."""

from __future__ import annotations

import time

import psutil


def running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def still_running(pids, seconds: float) -> list[int]:
    """Those of ``pids`` still running after waiting up to ``seconds`` for all of them to end."""
    deadline = time.monotonic() + seconds
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if running(p)]
