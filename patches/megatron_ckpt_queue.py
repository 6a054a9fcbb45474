"""megatron-core's checkpoint writer's results queue, served by a process that dies with the rank that made it.

``megatron.core.dist_checkpointing.strategies.filesystem_async`` (0.16.1 ``_get_write_results_queue``, 0.19.2
``get_write_results_queue``) keeps one ``multiprocessing.get_context("spawn").Manager().Queue()`` per process,
made by the first torch_dist save. The manager's server is a spawned process (``spawn_main``, with a resource
tracker) that multiprocessing shuts down only at a normal interpreter exit: a rank SIGKILLed after a save (the
OOM killer, an elastic restart, ``tests/train/test_checkpoint.py``'s kill during a save) leaves it, and its
resource tracker, running for ever. ``apply()`` sets that queue first, from the same kind of manager whose server
exits once its parent is gone (it polls its parent pid: ``PR_SET_PDEATHSIG`` would fire when the thread that
started it ends, not the process). Megatron then uses this queue as its own. Versions other than
``TESTED_MEGATRON_VERSIONS`` are refused (the queue's name and use may differ).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
import time
from multiprocessing.managers import SyncManager

from patches.megatron_cpu import TESTED_MEGATRON_VERSIONS, MegatronVersionError, _installed_megatron_version

POLL_S = 1.0  # how often the manager's server checks that its parent is alive


def _exit_with_parent(parent: int) -> None:
    """In the manager's server process: exit as soon as ``parent`` is no longer its parent (it died; the orphan
    was re-parented)."""
    def watch():
        while os.getppid() == parent:
            time.sleep(POLL_S)
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


def apply() -> None:
    """Give megatron's checkpoint writer a results queue whose server dies with this process. Idempotent; call
    before the first torch_dist save (``train.checkpoint.save`` does)."""
    version = _installed_megatron_version()
    if version not in TESTED_MEGATRON_VERSIONS:
        raise MegatronVersionError(
            f"patches.megatron_ckpt_queue was tested with megatron-core {', '.join(TESTED_MEGATRON_VERSIONS)}, "
            f"but {version} is installed (its checkpoint writer's results queue may differ)")
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is not None:  # this patch's (or megatron's, made before it)
        return
    manager = SyncManager(ctx=mp.get_context("spawn"))  # what ctx.Manager() makes
    manager.start(_exit_with_parent, (os.getpid(),))
    filesystem_async._results_queue = manager.Queue()  # the proxy keeps its manager (shut down at a normal exit)
