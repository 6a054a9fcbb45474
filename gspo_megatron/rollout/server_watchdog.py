"""Stop kept SGLang servers once the torchrun agent that restarts the trainer's workers is gone.

    python gspo_megatron/rollout/server_watchdog.py --agent PID --agent-started T --record FILE

Kept servers (``server.ServerProcess(keep=True)``) outlive the rank that launched them so that the next attempt's
rank 0 adopts them (``train.resilience.elastic``). A clean end stops them (rank 0's ``engine.close``); nothing else would if the
job ends otherwise: the agent giving up after its last restart, the last attempt's rank 0 SIGKILLed, the agent
itself killed. This process, started with the servers in its own session, checks every ``interval`` seconds that
the agent (pid and start time) still runs; once it is gone it stops every server the record file lists (SIGTERM to
its process group, SIGKILL after a grace period) and exits. It exits on its own once no listed server runs or the
record file is gone. It reads the file at each check, so servers recorded after it started are covered too.
"""

from __future__ import annotations

# Run as a script by path (``start``), not through the package: importing ``gspo_megatron`` would hold torch in a
# process that only polls. Standard library and psutil only.
import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


def start_time(pid: int) -> float | None:
    """The process's start time (psutil create_time), or None if no such process runs."""
    import psutil

    try:
        process = psutil.Process(pid)
        return None if process.status() == psutil.STATUS_ZOMBIE else process.create_time()
    except psutil.Error:
        return None


def running(pid: int, started: float | None) -> bool:
    """Whether ``pid`` still runs and is the process that started at ``started`` (not a later one given its pid)."""
    now = start_time(pid)
    return now is not None and started is not None and abs(now - started) < 1e-3


def stop_group(pid: int, started: float | None, grace_s: float) -> None:
    """SIGTERM the process group of ``pid`` (a server is its group's leader), SIGKILL it after ``grace_s``."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        if not running(pid, started):
            return
        try:
            os.killpg(pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        deadline = time.monotonic() + grace_s
        while running(pid, started) and time.monotonic() < deadline:
            time.sleep(0.2)


def _records(path: Path) -> list[dict] | None:
    try:
        return json.loads(path.read_text()).get("servers", [])
    except FileNotFoundError:
        return None
    except (OSError, ValueError):  # being replaced: read it at the next check
        return []


def watch(agent: int, agent_started: float, record: Path, interval: float = 1.0, grace_s: float = 10.0) -> str:
    """Until the agent is gone (then stop the recorded servers) or there is nothing left to watch; says which."""
    seen_running = False
    while True:
        records = _records(record)
        if records is None:
            return "record file removed"
        if not running(agent, agent_started):
            for entry in records:
                stop_group(entry["pid"], entry["started"], grace_s)
            return f"agent {agent} gone: stopped the servers {[e['pid'] for e in records]}"
        if any(running(e["pid"], e["started"]) for e in records):
            seen_running = True
        elif seen_running:
            return "no recorded server runs any more"
        time.sleep(interval)


def start(agent: int, record: Path, log_path: Path) -> subprocess.Popen:
    """The watchdog for ``agent``'s kept servers listed in ``record``, detached (own session, outlives the caller)."""
    with open(log_path, "ab") as log:
        return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--agent", str(agent),
                                 "--agent-started", repr(start_time(agent)), "--record", str(record)],
                                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Stop kept SGLang servers once the torchrun agent is gone.")
    parser.add_argument("--agent", type=int, required=True, help="the torchrun agent's pid")
    parser.add_argument("--agent-started", type=float, required=True, help="its start time (psutil create_time)")
    parser.add_argument("--record", type=Path, required=True, help="JSON file with a 'servers' list of records")
    parser.add_argument("--interval", type=float, default=1.0)
    args = parser.parse_args(argv)
    print(f"server watchdog (pid {os.getpid()}): {watch(args.agent, args.agent_started, args.record, args.interval)}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
