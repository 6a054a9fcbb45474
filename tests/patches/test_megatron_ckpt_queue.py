"""patches.megatron_ckpt_queue: megatron's checkpoint writer gets the patch's queue, and the queue's server process
exits soon after the process that made it is SIGKILLed (unpatched, it runs for ever)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from patches import megatron_ckpt_queue

ROOT = Path(__file__).resolve().parents[2]

KILLED_AFTER_APPLY = """
import os, signal
from patches import megatron_ckpt_queue
from megatron.core.dist_checkpointing.strategies import filesystem_async as fa

megatron_ckpt_queue.apply()
queue = fa._results_queue
get = getattr(fa, "get_write_results_queue", None) or fa._get_write_results_queue  # 0.19.2 / 0.16.1
assert get() is queue
megatron_ckpt_queue.apply()  # idempotent
assert fa._results_queue is queue
queue.put("written")
assert queue.get() == "written"
print(queue._manager._process.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"  # a zombie has exited (an orphan's new parent may not reap it at once)


def test_queue_server_exits_with_its_killed_parent():
    done = subprocess.run([sys.executable, "-c", KILLED_AFTER_APPLY], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == -signal.SIGKILL, done.stderr
    server = int(done.stdout.strip())
    deadline = time.monotonic() + 10 * megatron_ckpt_queue.POLL_S
    while _running(server) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(server), f"the queue's server (pid {server}) outlived the process that started it"
