"""The tests that depend on megatron-core's version, again on megatron-core 0.19 (Python 3.12), from this run.

megatron-core stops at 0.16.1 on Python 3.11 (0.17 onwards require 3.12), and clusters run 0.19.x. So this one
test runs, with the interpreter of ``.venv312`` (``tools/install.sh`` builds it: Python 3.12, torch 2.14.1,
megatron-core 0.19.2, no SGLang):
- every test marked ``megatron`` (it builds or runs a Megatron model, optimizer, dist checkpoint or one of our
  megatron patches; tests/conftest.py fails an unmarked test that builds one), except those marked
  ``megatron_covered_by`` a test that runs here (tests/megatron_use.py), or ``triton`` (the log-prob kernels under
  that environment's own Triton);
- and so a collection of the whole tree: pytest imports every test module before it deselects by marker, and a
  module that fails to import stops the run (``errors during collection``), so every module at least imports there.
It fails with the tail of the output if anything fails there, or if a test skips there for a reason not listed
in ``EXPECTED_SKIPS`` (it has no SGLang and no GPU, by design). One subprocess rather than a second pytest command
keeps CI at the README's single test command.

It runs in the background (tests/background.py): started as soon as the tests are collected, at a lower CPU
priority (``NICE``), and this test, ordered last, waits for it; ``GSPO_BACKGROUND=inline`` runs it here instead.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from patches.megatron_cpu import TESTED_MEGATRON_VERSIONS
from tests import background
from tests.background import BackgroundRun

ROOT = Path(__file__).resolve().parents[1]
VENV312 = Path(os.environ.get("VENV312", ROOT / ".venv312"))  # as tools/install.sh
SELECTION = "(megatron and not megatron_covered_by) or triton"
TIMEOUT_S = 45 * 60  # from its start, which overlaps the main run
NICE = 19  # the main run first: its tests time servers and collectives; this one only has to end. At 10 it still
# took ~10% of a busy CPU from the main run (CFS weights 110 vs 1024); at 19 ~1.5%: it runs in the main run's idle time
NODE_ID = "tests/test_megatron_019.py::test_megatron_side_tests_pass_on_megatron_core_019"
# Why a selected test may skip in this environment: no SGLang (tests/rollout/helpers.require_sglang) and no GPU.
EXPECTED_SKIPS = ("sglang is not installed", "needs CUDA", "auto picks the kernels for CUDA inputs only",
                  "the CPU's chunk size is fixed", "TransformerEngine is not installed",
                  "the trainer on the CPU runs in tests/train",  # tests/gpu's trainer test: GPU-only by design
                  "the offloaded optimizer runs on CUDA streams only")


def _python312() -> Path:
    python = VENV312 / "bin" / "python"
    if not python.exists():
        why = (f"{VENV312} is missing, so the Megatron-side tests did NOT run on megatron-core 0.19: "
               "`bash tools/install.sh` builds it where it finds Python 3.12 (and says so loudly where it does not)")
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    return python


def _start(nice: int) -> BackgroundRun | None:
    """The 0.19 pytest run as a child process (None where this is that run, or without .venv312: the test says why)."""
    if not will_run():
        return None
    python = VENV312 / "bin" / "python"
    # No CI variable there: the SGLang tests skip (this environment has none) instead of failing.
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTHONPATH", "VIRTUAL_ENV")}
    command = [str(python), "-m", "pytest", "-p", "no:cacheprovider", "--basetemp={work}/run",
               "-q", "-rs", "-m", SELECTION, "tests", f"--deselect={NODE_ID}"]
    if os.environ.get("GSPO_DURATIONS"):
        command.append(f"--durations={os.environ['GSPO_DURATIONS']}")
    return BackgroundRun("megatron-core 0.19", command, env, nice, TIMEOUT_S)


background.register(NODE_ID, _start, NICE)


def will_run() -> bool:
    """Whether this session's run of NODE_ID runs the 0.19 tests (it is not that run, and .venv312 is there)."""
    return sys.version_info < (3, 12) and (VENV312 / "bin" / "python").exists()


def selects(item) -> bool:
    """Whether ``-m SELECTION`` selects a collected item (pytest's own expression, on the item's marker names)."""
    from _pytest.mark.expression import Expression

    names = {mark.name for mark in item.iter_markers()}
    return Expression.compile(SELECTION).evaluate(lambda name, **_: name in names)


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
    run = background.take(NODE_ID) or _start(nice=0)
    with capsys.disabled():
        status, output = run.wait(say=lambda line: print("\n" + line, flush=True))
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
              f"started {run.elapsed():.0f} s before this line] {summary}")
        if os.environ.get("GSPO_DURATIONS"):
            print(output[output.find("slowest"):][:6000])
    run.remove()


class _Item:
    def __init__(self, nodeid: str, *markers):
        self.nodeid, self.markers = nodeid, {m.name: m for m in markers}

    def get_closest_marker(self, name):
        return self.markers.get(name)

    def iter_markers(self):
        return iter(self.markers.values())


def test_the_run_leaves_out_covered_tests_and_a_cover_must_run_there():
    """The selection leaves out ``megatron_covered_by`` tests and keeps the test that covers them; a marker naming a
    test that is missing, unmarked or itself covered stops the collection (``tests.megatron_use``)."""
    listed = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider",
                             "-m", SELECTION, "tests/train/test_loop.py"], capture_output=True, text=True, cwd=ROOT)
    assert listed.returncode == 0, listed.stdout[-3000:]
    selected = {line.split("::")[-1] for line in listed.stdout.splitlines() if "::" in line}
    assert "test_train_logs_plots_and_resumes_exactly" in selected, selected
    assert not {"test_one_step_off_through_the_loop", "test_partial_rollouts_through_the_loop"} & selected, selected
    # tests/conftest.py leaves to the 0.19 run the tests/gpu tests that ``selects`` picks: the same as -m picks
    for markers, picked in (([pytest.mark.megatron.mark], True), ([pytest.mark.triton.mark], True), ([], False),
                            ([pytest.mark.megatron.mark, pytest.mark.megatron_covered_by("x").mark], False)):
        assert selects(_Item("tests/gpu/test_x.py::test_x", *markers)) == picked, markers

    from tests.megatron_use import check_covering_tests

    mark = pytest.mark.megatron.mark
    cover = "tests/a.py::test_plain"
    covered = _Item("tests/a.py::test_schedule", mark, pytest.mark.megatron_covered_by(cover).mark)
    check_covering_tests([_Item(cover, mark), covered])  # fine
    elsewhere = _Item("tests/b.py::test_schedule", mark, pytest.mark.megatron_covered_by(cover).mark)
    check_covering_tests([elsewhere])  # the covering test's module not collected: a run of a subset
    for wrong in ([_Item(cover), covered], [_Item("tests/a.py::test_renamed", mark), covered],
                  [_Item(cover, mark, pytest.mark.megatron_covered_by("tests/b.py::test_x").mark), covered]):
        with pytest.raises(pytest.UsageError, match=r"test_schedule is marked megatron_covered_by\('tests/a.py::te"):
            check_covering_tests(wrong)
