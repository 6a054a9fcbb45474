"""The SGLang rollout engine: groups of n sampled responses per prompt with their log-probs, and weight sync.

    with SGLangEngine(SGLangConfig(model_path=..., device="cpu", dtype="float32")) as engine:
        groups = engine.generate(prompt_ids, n=8, sampling=SamplingParams(max_new_tokens=64))
        ...update the policy...
        engine.update_weights(export_hf_weights(model), version="step-1")   # checks the served version

Prompts are split into requests of at most ``prompts_per_request`` prompts (each asks for n samples: SGLang answers
prompt-major) whose tokens fit in one server's KV cache (``max_total_num_tokens``, read from /server_info: every
sample at its prompt plus ``max_new_tokens``), spread over the servers (or sent to the router), ``concurrency``
at a time and only as many on a server as its cache holds (``TokenBudget``): a request is one wave of decoding, not
several queued behind each other. While they run, the engine watches its own server processes (a dead one fails
the rollout at once, with its log tail) and probes every server's /health (a hung one fails it after
``health_failures`` missed probes); a request that takes longer than ``request_timeout_s`` per KV cache of tokens in
flight on its server (one, unless a single prompt's samples exceed the cache) or a rollout longer than
``rollout_timeout_s`` fails too. A failure aborts the other
requests on the servers still alive and raises: there is never a partial batch.

Fault tolerance: a launched server found dead (before a call or during one) or hung (missed probes, a request past
its timeout) is restarted with the same command on the same port and brought back to the current weights: the
launch weights, or the last disk sync's snapshot (still on disk); after a distributed sync only the trainer can
send them again, so the restarted server is marked stale and ``generate`` refuses until the next sync. The requests
without an answer yet are then sent again (same prompts, same sampling parameters). At most
``max_server_restarts`` restarts of one server per ``restart_window_s``, then ``TooManyRestarts``. An attached
server is waited for up to ``attached_wait_s`` and must come back at the current weight version.
``fault_metrics()`` counts restarts and the seconds lost to them.

One module although long: request splitting, the token budget, server watching, restarts and the weight sync all
act on one engine's per-server state (clients, KV budgets, restart history, the served weight version) within a
single ``generate`` or update call, and a failure in one must abort and re-send through the others; the pure
helpers at the end (``request_chunks``, ``TokenBudget``, ``parse_generate``) are the seam a split would take.
"""

from __future__ import annotations

import logging
import signal
import tempfile
import threading
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Sequence

import torch

from . import weight_sync
from .client import HttpClient, RetryPolicy
from .colocate import Colocation, check_generating_allowed, send_tensors
from .config import SGLangConfig
from .errors import (BadResponse, RequestFailed, RolloutError, ServerDied, ServerStartError, ServerUnresponsive,
                     StaleWeights, StartInterrupted, TooManyRestarts, WeightSyncError)
from .server import ServerProcess, Stop, launch_router, launch_servers, wait_all_ready
from .types import Group, NamedTensors, Sample, SamplingParams, SyncStats, check_prompts

log = logging.getLogger(__name__)
NOTE_EVERY_S = 15.0  # how often a wait for an attached server says what it awaits


