"""Typed, checked-once configuration of the SGLang engine and of weight sync. Every rule is checked in
``__post_init__`` with an error naming the field, before any server starts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (importing it imports torch: this module stays light)
    from ..model.fp8 import Fp8Scheme

DEVICES = ("cpu", "cuda")
SYNC_METHODS = ("distributed", "tensor", "disk")  # tensor: colocated servers (rollout/colocate.py)


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


@dataclass(frozen=True)
class WeightSyncConfig:
    """How the trainer's weights reach the servers after each update."""

    method: str = "distributed"  # broadcast over a process group; "tensor": handles to colocated servers
    # (update_weights_from_tensor, rollout/colocate.py); "disk": save safetensors + reload
    bucket_bytes: int = 256 << 20  # peak extra trainer memory is about one bucket (plus one tensor above it)
    # True: pack each bucket into one byte buffer, one broadcast per bucket (SGLang's flattened_bucket); False:
    # one broadcast per tensor of the bucket, no packing copy. None: True on NCCL (one collective per bucket), False
    # on gloo (bench/weight_sync.py measured the packing copy slower there).
    flatten: bool | None = None
    backend: str | None = None  # None: nccl on cuda, gloo on cpu
    dtype: str | None = None  # cast before sending (e.g. "bfloat16"); None: send the trainer's dtype
    disk_dir: str | None = None  # for method="disk" (and the fallback); None: a temporary directory
    group_name: str = "gspo_weight_sync"
    # Where the servers reach the trainer (rank 0 of the broadcast group). None: 127.0.0.1 when every server is on
    # loopback, else this host's fully qualified name; set it when that name does not resolve from the servers.
    master_address: str | None = None
    timeout_s: float = 600.0  # one bucket (HTTP call + broadcast) or one disk reload
    # FP8 rollouts: every method sends the weights this scheme names as block-FP8 (float8_e4m3fn + fp32
    # ``weight_scale_inv``, quantized bucket by bucket as they stream: ``model.fp8.quantized_stream``), the names
    # SGLang's FP8 checkpoint loader reads; the servers must serve an FP8 model dir with the matching
    # ``quantization_config`` (launched ones get one: ``server.serving_model_dir``). None: sent as they are.
    fp8: Fp8Scheme | None = None

    def __post_init__(self):
        if self.method not in SYNC_METHODS:
            raise ValueError(f"weight_sync.method={self.method!r} is not one of {SYNC_METHODS}")
        if self.bucket_bytes < 4096:
            raise ValueError(f"weight_sync.bucket_bytes={self.bucket_bytes} must be at least 4096")
        if self.backend not in (None, "gloo", "nccl"):
            raise ValueError(f"weight_sync.backend={self.backend!r} must be None, 'gloo' or 'nccl'")
        if self.dtype is not None:
            import torch

            if not isinstance(getattr(torch, self.dtype, None), torch.dtype):
                raise ValueError(f"weight_sync.dtype={self.dtype!r} is not a torch dtype name (e.g. 'bfloat16')")
        if self.timeout_s <= 0:
            raise ValueError(f"weight_sync.timeout_s={self.timeout_s} must be > 0")


def _pipeline_size(args: tuple[str, ...]) -> int:
    """The ``--pp-size`` / ``--pipeline-parallel-size`` in sglang.launch_server arguments (1 when absent)."""
    names = ("--pp-size", "--pipeline-parallel-size")
    for i, arg in enumerate(args):
        name, _, value = str(arg).partition("=")
        if name in names:
            value = value or (args[i + 1] if i + 1 < len(args) else "1")
            return int(value)
    return 1


