"""Put the trainer's current weights into running SGLang servers, from an iterator of (HF name, full tensor).

The source is any iterable of ``(hf_checkpoint_name, tensor)`` pairs: the bridge's export of a Megatron model
(TP/EP shards gathered into full Hugging Face tensors, lazily), or ``hf_weights.checkpoint_tensors(hf_model)``.
Names are Hugging Face *checkpoint* names (``...mlp.experts.3.gate_proj.weight``), what SGLang's ``load_weights``
reads.

Distributed (``DistributedSender``), the default: a sender and every server's ranks form one process group
(``/init_weights_update_group``, once per sender); each update is

    POST /begin_weight_update                                              (once, by one sender)
    for each bucket:  POST /update_weights_from_distributed (names, dtypes, shapes)  ||  broadcast it from the sender
    POST /end_weight_update, /update_weight_version, /flush_cache          (once, after every sender is done)

Several senders may send parts of one update (the trainer has one per pipeline stage: ``train.weight_sync.sync``),
each in its own group; ``SyncTarget`` is what a trainer rank needs to become one. A server handles one update call
at a time, whichever sender it comes from.

A bucket is consecutive tensors up to ``bucket_bytes``: one HTTP call per bucket. With ``dtype`` every floating
tensor is cast to it but the router's correction bias, which the engine keeps fp32 (``mapping.export_dtype``): the
names / dtypes / shapes POST carries each tensor's dtype, and SGLang's flattened bucket reads each at its byte offset,
which must be a multiple of its dtype's size (a tensor that would sit unaligned starts the next bucket). The source
produces bucket k+1 (the bridge's gathers) and it is packed while bucket k is on the wire, so about two buckets are alive
at a time (three when ``dtype`` casts). With ``flatten`` a bucket is packed into one of two reused byte buffers and
broadcast at once (SGLang's ``flattened_bucket``): one collective per bucket, what NCCL wants; without it each
tensor is broadcast as it is (no copy), which bench/weight_sync.py measured faster on gloo. ``flatten=None``
(default) chooses by backend: flattened on NCCL, per tensor on gloo. A tensor larger than a bucket is sent alone.

Disk (``save_checkpoint`` + ``/update_weights_from_disk``), the fallback: safetensors shards of at most one
bucket each in a full HF model directory; the servers must see the same file system.

FP8 rollouts (``config.fp8``, a ``model.fp8.Fp8Scheme``): every method streams the tensors through
``fp8.quantized_stream`` before bucketing, so each linear weight leaves as its fp32 ``weight_scale_inv`` followed by
its float8_e4m3fn bytes, quantized as its bucket is formed (one tensor's quantization alive at a time: the peak
stays about two buckets), the pair never split across buckets (``mapping.ends_no_bucket``). gloo has no float8
type, so FP8 buckets are always packed (flattened, bytes): a tensor larger than a bucket then gets a buffer of its
own size for its bucket.

Every step checks the servers' answers and fails with ``WeightSyncError`` naming the server and the step; the
caller then checks that each server reports the new weight version.

One module although over 350 lines: the distributed sender, the disk fallback and the bucketing share the bucket
layout and SGLang's update protocol above, which change together.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Sequence

import torch

from ..model import fp8
from ..model.mapping import ends_no_bucket, export_dtype
from .client import HttpClient, RetryPolicy
from .config import WeightSyncConfig
from .errors import RolloutError, WeightSyncError
from .process_group import destroy, init_custom_process_group
from .types import NamedTensors, SyncStats

log = logging.getLogger(__name__)

# Files of a Hugging Face model directory that are not weights: copied next to the new shards for disk sync.
MODEL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja")


def buckets(named_tensors: NamedTensors, bucket_bytes: int, dtype: torch.dtype | None = None
            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors grouped into buckets of at most ``bucket_bytes``, counted in the *sent* dtype
    (``mapping.export_dtype``: ``dtype``, the router's bias fp32). Dtypes may mix; each tensor starts at a byte
    offset that is a multiple of its dtype's size (else it starts the next bucket), as SGLang's flattened bucket
    reads it. A tensor alone larger than a bucket forms its own bucket. Tensors SGLang joins on load
    (``mapping.LOADED_TOGETHER``) share a bucket, which may then exceed ``bucket_bytes`` by the second one. Lazy:
    holds one bucket at a time."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named_tensors:
        if not isinstance(tensor, torch.Tensor):
            raise WeightSyncError(f"weight {name!r} is a {type(tensor).__name__}, not a tensor")
        send_dtype = export_dtype(name, tensor, dtype)
        nbytes = tensor.numel() * send_dtype.itemsize
        held = bool(bucket) and ends_no_bucket(bucket[-1][0])
        if held and size % send_dtype.itemsize:
            raise WeightSyncError(f"{bucket[-1][0]!r} and {name!r} must share a bucket (SGLang joins them on load) "
                                  f"but {name!r} ({send_dtype}) would sit at unaligned byte {size}")
        if bucket and not held and (size + nbytes > bucket_bytes or size % send_dtype.itemsize):
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def sent_tensors(named_tensors: NamedTensors, config: WeightSyncConfig) -> NamedTensors:
    """What a sync with ``config`` sends of ``named_tensors``: block-FP8 quantized as they stream under
    ``config.fp8``, else themselves."""
    return named_tensors if config.fp8 is None else fp8.quantized_stream(named_tensors, config.fp8)


def _post(client: HttpClient, path: str, body: dict | None, timeout: float, step: str | None = None):
    """POST and check SGLang's ``{"success": ..., "message": ...}`` answer; any failure is a WeightSyncError."""
    try:
        answer = client.post(path, body or {}, timeout=timeout)
    except RolloutError as e:
        raise WeightSyncError(f"{client.url}: {step or path} failed: {e}") from e
    if isinstance(answer, dict) and answer.get("success") is False:
        raise WeightSyncError(f"{client.url}: {step or path} failed: {answer.get('message')}")
    return answer


