"""Colocated rollouts: SGLang engines on the trainer's GPUs, their memory handed to training and back around each
update, the new weights passed as tensor handles (``rollout.colocate``).

One step, seen from the servers (SGLang 0.5.23):

    generate                                                     (rollout: the engines hold weights + KV cache)
    POST /flush_cache?timeout=T       wait until idle (release asserts it: a busy server's scheduler dies)
    POST /release_memory_occupation   {"tags": ["kv_cache", "weights", ("cuda_graph")]}
    ... training: old log-probs, update ...
    POST /resume_memory_occupation    {"tags": ["weights"]}      (first the weights: the sync writes into them)
    POST /begin_weight_update
    for each bucket: POST /update_weights_from_tensor {serialized_named_tensors: [payload per engine TP rank],
                                                       load_format: "flattened_bucket", flush_cache: false}
    POST /end_weight_update, /update_weight_version, /flush_cache
    POST /resume_memory_occupation    {"tags": ["kv_cache", ("cuda_graph")]}   (last: the sync's buckets are gone)

A payload is one bucket (consecutive tensors up to ``bucket_bytes``, each aligned to its dtype: ``weight_sync.buckets``;
cast to ``weight_sync.dtype`` but the router's fp32 bias: ``mapping.export_dtype``) packed into one byte buffer, pickled
as ``{"flattened_tensor": buffer, "metadata": [...]}``, SGLang's ``flattened_bucket`` form: the pickle carries a
*handle* to the buffer, not its bytes. On CUDA the handle is a CUDA IPC handle (torch's ``reduce_tensor``) whose device
is named by UUID, as SGLang's ``monkey_patch_torch_reductions`` expects (a server's CUDA_VISIBLE_DEVICES numbers the
GPUs differently). On CPU it is a shared-memory file name (torch's ``file_system``
sharing: ``rebuild_storage_filename``), which any process can open; the default ``file_descriptor`` sharing passes
a descriptor through multiprocessing's resource sharer, which only the sender's own children can reach. The metadata
are ``SimpleNamespace``s, which SGLang's restricted unpickler allows, so the trainer does not import sglang.

Full HF tensors through the model's ``load_weights``, not pre-sharded ones with ``load_format="direct"``: the export
is the one every other sync uses (the bridge's gathered Hugging Face tensors, one mapping table), and SGLang's
``load_weights`` does its own fusing (qkv_proj, gate_up_proj, the experts' w13/w2 stacks) and TP slicing, which
differ per model family and SGLang version; ``direct`` copies into SGLang's internal parameters by their internal
names and shapes, so the trainer would need a second table, per TP size, for SGLang's layout. The cost of the full
tensors is that every engine rank reads every whole tensor: on one GPU a device-local copy, cheap next to training.

Every engine rank gets the same payload here (the handle of the sender's buffer: rank 0's, or on several nodes each
node leader's for its own servers, ``train/sampling/colocate.py``): correct, one producer per node, and on GPUs a
peer read over NVLink for engine ranks on other GPUs. Per-rank payloads (each trainer rank sending its own GPU's copy)
are the next step on GPUs and need the trainer's ranks to gather their handles to rank 0 (not run: no GPU here).

On CPU (``--device cpu``) ``--enable-memory-saver`` needs torch_memory_saver, which is CUDA-only (a server started
with it fails to import it): a CPU server runs SGLang's no-op memory saver, so release / resume answer 200 and free
nothing (release flushes the KV cache and stashes the model's buffers, resume restores them); the protocol, its order
and the idle rule are what a CPU run checks.
"""

from __future__ import annotations

import base64
import io
import logging
import time
import types
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.reduction import ForkingPickler

import torch

from ..model.mapping import export_dtype
from .client import HttpClient, RetryPolicy
from .config import WeightSyncConfig
from .errors import RolloutError, WeightSyncError
from .types import NamedTensors, SyncStats
from .weight_sync import _post, buckets, finish, sent_tensors

log = logging.getLogger(__name__)

# SGLang's memory tags (sglang.srt.constants GPU_MEMORY_TYPE_*). CUDA graphs exist only on GPUs.
KV_CACHE, WEIGHTS, CUDA_GRAPH = "kv_cache", "weights", "cuda_graph"


def memory_tags(device: str) -> tuple[str, ...]:
    """Every tag a server on ``device`` holds memory under."""
    return (KV_CACHE, WEIGHTS, CUDA_GRAPH) if device == "cuda" else (KV_CACHE, WEIGHTS)


class ColocationError(WeightSyncError):
    """A step of the colocated protocol failed (a server not idle, release / resume refused)."""


