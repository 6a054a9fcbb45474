"""Launch and own SGLang server processes: one per rollout GPU group, or one CPU server on the loopback.

Each server runs ``python -m sglang.launch_server`` in its own session (so a Ctrl-C in the trainer's terminal
does not reach it half-way; the trainer shuts it down in order instead), with the kernel told to SIGTERM it if
the trainer dies (PR_SET_PDEATHSIG), and an ``atexit`` hook that stops every server still running. On CPU the
stand-ins of ``patches.sglang_cpu`` lead its PYTHONPATH.

A *kept* server (``keep=True``: torchrun restarts the trainer's workers, ``train.resilience.elastic``) has neither: it outlives
the process that started it, whose successor ``adopt``s it from its ``record``; ``server_watchdog`` stops it when
the torchrun agent is gone.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

from gspo_megatron.parallel.groups import free_port

from . import server_watchdog
from .client import HttpClient, RetryPolicy
from .config import SGLangConfig
from .errors import RolloutError, ServerStartError, StartInterrupted

log = logging.getLogger(__name__)
Stop = Optional[Callable[[], Optional[int]]]  # the stop signal caught so far, if any (train.preemption.requested)
# Lines (lower case) of a server's log after which it never becomes healthy
FATAL_LINES = ("address already in use",)
# Restarts on a new port of a launched server whose port was taken before it bound it. Kept servers get none: their
# URL is recorded for the next attempt before they are ready (train.resilience.elastic).
PORT_RETRIES = 3

_LIVE: set["ServerProcess"] = set()
_LIVE_LOCK = threading.Lock()


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM me when the thread that started me exits (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def launch_command(config: SGLangConfig, port: int, gpus: list[int]) -> list[str]:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", config.model_path,
           "--host", config.host, "--port", str(port), "--dtype", config.dtype,
           "--random-seed", str(config.seed), "--device", config.device]
    if config.device == "cuda":
        cmd += ["--tp-size", str(len(gpus)), "--nccl-port", str(free_port())]
    if config.sleep_on_idle if config.sleep_on_idle is not None else config.device == "cpu":
        cmd.append("--sleep-on-idle")
    if config.return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    if config.colocate and config.device == "cuda":  # release_memory_occupation frees memory only with it
        cmd.append("--enable-memory-saver")
    if config.device == "cpu" and "--disable-radix-cache" not in config.extra_args \
            and gated_deltanet(config.model_path):
        # SGLang's radix cache keeps a gated-DeltaNet's states per prefix in snapshots that only its GPU, NPU and
        # XPU platforms take ("extra_buffer requires platform support for Mamba cache state snapshots")
        cmd.append("--disable-radix-cache")
    for flag, value in (("--max-total-tokens", config.max_total_tokens),
                        ("--max-running-requests", config.max_running_requests),
                        ("--mem-fraction-static", config.mem_fraction_static),
                        ("--context-length", config.context_length)):
        if value is not None:
            cmd += [flag, str(value)]
    return cmd + list(config.extra_args)


# What torchrun sets for the trainer's ranks. A server launched from a rank must not inherit it: SGLang's own
# torch.distributed start-up would read the trainer's RANK / WORLD_SIZE / MASTER_PORT and wait forever for ranks
# of a group it is not part of ("Init parallel begin", then nothing).
TRAINER_DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                    "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
                    "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE",
                    "TORCHELASTIC_ERROR_FILE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")


def node_env(device: str) -> dict[str, str]:
    """This process's environment for an SGLang server on ``device``: without the trainer's torchrun variables,
    and on CPU with the stand-ins of ``patches.sglang_cpu`` leading PYTHONPATH."""
    from patches import sglang_cpu

    env = {k: v for k, v in os.environ.items() if k not in TRAINER_DIST_ENV}
    return sglang_cpu.server_env(env, device)


def server_env(config: SGLangConfig, gpus: list[int]) -> dict[str, str]:
    env = node_env(config.device)
    if gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in gpus)
    if config.device == "cpu" and config.cpu_threads is not None:
        env["OMP_NUM_THREADS"] = str(config.cpu_threads)
    if config.dtype == "float32":
        # SGLang keeps a gated-DeltaNet's convolution states in bfloat16 unless told otherwise (its recurrent state is
        # fp32): every decode then reads the last three inputs rounded, and fp32 rollouts' log-probs drift from the
        # trainer's by ~1e-2 (5e-6 with fp32 states, tests/train/test_family_loop.py)
        env.setdefault("SGLANG_MAMBA_CONV_DTYPE", "float32")
    return env


class ServerProcess:
    """One launched server: its URL, process, log file; ``wait_ready``, ``alive``, ``shutdown``.

    ``keep``: the server outlives this process (no PR_SET_PDEATHSIG, no ``atexit`` stop), for ``adopt``."""

    def __init__(self, cmd: list[str], env: dict[str, str], url: str, log_path: Path, name: str, keep: bool = False,
                 port_retries: int = 0):
        """``port_retries``: how often ``wait_ready`` may restart the server on a new port when its own was taken
        (the port is picked free at launch, but SGLang binds it only after loading the model, tens of seconds later:
        meanwhile any process on the host may take it). Only for a server whose URL nobody has read yet."""
        self.url, self.log_path, self.name, self.keep = url, log_path, name, keep
        self.cmd, self.env = list(cmd), dict(env)
        self.port_retries = port_retries
        self._start()

    def _start(self) -> None:
        self._log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0  # fatal lines: this start's
        self._log_file = open(self.log_path, "ab")
        self.process = subprocess.Popen(self.cmd, env=self.env, stdout=self._log_file, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL, start_new_session=True,
                                        preexec_fn=None if self.keep else _die_with_parent)
        if not self.keep:
            with _LIVE_LOCK:
                _LIVE.add(self)
        log.info("%s: started pid %d at %s, log %s", self.name, self.process.pid, self.url, self.log_path)

    def _restart_on_a_new_port(self, fatal: str) -> None:
        self.shutdown()
        port = free_port()
        self.cmd[self.cmd.index("--port") + 1] = str(port)
        log.warning("%s: its port was taken meanwhile (%r); restarting it on port %d", self.name, fatal, port)
        self.url = f"{self.url.rsplit(':', 1)[0]}:{port}"
        self.port_retries -= 1
        self._start()

    def record(self) -> dict:
        """What ``adopt`` needs, JSON-serialisable (the start time tells this process from a later one that got
        its pid)."""
        return {"name": self.name, "url": self.url, "pid": self.process.pid, "log": str(self.log_path),
                "started": server_watchdog.start_time(self.process.pid), "cmd": self.cmd, "env": self.env}

    @classmethod
    def adopt(cls, record: dict) -> "ServerProcess | None":
        """The kept server of ``record`` (started by another process), or None if it is no longer running."""
        process = _Adopted(record["pid"], record["started"])
        if process.poll() is not None:
            return None
        server = cls.__new__(cls)
        server.url, server.log_path, server.name, server.keep = record["url"], Path(record["log"]), record["name"], True
        server.cmd, server.env = list(record["cmd"]), dict(record["env"])  # to relaunch it if it dies
        server._log_file, server.process, server._log_offset, server.port_retries = None, process, 0, 0
        log.info("%s: adopted pid %d at %s", server.name, process.pid, server.url)
        return server

    def detach(self) -> None:
        """Leave a kept server running for a successor to adopt (``shutdown`` stops it)."""
        if self._log_file is not None:
            self._log_file.close()

    def relaunch(self) -> "ServerProcess":
        """Stop this process (if it still runs) and start the same command again: same port, same log (appended),
        kept as this one was. Call from the thread that owns the servers (PR_SET_PDEATHSIG); wait with
        ``wait_ready``."""
        self.shutdown(grace_s=5.0)
        return ServerProcess(self.cmd, self.env, self.url, self.log_path, self.name, keep=self.keep)

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join(text[-lines:])

    def describe_exit(self) -> str:
        code = self.process.poll()
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exited with code {code}"
        if isinstance(self.process, _Adopted):
            how = "is gone (adopted from an earlier process: exit status unknown)"
        return f"{self.name} (pid {self.process.pid}, {self.url}) {how}; last lines of {self.log_path}:\n{self.log_tail()}"

    def fatal_line(self) -> str | None:
        """The first line of the log that says the server cannot start (``FATAL_LINES``), or None."""
        try:
            with open(self.log_path, errors="replace") as f:
                f.seek(self._log_offset)  # a relaunch appends to the log of the start before
                for line in f:
                    if any(pattern in line.lower() for pattern in FATAL_LINES):
                        return line.strip()
        except OSError:
            return None
        return None

    def wait_ready(self, timeout: float, note_every_s: float = 15.0, stop: Stop = None) -> None:
        """Until GET /health_generate answers 200 (a real one-token generation), or raise ServerStartError: at once
        when the server exits or its log shows a fatal line (a taken port: SGLang keeps running ~60 s after saying
        so), else after ``timeout``. Says what it awaits every ``note_every_s``. ``stop``: returns the stop signal
        caught meanwhile, if any (the trainer's preemption flag): then shut down and raise StartInterrupted."""
        client = HttpClient(self.url, RetryPolicy(max_retries=0), timeout=10.0)
        start = time.monotonic()
        deadline, next_note = start + timeout, start + note_every_s
        while time.monotonic() < deadline:
            signum = stop() if stop is not None else None
            if signum:
                self.shutdown()
                raise StartInterrupted(f"{signal.Signals(signum).name} while waiting for {self.name} at {self.url} "
                                       "to start (shut down)", signum)
            if not self.alive():
                raise ServerStartError(f"SGLang server did not start: {self.describe_exit()}")
            fatal = self.fatal_line()
            if fatal is not None and "address already in use" in fatal.lower() and self.port_retries > 0:
                self._restart_on_a_new_port(fatal)
                client = HttpClient(self.url, RetryPolicy(max_retries=0), timeout=10.0)
                continue
            if fatal is not None:
                self.shutdown()
                raise ServerStartError(f"{self.name} at {self.url} cannot start (shut down): {fatal!r} in "
                                       f"{self.log_path}")
            try:
                client.get("/health_generate")
                log.info("%s: ready", self.name)
                return
            except RolloutError:
                time.sleep(1.0)
            if time.monotonic() >= next_note:
                log.warning("%s: waiting for %s/health_generate to answer (%.0f s of %.0f s; log %s)", self.name,
                            self.url, time.monotonic() - start, timeout, self.log_path)
                next_note += note_every_s
        self.shutdown()
        raise ServerStartError(f"{self.name} at {self.url} was not healthy after {timeout:.0f} s (shut down); "
                               f"last lines of {self.log_path}:\n{self.log_tail()}")

    def shutdown(self, grace_s: float = 15.0) -> None:
        """Stop the server and every process it started. Idempotent.

        A CPU server is SIGKILLed with its process group at once: it holds nothing to release (no device memory; its
        log is written line by line), while SGLang's own SIGTERM path costs ~5 s (its tokenizer manager notices the
        signal at a 5 s poll, then drains). Any other server gets SIGTERM on its leader, which stops its schedulers
        in order (they release device memory themselves) and then its process tree; whatever is left after
        ``grace_s`` is SIGKILLed. (A SIGTERM to the whole group would kill the schedulers first, which SGLang takes
        for a crash: it then sleeps 5 s for diagnostics.)"""
        with _LIVE_LOCK:
            _LIVE.discard(self)
        if self.alive():
            children = _descendants(self.process.pid)
            if not self.on_cpu:
                try:
                    os.kill(self.process.pid, signal.SIGTERM)
                    self.process.wait(timeout=grace_s)
                except ProcessLookupError:
                    pass
                except subprocess.TimeoutExpired:
                    log.warning("%s: still running %.0f s after SIGTERM; killing it", self.name, grace_s)
            _signal_group(self.process.pid, signal.SIGKILL)
            for child in children:  # a child that left the process group
                try:
                    child.kill()
                except Exception:  # psutil.NoSuchProcess and friends: already gone
                    pass
            self.process.wait(timeout=max(grace_s, 5.0))
            log.info("%s: shut down", self.name)
        if self._log_file is not None:
            self._log_file.close()

    @property
    def on_cpu(self) -> bool:
        return "--device" in self.cmd and self.cmd[self.cmd.index("--device") + 1] == "cpu"


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _descendants(pid: int) -> list:
    try:
        import psutil

        return psutil.Process(pid).children(recursive=True)
    except Exception:
        return []


class _Adopted:
    """``poll`` and ``wait`` of a ``Popen`` for a process this one did not start (its parent is gone, so init
    reaps it): alive while its pid runs with the recorded start time. No exit code: ``poll`` says -1 once gone."""

    def __init__(self, pid: int, started: float | None):
        self.pid, self.started = pid, started

    def poll(self) -> int | None:
        return None if server_watchdog.running(self.pid, self.started) else -1

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
            time.sleep(0.1)
        return -1


def start_servers(config: SGLangConfig, keep: bool = False) -> list[ServerProcess]:
    """Start every server of ``config`` without waiting for them (``ServerProcess.wait_ready`` does).

    Call from the thread that will outlive the servers: PR_SET_PDEATHSIG fires when the *starting thread* exits.
    ``keep``: servers that outlive this process (``ServerProcess``).
    """
    log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="gspo_sglang_"))
    log_dir.mkdir(parents=True, exist_ok=True)
    config = replace(config, model_path=serving_model_dir(config, log_dir))
    servers: list[ServerProcess] = []
    try:
        for i, gpus in enumerate(config.gpu_groups):
            port = free_port()
            url = f"http://{config.host}:{port}"
            servers.append(ServerProcess(launch_command(config, port, gpus), server_env(config, gpus), url,
                                         log_dir / f"sglang_server_{i}.log", name=f"sglang server {i}", keep=keep,
                                         port_retries=0 if keep else PORT_RETRIES))
    except BaseException:
        for server in servers:
            server.shutdown()
        raise
    return servers


