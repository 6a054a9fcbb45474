"""A trainer rank that dies, under torchrun's elastic agent (``torchrun --max-restarts N``): the restarted workers
resume from this run's latest checkpoint on their own, and the SGLang servers rank 0 launched are kept and synced
again rather than launched again.

torchrun's agent (torch.distributed.elastic, LocalElasticAgent) runs each worker in a session of its own. When one
fails (a non-zero exit, a signal) it SIGTERMs every worker's process group, SIGKILLs what is left after 30 s, and
starts them all again with ``TORCHELASTIC_RESTART_COUNT`` one higher, at most ``TORCHELASTIC_MAX_RESTARTS`` times,
with the same ``TORCHELASTIC_RUN_ID`` (each ``torchrun --standalone`` draws a new one). Under it, with restarts
allowed (``attempt()``):

- Rank 0 launches its servers *kept* (``ServerProcess(keep=True)``: own session, no parent-death signal) and
  records them in ``<logging.dir>/elastic_run.json`` with the run id. A rank 0 that fails with restarts left lets go
  of them (``leave_servers``); the next attempt's rank 0 adopts the recorded servers when they all still run
  (``servers``; the engine then checks they generate) instead of launching, and the loop syncs the resumed weights
  to them. The servers are stopped by a clean end (rank 0's ``engine.close``), by a rank 0 failing on the last
  attempt, and otherwise by ``rollout.server_watchdog``, started beside them, once the agent process is gone (it
  gave up after the last restart, or was killed).
- A restarted attempt resumes from ``checkpoint.dir``'s latest checkpoint when this run wrote it (the run file
  holds what ``latest`` was when the run began), or with ``--resume`` whatever it is; else it starts afresh like
  the first attempt (``checkpoint_to_resume``).

Outside torchrun, or with ``--max-restarts 0``, nothing changes: servers die with rank 0, ``--resume`` decides.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch.distributed as dist

from gspo_megatron.parallel import control
from gspo_megatron.rollout import server_watchdog
from gspo_megatron.rollout.server import ServerProcess, start_servers
from gspo_megatron.train.records import checkpoint
from gspo_megatron.train.startup.config import Config

RUN_FILE = "elastic_run.json"


@dataclass(frozen=True)
class Attempt:
    """This worker's attempt of a torchrun job that restarts failed workers."""

    run_id: str  # TORCHELASTIC_RUN_ID
    restart: int  # TORCHELASTIC_RESTART_COUNT: 0 for the first attempt
    max_restarts: int  # TORCHELASTIC_MAX_RESTARTS
    agent_pid: int  # the torchrun agent that restarts us: this worker's parent

    @property
    def restarts_left(self) -> int:
        return self.max_restarts - self.restart


def attempt() -> Attempt | None:
    """The attempt when torchrun's elastic agent runs this worker with ``--max-restarts`` >= 1, else None."""
    env = os.environ
    if "TORCHELASTIC_RUN_ID" not in env or int(env.get("TORCHELASTIC_MAX_RESTARTS", "0")) < 1:
        return None
    return Attempt(env["TORCHELASTIC_RUN_ID"], int(env.get("TORCHELASTIC_RESTART_COUNT", "0")),
                   int(env["TORCHELASTIC_MAX_RESTARTS"]), os.getppid())


def restarted() -> bool:
    """True in every worker of an attempt after the first (torchrun restarted them)."""
    now = attempt()
    return now is not None and now.restart > 0


def resumed_version(version: int) -> str:
    """The weight version the servers get after a resume: a new one at each attempt (one already served is refused)."""
    now = attempt()
    return f"{version}-resumed" + (f"-restart{now.restart}" if now is not None and now.restart else "")


def _run_path(cfg: Config) -> Path:
    return Path(cfg.logging.dir) / RUN_FILE


