"""Self-contained commands that run beside the test session instead of inside its sequence.

A test whose work is one long child process (the megatron-core 0.19 run, the soak) registers it here
(``register``); tests/conftest.py starts every registered command whose test was collected as soon as collection
ends, and orders those tests last, where each waits for its command (``take(...).wait()``) and asserts on its
output as it would on a run of its own. The main run spends much of its time waiting (for servers to start,
time-outs to fire, a rank to restart): the background commands fill those gaps on the 2 cores instead of adding
their minutes after them. Each runs at a lower CPU priority (its ``nice``), so the main run's timed waits keep the
CPU first, and in a process group of its own, so that a run nobody waited for (``-x``, Ctrl-C) is stopped with its
ranks and servers at the session's end (``stop_all``). ``GSPO_BACKGROUND=inline`` runs each in its test instead.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]


class BackgroundRun:
    """A command as a child process in its own temporary directory (``work``; ``{work}`` in the command names it),
    its output going to a file there."""

    def __init__(self, name: str, command: list[str], env: dict[str, str] | None, nice: int, timeout_s: float):
        self.name, self.timeout_s = name, timeout_s
        self.work = Path(tempfile.mkdtemp(prefix="gspo_background_"))
        self.log = self.work / "output.txt"
        self.command = command = [part.replace("{work}", str(self.work)) for part in command]
        with open(self.log, "w") as out:  # a file, not a pipe: nobody reads it until the end
            self.proc = subprocess.Popen(["nice", "-n", str(nice), *command] if nice else command, cwd=ROOT,
                                         env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         process_group=0)
        self.started = time.monotonic()

    def wait(self, say: Callable[[str], None] = print) -> tuple[int | None, str]:
        """(exit status, output); status None if it ran past ``timeout_s`` from its start (it is then stopped).
        ``say`` hears what it waits for, if it has to wait."""
        if self.proc.poll() is None:
            say(f"[{self.name}] waiting for its run, started {self.elapsed():.0f} s ago (output: {self.log})")
        try:
            status = self.proc.wait(timeout=max(self.timeout_s - self.elapsed(), 1))
        except subprocess.TimeoutExpired:
            self.stop()
            status = None
        return status, self.log.read_text(errors="replace")

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def remove(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


_registered: dict[str, tuple[Callable[[int], BackgroundRun | None], int]] = {}  # node id -> (start, nice)
_running: dict[str, BackgroundRun] = {}


def register(node_id: str, start: Callable[[int], BackgroundRun | None], nice: int) -> None:
    """``start(nice)`` launches the command of the test ``node_id`` (None: it cannot run here; its test says why)."""
    _registered[node_id] = (start, nice)


def is_background(node_id: str) -> bool:
    return node_id in _registered


def inline() -> bool:
    return os.environ.get("GSPO_BACKGROUND", "on") == "inline"


def start_collected(items) -> None:
    """tests/conftest.py, once the session's tests are known: start the registered commands of those tests."""
    if inline():
        return
    collected = {item.nodeid for item in items}
    for node_id, (start, nice) in _registered.items():
        if node_id in collected and node_id not in _running:
            run = start(nice)
            if run is not None:
                _running[node_id] = run


def take(node_id: str) -> BackgroundRun | None:
    """The command started for ``node_id`` at collection (the test then owns it), or None: start it in the test."""
    return _running.pop(node_id, None)


def stop_all() -> None:
    """tests/conftest.py at the session's end: runs no test waited for are stopped."""
    for run in _running.values():
        run.stop()
        run.remove()
    _running.clear()