@dataclass(frozen=True)
class SGLangConfig:
    """An SGLang rollout engine: servers it launches and owns, or servers (or a router) it attaches to.

    Launch (``urls`` empty): ``num_servers`` servers of ``tp_size`` GPUs each from ``first_gpu`` on, or one CPU
    server on 127.0.0.1 (``device="cpu"``). Attach: ``urls`` are the workers (weight updates always go to each
    worker: sglang-router answers 404 to them); ``router_url``, when set, receives the generate requests.
    """

    model_path: str = ""
    device: str = field(default_factory=_default_device)
    urls: tuple[str, ...] = ()
    router_url: str | None = None
    launch_router: bool = False  # start sglang-router in front of the launched servers
    num_servers: int = 1
    tp_size: int = 1
    first_gpu: int = 0
    dtype: str = "auto"  # --dtype; "float32" for exact train/inference log-prob agreement on CPU
    host: str = "127.0.0.1"
    max_total_tokens: int | None = None  # KV-cache size in tokens (set it on CPU: the default takes most RAM)
    max_running_requests: int | None = None
    mem_fraction_static: float | None = None
    context_length: int | None = None
    seed: int = 0
    # --sleep-on-idle: without it an idle scheduler busy-polls (measured: 0.8 of a core on CPU, which the trainer
    # then lacks). None: on for CPU servers, off on GPUs (where the poll costs a host core nobody misses).
    sleep_on_idle: bool | None = None
    # OMP_NUM_THREADS of a CPU server (None: torch's default, all cores). 1 suits tiny models on a machine the
    # trainer shares: torch's intra-op threads spin-wait, and oversubscribed they make small ops ~50x slower.
    cpu_threads: int | None = None
    # Rollout routing replay: every sample carries the experts the server routed each token to (Sample.rollout_routing;
    # SGLang's names: the request's return_routed_experts). Launched servers get --enable-return-routed-experts;
    # attached ones must have been started with it.
    return_routed_experts: bool = False
    # Colocated with the trainer (rollout/colocate.py): launched CUDA servers get --enable-memory-saver (needs
    # torch_memory_saver, CUDA-only) so that release_memory_occupation frees their memory; CPU servers do not.
    colocate: bool = False
    extra_args: tuple[str, ...] = ()  # passed to sglang.launch_server verbatim
    log_dir: str | None = None  # server logs; None: a temporary directory
    startup_timeout_s: float = 300.0
    # A generate request gets this per KV cache of tokens in flight on its server (requests are sized and admitted
    # to fit the server's cache, so one, unless one prompt's samples exceed it); longer means the server is hung.
    request_timeout_s: float = 600.0
    rollout_timeout_s: float = 3600.0  # a whole generate() call
    max_retries: int = 3  # per request, for HTTP 5xx / 429 / refused connections
    backoff_s: float = 0.5  # first retry delay; doubles each retry up to backoff_max_s
    backoff_max_s: float = 8.0
    health_interval_s: float = 10.0  # liveness probe (GET /health) of each server during a rollout
    health_timeout_s: float = 10.0  # generous: a CPU server sharing cores with the trainer answers late
    health_failures: int = 3  # consecutive failed probes that make a server "unresponsive"
    # Fault tolerance. A launched server that dies or stops answering (generation, weight sync, eval) is
    # restarted with the same arguments on the same port, brought to the current weights, and the requests that
    # were in flight are sent again; more than max_server_restarts restarts of one server within restart_window_s
    # fail with TooManyRestarts (0: no restart, the failure is raised as it is). An attached server (urls) that
    # refuses connections or stops answering is waited for, with backoff, up to attached_wait_s.
    max_server_restarts: int = 3
    restart_window_s: float = 3600.0
    attached_wait_s: float = 120.0
    concurrency: int = 8  # generate requests in flight (over all servers)
    prompts_per_request: int = 8  # at most; fewer where their samples would not fit in one server's KV cache
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)

    def __post_init__(self):
        if self.device not in DEVICES:
            raise ValueError(f"sglang.device={self.device!r} is not one of {DEVICES}")
        if not self.urls and not self.model_path:
            raise ValueError("sglang.model_path is required to launch servers (or give sglang.urls to attach)")
        if self.model_path and not self.urls and not Path(self.model_path).is_dir():
            raise ValueError(f"sglang.model_path={self.model_path!r} is not a directory (a Hugging Face model dir)")
        if self.router_url and not self.urls:
            raise ValueError(
                "sglang.router_url needs sglang.urls too: weight updates go to each worker directly "
                "(sglang-router answers 404 to them)"
            )
        if self.launch_router and self.urls:
            raise ValueError("sglang.launch_router only applies to launched servers: leave sglang.urls empty")
        for name in ("num_servers", "tp_size", "concurrency", "prompts_per_request", "health_failures"):
            if getattr(self, name) < 1:
                raise ValueError(f"sglang.{name}={getattr(self, name)} must be >= 1")
        if self.device == "cpu" and self.tp_size != 1:
            raise ValueError(f"sglang.tp_size={self.tp_size} on CPU: only tp_size=1 is supported there")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ValueError(f"sglang.cpu_threads={self.cpu_threads} must be >= 1 (or None)")
        if self.first_gpu < 0:
            raise ValueError(f"sglang.first_gpu={self.first_gpu} must be >= 0")
        if self.max_server_restarts < 0:
            raise ValueError(f"sglang.max_server_restarts={self.max_server_restarts} must be >= 0")
        if self.attached_wait_s < 0:
            raise ValueError(f"sglang.attached_wait_s={self.attached_wait_s} must be >= 0")
        if self.max_retries < 0:
            raise ValueError(f"sglang.max_retries={self.max_retries} must be >= 0")
        for name in ("startup_timeout_s", "request_timeout_s", "rollout_timeout_s", "health_interval_s",
                     "health_timeout_s", "backoff_s", "backoff_max_s", "restart_window_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"sglang.{name}={getattr(self, name)} must be > 0")
        pp = _pipeline_size(self.extra_args)
        if pp > 1 and not self.urls:
            raise ValueError(f"sglang.extra_args sets a pipeline-parallel size of {pp}: launched servers get tp_size "
                             "GPUs each and join a distributed weight sync as tp_size ranks, so pp > 1 servers are "
                             "not launched; start them yourself and attach them with sglang.urls and "
                             "weight_sync.method=disk")
        if self.host not in ("127.0.0.1", "localhost", "::1") and not self.urls and not self.colocate:
            # (colocated servers on several nodes listen on their node's address toward the trainer's master)
            raise ValueError(f"sglang.host={self.host!r}: launched servers listen on the loopback only")

    @property
    def gpu_groups(self) -> list[list[int]]:
        """The GPUs of each launched server (empty lists on CPU)."""
        if self.device == "cpu":
            return [[] for _ in range(self.num_servers)]
        start = self.first_gpu
        return [list(range(start + i * self.tp_size, start + (i + 1) * self.tp_size)) for i in range(self.num_servers)]

    @property
    def sync_backend(self) -> str:
        return self.weight_sync.backend or ("nccl" if self.device == "cuda" else "gloo")
