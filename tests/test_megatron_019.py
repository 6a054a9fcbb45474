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
keeps CI at the README's single test command; the two runs are sequential, as 2 cores can take.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from patches.megatron_cpu import TESTED_MEGATRON_VERSIONS

ROOT = Path(__file__).resolve().parents[1]
VENV312 = Path(os.environ.get("VENV312", ROOT / ".venv312"))  # as tools/install.sh
SELECTION = "megatron or triton"
TIMEOUT_S = 30 * 60
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


def _run(command: list[str], env: dict, what: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        tail = e.stdout[-6000:] if isinstance(e.stdout, str) else (e.stdout or b"")[-6000:].decode()
        pytest.fail(f"{what} took over {TIMEOUT_S} s; its output ends:\n{tail}", pytrace=False)


def unexpected_skips(output: str) -> list[str]:
    """pytest's ``-rs`` lines (``SKIPPED [n] file:line: reason``) whose reason is none of ``EXPECTED_SKIPS``."""
    skips = re.findall(r"^SKIPPED \[\d+\] (.*)$", output, flags=re.M)
    return [line for line in skips if not any(reason in line for reason in EXPECTED_SKIPS)]


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="this is the megatron-core 0.19 run itself")
def test_megatron_side_tests_pass_on_megatron_core_019(tmp_path, capsys):
    python = _python312()
    version = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('megatron-core'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version.startswith("0.19.") and version in TESTED_MEGATRON_VERSIONS, (
        f"{VENV312} has megatron-core {version}, not the tested 0.19 release: rerun `bash tools/install.sh`")
    # No CI variable there: the SGLang tests skip (this environment has none) instead of failing.
    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTHONPATH", "VIRTUAL_ENV")}
    base = [str(python), "-m", "pytest", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'run'}"]

    command = [*base, "-q", "-rs", "-m", SELECTION, "tests", f"--deselect={Path(__file__).relative_to(ROOT)}"]
    if os.environ.get("GSPO_DURATIONS"):
        command.append(f"--durations={os.environ['GSPO_DURATIONS']}")
    out = _run(command, env, f"the megatron-core {version} run")
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "(no output)"
    if out.returncode != 0:
        pytest.fail(f"on megatron-core {version} (Python 3.12, `{' '.join(command[2:])}`): {summary}\n"
                    f"{out.stdout[-8000:]}\n{out.stderr[-2000:]}", pytrace=False)
    surprises = unexpected_skips(out.stdout)
    assert not surprises, f"on megatron-core {version}, tests skipped for reasons not expected there:\n" + \
        "\n".join(surprises)
    with capsys.disabled():
        print(f"\n[megatron-core {version}, Python 3.12, -m '{SELECTION}'] {summary}")
        if os.environ.get("GSPO_DURATIONS"):
            print(out.stdout[out.stdout.find("slowest"):][:6000])