class SGLangEngine:
    """See the module docstring. ``servers``: processes already started with ``server.start_servers(config)``
    for this engine to wait for and own (to overlap server start-up with other work)."""

    def __init__(self, config: SGLangConfig, servers: list[ServerProcess] | None = None, stop: Stop = None):
        self.config = config
        self._servers: list[ServerProcess] = []
        self._router: ServerProcess | None = None
        self._sender: weight_sync.DistributedSender | None = None
        self._target: weight_sync.SyncTarget | None = None
        self._disk_dir: Path | None = None
        if config.urls:
            self.worker_urls = [u.rstrip("/") for u in config.urls]
            self.generate_urls = [config.router_url.rstrip("/")] if config.router_url else list(self.worker_urls)
        else:
            if servers is None:
                self._servers = launch_servers(config, stop)
            else:
                wait_all_ready(servers, config.startup_timeout_s, stop)
                self._servers = list(servers)
            self.worker_urls = [s.url for s in self._servers]
            self.generate_urls = list(self.worker_urls)
            if config.launch_router:
                try:
                    self._router = launch_router(config, self.worker_urls)
                except BaseException:
                    self.close()
                    raise
                self.generate_urls = [self._router.url]
        retry = RetryPolicy(config.max_retries, config.backoff_s, config.backoff_max_s)
        self._clients = {u: HttpClient(u, retry, config.request_timeout_s) for u in self.worker_urls + self.generate_urls}
        try:
            if config.urls:  # attached: check each can generate before use (launched ones were checked)
                for url in dict.fromkeys(self.worker_urls + self.generate_urls):
                    self._wait_healthy(url, stop)
            info = [self._clients[u].get("/model_info", timeout=config.health_timeout_s * 4) for u in self.worker_urls]
        except BaseException:
            self.close()
            raise
        self.model_path = config.model_path or info[0]["model_path"]
        self._version = self._agreed_version(info)
        self._restore: tuple[str, str] | None = None  # (method, version) of the last sync; None: launch weights
        self._stale: set[str] = set()  # restarted workers without the current weights (after a distributed sync)
        self._restarts: dict[str, deque] = {}  # server name -> times of its restarts within restart_window_s
        self._epoch = 0  # restarts so far: a weight-sync group formed before one has lost a member
        self.restarts_total, self.seconds_lost = 0, 0.0
        self.on_relaunch = None  # called after a server was relaunched (a new process): e.g. to record it
        self._routed_shape = routed_experts_shape(self.model_path) if config.return_routed_experts else None
        self._budget = TokenBudget(self._capacities())
        # config.colocate: the servers share the trainer's GPUs; their memory is released and resumed (``colocate``)
        self.colocation = Colocation(self.worker_urls, config.device, config.weight_sync.timeout_s,
                                     config.request_timeout_s) if config.colocate else None

    def _wait_healthy(self, url: str, stop: Stop = None) -> None:
        """GET /health_generate until 200. A server still starting answers 503, and one that accepts connections
        but has not answered yet times out: wait for it up to startup_timeout_s, saying so every NOTE_EVERY_S
        and polling ``stop`` (see server.wait_ready); one that refuses connections fails after the configured
        retries (ServerDied)."""
        timeout = self.config.startup_timeout_s
        start = time.monotonic()
        deadline, next_note = start + timeout, start + NOTE_EVERY_S
        while True:
            signum = stop() if stop is not None else None
            if signum:
                raise StartInterrupted(f"{signal.Signals(signum).name} while waiting for {url} to answer", signum)
            try:
                # Short probes, so that a server that never answers is reported and a stop signal is seen.
                self._clients[url].get("/health_generate", timeout=max(1.0, min(10.0, NOTE_EVERY_S, deadline - time.monotonic())))
                return
            except (RequestFailed, ServerUnresponsive) as e:
                if time.monotonic() > deadline:
                    raise ServerStartError(f"{url} not healthy after {timeout:.0f} s: {e}") from e
                time.sleep(1.0)
            if time.monotonic() >= next_note:
                log.warning("waiting for %s/health_generate to answer (%.0f s of %.0f s)", url,
                            time.monotonic() - start, timeout)
                next_note += NOTE_EVERY_S

    # ---- lifecycle ------------------------------------------------------------------------------------------

    def __enter__(self) -> "SGLangEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Tear down the weight-sync group and stop the servers this engine launched (attached ones keep
        running). Idempotent; also runs at interpreter exit for launched servers (``server.py``)."""
        if self._sender is not None:
            self._sender.close()
            self._sender = None
        for process in ([self._router] if self._router else []) + self._servers:
            process.shutdown()
        self._router, self._servers = None, []

    def leave_kept_servers(self) -> None:
        """Let go of the kept servers (``ServerProcess(keep=True)``) without stopping them, for the next process to
        adopt (a trainer rank failing with torchrun restarts left); ``close`` then stops only the rest."""
        for process in self._servers:
            if process.keep:
                process.detach()
        self._servers = [p for p in self._servers if not p.keep]

    @property
    def servers(self) -> list[ServerProcess]:
        """The launched server processes (empty when attached)."""
        return list(self._servers)

    # ---- generation -----------------------------------------------------------------------------------------

    def generate(self, prompts: Sequence[Sequence[int]], n: int, sampling: SamplingParams) -> list[Group]:
        """n samples for every prompt: one Group per prompt, in order, each with its n Samples (prompt-major).
        A server that fails meanwhile is restarted (or, attached, waited for) and the unanswered requests resent."""
        prompts = check_prompts(prompts, n)
        check_generating_allowed(self.colocation)  # colocated: not while training holds the servers' memory
        self.ensure_servers()
        chunks = request_chunks(prompts, n, sampling.max_new_tokens, self.config.prompts_per_request,
                                self._budget.smallest)
        results: dict[int, list[Sample]] = {}
        deadline = time.monotonic() + self.config.rollout_timeout_s
        while len(results) < len(chunks):
            self._check_current()
            attempt = time.monotonic()
            try:
                self._generate_chunks([c for c in chunks if c[0] not in results], n, sampling, results, deadline)
            except RolloutError as e:
                self._recover(e, attempt)  # re-raises what no restart or wait can mend
        samples = [s for start in sorted(results) for s in results[start]]
        return [Group(i, p, samples[i * n:(i + 1) * n]) for i, p in enumerate(prompts)]

    def _generate_chunks(self, chunks: list, n: int, sampling: SamplingParams, results: dict, deadline: float):
        pool = ThreadPoolExecutor(max_workers=min(self.config.concurrency, len(chunks)), thread_name_prefix="rollout")
        cancelled = threading.Event()  # set on failure: requests still in flight stop retrying
        try:
            futures = {pool.submit(self._generate_chunk, start, chunk, n, sampling, cancelled): start
                       for start, chunk in chunks}
            self._watch(futures, results, deadline)
        except BaseException:
            cancelled.set()
            self._abort_all()
            raise
        finally:
            pool.shutdown(wait=False, cancel_futures=True)

    def _watch(self, futures: dict, results: dict, deadline: float) -> None:
        """Wait for every request while checking the servers; raise on the first failure of any kind."""
        cfg = self.config
        next_probe = time.monotonic() + cfg.health_interval_s
        missed = {u: 0 for u in self.generate_urls + self.worker_urls}
        pending = set(futures)
        while pending:
            done, pending = wait(pending, timeout=0.2, return_when=FIRST_COMPLETED)
            self._check_alive()  # first: a dead server explains a failed request best (exit code, log tail)
            for future in done:
                results[futures[future]] = future.result()  # re-raises the request's error
            now = time.monotonic()
            if pending and now >= next_probe:
                self._probe(missed)
                next_probe = time.monotonic() + cfg.health_interval_s
            if pending and now > deadline:
                raise ServerUnresponsive(f"rollout not finished after rollout_timeout_s={cfg.rollout_timeout_s:.0f} s "
                                         f"({len(pending)} of {len(futures)} requests pending)")

    def _check_alive(self) -> None:
        for server in self._servers + ([self._router] if self._router else []):
            if not server.alive():
                raise ServerDied(f"rollout failed: {server.describe_exit()}", url=server.url)

    def _probe(self, missed: dict[str, int]) -> None:
        for url in missed:
            try:
                self._clients[url].get("/health", timeout=self.config.health_timeout_s, retry=RetryPolicy(0))
                missed[url] = 0
            except RolloutError as e:
                missed[url] += 1
                log.warning("%s: health probe %d failed: %s", url, missed[url], e)
                if missed[url] >= self.config.health_failures:
                    raise ServerUnresponsive(
                        f"{url} missed {missed[url]} health probes in a row ({self.config.health_timeout_s:.0f} s "
                        f"each) during a rollout: hung or overloaded. Last error: {e}", url=url) from e

    def _abort_all(self) -> None:
        """Best effort: stop what the servers still generate for requests nobody will read."""
        for url in self.worker_urls:
            try:
                self._clients[url].post("/abort_request", {"abort_all": True}, timeout=2.0, retry=RetryPolicy(0))
            except RolloutError:
                pass

    def _generate_chunk(self, start: int, prompts: list[list[int]], n: int, sampling: SamplingParams,
                        cancelled: threading.Event) -> list[Sample]:
        """One /generate request, sent to the server with the most room once its tokens fit there (``TokenBudget``);
        its time-out is ``request_timeout_s`` per KV cache of tokens in flight there with it."""
        body = {"input_ids": prompts, "sampling_params": sampling.to_sglang(n), "return_logprob": True}
        if self._routed_shape is not None:
            body["return_routed_experts"] = True
        tokens = request_tokens(prompts, n, sampling.max_new_tokens)
        url, waves = self._budget.acquire(tokens, cancelled)
        try:
            answer = self._clients[url].post("/generate", body, timeout=self.config.request_timeout_s * waves,
                                             cancelled=cancelled)
        finally:
            self._budget.release(url, tokens)
        return parse_generate(answer, prompts, n, start, url, self._routed_shape)

    def _capacities(self) -> dict[str, int | None]:
        """KV-cache tokens of each generate URL (a router's: its workers' sum); None where a server does not say."""
        workers = {}
        for url in self.worker_urls:
            try:
                info = self._clients[url].get("/server_info", timeout=self.config.health_timeout_s * 4)
            except RolloutError as e:
                log.warning("%s: no /server_info (%s): its requests are not sized to its KV cache", url, e)
                info = {}
            workers[url] = server_capacity(info)
        if self.generate_urls == self.worker_urls:
            return workers
        known = [c for c in workers.values() if c is not None]
        total = sum(known) if len(known) == len(workers) else None
        return {url: total for url in self.generate_urls}

    @property
    def capacities(self) -> dict[str, int | None]:
        """Each generate URL's KV-cache tokens, as its server reported them (``server_capacity``)."""
        return dict(self._budget.capacity)

    @property
    def peak_tokens_in_flight(self) -> dict[str, int]:
        """The most worst-case tokens each generate URL has had in flight at once since this engine started."""
        return dict(self._budget.peak)

    def pause_generation(self) -> None:
        """Hold every request in flight on every worker (SGLang's ``/pause_generation``, retract mode: running
        requests go back to the waiting queue and their KV cache is rebuilt on continue). A weight update of
        paused servers runs at once instead of waiting for the requests to finish, and none is lost: the tokens
        they sampled so far keep their old-weight log-probs, the rest come from the new weights."""
        for url in self.worker_urls:
            self._clients[url].post("/pause_generation", {"mode": "retract"}, timeout=self.config.health_timeout_s * 4)

    def continue_generation(self) -> None:
        """Resume the requests ``pause_generation`` held."""
        for url in self.worker_urls:
            self._clients[url].post("/continue_generation", {}, timeout=self.config.health_timeout_s * 4)

    # ---- fault tolerance ------------------------------------------------------------------------------------

    def fault_metrics(self) -> dict[str, float]:
        """Since this engine started: server restarts, and seconds lost to failures (the failed attempt's work,
        the restart, bringing the weights back, waiting for an attached server)."""
        return {"rollout/server_restarts": float(self.restarts_total), "rollout/seconds_lost": self.seconds_lost}

    def restarts_in_window(self, name: str) -> int:
        """Restarts of the server called ``name`` within the last ``restart_window_s``."""
        times = self._restarts.get(name, deque())
        while times and time.monotonic() - times[0] > self.config.restart_window_s:
            times.popleft()
        return len(times)

    def ensure_servers(self) -> None:
        """Restart every launched server that exited since the last call (counted against the bound)."""
        start = time.monotonic()
        dead = [p for p in self._processes() if not p.alive()]
        for process in dead:
            self._restart(process, ServerDied(f"found dead: {process.describe_exit()}", url=process.url))
        if dead:
            self.seconds_lost += time.monotonic() - start

    def recover_failed_update(self, problem: str) -> None:
        """After a distributed weight update failed (``problem``: what a sender saw): if a launched server died,
        restart it and every other launched server (those alive are inside the broken update's group, waiting on
        a broadcast that will not come), so the update can be sent again from the start; anything else (no server
        died, servers given by URL, too many restarts) raises ``WeightSyncError`` / ``TooManyRestarts``."""
        error = WeightSyncError(f"a distributed weight update failed: {problem}")
        start = time.monotonic()
        # A server killed mid-update resets its connections a moment before its process is gone.
        while not self.config.urls and all(p.alive() for p in self._servers):
            if time.monotonic() - start > self.config.health_timeout_s:
                raise error
            time.sleep(0.1)
        if self.config.urls:
            raise error
        for process in [p for p in self._servers if not p.alive()] + [p for p in self._servers if p.alive()]:
            self._restart(process, error)
        self.seconds_lost += time.monotonic() - start

    def _processes(self) -> list[ServerProcess]:
        return self._servers + ([self._router] if self._router else [])

    def _recover(self, error: RolloutError, since: float) -> None:
        """After ``error`` in an attempt begun at ``since``: restart the launched servers that died or hung, or
        wait for the attached one; re-raise ``error`` when neither applies."""
        if self.config.urls:
            self._wait_attached(error)
        else:
            processes = self._processes()
            failed = [p for p in processes if not p.alive()]
            if not failed and isinstance(error, ServerUnresponsive) and error.url:
                failed = [p for p in processes if p.url == error.url]  # alive but hung: restarted too
            if not failed:
                raise error
            for process in failed:
                self._restart(process, error)
        self.seconds_lost += time.monotonic() - since

    def _restart(self, process: ServerProcess, error: RolloutError) -> None:
        cfg = self.config
        if cfg.max_server_restarts == 0:
            raise error
        done = self.restarts_in_window(process.name)
        if done >= cfg.max_server_restarts:
            raise TooManyRestarts(
                f"{process.name} at {process.url} failed again after {done} restarts within {cfg.restart_window_s:.0f} "
                f"s (max_server_restarts={cfg.max_server_restarts}, rollout.max_server_restarts in a training config)"
                f": {error}", url=process.url) from error
        self._restarts.setdefault(process.name, deque()).append(time.monotonic())
        log.warning("%s: restarting it (restart %d of at most %d per %.0f s) after: %s", process.name, done + 1,
                    cfg.max_server_restarts, cfg.restart_window_s, error)
        new = process.relaunch()
        if process is self._router:
            self._router = new
        else:
            self._servers[self._servers.index(process)] = new
        if self.on_relaunch is not None:
            self.on_relaunch()
        new.wait_ready(cfg.startup_timeout_s)  # ServerStartError (with its log tail) if it does not come back
        self.restarts_total += 1
        self._epoch += 1  # weight-sync groups formed with the old process are gone
        self._target = None
        if self._sender is not None:
            try:
                self._sender.close()
            except Exception as e:  # a group with a dead member: drop it
                log.warning("closing the weight-sync group after a restart: %s", e)
            self._sender = None
        if process is not self._router:
            self._restore_weights(new.url)

    def _restore_weights(self, url: str) -> None:
        """Bring a restarted worker (serving the launch weights) to the current version where this engine can."""
        if self._restore is None:
            return
        method, version = self._restore
        if method == "disk":  # the last sync's snapshot stays on disk until the next sync has loaded
            self._load_from_disk([url], version)
        else:  # distributed: the tensors were the trainer's; the next sync sends them all again
            self._stale.add(url)
            log.warning("%s restarted serving its launch weights, not version %s: generation waits for the next "
                        "weight sync", url, version)

    def _load_from_disk(self, urls: list[str], version: str) -> None:
        path = self._disk_directory() / f"weights_{version}"
        for url in urls:
            client = HttpClient(url, RetryPolicy(0), self.config.weight_sync.timeout_s)
            weight_sync._post(client, "/update_weights_from_disk", {"model_path": str(path), "weight_version": version,
                                                                     "flush_cache": True, "abort_all_requests": False},
                              self.config.weight_sync.timeout_s, f"update_weights_from_disk({path})")

    def _check_current(self) -> None:
        if self._stale:
            raise StaleWeights(
                f"{sorted(self._stale)} restarted and serve their launch weights, not version {self._version!r}, which "
                "came by distributed sync (only the trainer can send it again): sync the weights before generating",
                url=sorted(self._stale)[0])

    def _wait_attached(self, error: RolloutError) -> None:
        """An attached server refused connections or stopped answering: probe it with backoff up to
        ``attached_wait_s``; it must come back serving the current weight version."""
        cfg, url = self.config, error.url
        waitable = isinstance(error, (ServerDied, ServerUnresponsive)) and url in self._clients
        if not waitable or not cfg.attached_wait_s:
            raise error
        deadline, delay = time.monotonic() + cfg.attached_wait_s, cfg.backoff_s
        log.warning("attached server %s failed (%s): waiting up to %.0f s for it", url, error, cfg.attached_wait_s)
        while True:
            try:
                self._clients[url].get("/health_generate", timeout=cfg.health_timeout_s, retry=RetryPolicy(0))
                break
            except RolloutError as e:
                if time.monotonic() + delay > deadline:
                    raise TooManyRestarts(f"attached server {url} did not answer again within attached_wait_s="
                                          f"{cfg.attached_wait_s:.0f} s (last: {e}); it failed with: {error}",
                                          url=url) from error
                time.sleep(delay)
                delay = min(2 * delay, cfg.backoff_max_s)
        if url in self.worker_urls:
            info = self._clients[url].get("/model_info", timeout=cfg.health_timeout_s * 4)
            if info.get("weight_version") != self._version:
                served = info.get("weight_version")
                raise WeightSyncError(f"attached server {url} came back serving weight version {served!r}, not "
                                      f"{self._version!r} (restarted by its owner?)", url=url) from error

    # ---- weights --------------------------------------------------------------------------------------------

    def weight_version(self) -> str:
        """The weight version every worker reports (they must agree)."""
        info = [self._clients[u].get("/model_info", timeout=self.config.health_timeout_s * 4) for u in self.worker_urls]
        self._version = self._agreed_version(info)
        return self._version

    def _agreed_version(self, info: list[dict]) -> str:
        versions = {u: i.get("weight_version") for u, i in zip(self.worker_urls, info)}
        if len(set(versions.values())) != 1:
            raise WeightSyncError(f"the servers serve different weight versions: {versions}")
        return next(iter(versions.values()))

    def update_weights(self, named_tensors: NamedTensors, version: str, method: str | None = None) -> SyncStats:
        """Load the trainer's weights (``(hf_name, full tensor)`` pairs) into every worker as ``version``, by
        distributed broadcast (default), tensor handles (colocated servers: ``colocate``) or from disk, then check each
        worker reports ``version``."""
        method = method or self.config.weight_sync.method
        version = self._check_new_version(version)
        self.ensure_servers()
        if method == "distributed":
            start = time.perf_counter()
            self.begin_distributed_update(version)
            begun = time.perf_counter()
            stats = self._sender.send_buckets(named_tensors, self.config.weight_sync)
            t = time.perf_counter()
            self._sender.end(version)
            phases = {"begin": begun - start, **stats.phases, "end": time.perf_counter() - t}
            stats = SyncStats("distributed", version, time.perf_counter() - start, stats.num_tensors, stats.num_bytes,
                              stats.num_buckets, phases)
        elif method == "tensor":  # colocated servers: weights resumed, tensor handles written in, then the KV cache
            if self.colocation is not None:
                self.colocation.resume_weights()
            sync_clients = [HttpClient(u, RetryPolicy(0), self.config.weight_sync.timeout_s) for u in self.worker_urls]
            stats = send_tensors(sync_clients, self._server_ranks(), named_tensors, version, self.config.weight_sync)
            if self.colocation is not None:
                self.colocation.resume_kv_cache()
        elif method == "disk":
            sync_clients = [HttpClient(u, RetryPolicy(0), self.config.weight_sync.timeout_s) for u in self.worker_urls]
            attempt = time.monotonic()
            try:
                stats = weight_sync.disk_update(sync_clients, named_tensors, version, self.model_path,
                                                self._disk_directory(), self.config.weight_sync)
            except RolloutError as e:  # a server died loading: restart it, then every worker loads the snapshot
                self._recover(e, attempt)
                self._load_from_disk(self.worker_urls, version)
                stats = SyncStats("disk", version, time.monotonic() - attempt, 0, 0, 0, {})
        else:
            raise ValueError(f"weight sync method={method!r} is not 'distributed', 'tensor' or 'disk'")
        self._check_served(version, method, stats)
        return stats

    # Several senders (the trainer's pipeline stages): this engine opens and closes the update, each sender (this
    # process's included) sends its part in between through its own group (``SyncTarget.connect``).

    def sync_target(self) -> weight_sync.SyncTarget:
        """What another trainer rank needs to send its part of a distributed update."""
        if self._target is None:
            import socket

            self._target = weight_sync.SyncTarget(tuple(self.worker_urls), tuple(self._server_ranks()),
                                                  self.config.weight_sync, self.config.sync_backend,
                                                  host=socket.gethostname(), epoch=self._epoch)
        return self._target

    def begin_distributed_update(self, version: str) -> weight_sync.DistributedSender:
        """Open a distributed update to ``version`` on every worker; returns this process's sender (its group with
        the servers formed on first use, and again after a failed update left it unusable)."""
        self._check_new_version(version)
        self.ensure_servers()
        if self._sender is not None and self._sender.broken:
            self._sender.close()
            self._sender = None
        if self._sender is None:
            self._sender = self.sync_target().connect(torch.device(self.config.device))
        self._sender.begin()
        return self._sender

    def end_distributed_update(self, version: str, stats: SyncStats) -> None:
        """Close the update every sender has sent its part of; check every worker serves ``version``."""
        self._sender.end(str(version))
        self._check_served(str(version), "distributed", stats)

    def begin_tensor_update(self, version: str) -> None:
        """Colocated servers on several nodes (each node's trainer leader sends its own servers the update,
        ``train/sampling/colocate.py``): check the version is new and give every server its weights back."""
        self._check_new_version(version)
        if self.colocation is not None:
            self.colocation.resume_weights()

    def end_tensor_update(self, version: str, stats: SyncStats) -> None:
        """After every node's leader has sent its servers ``version``: their KV cache back, then check every worker
        serves ``version``."""
        if self.colocation is not None:
            self.colocation.resume_kv_cache()
        self._check_served(str(version), "tensor", stats)

    def _check_new_version(self, version) -> str:
        version = str(version)
        if version == self._version:
            raise WeightSyncError(f"weight version {version!r} is already served: give each update a new version")
        return version

    def _check_served(self, version: str, method: str, stats: SyncStats) -> None:
        served = self.weight_version()
        if served != version:
            raise WeightSyncError(f"after a {method} weight update to {version!r} the servers report {served!r}")
        self._restore = (method, version)  # what a restarted server is brought back to
        self._stale.clear()  # either method brings every worker (restarted ones too) to ``version``
        log.info("weight sync (%s) to version %s: %.2f s, %.3f GB in %d tensors / %d buckets (%.2f GB/s)",
                 method, version, stats.seconds, stats.num_bytes / 1e9, stats.num_tensors, stats.num_buckets,
                 stats.gb_per_s)

    def _server_ranks(self) -> list[int]:
        """Ranks each worker brings to the weight-sync group (``update_group_ranks``)."""
        return [update_group_ranks(url, self._clients[url].get("/server_info", timeout=self.config.health_timeout_s * 4))
                for url in self.worker_urls]

    def _disk_directory(self) -> Path:
        if self._disk_dir is None:
            root = self.config.weight_sync.disk_dir
            self._disk_dir = Path(root) if root else Path(tempfile.mkdtemp(prefix="gspo_weights_"))
            self._disk_dir.mkdir(parents=True, exist_ok=True)
        return self._disk_dir