@dataclass
class _Bucket:
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    payload: list[torch.Tensor]  # what is broadcast: the packed bytes, or the tensors themselves
    flattened: bool
    num_bytes: int


@dataclass(frozen=True)
class SyncTarget:
    """What a trainer rank needs to send weights to the servers itself: the workers, the ranks each brings to a
    weight-sync group (its TP size), the sync settings and the backend. Small and picklable (rank 0's engine
    makes it; the other senders receive it)."""

    urls: tuple[str, ...]
    server_ranks: tuple[int, ...]
    config: WeightSyncConfig
    backend: str
    host: str = ""  # the host whose address ``config.master_address`` is (the engine's)
    epoch: int = 0  # server restarts so far: a sender's group with an earlier epoch's servers is gone

    def address(self) -> str:
        """Where the servers reach a sender in this process: ``config.master_address`` on the engine's host (it
        names that host), else ``trainer_address``'s choice for this host."""
        import socket
        from dataclasses import replace

        config = self.config
        if config.master_address and self.host and socket.gethostname() != self.host:
            config = replace(config, master_address=None)
        return trainer_address(self.urls, config)

    def connect(self, device: torch.device, tag: str = "") -> "DistributedSender":
        """A sender from this process: its own group with every server, reached at ``address()``."""
        from gspo_megatron.parallel.groups import free_port

        clients = [HttpClient(u, RetryPolicy(0), self.config.timeout_s) for u in self.urls]
        return DistributedSender(clients, list(self.server_ranks), self.config, self.backend, device,
                                 master_port=free_port(), master_address=self.address(), tag=tag)


@dataclass
class _InFlight:
    """A bucket on the wire: its broadcasts, the servers' HTTP calls receiving it, when it started."""

    works: list
    calls: list
    what: str
    started: float
    payload: list  # kept alive until the broadcast completes


