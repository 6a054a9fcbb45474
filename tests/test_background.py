"""tests/background.py: a registered command starts once its test is collected, its test takes it, and one nobody
took is stopped with its whole process group at the session's end."""

from __future__ import annotations

import sys
import time

import psutil

from tests import background
from tests.background import BackgroundRun
from tests.processes import still_running

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
    assert len(group) >= 2 and psutil.Process(left.proc.pid).nice() == 5  # below the main run
    background.stop_all()
    assert not background._running and not left.work.exists()
    assert not still_running(group, seconds=10)


def test_inline_starts_nothing(monkeypatch):
    monkeypatch.setattr(background, "_registered", {})
    monkeypatch.setattr(background, "_running", {})
    monkeypatch.setenv("GSPO_BACKGROUND", "inline")
    background.register("a::t", lambda nice: BackgroundRun("a", SLEEPER, None, nice, 60), nice=0)
    background.start_collected([_Item("a::t")])
    assert background.take("a::t") is None


def test_marked_tests_run_in_the_side_session_and_report_their_own_outcomes(tmp_path):
    """tests/beside.py through a real pytest session: the marked tests of tests/beside_examples.py run in a second
    session (another process) and each is reported under its own node id in the main one: passed with its output,
    failed with its assertion message, skipped with its reason; the unmarked test runs in the main session."""
    import os
    import re
    import subprocess

    env = {k: v for k, v in os.environ.items() if k not in ("GSPO_BACKGROUND", "GSPO_BESIDE_SESSION",
                                                            "GSPO_BESIDE_REPORT", "PYTEST_ADDOPTS")}
    env["COLUMNS"] = "300"  # the short summary lines whole
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", "-q",
                          f"--basetemp={tmp_path}", "tests/beside_examples.py"], cwd=background.ROOT, env=env,
                         capture_output=True, text=True, timeout=300)
    text = out.stdout
    assert out.returncode == 1, text[-3000:]  # one test fails
    example = "tests/beside_examples.py::"
    assert re.search(rf"^PASSED {example}test_passes_in_the_side_session$", text, re.M), text[-3000:]
    assert re.search(rf"^FAILED {example}test_fails_in_the_side_session - .*arithmetic in the side session", text,
                     re.M), text[-3000:]
    assert re.search(r"^SKIPPED \[1\] tests/beside_examples.py:\d+: nothing to do on this machine$", text, re.M), \
        text[-3000:]
    assert f"PASSED {example}test_parametrized_in_the_side_session[1]" in text
    assert f"PASSED {example}test_parametrized_in_the_side_session[2]" in text
    side = re.search(r"side pid (\d+) session (\S+)", text)
    main = re.search(r"main pid (\d+) session (\S+)", text)
    assert side and main and side.group(2) == "1" and main.group(2) == "None" and side.group(1) != main.group(1)
    assert "1 failed, 4 passed, 1 skipped" in text.splitlines()[-1]

    shared = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--basetemp={tmp_path}",
                             "tests/beside_examples.py"], cwd=background.ROOT, env=dict(env, BESIDE_EXAMPLE_SHARED="1"),
                            capture_output=True, text=True, timeout=300)
    assert shared.returncode == 4 and "test_uses_the_session_server is marked beside but uses the session's engine" \
        in shared.stderr, shared.stdout[-2000:] + shared.stderr[-2000:]
