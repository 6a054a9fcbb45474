"""A process group joining the trainer's rank 0 with the SGLang servers' ranks, apart from any default group.

The servers create their side in ``/init_weights_update_group`` with SGLang's ``init_custom_process_group``; this
is the trainer's side of the same construction (rank 0, which also hosts the TCP store). It uses torch's private
``_new_process_group_helper``, as SGLang, verl and slime do, because ``torch.distributed.new_group`` can only make
subgroups of the default world, and the servers are not in the trainer's world. Checked with torch 2.13.
"""

from __future__ import annotations

import os

from datetime import timedelta

import torch.distributed as dist


def init_custom_process_group(backend: str, init_method: str, world_size: int, rank: int, group_name: str,
                              timeout_s: float) -> dist.ProcessGroup:
    from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

    timeout = timedelta(seconds=timeout_s)
    # Under torchrun, TORCHELASTIC_USE_AGENT_STORE makes every rendezvous a *client* of torchrun's agent store;
    # this group's store is ours to host (the servers connect to it), so the flag must not apply here.
    agent_store = os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    try:
        store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    finally:
        if agent_store is not None:
            os.environ["TORCHELASTIC_USE_AGENT_STORE"] = agent_store
    store.set_timeout(timeout)
    store = PrefixStore(group_name, store)  # the same prefix the servers use
    group, _ = _new_process_group_helper(world_size, rank, [], Backend(backend), store, group_name=group_name,
                                         timeout=timeout)
    _world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def destroy(group: dist.ProcessGroup | None) -> None:
    if group is not None:
        try:
            dist.destroy_process_group(group)
        except Exception:  # already torn down with a dead peer: nothing left to release
            pass