def _all(clients: list[HttpClient], path: str, body: dict | None, timeout: float, step: str) -> None:
    with ThreadPoolExecutor(max_workers=max(1, len(clients))) as pool:
        for call in [pool.submit(_post, c, path, body, timeout, step) for c in clients]:
            call.result()


def release_memory(clients: list[HttpClient], tags: tuple[str, ...], idle_timeout_s: float, timeout: float) -> None:
    """Hand the servers' memory under ``tags`` to training. SGLang 0.5.23 asserts the server is idle inside its
    scheduler (an AssertionError there ends the scheduler), so each server first drains: ``/flush_cache`` with a
    timeout waits until nothing runs or waits, then flushes, and answers 400 if that took longer."""
    try:
        _all(clients, f"/flush_cache?timeout={idle_timeout_s:g}", None, idle_timeout_s + timeout, "drain (flush_cache)")
    except WeightSyncError as e:
        raise ColocationError(f"a server was not idle within {idle_timeout_s:.0f} s, so its memory cannot be "
                              f"released (requests still running?): {e}") from e
    _all(clients, "/release_memory_occupation", {"tags": list(tags)}, timeout, f"release_memory_occupation{list(tags)}")


def resume_memory(clients: list[HttpClient], tags: tuple[str, ...], timeout: float) -> None:
    """Give the servers back their memory under ``tags`` (weights before a sync, the KV cache after it)."""
    _all(clients, "/resume_memory_occupation", {"tags": list(tags)}, timeout, f"resume_memory_occupation{list(tags)}")


# ---- the payload ----------------------------------------------------------------------------------------------


def _reduce_cpu_storage(storage):
    """A CPU storage as a shared-memory file name (torch's ``file_system`` strategy, without changing the process's
    global sharing strategy): moved into shared memory on first use, the same name afterwards."""
    from torch.multiprocessing.reductions import rebuild_storage_filename

    if storage.device.type != "cpu":
        raise WeightSyncError(f"colocated sync: a {storage.device} storage reached the CPU reducer")
    manager, handle, size = storage._share_filename_cpu_()
    storage._shared_incref()  # the receiver's rebuild decrements it
    return rebuild_storage_filename, (type(storage), manager, handle, size)


def _reduce_tensor(tensor: torch.Tensor):
    """torch's tensor reducer; a CUDA tensor's device named by UUID (``_rebuild_cuda_tensor_modified`` in SGLang
    maps it to the server's own device index)."""
    from torch.multiprocessing import reductions

    rebuild, args = reductions.reduce_tensor(tensor)
    if tensor.is_cuda:
        device_uuid = str(torch.cuda.get_device_properties(tensor.device.index).uuid)
        args = (*args[:6], device_uuid, *args[7:])  # args[6]: the device index (torch's reduce_tensor layout)
    return rebuild, args


def serialize(obj) -> str:
    """``obj`` pickled with tensor handles (not bytes), base64 for JSON: what SGLang's ``MultiprocessingSerializer``
    reads from ``serialized_named_tensors``."""
    import torch.multiprocessing  # noqa: F401  (registers torch's reducers with ForkingPickler)

    out = io.BytesIO()
    pickler = ForkingPickler(out)
    pickler.dispatch_table[torch.Tensor] = _reduce_tensor
    pickler.dispatch_table[torch.UntypedStorage] = _reduce_cpu_storage
    pickler.dump(obj)
    return base64.b64encode(out.getvalue()).decode()


def pack(bucket: list[tuple[str, torch.Tensor]], buffer: torch.Tensor | None, dtype: torch.dtype | None
         ) -> tuple[dict, torch.Tensor]:
    """(SGLang's flattened bucket: the packed bytes and each tensor's place in them, the buffer used). ``buffer`` is
    reused when large enough (its handle stays valid: a server has copied a bucket out before it answers)."""
    send = [(n, t.detach().to(export_dtype(n, t, dtype))) for n, t in bucket]
    total = sum(t.numel() * t.element_size() for _, t in send)
    device = send[0][1].device
    if buffer is None or buffer.numel() < total or buffer.device != device:
        buffer = torch.empty(total, dtype=torch.uint8, device=device)
    metadata, offset = [], 0
    for name, tensor in send:
        nbytes = tensor.numel() * tensor.element_size()
        buffer[offset:offset + nbytes].view(tensor.dtype).copy_(tensor.reshape(-1))
        metadata.append(types.SimpleNamespace(name=name, shape=tensor.shape, dtype=tensor.dtype, start_idx=offset,
                                              end_idx=offset + nbytes, numel=nbytes))
        offset += nbytes
    return {"flattened_tensor": buffer[:total], "metadata": metadata}, buffer