def gated_deltanet(model_path: str) -> bool:
    """Whether the model in ``model_path`` (config.json) is a gated-DeltaNet hybrid (Qwen3.5, Qwen3-Next)."""
    from gspo_megatron.model.errors import UnsupportedModel
    from gspo_megatron.model.hf_config import family_of, text_config

    try:
        return family_of(text_config(json.loads((Path(model_path) / "config.json").read_text()))).gated_deltanet
    except (OSError, ValueError, UnsupportedModel):  # not ours to judge here: SGLang says what it cannot load
        return False


def serving_model_dir(config: SGLangConfig, log_dir: Path) -> str:
    """The model directory launched servers load: ``config.model_path``; or, where its config.json lacks fields
    SGLang reads that the family's releases have (``hf_config.serving_config``: a directory transformers saved),
    a copy under ``log_dir`` of its files (links) with them added (the user's directory is never edited); or for
    FP8 rollouts (``weight_sync.fp8``) one whose config.json has the scheme's ``quantization_config``, so that SGLang
    builds FP8 layers (its ``Fp8Config``) into which every weight sync then loads FP8 tensors: ``model_path`` itself
    where it is such a copy (``train`` serves one: ``bootstrap.engine_model_dir``), else its block-FP8 copy under
    ``log_dir`` (written once, ``hf_files.quantized_copy``)."""
    scheme = config.weight_sync.fp8
    model_config = json.loads((Path(config.model_path) / "config.json").read_text())
    if scheme is None:
        return serving_fields_copy(config.model_path, model_config, log_dir / "serving_model")
    if model_config.get("quantization_config") == scheme.config(model_config)["quantization_config"]:
        return config.model_path
    from gspo_megatron.model.hf_files import quantized_copy

    started = time.perf_counter()
    out = quantized_copy(config.model_path, log_dir / "fp8_model", scheme)
    log.info("FP8 copy of %s for the servers: %s (%.1f s)", config.model_path, out, time.perf_counter() - started)
    return str(out)


