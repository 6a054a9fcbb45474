"""The Megatron-side tests again on megatron-core 0.19 (Python 3.12), from this Python 3.11 run.

megatron-core stops at 0.16.1 on Python 3.11 (0.17 onwards require 3.12), and clusters run 0.19.x. So this
one test runs the test suite, minus what needs SGLang (tests/rollout, the CPU example), with the interpreter
of ``.venv312`` (``tools/install.sh`` builds it: Python 3.12, torch 2.14.1, megatron-core 0.19.2, no SGLang),
and fails with the tail of its output if anything there fails. One subprocess rather than a second pytest
command keeps CI at the README's single test command; the two runs are sequential, as 2 cores can take.

Tests elsewhere that need SGLang must call ``tests.rollout.helpers.require_sglang()``: the run here has no
``CI`` variable, so they skip in it (the 3.11 run still runs them).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from patches.megatron_cpu import TESTED_MEGATRON_VERSIONS

ROOT = Path(__file__).resolve().parents[1]
VENV312 = Path(os.environ.get("VENV312", ROOT / ".venv312"))  # as tools/install.sh
# Everything but the SGLang tests (and this file), and the preemption and elastic-restart tests: torchrun launches
# (~4 min each here on 0.19) of signal handling, restart and CLI flow that do not depend on megatron's version; the
# checkpoint and exact resume they rely on run on 0.19 in tests/train/test_checkpoint.py and test_loop.py, and the
# checkpoint writer's patch in tests/patches (the preemption test passed on 0.19 when added).
ARGS = ["tests", "--ignore=tests/rollout", "--ignore=tests/test_cpu_example.py",
        "--ignore=tests/train/test_preemption.py", "--ignore=tests/train/test_elastic.py",
        f"--ignore={Path(__file__).relative_to(ROOT)}"]
TIMEOUT_S = 45 * 60  # measured: 15 min on a busy 2-core machine (10 CPU-minutes), as long as the same tests on 3.11


def _python312() -> Path:
    python = VENV312 / "bin" / "python"
    if not python.exists():
        why = (f"{VENV312} is missing, so the Megatron-side tests did NOT run on megatron-core 0.19: "
               "`bash tools/install.sh` builds it where it finds Python 3.12 (and says so loudly where it does not)")
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(why, pytrace=False)
        pytest.skip(why)
    return python


@pytest.mark.skipif(sys.version_info >= (3, 12), reason="this is the megatron-core 0.19 run itself")
def test_megatron_side_tests_pass_on_megatron_core_019(tmp_path, capsys):
    python = _python312()
    version = subprocess.run([python, "-c", "import importlib.metadata as m; print(m.version('megatron-core'))"],
                             capture_output=True, text=True, check=True).stdout.strip()
    assert version.startswith("0.19.") and version in TESTED_MEGATRON_VERSIONS, (
        f"{VENV312} has megatron-core {version}, not the tested 0.19 release: rerun `bash tools/install.sh`")

    env = {k: v for k, v in os.environ.items() if k not in ("CI", "PYTHONPATH", "VIRTUAL_ENV")}
    command = [str(python), "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--basetemp={tmp_path / 'run'}", *ARGS]
    try:
        out = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-6000:]
        pytest.fail(f"the megatron-core {version} run took over {TIMEOUT_S} s; its output ends:\n"
                    f"{tail.decode() if isinstance(tail, bytes) else tail}", pytrace=False)
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else "(no output)"
    if out.returncode != 0:
        pytest.fail(f"on megatron-core {version} (Python 3.12, `{' '.join(command[2:])}`): {summary}\n"
                    f"{out.stdout[-8000:]}\n{out.stderr[-2000:]}", pytrace=False)
    with capsys.disabled():
        print(f"\n[megatron-core {version}, Python 3.12] {summary}")
