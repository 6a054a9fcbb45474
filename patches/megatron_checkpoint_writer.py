"""megatron-core's checkpoint writer: the process behind its results queue dies with the rank that started it.

``dist_checkpointing.strategies.filesystem_async._get_write_results_queue`` (megatron-core 0.16.1;
``get_write_results_queue(mp_mode)`` in 0.19.2: ``QUEUE_FUNCTION`` names it per tested version) starts a ``multiprocessing`` Manager, a spawned server process, at a
rank's first torch_dist save and keeps it for the rank's life. A clean exit stops it; a rank that is SIGKILLed (a
crash, the OOM killer, torchrun stopping a failed attempt, ``train.resilience.elastic``) leaves it running, one per rank and
attempt, holding the rank's stdout and stderr open. ``apply()`` gives the queue a Manager whose process asks the
kernel for SIGKILL when the rank dies (PR_SET_PDEATHSIG, Linux); the queue is the same kind of object. On other
versions (or systems) it changes nothing and warns once, naming the tested ones: the leak is a nuisance, not a reason
to stop a run at its first checkpoint.
"""

from __future__ import annotations

import ctypes
import signal
import sys
import warnings

QUEUE_FUNCTION = {"0.16.1": "_get_write_results_queue", "0.19.2": "get_write_results_queue"}

_refused: list = []  # warned once
_manager = None  # the SyncManager behind the queue, kept for the rank's life (megatron keeps its queue as long)


def _die_with_parent() -> None:
    """In the Manager's process at its start: SIGKILL me when the thread that started me exits (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def _results_queue(mp_mode: str = "spawn"):
    """megatron's queue function (``QUEUE_FUNCTION``) with a Manager that dies with this rank."""
    global _manager
    import multiprocessing as mp
    from multiprocessing.managers import SyncManager

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if filesystem_async._results_queue is None:
        _manager = SyncManager(ctx=mp.get_context(mp_mode))
        _manager.start(initializer=_die_with_parent)
        filesystem_async._results_queue = _manager.Queue()
    return filesystem_async._results_queue


def apply() -> None:
    """Idempotent; call before the first checkpoint save (``train.records.checkpoint.save`` does)."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from patches.megatron_cpu import _installed_megatron_version

    version = _installed_megatron_version()
    name = QUEUE_FUNCTION.get(version)
    if name is None or not sys.platform.startswith("linux"):
        if not _refused:
            warnings.warn(f"patches.megatron_checkpoint_writer is for megatron-core {', '.join(QUEUE_FUNCTION)} on Linux, "
                          f"not {version} on {sys.platform}: not applied, so a SIGKILLed rank leaves its checkpoint "
                          "writer's Manager process running (update the patch from this version's "
                          "dist_checkpointing/strategies/filesystem_async.py)")
            _refused.append(version)
        return
    setattr(filesystem_async, name, _results_queue)
