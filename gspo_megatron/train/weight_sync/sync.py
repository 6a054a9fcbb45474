"""Every rank's side of the weight sync: the policy's weights to the rollout engine, as one weight version.

To SGLang servers (``weight_sync=distributed``) each pipeline stage's first rank sends its stage, gathered onto it
from its replica's shards, one stage after another; for the local engine (or disk sync) every stage's tensors reach
rank 0, which hands them to the engine. The engine's side (buckets, the servers' update calls) is
``rollout.weight_sync`` / ``rollout.sglang_engine``; the export is ``model.bridge``. Whenever the other ranks wait
for rank 0's solo work (the servers' side of the update) they wait in the control group (``parallel.control``).
"""

from __future__ import annotations

import time

import torch.distributed as dist

from gspo_megatron import environment
from gspo_megatron.model.bridge import is_stage_sender
from gspo_megatron.parallel import control
from gspo_megatron.rollout import SGLangEngine, SyncStats
from gspo_megatron.rollout.errors import RolloutError
from gspo_megatron.rollout.weight_sync import consume
from gspo_megatron.train.resilience import fault_injection
from gspo_megatron.train.sampling import colocate
from gspo_megatron.train.weight_sync.pipeline import pipeline_gathered


def sync_weights(policy, engine, version: int) -> dict:
    """Send the policy's weights to the engine as ``version`` (collective over all ranks).

    To SGLang servers by distributed broadcast: one sender per pipeline stage (its first rank:
    ``Bridge.export_to_sender``), each in its own group with the servers, the stages one after another (every server
    then receives the buckets in the same order); only the ranks holding shards of a sender's
    replica gather (to it), the other data-parallel replicas wait. Rank 0 opens the update before any sender sends
    and closes it after the last, then checks the served version. Otherwise (the local engine, disk sync) every
    stage's tensors reach rank 0 (``pipeline_gathered``), which hands them to the engine. The ranks wait for rank
    0's solo work in the control group; inside the export they wait in gathers while their sender sends one bucket
    (``distributed.timeout_s``)."""
    from gspo_megatron.train.startup.performance import params_current

    start = time.perf_counter()
    params_current(policy.model)  # under overlap_param_gather the last step's all-gather is still to come
    if colocate.on_each_node():  # rollout.colocate on several nodes: each node's leader sends its own servers
        metrics = colocate.sync_on_each_node(policy, engine, version)
        metrics["time/weight_sync"] = time.perf_counter() - start
        return metrics
    while True:
        target = control.broadcast_from_rank0(_stage_sync_target(engine) if dist.get_rank() == 0 else None)
        if target is None:
            metrics = _sync_through_rank0(policy, engine, version)
        else:
            metrics = _sync_from_stage_senders(policy, engine, version, target)
        if metrics is not None:
            break
        # A server died inside the update: restarted (rank 0), every rank sends the whole update again.
    metrics["time/weight_sync"] = time.perf_counter() - start
    return metrics


def _stage_sync_target(engine):
    """The servers' ``SyncTarget`` when the engine takes distributed updates from several senders, else None."""
    if isinstance(engine, SGLangEngine) and engine.config.weight_sync.method == "distributed":
        return engine.sync_target()
    return None


# This process's sender (its NCCL group with the servers), per servers' target. Module-level because the group must
# outlive each sync (forming one is a rendezvous with every server) while ``sync_weights`` is a plain function the
# loop and the rollout source call; a restarted server's new epoch replaces the stale entry (``_stage_sender``).
_stage_senders: dict = {}


def _stage_sender(target):
    key = (target.urls, target.backend, target.epoch)
    sender = _stage_senders.get(key)
    if sender is not None and sender.broken:
        sender.close()
        sender = None
    if sender is None:
        for stale in [k for k in _stage_senders if k[:2] == key[:2] and k != key]:  # servers restarted since
            _stage_senders.pop(stale).close()
        sender = _stage_senders[key] = target.connect(environment.device(), tag=f"_r{dist.get_rank()}")
    return sender