def server_capacity(server_info: dict) -> int | None:
    """The tokens an SGLang server's KV cache holds, from its ``/server_info`` (0.5.23): the sum of every
    data-parallel scheduler's ``internal_states[i].memory_usage.token_capacity``, else ``max_total_num_tokens``
    (its first scheduler's); None when it reports neither."""
    states = server_info.get("internal_states") or []
    per_dp = [(s.get("memory_usage") or {}).get("token_capacity") for s in states if isinstance(s, dict)]
    if per_dp and all(isinstance(c, int) and c > 0 for c in per_dp):
        return sum(per_dp)
    total = server_info.get("max_total_num_tokens")
    return int(total) if isinstance(total, int) and total > 0 else None


def request_tokens(prompts: Sequence[Sequence[int]], n: int, max_new_tokens: int) -> int:
    """The KV-cache tokens a /generate request may hold at its end: each of its n samples per prompt holds the
    prompt and up to ``max_new_tokens`` (worst case: no prefix shared, every response at full length)."""
    return sum(n * (len(p) + max_new_tokens) for p in prompts)


def request_chunks(prompts: list, n: int, max_new_tokens: int, most: int, capacity: int | None) -> list:
    """``prompts`` as (start, chunk) requests of at most ``most`` consecutive prompts whose ``request_tokens`` fit in
    ``capacity`` (one server's KV cache; None: unknown, count only), so that a request is one wave of decoding, not
    several; a prompt that alone exceeds it is a request of its own."""
    chunks, start = [], 0
    while start < len(prompts):
        end = start + 1
        while (end < len(prompts) and end - start < most and
               (capacity is None or request_tokens(prompts[start:end + 1], n, max_new_tokens) <= capacity)):
            end += 1
        chunks.append((start, prompts[start:end]))
        start = end
    return chunks


