"""The trainer's side of colocated rollouts (``rollout.colocate``; the protocol: ``rollout/colocate.py``).

The loop calls ``release`` once the step's rollout is in hand: the servers hand their weights and KV cache to
training. The weight sync (``SGLangEngine.update_weights``, method ``tensor``) gives them back: weights first, the
new ones written into them, then the KV cache. With ``rollout.colocate_offload=optimizer`` the trainer hands over
its own memory too: ``TrainerState.offload`` after each update (before the sync resumes the servers), ``reload``
before the next update (after the release).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from gspo_megatron.parallel import control
from gspo_megatron.rollout.errors import RolloutError
from gspo_megatron.train.startup.config import Config, ConfigError


OFFLOADS = ("none", "optimizer")  # rollout.colocate_offload


def validate(cfg: Config) -> None:
    """What colocation needs, checked before anything starts."""
    r = cfg.rollout
    if r.colocate_offload not in OFFLOADS:
        raise ConfigError(f"rollout.colocate_offload={r.colocate_offload!r} is not one of {', '.join(OFFLOADS)}")
    if r.colocate_offload != "none" and not r.colocate:
        raise ConfigError(f"rollout.colocate_offload={r.colocate_offload} needs rollout.colocate=true (it hands the "
                          "trainer's memory to colocated servers); set rollout.colocate_offload=none")
    if not r.colocate:
        return
    refused = [
        (r.engine != "sglang", f"rollout.engine={r.engine}", "set rollout.engine=sglang (the local engine already "
                                                             "shares the trainer's process)"),
        (r.mode != "sync", f"rollout.mode={r.mode}", "set rollout.mode=sync: generation ahead of the update would "
                                                     "need the memory training holds"),
        (r.partial_chunk_tokens is not None, f"rollout.partial_chunk_tokens={r.partial_chunk_tokens}",
         "unset it: carried samples would keep KV cache through the update"),
        (r.weight_sync == "disk", "rollout.weight_sync=disk", "leave rollout.weight_sync at its default: colocated "
                                                              "servers take the weights as tensor handles"),
        (bool(r.urls), f"rollout.urls={r.urls}", "leave rollout.urls empty: the trainer launches its colocated "
                                                 "servers itself (tensor handles reach servers on its own node only)"),
    ]
    for bad, what, fix in refused:
        if bad:
            raise ConfigError(f"rollout.colocate=true with {what}: {fix}")


def release(engine, cfg: Config) -> dict:
    """After the rollout (collective): rank 0's servers release their memory to training; the other ranks wait
    for it in the control group, so none allocates on a GPU before its server has let go. Returns the time taken."""
    if not cfg.rollout.colocate:
        return {}
    metrics = {}
    if dist.get_rank() == 0 and engine.colocation is not None:
        engine.colocation.release()
        metrics = {"colocate/release_seconds": engine.colocation.seconds["release"]}
    control.barrier()
    return metrics


# ---- several nodes: each node's leader launches its servers and sends them the update ---------------------------
#
# CUDA IPC handles open only on the GPUs of the node that made them, so on several nodes every node's leader (its
# LOCAL_RANK 0) launches that node's servers on its own GPUs and writes each update into them from its own copy of
# the full Hugging Face tensors, which the export already gives every first-stage rank (``pipeline_gathered``:
# gathered over TP / EP onto each rank). Rank 0's engine attaches to every node's servers by URL: it generates on
# all of them and releases / resumes all of them (plain HTTP); only the update's payloads come from each node.


class _Nodes:
    """This process's view of the nodes: how many, and (on a leader) its node's launched servers."""

    count: int | None = None
    servers: list = []
    config = None  # the leader's servers' SGLangConfig


def on_several_nodes(cfg: Config) -> bool:
    """``rollout.colocate`` over more than one trainer node: ranks with LOCAL_RANK 0, as torchrun numbers them
    (collective; ``make_engine`` asks once per run, ``on_each_node`` remembers the answer)."""
    _Nodes.count = sum(control.all_gather(int(os.environ.get("LOCAL_RANK", "0")) == 0)) if cfg.rollout.colocate else 1
    return _Nodes.count > 1


def node_address() -> str:
    """This node's address toward the trainer's master (MASTER_ADDR): the one rank 0 reaches it on (the loopback
    when the master is on this host, as in the CPU tests). A UDP connect sends nothing; it only picks the route."""
    import socket

    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master, int(os.environ.get("MASTER_PORT", "29500"))))
        return s.getsockname()[0]


def engine_on_each_node(cfg: Config, config):
    """Every node's leader launches ``config``'s servers on its node (collective); rank 0 gets an engine attached
    to all of them, the other ranks None. A leader's failure to launch is raised on every rank."""
    from dataclasses import replace
    from pathlib import Path

    from gspo_megatron.rollout import SGLangEngine
    from gspo_megatron.rollout.server import launch_servers
    from gspo_megatron.train.resilience import preemption

    if cfg.parallel.pipeline > 1:
        raise ConfigError(f"rollout.colocate on {_Nodes.count} nodes with parallel.pipeline={cfg.parallel.pipeline}: each "
                          "node's leader sends its servers the full tensors only the first stage's ranks hold; set "
                          "parallel.pipeline=1 or use separate rollout servers")
    node = int(os.environ.get("GROUP_RANK", dist.get_rank() // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    urls, problem = [], None
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        config = replace(config, host=node_address())
        if config.log_dir:
            config = replace(config, log_dir=str(Path(config.log_dir) / f"node_{node}"))
        try:
            _Nodes.servers, _Nodes.config = launch_servers(config, preemption.requested), config
            urls = [s.url for s in _Nodes.servers]
        except Exception as e:  # every rank must hear of it, not wait for this leader forever
            problem = f"node {node} (rank {dist.get_rank()}): {type(e).__name__}: {e}"
    reports = control.all_gather((urls, problem))
    problems = [p for _, p in reports if p]
    if problems:
        raise RolloutError(f"colocated servers failed to start: {'; '.join(problems)}")
    every = tuple(u for us, _ in reports for u in us)
    engine = SGLangEngine(replace(config, urls=every), stop=preemption.requested) if dist.get_rank() == 0 else None
    control.barrier()
    return engine


def on_each_node() -> bool:
    """The weight sync goes through each node's leader (``sync_on_each_node``)."""
    return (_Nodes.count or 1) > 1


def sync_on_each_node(policy, engine, version) -> dict:
    """The colocated update on several nodes (collective): rank 0 resumes every server's weights; each leader
    writes the export into its node's servers through ``update_weights_from_tensor`` (its own handles), the other
    ranks walk the export in step (it gathers over TP / EP); rank 0 resumes the KV caches and checks every server
    serves ``version``. A failure anywhere is raised on every rank."""
    from gspo_megatron.rollout import SyncStats
    from gspo_megatron.rollout.client import HttpClient, RetryPolicy
    from gspo_megatron.rollout.colocate import send_tensors
    from gspo_megatron.train.weight_sync.pipeline import pipeline_gathered

    start, version, rank0 = time.perf_counter(), str(version), dist.get_rank() == 0
    problem = None
    if rank0:
        try:
            engine.begin_tensor_update(version)
        except (RolloutError, RuntimeError, OSError) as e:
            problem = f"rank 0 resuming the servers: {type(e).__name__}: {e}"
    problem = control.broadcast_from_rank0(problem)
    if problem:
        raise RolloutError(problem)
    tensors = pipeline_gathered(policy.bridge, policy.model)
    sent = None
    if _Nodes.servers:
        c = _Nodes.config
        clients = [HttpClient(s.url, RetryPolicy(0), c.weight_sync.timeout_s) for s in _Nodes.servers]
        try:
            stats = send_tensors(clients, [max(1, len(g)) for g in c.gpu_groups], tensors, version, c.weight_sync)
            sent = (stats.seconds, stats.num_tensors, stats.num_bytes, stats.num_buckets, stats.phases)
        except (RolloutError, RuntimeError, OSError) as e:
            problem = f"rank {dist.get_rank()}: {type(e).__name__}: {e}"
    for _ in tensors:  # the rest of the export (all of it off the leaders), in step with every rank
        pass
    reports = control.all_gather((sent, problem))
    problems = [p for _, p in reports if p]
    metrics = {}
    if rank0 and not problems:
        parts = [p for p, _ in reports if p is not None]
        slowest = max(parts, key=lambda p: p[0])
        stats = SyncStats("tensor", version, time.perf_counter() - start, slowest[1], sum(p[2] for p in parts),
                          slowest[3], slowest[4])
        try:
            engine.end_tensor_update(version, stats)
            metrics = {f"weight_sync/{k.split('/')[-1]}": v for k, v in stats.metrics().items()}
            metrics["weight_sync/senders"] = float(len(parts))
        except (RolloutError, RuntimeError, OSError) as e:
            problems.append(f"rank 0 ending the update: {type(e).__name__}: {e}")
    problems = control.broadcast_from_rank0(problems)
    if problems:
        raise RolloutError(f"the colocated update to {version} failed: {'; '.join(problems)}")
    return metrics


# ---- the trainer's memory between updates (rollout.colocate_offload) -----------------------------------------


def _torch_optimizers(optimizer) -> list:
    """The torch optimizers inside a Megatron optimizer (``ChainedOptimizer``, ``.optimizer`` wrappers) or itself."""
    if hasattr(optimizer, "chained_optimizers"):
        return [t for o in optimizer.chained_optimizers for t in _torch_optimizers(o)]
    inner = getattr(optimizer, "optimizer", None)
    return _torch_optimizers(inner) if inner is not None and inner is not optimizer else [optimizer]


def _owns_storage(t: torch.Tensor) -> bool:
    """Freeing ``t``'s storage frees ``t`` and nothing else (no view of a larger buffer)."""
    return t.storage_offset() == 0 and t.untyped_storage().nbytes() == t.numel() * t.element_size()


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class TrainerState:
    """What only the optimizer step needs, off the device between updates (``rollout.colocate_offload=optimizer``):
    ``offload`` after an update, ``reload`` before the next.

    Offloaded: every optimizer-state tensor on ``device`` (Adam's ``exp_avg`` / ``exp_avg_sq``; on the CPU also its
    ``step``) and every optimizer parameter on ``device`` that is not a model parameter's storage (the fp32 master
    weights of bf16 training; in fp32 training the optimizer steps the model's own parameters, which stay). Each is
    copied to host memory (pinned under CUDA), the optimizer is pointed at the copy (a checkpoint saved meanwhile
    reads it), and the original's storage is freed (``untyped_storage().resize_(0)``: the tensor object survives, so
    every reference to it stays valid). ``reload`` regrows each storage, copies the values back and points the
    optimizer at the originals again: the values are bit for bit the same. Tensors that share a storage with another
    (views of one buffer) are left in place. The DDP gradient buffers are freed too (megatron-core's own
    ``offload_grad_buffers`` / ``restore_grad_buffers``, 0.16 and 0.19: resized to 0, regrown zeroed; the update
    zeroes them first anyway). On the CPU (tests) ``device`` is the CPU: the same moves, observable as freed
    storages."""

    def __init__(self, model, optimizer, device: torch.device, mode: str):
        self.model, self.optimizer, self.device, self.mode = model, optimizer, torch.device(device), mode
        self.moved: list[tuple[dict | torch.Tensor, object, torch.Tensor, torch.Tensor]] = []  # (where, key, orig, host)
        self.grad_buffers_freed = False

    def _tensors(self):
        """(container, key, tensor) for each optimizer state tensor and master parameter on ``self.device``, each
        the only tensor on its storage."""
        model_storages = {p.untyped_storage().data_ptr() for p in self.model.parameters()}
        found = []
        for opt in _torch_optimizers(self.optimizer):
            for group in opt.param_groups:
                for p in group["params"]:
                    if p.untyped_storage().data_ptr() not in model_storages:
                        found.append((p, None, p.data))
            for state in opt.state.values():
                found += [(state, k, v) for k, v in state.items() if isinstance(v, torch.Tensor)]
        found = [f for f in found if f[2].device == self.device and f[2].numel() > 0 and _owns_storage(f[2])]
        seen: dict[int, int] = {}
        for _, _, t in found:
            seen[t.untyped_storage().data_ptr()] = seen.get(t.untyped_storage().data_ptr(), 0) + 1
        return [f for f in found if seen[f[2].untyped_storage().data_ptr()] == 1]

    def offload(self) -> dict:
        if self.mode == "none" or self.moved or self.grad_buffers_freed:
            return {}
        start = time.perf_counter()
        pin = self.device.type == "cuda"
        for where, key, orig in self._tensors():
            host = torch.empty(orig.shape, dtype=orig.dtype, pin_memory=pin)
            host.copy_(orig, non_blocking=pin)
            self.moved.append((where, key, orig, host))
        _synchronize(self.device)  # every copy landed before a storage is freed
        grad_bytes = 0
        if hasattr(self.model, "offload_grad_buffers"):
            buffers = self.model.buffers + self.model.expert_parallel_buffers
            grad_bytes = sum(b.grad_data.numel() * b.grad_data.element_size() for b in buffers
                             if b.grad_data is not None)
            self.model.offload_grad_buffers(synchronize=False, empty_cache=False)
            self.grad_buffers_freed = True
        for where, key, orig, host in self.moved:
            if key is None:
                where.data = host
            else:
                where[key] = host
            orig.untyped_storage().resize_(0)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # the freed blocks back to the driver, for the servers to take
        return {"colocate/offload_bytes": sum(h.numel() * h.element_size() for *_, h in self.moved),
                "colocate/grad_buffer_bytes": grad_bytes, "colocate/offload_seconds": time.perf_counter() - start}

    def reload(self) -> dict:
        if not self.moved and not self.grad_buffers_freed:
            return {}
        start = time.perf_counter()
        for where, key, orig, host in self.moved:
            orig.untyped_storage().resize_(host.numel() * host.element_size())
            orig.copy_(host, non_blocking=self.device.type == "cuda")
            if key is None:
                where.data = orig
            else:
                where[key] = orig
        if self.grad_buffers_freed:
            self.model.restore_grad_buffers(synchronize=False)
        _synchronize(self.device)  # the copies done before their pinned sources go
        self.moved, self.grad_buffers_freed = [], False
        return {"colocate/reload_seconds": time.perf_counter() - start}


def trainer_state(policy, cfg: Config) -> TrainerState:
    """The policy's ``TrainerState`` under ``rollout.colocate_offload`` (a no-op with ``none``)."""
    from gspo_megatron import environment

    return TrainerState(policy.model, policy.optimizer, environment.device(), cfg.rollout.colocate_offload)
