"""``subprocess.run`` for our command lines, in processes forked from the warm server (``parallel.launch``).

A CLI test pays ~8 s to import torch, megatron-core and transformers before the command starts; the suite runs
~40 of them. ``run`` takes the same arguments as ``subprocess.run`` for ``[python, "-m", module, ...]`` and
``[python, script.py, ...]`` and runs the command as that interpreter would: in a process of its own (forked
from the server that imported those once), in ``cwd`` with ``cwd`` first on ``sys.path``, with ``env`` as its
environment, ``sys.argv`` as given, its own stdout/stderr file descriptors (so the output of the servers it
starts is captured too), ``__main__`` as the module's name, and the exit code of its ``SystemExit`` (atexit
handlers run). What the command builds is reported to the suite's megatron check (``GSPO_RANK_PROBE``), as a
rank's is. Under ``GSPO_RANK_WORKERS=fresh``, or for any other command, it is ``subprocess.run`` itself.
"""

from __future__ import annotations

import atexit
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

from gspo_megatron.parallel import launch


def _main(module: str | None, script: str | None, argv: list[str], cwd: str, env: dict, out: str | None,
          err: str | None, report: str) -> None:
    for fd, path in ((1, out), (2, err)):
        if path is not None:
            target = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(target, fd)
            os.close(target)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    sys.path.insert(0, cwd if module else str(Path(script).resolve().parent))
    sys.argv = [script or module, *argv]
    code = 0
    import runpy

    probe = launch.load_probe(env.get("GSPO_RANK_PROBE"))  # what the command built (tests/conftest.py asks)
    if probe is not None:
        probe.start()
    try:
        if module:
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        if probe is not None:
            Path(report).write_text("\n".join(probe.stop()))
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def run(args, *, capture_output=False, stdout=None, stderr=None, text=False, cwd=None, env=None, timeout=None,
        check=False, **kwargs) -> subprocess.CompletedProcess:
    args = [str(a) for a in args]
    module = args[2] if len(args) > 2 and args[1] == "-m" else None
    script = args[1] if module is None and len(args) > 1 and args[1].endswith(".py") else None
    if not launch.warm_ranks() or args[0] != sys.executable or not (module or script) or kwargs:
        return subprocess.run(args, capture_output=capture_output, stdout=stdout, stderr=stderr, text=text, cwd=cwd,
                              env=env, timeout=timeout, check=check, **kwargs)
    if capture_output:
        stdout = stderr = subprocess.PIPE
    argv = args[3:] if module else args[2:]
    with tempfile.TemporaryDirectory(prefix="gspo_cli_") as tmp:
        paths = {}
        for name, how in (("stdout", stdout), ("stderr", stderr)):
            paths[name] = (os.devnull if how == subprocess.DEVNULL else
                           str(Path(tmp) / name) if how == subprocess.PIPE else None)
        proc = launch.context(True).Process(
            target=_main, args=(module, script, argv, str(cwd or os.getcwd()), dict(env or os.environ),
                                paths["stdout"], paths["stderr"], str(Path(tmp) / "probe")))
        proc.start()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired(args, timeout)
        captured = {}
        for name, how in (("stdout", stdout), ("stderr", stderr)):
            if how == subprocess.PIPE:
                data = Path(paths[name]).read_bytes()
                captured[name] = data.decode(errors="replace") if text else data
            else:
                captured[name] = None
        report = Path(tmp) / "probe"
        if report.is_file() and report.read_text():
            launch.probe_reports.append(report.read_text().split("\n"))
    result = subprocess.CompletedProcess(args, proc.exitcode, captured["stdout"], captured["stderr"])
    if check:
        result.check_returncode()
    return result