def send_tensors(clients: list[HttpClient], tp_sizes: list[int], named_tensors: NamedTensors, version: str,
                 config: WeightSyncConfig) -> SyncStats:
    """One update to ``version`` through ``update_weights_from_tensor``: begin, a payload per bucket (the same one
    for every engine TP rank), end, version, flush. The servers' weights must be resumed."""
    start = time.perf_counter()
    timeout = config.timeout_s
    dtype = getattr(torch, config.dtype) if config.dtype else None
    phases = dict.fromkeys(("begin", "export", "pack", "transfer", "end"), 0.0)
    _all(clients, "/begin_weight_update", None, timeout, "begin_weight_update")
    phases["begin"] = time.perf_counter() - start
    num_tensors = num_bytes = num_buckets = 0
    slots: list[torch.Tensor | None] = [None]  # one buffer: each bucket's call returns after the servers copied it
    source = iter(buckets(sent_tensors(named_tensors, config), config.bucket_bytes, dtype))  # FP8: quantized here
    try:
        while True:
            t0 = time.perf_counter()
            bucket = next(source, None)
            t1 = time.perf_counter()
            phases["export"] += t1 - t0
            if bucket is None:
                break
            flat, slots[0] = pack(bucket, slots[0], dtype)
            payload = serialize(flat)
            t2 = time.perf_counter()
            phases["pack"] += t2 - t1
            what = f"update_weights_from_tensor (bucket {num_buckets}: {bucket[0][0]} ... {bucket[-1][0]})"
            with ThreadPoolExecutor(max_workers=max(1, len(clients))) as pool:
                calls = [pool.submit(_post, c, "/update_weights_from_tensor",
                                     {"serialized_named_tensors": [payload] * tp, "load_format": "flattened_bucket",
                                      "flush_cache": False}, timeout, what)
                         for c, tp in zip(clients, tp_sizes)]
                for call in calls:
                    call.result()
            phases["transfer"] += time.perf_counter() - t2
            num_tensors += len(bucket)
            num_bytes += flat["flattened_tensor"].numel()
            num_buckets += 1
            flat = bucket = None
    finally:
        slots[0] = None  # no trainer memory held between updates
    t3 = time.perf_counter()
    _all(clients, "/end_weight_update", None, timeout, "end_weight_update")
    finish(clients, version, timeout)
    phases["end"] = time.perf_counter() - t3
    return SyncStats("tensor", version, time.perf_counter() - start, num_tensors, num_bytes, num_buckets, phases)


class Colocation:
    """The colocated protocol for one engine's servers: ``release`` after a rollout, ``resume_weights`` then the
    tensor sync (``SGLangEngine.update_weights(..., method="tensor")``) then ``resume_kv_cache`` after an update.
    ``released``: the tags currently handed to training."""

    def __init__(self, urls: list[str], device: str, timeout_s: float = 600.0, idle_timeout_s: float = 60.0):
        self.clients = [HttpClient(u, RetryPolicy(0), timeout_s) for u in urls]
        self.tags = memory_tags(device)
        self.timeout_s, self.idle_timeout_s = timeout_s, idle_timeout_s
        self.released: tuple[str, ...] = ()
        self.seconds: dict[str, float] = {}

    def release(self) -> None:
        start = time.perf_counter()
        release_memory(self.clients, self.tags, self.idle_timeout_s, self.timeout_s)
        self.released = self.tags
        self.seconds["release"] = time.perf_counter() - start

    def resume_weights(self) -> None:
        self._resume((WEIGHTS,))

    def resume_kv_cache(self) -> None:
        self._resume(tuple(t for t in self.released if t != WEIGHTS))

    def _resume(self, tags: tuple[str, ...]) -> None:
        tags = tuple(t for t in tags if t in self.released)
        if not tags:
            return
        start = time.perf_counter()
        resume_memory(self.clients, tags, self.timeout_s)
        self.released = tuple(t for t in self.released if t not in tags)
        self.seconds[f"resume_{'_'.join(tags)}"] = time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"colocate/{k}_seconds": v for k, v in self.seconds.items()}


def check_generating_allowed(colocation: Colocation | None) -> None:
    """Generation needs the weights and the KV cache back."""
    if colocation is not None and colocation.released:
        raise RolloutError(f"the colocated servers' memory {list(colocation.released)} is released to training: "
                           "resume it before generating")
