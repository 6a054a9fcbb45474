"""Faults on a schedule, for the soak run (``bench/soak.py``): what a long run meets, at the worst moments; and for
the tests that need a fault at a fixed point of a run, whatever the machine's load.

``GSPO_FAULTS=/path/faults.json`` (unset: every call here is a no-op) holds a list of faults:

    [{"at": "rollout", "step": 40, "action": "kill_server", "delay_s": 0.3},
     {"at": "weight_sync", "step": 90, "action": "kill_server"},
     {"at": "checkpoint_written", "step": 150, "action": "kill_rank", "rank": 1}]

``at`` names a point the trainer passes once per step: ``rollout`` (rank 0 before generation starts: the kill lands
``delay_s`` later, mid-generation; the other ranks as they start waiting for that step's rollout), ``weight_sync``
(rank 0, a distributed update open on the servers, before the weights are sent), ``checkpoint_written`` (every rank,
its checkpoint shards written, before the checkpoint is published). Actions: ``kill_server`` (SIGKILL the first
launched SGLang server's process group, after ``delay_s``), ``kill_rank`` (SIGKILL this process if it is global rank
``rank``), ``signal_rank`` (send this process ``signal``, a name such as "SIGUSR1", if it is global rank ``rank``: a
preemption notice arriving at that point). Each fault fires once per run: firing writes
``faults.json.fired.<index>`` next to the file, so a restarted or resumed trainer passing the same step again does
not fire it twice.
"""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

POINTS = ("rollout", "weight_sync", "checkpoint_written")
ACTIONS = ("kill_server", "kill_rank", "signal_rank")
ENV = "GSPO_FAULTS"


def load(path: str | Path) -> list[dict]:
    """The faults of ``path``, checked: a bad entry is a ValueError naming its index and field."""
    faults = json.loads(Path(path).read_text())
    if not isinstance(faults, list):
        raise ValueError(f"{path}: a list of faults, got {type(faults).__name__}")
    for i, fault in enumerate(faults):
        where = f"{path}: fault {i}"
        if fault.get("at") not in POINTS:
            raise ValueError(f"{where}: at={fault.get('at')!r} is not one of {POINTS}")
        if fault.get("action") not in ACTIONS:
            raise ValueError(f"{where}: action={fault.get('action')!r} is not one of {ACTIONS}")
        if not isinstance(fault.get("step"), int) or fault["step"] < 1:
            raise ValueError(f"{where}: step={fault.get('step')!r} must be an integer >= 1")
        if fault["action"] in ("kill_rank", "signal_rank") and not isinstance(fault.get("rank"), int):
            raise ValueError(f"{where}: {fault['action']} needs rank (an integer)")
        if fault["action"] == "signal_rank" and fault.get("signal") not in signal.Signals.__members__:
            raise ValueError(f"{where}: signal={fault.get('signal')!r} is not a signal name such as 'SIGUSR1'")
    return faults


def write(path: str | Path, faults: list[dict]) -> dict[str, str]:
    """Write the schedule ``faults`` to ``path``, checked as ``load`` checks it (a bad entry fails here, before any
    run starts); the environment entry that turns it on, ``{GSPO_FAULTS: path}``."""
    Path(path).write_text(json.dumps(faults, indent=1))
    load(path)
    return {ENV: str(path)}


def at(point: str, step: int, engine=None) -> None:
    """The trainer passes ``point`` in ``step``: fire the faults scheduled there (once each per run)."""
    path = os.environ.get(ENV)
    if not path:
        return
    for index, fault in enumerate(load(path)):
        if fault["at"] != point or fault["step"] != step:
            continue
        if fault["action"] in ("kill_rank", "signal_rank") and fault["rank"] != _rank():
            continue
        if fault["action"] == "kill_server" and engine is None:
            continue  # only rank 0 holds the engine
        fired = Path(f"{path}.fired.{index}")
        if fired.exists():
            continue
        fired.write_text(json.dumps(fault))
        print(f"gspo-megatron: fault injection: {fault}", flush=True)
        if fault["action"] == "kill_rank":
            os.kill(os.getpid(), signal.SIGKILL)
        elif fault["action"] == "signal_rank":
            os.kill(os.getpid(), signal.Signals[fault["signal"]])
        else:
            _kill_server_later(engine, float(fault.get("delay_s", 0.0)))


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", 0))


def _kill_server_later(engine, delay_s: float) -> None:
    servers = engine.servers if hasattr(engine, "servers") else []
    if not servers:
        raise ValueError("fault injection: kill_server, but the engine launched no server (rollout.urls given?)")
    pid = servers[0].process.pid

    def kill():
        try:
            os.killpg(pid, signal.SIGKILL)  # the server and its scheduler/detokenizer children
        except ProcessLookupError:
            pass

    if delay_s <= 0:
        kill()
    else:
        threading.Timer(delay_s, kill).start()
