"""Whether processes still run, for tests that stop or kill them (a zombie has ended: only its parent's wait is
missing)."""

from __future__ import annotations

import os
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


def in_session(session: int) -> list[int]:
    """The processes of session ``session`` (a process started with ``start_new_session=True`` leads one, its pid):
    its descendants, those whose parent died included, unless they started a session of their own."""
    pids = []
    for pid in psutil.pids():
        try:
            if os.getsid(pid) == session:
                pids.append(pid)
        except OSError:
            continue
    return pids