class DistributedSender:
    """One sender's end of broadcast weight sync to a set of servers (one process group for all of them).
    ``tag`` tells senders of one trainer apart in the servers' group names."""

    def __init__(self, clients: list[HttpClient], server_ranks: list[int], config: WeightSyncConfig, backend: str,
                 device: torch.device, master_port: int, master_address: str = "127.0.0.1", tag: str = ""):
        self.clients, self.config, self.backend, self.device = clients, config, backend, device
        self.world_size = 1 + sum(server_ranks)
        self.group_name = f"{config.group_name}{tag}_{master_port}"
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(clients)), thread_name_prefix="weight_sync")
        self._configure(config)
        offsets = [1 + sum(server_ranks[:i]) for i in range(len(clients))]
        body = lambda offset: {"master_address": master_address, "master_port": master_port,  # noqa: E731
                               "rank_offset": offset, "world_size": self.world_size,
                               "group_name": self.group_name, "backend": backend}
        # Each server joins inside its HTTP call, so the calls run while this rank joins as rank 0.
        calls = [self._pool.submit(_post, c, "/init_weights_update_group", body(o), config.timeout_s)
                 for c, o in zip(clients, offsets)]
        try:
            self.group = init_custom_process_group(backend, f"tcp://{master_address}:{master_port}",
                                                   self.world_size, 0, self.group_name, config.timeout_s)
        except Exception as e:
            failures = [str(c.exception()) for c in calls if c.done() and c.exception()]
            raise WeightSyncError(f"could not form the weight-sync group ({backend}, world {self.world_size}, "
                                  f"port {master_port}) with {[c.url for c in clients]}: {e} {failures}") from e
        for call in calls:
            call.result(timeout=config.timeout_s)
        self.broken = False
        log.info("weight sync: %s group %s of %d ranks with %d server(s)", backend, self.group_name,
                 self.world_size, len(clients))

    def _configure(self, config: WeightSyncConfig) -> None:
        self.config = config
        self._dtype = getattr(torch, config.dtype) if config.dtype else None
        # One collective per bucket on NCCL; on gloo per-tensor broadcasts skip the packing copy (faster there).
        # FP8 buckets always packed: gloo cannot broadcast float8 tensors ("Invalid scalar type"), bytes it can.
        self.flatten = config.flatten if config.flatten is not None else self.backend == "nccl"
        self.flatten = self.flatten or config.fp8 is not None
        self._buffers: list[torch.Tensor | None] = [None, None]

    def _all(self, path: str, body: dict | None = None) -> None:
        calls = [self._pool.submit(_post, c, path, body, self.config.timeout_s) for c in self.clients]
        for call in calls:
            call.result(timeout=self.config.timeout_s)

    def _launch(self, packed: _Bucket, index: int) -> _InFlight:
        """POST the bucket to every server and start its broadcast (asynchronous: ``_await`` completes it)."""
        body = {"names": packed.names, "dtypes": packed.dtypes, "shapes": packed.shapes,
                "group_name": self.group_name, "flush_cache": False,
                "load_format": "flattened_bucket" if packed.flattened else None}
        what = f"update_weights_from_distributed (bucket {index}: {packed.names[0]} ... {packed.names[-1]})"
        calls = [self._pool.submit(_post, c, "/update_weights_from_distributed", body, self.config.timeout_s, what)
                 for c in self.clients]
        started = time.perf_counter()
        works = [torch.distributed.broadcast(t, src=0, group=self.group, async_op=True) for t in packed.payload]
        return _InFlight(works, calls, what, started, packed.payload)

    def _await(self, inflight: _InFlight) -> None:
        """Wait for a bucket's broadcast while watching the servers' HTTP calls: a server that refuses the update
        never joins the broadcast, so waiting on the broadcast alone would hang until the group timeout."""
        works, calls, what = inflight.works, inflight.calls, inflight.what
        deadline = time.monotonic() + self.config.timeout_s
        while not all(work.is_completed() for work in works):
            done, _ = wait(calls, timeout=0.005, return_when=FIRST_EXCEPTION)
            failed = [c for c in done if c.exception() is not None]
            if failed:
                self.broken = True  # a broadcast is left pending in the group: it cannot be used again
                raise WeightSyncError(f"{what}: {failed[0].exception()}") from failed[0].exception()
            if time.monotonic() > deadline:
                self.broken = True
                raise WeightSyncError(f"{what}: broadcast not received within {self.config.timeout_s:.0f} s")
        try:
            for work in works:
                work.wait()
        except Exception as e:
            self.broken = True
            raise WeightSyncError(f"{what}: broadcast failed: {e}") from e
        for call in calls:
            call.result(timeout=self.config.timeout_s)

    def _pack(self, bucket: list[tuple[str, torch.Tensor]], slot: int) -> _Bucket:
        names = [n for n, _ in bucket]
        sent = [export_dtype(n, t, self._dtype) for n, t in bucket]
        dtypes = [str(dt).removeprefix("torch.") for dt in sent]
        shapes = [list(t.shape) for _, t in bucket]
        total = sum(t.numel() * dt.itemsize for (_, t), dt in zip(bucket, sent))
        oversized = total > self.config.bucket_bytes
        if not self.flatten or (oversized and self.config.fp8 is None):
            # One broadcast per tensor, no copy unless the dtype, device or layout must change (a tensor larger
            # than a bucket always goes this way, unless FP8: it is alone in its bucket).
            payload = [t.detach().to(self.device, dt).contiguous() for (_, t), dt in zip(bucket, sent)]
            return _Bucket(names, dtypes, shapes, payload, False, total)
        # Two buffers: this bucket is packed while the previous one, in the other buffer, is on the wire (an
        # oversized FP8 bucket: a buffer of its own, freed once sent).
        buffer = None if oversized else self._buffers[slot]
        if buffer is None:
            buffer = torch.empty(max(total, self.config.bucket_bytes), dtype=torch.uint8, device=self.device)
            if not oversized:
                self._buffers[slot] = buffer
        offset = 0
        for (_, tensor), dt in zip(bucket, sent):
            nbytes = tensor.numel() * dt.itemsize
            buffer[offset:offset + nbytes].view(dt).copy_(tensor.detach().reshape(-1))
            offset += nbytes
        return _Bucket(names, dtypes, shapes, [buffer[:offset]], True, total)

    def begin(self) -> None:
        """Open an update on every server (once per update, whichever sender does it)."""
        self._all("/begin_weight_update")

    def end(self, version: str) -> None:
        """Close the update every sender has sent its part of, and serve it as ``version``."""
        self._all("/end_weight_update")
        finish(self.clients, version, self.config.timeout_s)

    def send_buckets(self, named_tensors: NamedTensors, config: WeightSyncConfig | None = None) -> SyncStats:
        """Send ``named_tensors`` inside an update opened by ``begin``; returns what moved (no version yet).

        Phases (seconds): export (the source producing each bucket: the bridge's gathers), pack (copies into the
        bucket buffer), transfer (each bucket from its broadcast's start to every server's answer: receive and
        load_weights there), wait (the part of transfer this rank was blocked on); transfer - wait is ``overlap``,
        the transfer hidden behind exporting and packing the next bucket.
        """
        if config is not None:
            self._configure(config)
        start = time.perf_counter()
        phases = dict.fromkeys(("export", "pack", "transfer", "wait"), 0.0)
        num_tensors = num_bytes = num_buckets = 0
        source = iter(buckets(sent_tensors(named_tensors, self.config), self.config.bucket_bytes, self._dtype))
        inflight: _InFlight | None = None
        try:
            while True:
                t0 = time.perf_counter()
                bucket = next(source, None)  # bucket k+1's export runs while bucket k is on the wire
                t1 = time.perf_counter()
                phases["export"] += t1 - t0
                packed = self._pack(bucket, num_buckets % 2) if bucket is not None else None
                bucket = None  # the packed copy (or the payload) is what stays alive
                phases["pack"] += time.perf_counter() - t1
                if inflight is not None:
                    t2 = time.perf_counter()
                    self._await(inflight)
                    done = time.perf_counter()
                    phases["wait"] += done - t2
                    phases["transfer"] += done - inflight.started
                    inflight = None
                if packed is None:
                    break
                inflight = self._launch(packed, num_buckets)
                num_tensors += len(packed.names)
                num_bytes += packed.num_bytes
                num_buckets += 1
                packed = None
        finally:
            self._buffers = [None, None]  # no trainer memory held between updates
        phases["overlap"] = phases["transfer"] - phases["wait"]
        return SyncStats("distributed", "", time.perf_counter() - start, num_tensors, num_bytes, num_buckets, phases)

    def send(self, named_tensors: NamedTensors, version: str, config: WeightSyncConfig | None = None) -> SyncStats:
        """One full update to ``version`` by this sender alone; ``config`` (bucket size, dtype, timeout) may differ
        per call."""
        if config is not None:
            self._configure(config)
        start = time.perf_counter()
        self.begin()
        begun = time.perf_counter()
        stats = self.send_buckets(named_tensors)
        t3 = time.perf_counter()
        self.end(version)
        phases = {"begin": begun - start, **stats.phases, "end": time.perf_counter() - t3}
        return SyncStats("distributed", version, time.perf_counter() - start, stats.num_tensors, stats.num_bytes,
                         stats.num_buckets, phases)

    def close(self) -> None:
        for client in self.clients:
            try:
                client.post("/destroy_weights_update_group", {"group_name": self.group_name}, timeout=10.0)
            except RolloutError:
                pass  # the server is gone: nothing to tear down there
        destroy(self.group)
        self.group = None
        self._pool.shutdown(wait=False, cancel_futures=True)


