"""The control group: where ranks wait while global rank 0 works alone (a CPU/gloo group with its own timeout).

Rank 0 rolls out, scores and evaluates, starts or attaches to the SGLang servers and talks to them during weight
sync, while every other rank waits for it. On GPUs the world and model-parallel groups are NCCL, whose watchdog
aborts the job when a collective stays pending longer than its group's timeout: a rank waiting there for a
long-CoT rollout would be killed. Those waits happen here instead, in gloo collectives whose timeout
(``distributed.control_timeout_s``) is sized for a whole rollout; no watchdog watches a gloo group, and the NCCL
groups keep a timeout sized for training collectives (``distributed.timeout_s``). Only small objects travel here
(the rollout's samples and rewards, metrics), pickled on the CPU.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist

_GROUP: dist.ProcessGroup | None = None
_TIMEOUT_S: float | None = None


def init(timeout_s: float | None) -> None:
    """Create the control group over every rank (collective), unless one exists with this timeout (or any, when
    ``timeout_s`` is None: a later plain ``init_distributed()`` keeps the trainer's). A new group with
    ``timeout_s=None`` gets torch's default for gloo (30 minutes)."""
    global _GROUP, _TIMEOUT_S
    if _GROUP is not None and timeout_s in (None, _TIMEOUT_S):
        return
    timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
    _GROUP = dist.new_group(backend="gloo", timeout=timeout)
    _TIMEOUT_S = timeout_s


def reset() -> None:
    """Forget the group (``parallel.groups.destroy`` tears down every process group)."""
    global _GROUP, _TIMEOUT_S
    _GROUP, _TIMEOUT_S = None, None


def group() -> dist.ProcessGroup:
    if _GROUP is None:
        raise RuntimeError("the control group does not exist: start torch.distributed with "
                           "gspo_megatron.parallel.groups.init_distributed()")
    return _GROUP


def broadcast_from_rank0(obj: Any = None) -> Any:
    """Global rank 0's ``obj`` on every rank; the others block here, in gloo, until rank 0 sends it."""
    payload = [obj]
    dist.broadcast_object_list(payload, src=0, group=group())
    return payload[0]


def barrier() -> None:
    """Every rank waits here, in gloo, until all arrive (rank 0 last, after its solo work)."""
    dist.barrier(group=group())


def all_gather(obj: Any) -> list:
    """Every rank's ``obj``, in rank order, on every rank (small objects, pickled, in gloo)."""
    out = [None] * dist.get_world_size(group())
    dist.all_gather_object(out, obj, group=group())
    return out
