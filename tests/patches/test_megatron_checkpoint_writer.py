"""``patches.megatron_checkpoint_writer``: the Manager process behind megatron's checkpoint-writer queue dies with a
SIGKILLed rank (without the patch it outlives it), and the queue still carries results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.processes import still_running

pytestmark = pytest.mark.megatron  # one of our megatron patches, in a process of its own

ROOT = Path(__file__).resolve().parents[2]
RANK = """
import sys, time
from patches import megatron_checkpoint_writer
megatron_checkpoint_writer.apply()
megatron_checkpoint_writer.apply()  # idempotent
from megatron.core.dist_checkpointing.strategies import filesystem_async
from patches.megatron_cpu import _installed_megatron_version
name = megatron_checkpoint_writer.QUEUE_FUNCTION[_installed_megatron_version()]
queue = getattr(filesystem_async, name)()
queue.put(("rank", 0))
assert queue.get(timeout=30) == ("rank", 0)
print(megatron_checkpoint_writer._manager._process.pid, flush=True)
time.sleep(600)
"""


def test_the_writer_queue_process_dies_with_a_killed_rank():
    rank = subprocess.Popen([sys.executable, "-c", RANK], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        manager = int(rank.stdout.readline())
        assert psutil.Process(manager).ppid() == rank.pid
        rank.kill()  # SIGKILL: no atexit, no finalizer
        rank.wait()
        assert not still_running([manager], seconds=20)
    finally:
        rank.kill()