def _sync_from_stage_senders(policy, engine, version, target) -> dict | None:
    """The distributed update from every stage's sender; None when a server died inside it and rank 0 restarted
    the servers (then every rank sends it again). A sender that fails goes on walking the export (its gathers run
    in step on every rank of its replica) and reports the failure to every rank."""
    from megatron.core import parallel_state as ps

    rank0 = dist.get_rank() == 0
    start = time.perf_counter()
    stages, my_stage = ps.get_pipeline_model_parallel_world_size(), ps.get_pipeline_model_parallel_rank()
    if rank0:
        assert is_stage_sender() and my_stage == 0, "global rank 0 must be the first pipeline stage's sender"
    sender, problem = None, None
    # Each sender joins its group with the servers (on first use) one stage after another, rank 0 as it opens the
    # update: a server joins one group at a time, so two senders forming theirs at once could be joined in opposite
    # orders by two servers, each then waiting in one group's rendezvous for the other (seen in CI, PP2 with two
    # servers: "2/3 clients joined" in both groups until weight_sync.timeout_s).
    for stage in range(stages):
        if stage == my_stage and is_stage_sender():
            try:
                if rank0:
                    sender = engine.begin_distributed_update(str(version))
                    if isinstance(version, int):
                        fault_injection.at("weight_sync", version, engine)  # the soak run's schedule (GSPO_FAULTS)
                else:
                    sender = _stage_sender(target)
            except (RolloutError, RuntimeError, OSError) as e:  # a server gone: its group or its update cannot start
                problem = f"rank {dist.get_rank()}: {type(e).__name__}: {e}"
        control.barrier()  # this stage's group formed (and, after stage 0, the update open) before the next
    begun = time.perf_counter()
    sent = None
    # Stage by stage, so that every server receives the buckets in one order: a server takes one update call at a
    # time and broadcasts on that call's group, so two stages sending at once could be taken in opposite orders by
    # two servers, each then waiting in one stage's broadcast for the other (until weight_sync.timeout_s).
    failed = False  # some rank failed in an earlier stage: the update is sent again anyway, later stages skip it
    for stage in range(stages):
        if stage == my_stage:
            exported = policy.bridge.export_to_sender(policy.model)
            if sender is not None and problem is None and not failed:
                try:
                    stats = sender.send_buckets(exported, target.config)
                    sent = (stats.seconds, stats.num_tensors, stats.num_bytes, stats.num_buckets, stats.phases)
                except (RolloutError, RuntimeError, OSError) as e:
                    problem = f"rank {dist.get_rank()}: {type(e).__name__}: {e}"
            consume(exported)  # this rank's shards go to its sender (or, in another replica, nothing to do);
            # after a failed (or skipped) send, the rest of the export, in step with the replica's other ranks
        if stage + 1 < stages:  # the next stage starts when this one is done
            failed = any(control.all_gather(problem is not None))
    reports = control.all_gather((sent, problem))
    parts = [p for p, _ in reports if p is not None]
    problems = [q for _, q in reports if q is not None]
    metrics = {}
    if rank0 and not problems:
        # Phases of the slowest sender (the one the update waited for), and the whole update's bytes and time.
        slowest = max(parts, key=lambda p: p[0])
        phases = {"begin": begun - start, "send": time.perf_counter() - begun, **slowest[4]}
        t = time.perf_counter()
        totals = (sum(p[1] for p in parts), sum(p[2] for p in parts), sum(p[3] for p in parts))
        try:
            engine.end_distributed_update(str(version), SyncStats("distributed", str(version), t - start, *totals,
                                                                  phases))
        except (RolloutError, RuntimeError, OSError) as e:
            problems.append(f"rank 0 ending the update: {type(e).__name__}: {e}")
        phases["end"] = time.perf_counter() - t
        stats = SyncStats("distributed", str(version), time.perf_counter() - start, *totals, phases)
        metrics = {f"weight_sync/{k.split('/')[-1]}": v for k, v in stats.metrics().items()}
        metrics["weight_sync/senders"] = float(len(parts))
    outcome = None
    if rank0:
        outcome = "ok"
        if problems:
            try:
                engine.recover_failed_update("; ".join(problems))
                outcome = "again"
            except RolloutError as e:
                outcome = e
    outcome = control.broadcast_from_rank0(outcome)
    if isinstance(outcome, Exception):
        raise outcome
    return metrics if outcome == "ok" else None


def _sync_through_rank0(policy, engine, version) -> dict:
    """Every stage's tensors to rank 0, which gives them to the engine (the local engine, disk sync)."""
    tensors = _after_control_barrier(pipeline_gathered(policy.bridge, policy.model))
    if dist.get_rank() == 0:
        stats = engine.update_weights(tensors, str(version))  # pulls the first tensor once the servers are ready
        metrics = {f"weight_sync/{k.split('/')[-1]}": v for k, v in stats.metrics().items()}
    else:
        for _ in tensors:  # the export gathers over TP/EP (and PP): every rank walks it in step
            pass
        metrics = {}
    control.barrier()
    return metrics


def _after_control_barrier(tensors):
    """``tensors``, once every rank has reached the control barrier (rank 0 reaches it when the engine asks for
    the first tensor, after its own set-up)."""
    control.barrier()
    yield from tensors