class TokenBudget:
    """Worst-case KV-cache tokens in flight per generate URL, shared by every rollout of the engine (multi-turn
    trajectories call ``generate`` from many threads). A request is sent to the URL with the fewest tokens in flight
    where it fits beside them (or alone, if it is larger than the whole cache), else waits for room; it gets
    ``waves`` = ceil(tokens in flight there with it / capacity) as its time-out multiple: the decoding waves the
    server needs for what it holds. URLs of unknown capacity take every request at once, with one wave."""

    def __init__(self, capacity: dict[str, int | None]):
        self.capacity = capacity
        self.in_flight = dict.fromkeys(capacity, 0)
        self.peak = dict.fromkeys(capacity, 0)
        self._room = threading.Condition()

    @property
    def smallest(self) -> int | None:
        known = [c for c in self.capacity.values() if c is not None]
        return min(known) if len(known) == len(self.capacity) else None

    def _fits(self, url: str, tokens: int) -> bool:
        capacity = self.capacity[url]
        return capacity is None or self.in_flight[url] == 0 or self.in_flight[url] + tokens <= capacity

    def acquire(self, tokens: int, cancelled: threading.Event) -> tuple[str, int]:
        """(url, waves) for a request of ``tokens``, once it fits somewhere; ``cancelled`` stops the wait."""
        with self._room:
            while True:
                room = [u for u in self.capacity if self._fits(u, tokens)]
                if room:
                    url = min(room, key=lambda u: self.in_flight[u])
                    self.in_flight[url] += tokens
                    self.peak[url] = max(self.peak[url], self.in_flight[url])
                    capacity = self.capacity[url]
                    return url, 1 if capacity is None else max(1, -(-self.in_flight[url] // capacity))
                if cancelled.is_set():
                    raise RequestFailed("the rollout failed elsewhere: a request waiting for KV-cache room is dropped")
                self._room.wait(timeout=0.1)

    def release(self, url: str, tokens: int) -> None:
        with self._room:
            self.in_flight[url] -= tokens
            self._room.notify_all()


def update_group_ranks(url: str, server_info: dict) -> int:
    """The ranks a server (its ``/server_info``) takes in a weight-sync group: its ``tp_size``.

    SGLang 0.5.23 joins each scheduler as ``rank_offset + tp_rank`` (``weight_updater.init_weights_update_group``),
    the same ranks in every pipeline stage: a ``pp_size`` > 1 server's stages claim each rank twice and the group
    never forms (it hangs until its time-out). Such a server is refused here, by name."""
    pp = int(server_info.get("pp_size", 1) or 1)
    if pp > 1:
        raise WeightSyncError(f"{url} serves with pp_size={pp}: SGLang gives its pipeline stages the same weight-sync "
                              "ranks (rank_offset + tp_rank in every stage), so a distributed update cannot form its "
                              "group; serve with pp_size=1 or set weight_sync.method=disk", url=url)
    return int(server_info.get("tp_size", 1) or 1)


def routed_experts_shape(model_path: str) -> tuple[int, int]:
    """(layers, top-k) of the routed experts SGLang returns for the model in ``model_path`` (a local Hugging Face
    directory: its config.json's num_hidden_layers and num_experts_per_tok, of the text config if nested)."""
    import json

    path = Path(model_path) / "config.json"
    if not path.is_file():
        raise ValueError(f"sglang.return_routed_experts needs the model's config.json to decode the routes: "
                         f"{path} does not exist (set sglang.model_path to a local copy of the served model)")
    config = json.loads(path.read_text())
    config = config.get("text_config", config)
    if not config.get("num_experts_per_tok"):
        raise ValueError(f"sglang.return_routed_experts: {path} has no num_experts_per_tok: not an MoE model")
    return int(config["num_hidden_layers"]), int(config["num_experts_per_tok"])


def decode_routed_experts(meta: dict, tokens: int, shape: tuple[int, int], where: str) -> torch.Tensor:
    """meta_info["routed_experts"] (base64 of int32 [tokens, layers, top-k]: the prompt's and the response's
    tokens but the last) -> int16 [tokens, layers, top-k], a Sample's ``rollout_routing``; any other length is an
    error naming the sample. ``routed_experts`` (here and in the request) is SGLang's name, kept at this boundary."""
    import base64

    import numpy as np

    encoded = meta.get("routed_experts")
    if not encoded:
        raise BadResponse(f"{where}: the answer has no routed_experts: start the server with "
                          "--enable-return-routed-experts (rollout routing replay needs the experts it routed to)")
    ids = np.frombuffer(base64.b64decode(encoded), dtype=np.int32)
    layers, topk = shape
    if ids.size != tokens * layers * topk:
        raise BadResponse(f"{where}: routed_experts holds {ids.size} expert ids, expected {tokens} tokens (prompt + "
                          f"response - 1) x {layers} layers x top-{topk} = {tokens * layers * topk}")
    if ids.size and (ids.min() < 0 or ids.max() > torch.iinfo(torch.int16).max):
        raise BadResponse(f"{where}: routed_experts has expert ids outside [0, 32767]: {ids.min()}..{ids.max()}")
    return torch.from_numpy(ids.astype(np.int16)).view(tokens, layers, topk)


def parse_generate(answer, prompts: list[list[int]], n: int, start: int, url: str,
                   routed_shape: tuple[int, int] | None = None) -> list[Sample]:
    """SGLang's /generate answer for ``prompts`` x n samples (prompt-major) as Samples; every count, order and
    length is checked, and an aborted sample is an error, never a silently short group. With ``routed_shape``
    (layers, top-k), each sample carries its routed experts as ``rollout_routing``."""
    items = answer if isinstance(answer, list) else [answer]
    if len(items) != len(prompts) * n:
        raise BadResponse(f"{url}: /generate returned {len(items)} samples for {len(prompts)} prompts x n={n}")
    samples = []
    for j, item in enumerate(items):
        p, s = divmod(j, n)
        where = f"{url}: prompt {start + p}, sample {s}"
        try:
            meta = item["meta_info"]
            output_ids = [int(t) for t in item["output_ids"]]
            token_logprobs = meta["output_token_logprobs"]
            finish = meta["finish_reason"] or {}
        except (KeyError, TypeError) as e:
            raise BadResponse(f"{where}: /generate answer lacks {e} (return_logprob unsupported?)") from e
        if meta.get("prompt_tokens") not in (None, len(prompts[p])):
            raise BadResponse(f"{where}: answer is for a prompt of {meta['prompt_tokens']} tokens, expected "
                              f"{len(prompts[p])}: SGLang's prompt-major order did not hold")
        kind = finish.get("type")
        if kind not in ("stop", "length"):
            raise BadResponse(f"{where}: finished with {finish!r} (aborted by the server?)")
        if len(token_logprobs) != len(output_ids) or any(int(t[1]) != i for t, i in zip(token_logprobs, output_ids)):
            raise BadResponse(f"{where}: output_token_logprobs ({len(token_logprobs)}) do not match output_ids "
                              f"({len(output_ids)})")
        logprobs = [float(t[0]) for t in token_logprobs]
        routed = None
        if routed_shape is not None:
            routed = decode_routed_experts(meta, len(prompts[p]) + len(output_ids) - 1, routed_shape, where)
        samples.append(Sample(prompts[p], output_ids, logprobs, kind, str(meta.get("weight_version")), start + p, s,
                              item.get("text"), routed))
    return samples