def serving_fields_copy(model_path: str, model_config: dict, out: Path) -> str:
    """``model_path``, or where ``serving_config`` adds to its config.json, ``out``: links to its files and that
    config.json (SGLang's Qwen3NextConfig, which Qwen3.5's text configs derive from, places its layers by
    ``full_attention_interval`` alone, which transformers 5.19 does not save)."""
    from gspo_megatron.model.atomic import replaced_dir
    from gspo_megatron.model.errors import UnsupportedModel
    from gspo_megatron.model.hf_config import serving_config

    try:
        serving = serving_config(model_config)
    except UnsupportedModel:  # not ours to judge here: SGLang says what it cannot load
        return model_path
    if serving == model_config:
        return model_path
    source = Path(model_path).absolute()
    if out.is_dir() and json.loads((out / "config.json").read_text()) == serving \
            and all(f.resolve() == (source / f.name).resolve() for f in out.iterdir() if f.name != "config.json"):
        return str(out)
    with replaced_dir(out) as tmp:
        for f in source.iterdir():
            if f.name != "config.json":
                (tmp / f.name).symlink_to(f.resolve())
        (tmp / "config.json").write_text(json.dumps(serving, indent=2) + "\n")
    added = sorted(k for k in _flat(serving) if k not in _flat(model_config))
    log.info("the servers load %s: %s with %s added to its config.json", out, source, ", ".join(added))
    return str(out)