def finish(clients: list[HttpClient], version: str, timeout: float) -> None:
    """After the last tensor: set the served weight version and drop the KV cache built with the old weights."""
    for client in clients:
        _post(client, "/update_weight_version", {"new_version": version, "abort_all_requests": False}, timeout)
        _post(client, "/flush_cache", None, timeout)


def save_checkpoint(named_tensors: NamedTensors, out_dir: Path, base_model_dir: str | Path,
                    shard_bytes: int, dtype: torch.dtype | None = None, fp8_scheme: fp8.Fp8Scheme | None = None
                    ) -> tuple[int, int, int]:
    """Write a complete HF model directory: safetensors shards (one bucket each) + index + the base model's
    config and tokenizer files (with ``fp8_scheme``: the weights it names block-FP8, config.json with its
    ``quantization_config``). Returns (tensors, bytes, shards)."""
    from safetensors.torch import save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    weight_map, num_tensors, num_bytes, shards = {}, 0, 0, []
    if fp8_scheme is not None:
        named_tensors = fp8.quantized_stream(named_tensors, fp8_scheme)
    for i, bucket in enumerate(buckets(named_tensors, shard_bytes, dtype)):
        file = f"model-{i + 1:05d}.safetensors"
        tensors = {}
        for name, tensor in bucket:
            if name in weight_map or name in tensors:
                raise WeightSyncError(f"weight {name!r} appears twice in the exported weights")
            t = tensor.detach().to(export_dtype(name, tensor, dtype))
            tensors[name] = t.to("cpu").contiguous()
            num_bytes += t.numel() * t.element_size()
        save_file(tensors, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update({name: file for name in tensors})
        num_tensors += len(tensors)
        shards.append(file)
    index = {"metadata": {"total_size": num_bytes}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    for name in MODEL_FILES:
        source = Path(base_model_dir) / name
        if source.is_file():
            shutil.copy2(source, out_dir / name)
    if fp8_scheme is not None:
        config = json.loads((out_dir / "config.json").read_text())
        (out_dir / "config.json").write_text(json.dumps(fp8_scheme.config(config), indent=2))
    return num_tensors, num_bytes, len(shards)


def disk_update(clients: list[HttpClient], named_tensors: NamedTensors, version: str, base_model_dir: str,
                disk_dir: Path, config: WeightSyncConfig) -> SyncStats:
    """Save the weights under ``disk_dir/<version>`` and have every server load them; older versions there are
    deleted once the servers have the new one."""
    start = time.perf_counter()
    out = disk_dir / f"weights_{version}"
    if out.exists():
        shutil.rmtree(out)
    dtype = getattr(torch, config.dtype) if config.dtype else None
    num_tensors, num_bytes, shards = save_checkpoint(named_tensors, out, base_model_dir, config.bucket_bytes, dtype,
                                                     config.fp8)
    saved = time.perf_counter()
    for client in clients:
        _post(client, "/update_weights_from_disk", {"model_path": str(out), "weight_version": version,
                                                    "flush_cache": True, "abort_all_requests": False},
              config.timeout_s, f"update_weights_from_disk({out})")
    for old in disk_dir.glob("weights_*"):
        if old != out and old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
    loaded = time.perf_counter()
    return SyncStats("disk", version, loaded - start, num_tensors, num_bytes, shards,
                     {"save": saved - start, "load": loaded - saved})


def consume(named_tensors: Iterable) -> None:
    """On trainer ranks other than the sender: run the export (it may gather over TP/EP) and drop the tensors."""
    for _ in named_tensors:
        pass


LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")


def trainer_address(server_urls: Sequence[str], config: WeightSyncConfig) -> str:
    """The address the servers join the broadcast group at: ``config.master_address``, else 127.0.0.1 when all
    servers are local, else this host's fully qualified name (servers on other nodes cannot reach loopback)."""
    from urllib.parse import urlsplit

    if config.master_address:
        return config.master_address
    if all(urlsplit(url).hostname in LOOPBACK for url in server_urls):
        return "127.0.0.1"
    import socket

    return socket.getfqdn()
