"""The tests that depend on megatron-core's version, again on megatron-core 0.19 (Python 3.12), from this run.

megatron-core stops at 0.16.1 on Python 3.11 (0.17 onwards require 3.12), and clusters run 0.19.x. So this one
test runs, with the interpreter of ``.venv312`` (``tools/install.sh`` builds it: Python 3.12, torch 2.14.1,
megatron-core 0.19.2, no SGLang):
- every test marked ``megatron`` (it builds or runs a Megatron model, optimizer, dist checkpoint or one of our
  megatron patches; tests/conftest.py fails an unmarked test that builds one) or ``triton`` (the log-prob kernels
  under that environment's own Triton);
- and so a collection of the whole tree: pytest imports every test module before it deselects by marker, and a
  module that fails to import stops the run (``errors during collection``), so every module at least imports there.
It fails with the tail of the output if anything fails there, or if a test skips there for a reason not listed
in ``EXPECTED_SKIPS`` (it has no SGLang and no GPU, by design). One subprocess rather than a second pytest command
keeps CI at the README's single test command.

The run starts in the background as soon as this test is collected (tests/conftest.py), at a lower CPU priority
(``NICE``), and this test, ordered last, waits for it: the main run spends much of its time waiting (for servers
to start, time-outs to fire, a rank to restart), and the 0.19 run fills those gaps on the 2 cores instead of
taking ~7 minutes after them, while the main run's own timings keep the CPU first. ``GSPO_MEGATRON_019=inline``
runs it here instead, after everything else.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from patches.megatron_cpu import TESTED_MEGATRON_VERSIONS

ROOT = Path(__file__).resolve().parents[1]
VENV312 = Path(os.environ.get("VENV312", ROOT / ".venv312"))  # as tools/install.sh
SELECTION = "megatron or triton"
TIMEOUT_S = 45 * 60  # from its start, which overlaps the main run
NICE = 10  # the main run first: its tests time servers and collectives; this one only has to end
NODE_ID = "tests/test_megatron_019.py::test_megatron_side_tests_pass_on_megatron_core_019"
# Why a selected test may skip in this environment: no SGLang (tests/rollout/helpers.require_sglang) and no GPU.
EXPECTED_SKIPS = ("sglang is not installed", "needs CUDA", "auto picks the kernels for CUDA inputs only",
                  "the CPU's chunk size is fixed", "TransformerEngine is not installed",
                  "the trainer on the CPU runs in tests/train")  # tests/gpu's trainer test: GPU-only by design


def _python312() -> Path:
    python = VENV312 / "bin" / "python"
    if not python.exists():
        why = (f"{VENV312} is missing, so the Megatron-side tests did NOT run on megatron-core 0.19: "
               "`bash tools/install.sh` builds it where it finds Python 3.12 (and says so loudly where it does not)")
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    return python


class Run019:
    """The 0.19 pytest run as a child process: its output goes to a file in its own temporary directory."""

    def __init__(self, python: Path, nice: int):
        self.work = Path(tempfile.mkdtemp(prefix="gspo_megatron_019_"))
        self.log = self.work / "output.txt"
        # No CI variable there: the SGLang tests skip (this environment has none) instead of failing.
        env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTHONPATH", "VIRTUAL_ENV")}
        self.command = [str(python), "-m", "pytest", "-p", "no:cacheprovider", f"--basetemp={self.work / 'run'}",
                        "-q", "-rs", "-m", SELECTION, "tests", f"--deselect={NODE_ID}"]
        if os.environ.get("GSPO_DURATIONS"):
            self.command.append(f"--durations={os.environ['GSPO_DURATIONS']}")
        with open(self.log, "w") as out:  # a file, not a pipe: nobody reads it until the end
            self.proc = subprocess.Popen(["nice", "-n", str(nice), *self.command] if nice else self.command,
                                         cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                         process_group=0)  # stop() ends its ranks and servers with it
        self.started = time.monotonic()

    def wait(self) -> tuple[int | None, str]:
        """(exit status, output); status None if it ran past TIMEOUT_S (it is then stopped)."""
        left = TIMEOUT_S - (time.monotonic() - self.started)
        try:
            status = self.proc.wait(timeout=max(left, 1))
        except subprocess.TimeoutExpired:
            self.stop()
            status = None
        return status, self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def remove(self) -> None:
        shutil.rmtree(self.work, ignore_errors=True)


_background: Run019 | None = None


def start_in_background(items) -> None:
    """tests/conftest.py, once the session's tests are known: start the 0.19 run now if this test is among them."""
    global _background
    if os.environ.get("GSPO_MEGATRON_019", "background") == "inline" or sys.version_info >= (3, 12):
        return
    if any(item.nodeid == NODE_ID for item in items) and (VENV312 / "bin" / "python").exists():
        _background = Run019(VENV312 / "bin" / "python", NICE)


def stop_background() -> None:
    """tests/conftest.py at the session's end: a run this test never waited for (``-x``, Ctrl-C) is stopped."""
    if _background is not None:
        _background.stop()


def unexpected_skips(output: str) -> list[str]:
    """pytest's ``-rs`` lines (``SKIPPED [n] file:line: reason``) whose reason is none of ``EXPECTED_SKIPS``."""
    skips = re.findall(r"^SKIPPED \[\d+\] (.*)$", output, flags=re.M)
    return [line for line in skips if not any(reason in line for reason in EXPECTED_SKIPS)]


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="this is the megatron-core 0.19 run itself")
def test_megatron_side_tests_pass_on_megatron_core_019(capsys):
    python = _python312()
    version = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('megatron-core'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version.startswith("0.19.") and version in TESTED_MEGATRON_VERSIONS, (
        f"{VENV312} has megatron-core {version}, not the tested 0.19 release: rerun `bash tools/install.sh`")
    run = _background or Run019(python, nice=0)
    if run.proc.poll() is None:
        with capsys.disabled():
            print(f"\n[megatron-core {version}] waiting for its run, started {time.monotonic() - run.started:.0f} s "
                  f"ago (output: {run.log})", flush=True)
    status, output = run.wait()
    command = " ".join(run.command[2:])
    if status is None:
        pytest.fail(f"the megatron-core {version} run took over {TIMEOUT_S} s; its output ends:\n{output[-6000:]}",
                    pytrace=False)
    summary = output.strip().splitlines()[-1] if output.strip() else "(no output)"
    if status != 0:
        pytest.fail(f"on megatron-core {version} (Python 3.12, `{command}`): {summary}\n{output[-10000:]}",
                    pytrace=False)
    surprises = unexpected_skips(output)
    assert not surprises, f"on megatron-core {version}, tests skipped for reasons not expected there:\n" + \
        "\n".join(surprises)
    with capsys.disabled():
        print(f"\n[megatron-core {version}, Python 3.12, -m '{SELECTION}', "
              f"{time.monotonic() - run.started:.0f} s from its start] {summary}")
        if os.environ.get("GSPO_DURATIONS"):
            print(output[output.find("slowest"):][:6000])
    run.remove()