def _flat(config: dict) -> set[str]:
    return {k for k, v in config.items() if not isinstance(v, dict)} | {
        f"{k}.{inner}" for k, v in config.items() if isinstance(v, dict) for inner in _flat(v)}


def wait_all_ready(servers: list[ServerProcess], timeout: float, stop: Stop = None) -> None:
    """Wait for each server in turn (they start in parallel); on any failure (or ``stop``) stop them all."""
    try:
        for server in servers:
            server.wait_ready(timeout, stop=stop)
    except BaseException:
        for server in servers:
            server.shutdown()
        raise


def launch_servers(config: SGLangConfig, stop: Stop = None) -> list[ServerProcess]:
    """Start every server of ``config`` and wait until all are healthy."""
    servers = start_servers(config)
    wait_all_ready(servers, config.startup_timeout_s, stop)
    return servers


def launch_router(config: SGLangConfig, worker_urls: list[str]) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", config.host, "--port", str(port),
           "--worker-urls", *worker_urls]
    log_dir = Path(config.log_dir or tempfile.mkdtemp(prefix="gspo_sglang_"))
    router = ServerProcess(cmd, dict(os.environ), f"http://{config.host}:{port}", log_dir / "sglang_router.log",
                           name="sglang-router")
    client = HttpClient(router.url, RetryPolicy(max_retries=0), timeout=5.0)
    deadline = time.monotonic() + config.startup_timeout_s
    while time.monotonic() < deadline:
        if not router.alive():
            raise ServerStartError(f"sglang-router did not start: {router.describe_exit()}")
        try:
            client.get("/health")
            return router
        except RolloutError:
            time.sleep(0.5)
    router.shutdown()
    raise ServerStartError(f"sglang-router at {router.url} not healthy after {config.startup_timeout_s:.0f} s")


@atexit.register
def _shutdown_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for server in live:
        server.shutdown(grace_s=5.0)
