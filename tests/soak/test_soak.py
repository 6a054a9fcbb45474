"""The soak run (``bench/soak.py``) in short: 24 steps of the CPU example on 2 ranks under torchrun restarts with the
real SGLang server, meeting every fault of its schedule (server SIGKILLed mid-generation and inside a weight update,
rewards that hang and raise, rank 1 SIGKILLed during a checkpoint write, SIGTERM and resume). Every check of the
script passes, and no server process of the run outlives it (a server relaunched before the worker restart is
adopted, not orphaned)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.rollout.helpers import require_sglang

pytestmark = pytest.mark.megatron  # trains the Megatron policy through the CLI

ROOT = Path(__file__).resolve().parents[2]


def _servers_of(run: Path) -> list:
    found = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = " ".join(p.info["cmdline"] or [])
        if "sglang.launch_server" in cmdline and str(run) in cmdline:
            found.append(p)
    return found


def test_short_soak_survives_every_fault(tmp_path):
    require_sglang()
    out = subprocess.run([sys.executable, str(ROOT / "bench/soak.py"), "--steps", "24", "--checkpoint-every", "6",
                          "--out", str(tmp_path / "soak")], cwd=ROOT, capture_output=True, text=True, timeout=1500)
    print(out.stdout[-3000:])
    left = _servers_of(tmp_path / "soak")
    for p in left:
        p.kill()
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "FAIL" not in out.stdout
    assert not left, f"servers of the run still running: {[p.pid for p in left]}"
