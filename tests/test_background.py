"""tests/background.py: a registered command starts once its test is collected, its test takes it, and one nobody
took is stopped with its whole process group at the session's end."""

from __future__ import annotations

import sys
import time

import psutil

from tests import background
from tests.background import BackgroundRun

SLEEPER = [sys.executable, "-c", "import subprocess, sys, time; "
           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); print('{work}', flush=True); "
           "time.sleep(600)"]


class _Item:
    def __init__(self, nodeid):
        self.nodeid = nodeid


def test_collected_commands_start_are_taken_once_and_the_rest_are_stopped(monkeypatch):
    monkeypatch.setattr(background, "_registered", {})
    monkeypatch.setattr(background, "_running", {})
    monkeypatch.delenv("GSPO_BACKGROUND", raising=False)
    background.register("a::taken", lambda nice: BackgroundRun("a", [sys.executable, "-c", "print('{work}')"], None,
                                                                nice, 60), nice=5)
    background.register("b::left", lambda nice: BackgroundRun("b", SLEEPER, None, nice, 60), nice=5)
    background.register("c::not_collected", lambda nice: BackgroundRun("c", SLEEPER, None, nice, 60), nice=0)
    background.start_collected([_Item("a::taken"), _Item("b::left"), _Item("x::plain")])
    assert set(background._running) == {"a::taken", "b::left"}
    assert background.is_background("c::not_collected") and not background.is_background("x::plain")

    taken = background.take("a::taken")
    assert background.take("a::taken") is None  # the test owns it now
    status, output = taken.wait(say=lambda line: None)
    assert status == 0 and output.strip() == str(taken.work)  # {work} is its own directory
    taken.remove()
    assert not taken.work.exists()

    left = background._running["b::left"]
    time.sleep(1.0)
    group = [left.proc.pid] + [c.pid for c in psutil.Process(left.proc.pid).children(recursive=True)]
    assert len(group) >= 2 and psutil.Process(left.proc.pid).nice() == psutil.Process().nice() + 5  # below the main run
    background.stop_all()
    assert not background._running and not left.work.exists()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"
                                              for p in group):
        time.sleep(0.1)
    assert not [p for p in group if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def test_inline_starts_nothing(monkeypatch):
    monkeypatch.setattr(background, "_registered", {})
    monkeypatch.setattr(background, "_running", {})
    monkeypatch.setenv("GSPO_BACKGROUND", "inline")
    background.register("a::t", lambda nice: BackgroundRun("a", SLEEPER, None, nice, 60), nice=0)
    background.start_collected([_Item("a::t")])
    assert background.take("a::t") is None
