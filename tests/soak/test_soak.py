"""The soak run (``bench/soak.py``) in short: 24 steps of the CPU example on 2 ranks under torchrun restarts with the
real SGLang server, meeting every fault of its schedule (server SIGKILLed mid-generation and inside a weight update,
rewards that hang and raise, rank 1 SIGKILLed during a checkpoint write, SIGTERM and resume). Every check of the
script passes, and no server process of the run outlives it (a server relaunched before the worker restart is
adopted, not orphaned).

The script runs in the background (tests/background.py), started when the tests are collected: its ~3.5 minutes
are mostly waits (servers starting and restarting, torchrun restarting its workers) that the main run fills."""

from __future__ import annotations

import sys
from pathlib import Path

import psutil
import pytest

from tests import background
from tests.background import BackgroundRun
from tests.rollout.helpers import SGLANG_INSTALLED, require_sglang

pytestmark = pytest.mark.megatron  # trains the Megatron policy through the CLI

ROOT = Path(__file__).resolve().parents[2]
NODE_ID = "tests/soak/test_soak.py::test_short_soak_survives_every_fault"
TIMEOUT_S = 30 * 60  # from its start, which overlaps the main run
NICE = 5  # below the main run's tests, above the megatron-core 0.19 run: its own restarts are timed too


def _start(nice: int) -> BackgroundRun | None:
    if not SGLANG_INSTALLED:  # the test says why
        return None
    command = [sys.executable, str(ROOT / "bench/soak.py"), "--steps", "24", "--checkpoint-every", "6",
               "--out", "{work}/soak"]
    return BackgroundRun("soak", command, None, nice, TIMEOUT_S)


background.register(NODE_ID, _start, NICE)


def _servers_of(run: Path) -> list:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if "sglang.launch_server" in cmdline and str(run) in cmdline:
            found.append(p)
    return found


def test_short_soak_survives_every_fault(capsys):
    require_sglang()
    run = background.take(NODE_ID) or _start(nice=0)
    with capsys.disabled():
        status, output = run.wait(say=lambda line: print("\n" + line, flush=True))
    print(output[-3000:])
    left = _servers_of(run.work / "soak")
    for p in left:
        p.kill()
    assert status is not None, f"the soak ran past {TIMEOUT_S} s; its output ends:\n{output[-3000:]}"
    assert status == 0, output[-6000:]
    assert "FAIL" not in output
    assert not left, f"servers of the run still running: {[p.pid for p in left]}"
    run.remove()
