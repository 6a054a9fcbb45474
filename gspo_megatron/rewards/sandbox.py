"""Run untrusted Python (a model's program) in a subprocess with limits: the code-execution reward's sandbox, and
the multi-turn Python tool's (``rollout.env: python``, ``multiturn.PythonEnv``).

    result = run_python("print(input()[::-1])", stdin="abc", limits=Limits(wall_s=5))
    result.stdout == "cba\\n", result.ok, result.killed_by  # None, "wall", "cpu", "memory" or "output"

Each run gets a fresh scratch directory (its working directory, HOME and TMPDIR; deleted afterwards) and:
- ``wall_s``: killed (its whole process group) when it runs longer;
- ``cpu_s``: RLIMIT_CPU (SIGXCPU at the soft limit, SIGKILL one second later);
- ``memory_bytes``: RLIMIT_AS (allocation beyond it fails: MemoryError in Python);
- ``output_bytes``: stdout and stderr go to files capped by RLIMIT_FSIZE, so a program printing more is stopped
  (SIGXFSZ; Python ignores it, and its write fails with EFBIG instead); any file it writes is capped the same way;
- no network: it runs in new user and network namespaces (``unshare --map-root-user --net``: no interface but a
  loopback that is down) where the kernel allows unprivileged user namespaces. Where it does not (``unshare``
  missing, or user namespaces disabled, as in many containers) the program CAN open network connections: the
  environment is scrubbed (no proxy variables, no credentials, PATH=/usr/bin:/bin) and ``Result.network_isolated``
  is False; run the trainer in a network-less container there.
- it dies with the process that started it (PR_SET_PDEATHSIG), e.g. a reward worker killed for its time limit;
- ``python -I`` (isolated mode: no user site-packages, no PYTHON* variables, the script's directory not on sys.path
  before the standard library), started by a launcher that sets the limits and then execs the program.

Not a security boundary against a determined attacker: the program runs as this user (RLIMIT_NPROC is not set,
it counts every process of the user), can read files this user can read, and can see the interpreter's own
site-packages. It bounds what a model's buggy or runaway program costs.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

# Sets the limits, then replaces itself with the program (limits survive exec). argv: cpu_s memory output script.
_LAUNCHER = """
import ctypes, os, resource, sys
ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: dies with the process that started it
cpu, memory, output = (int(x) for x in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (output, output))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.execv(sys.executable, [sys.executable, "-I", sys.argv[4]])
"""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 1 << 30
    output_bytes: int = 1 << 16


@dataclass
class Result:
    returncode: int | None
    stdout: str
    stderr: str
    killed_by: str | None  # None, "wall", "cpu", "memory", "output"
    network_isolated: bool

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_by is None


@functools.lru_cache(maxsize=1)
def network_isolation() -> bool:
    """Whether ``unshare --map-root-user --net`` works here (checked once per process)."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "--map-root-user", "--net", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def run_python(code: str, stdin: str = "", limits: Limits = Limits()) -> Result:
    """Run ``code`` as a script with ``stdin``; never raises for anything the program does."""
    isolated = network_isolation()
    with tempfile.TemporaryDirectory(prefix="gspo_sandbox_") as scratch:
        work = Path(scratch)
        (work / "main.py").write_text(code)
        (work / "stdin").write_text(stdin)
        command = [sys.executable, "-I", "-c", _LAUNCHER, str(limits.cpu_s), str(limits.memory_bytes),
                   str(limits.output_bytes), "main.py"]
        if isolated:
            command = ["unshare", "--map-root-user", "--net"] + command
        env = {"PATH": "/usr/bin:/bin", "HOME": scratch, "TMPDIR": scratch, "LANG": "C.UTF-8",
               "PYTHONIOENCODING": "utf-8"}
        with open(work / "stdin", "rb") as inp, open(work / "stdout", "wb") as out, open(work / "stderr", "wb") as err:
            process = subprocess.Popen(command, cwd=scratch, env=env, stdin=inp, stdout=out, stderr=err,
                                       start_new_session=True)
            killed_by = None
            try:
                returncode = process.wait(timeout=limits.wall_s)
            except subprocess.TimeoutExpired:
                killed_by = "wall"
                _kill_group(process)
                returncode = process.wait()
        full = max((work / "stdout").stat().st_size, (work / "stderr").stat().st_size) >= limits.output_bytes
        stdout = (work / "stdout").read_bytes()[:limits.output_bytes].decode("utf-8", "replace")
        stderr = (work / "stderr").read_bytes()[:limits.output_bytes].decode("utf-8", "replace")
    if killed_by is None:
        if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
            killed_by = "cpu"  # SIGKILL: the hard CPU limit (nothing else here sends it before the wall limit)
        elif returncode == -signal.SIGXFSZ or (returncode != 0 and full):
            killed_by = "output"  # Python ignores SIGXFSZ: its write fails (EFBIG) and it exits with the error
        elif returncode != 0 and "MemoryError" in stderr:
            killed_by = "memory"
    return Result(returncode, stdout, stderr, killed_by, isolated)


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