def _read(cfg: Config) -> dict:
    try:
        return json.loads(_run_path(cfg).read_text())
    except (FileNotFoundError, ValueError):
        return {}


def _update(cfg: Config, now: Attempt, **fields) -> dict:
    """Set ``fields`` in this run's file (a file of another run is replaced), atomically: the watchdog reads it at
    any time."""
    run = _read(cfg)
    if run.get("run_id") != now.run_id:
        run = {"run_id": now.run_id}
    run.update(fields)
    path = _run_path(cfg)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(run, indent=1))
    os.replace(tmp, path)
    return run


def _identity(directory: str) -> list | None:
    """Which checkpoint ``latest`` names and which write of it this is (``latest`` is replaced at every save)."""
    pointer = Path(directory) / checkpoint.LATEST
    try:
        stat = pointer.stat()
        return [pointer.read_text().strip(), stat.st_ino, stat.st_mtime_ns]
    except FileNotFoundError:
        return None


def checkpoint_to_resume(cfg: Config, resume: bool) -> Path | None:
    """The checkpoint this attempt continues from, the same on every rank (rank 0 decides; collective):
    ``checkpoint.dir``'s latest with ``--resume``; after a torchrun restart also without it, when this run wrote it."""
    choice = None
    if dist.get_rank() == 0 and cfg.checkpoint.dir:
        latest = checkpoint.latest(cfg.checkpoint.dir)
        now, run = attempt(), _read(cfg)
        if now is not None and (now.restart == 0 or run.get("run_id") != now.run_id or "latest_at_start" not in run):
            run = _update(cfg, now, latest_at_start=_identity(cfg.checkpoint.dir))  # what this run began with
        ours = now is not None and now.restart > 0 and _identity(cfg.checkpoint.dir) != run["latest_at_start"]
        if latest is not None and (resume or ours):
            choice = str(latest)
            if now is not None and now.restart:
                print(f"gspo-megatron train: torchrun restart {now.restart} of {now.max_restarts}: resuming from "
                      f"{latest}", flush=True)
    choice = control.broadcast_from_rank0(choice)
    return Path(choice) if choice else None


def servers(cfg: Config, config) -> list | None:
    """Rank 0's launched servers under torchrun restarts (``config``: an ``SGLangConfig`` without urls): the
    recorded ones when this run recorded them and every one still runs, else new kept ones, recorded, with a
    watchdog. None (launch as usual) outside torchrun ``--max-restarts``."""
    now = attempt()
    if now is None:
        return None
    run = _read(cfg)
    if run.get("run_id") == now.run_id and run.get("servers"):
        adopted = [ServerProcess.adopt(record) for record in run["servers"]]
        if all(adopted) and len(adopted) == len(config.gpu_groups):
            print(f"gspo-megatron train: torchrun restart {now.restart}: kept SGLang servers "
                  f"{[(s.url, s.process.pid) for s in adopted]} adopted", flush=True)
            return adopted
        for server in filter(None, adopted):  # a partial set: start afresh
            server.shutdown()
    launched = start_servers(config, keep=True)
    _update(cfg, now, servers=[s.record() for s in launched])
    watchdog = server_watchdog.start(now.agent_pid, _run_path(cfg), Path(cfg.logging.dir) / "server_watchdog.log")
    _update(cfg, now, watchdog=watchdog.pid)
    return launched


def record_servers(cfg: Config, servers: list) -> None:
    """Record rank 0's kept servers again after one was relaunched (a new pid): the next attempt adopts these and the
    watchdog stops these, not the dead process."""
    now = attempt()
    if now is not None:
        _update(cfg, now, servers=[s.record() for s in servers])


def leave_servers(engine) -> None:
    """After a failure with torchrun restarts left: rank 0's kept servers stay up for the next attempt to adopt."""
    now = attempt()
    if engine is not None and now is not None and now.restarts_left > 0 and hasattr(engine, "leave_kept_servers"):
        engine.leave_kept_servers()
