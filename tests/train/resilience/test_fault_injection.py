"""The soak run's fault schedule (``train.resilience.fault_injection``): checked entries, each fault once per run, a
server's process group killed mid-call, this rank SIGKILLed, nothing without ``GSPO_FAULTS``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from gspo_megatron.train.resilience import fault_injection

ROOT = Path(__file__).resolve().parents[3]


def _faults(tmp_path, faults) -> Path:
    path = tmp_path / "faults.json"
    path.write_text(json.dumps(faults))
    return path


@pytest.mark.parametrize("fault, message", [
    ({"at": "update", "step": 1, "action": "kill_server"}, r"fault 0: at='update' is not one of"),
    ({"at": "rollout", "step": 0, "action": "kill_server"}, r"fault 0: step=0 must be an integer >= 1"),
    ({"at": "rollout", "step": 1, "action": "explode"}, r"fault 0: action='explode' is not one of"),
    ({"at": "rollout", "step": 1, "action": "kill_rank"}, r"fault 0: kill_rank needs rank"),
    ({"at": "rollout", "step": 1, "action": "signal_rank", "signal": "SIGUSR1"}, r"fault 0: signal_rank needs rank"),
    ({"at": "rollout", "step": 1, "action": "signal_rank", "rank": 0, "signal": "USR1"},
     r"fault 0: signal='USR1' is not a signal name"),
])
def test_bad_entries_name_index_and_field(tmp_path, fault, message):
    with pytest.raises(ValueError, match=message):
        fault_injection.load(_faults(tmp_path, [fault]))
    with pytest.raises(ValueError, match=message):  # a run's schedule is checked as it is written
        fault_injection.write(tmp_path / "written.json", [fault])


def test_kill_server_fires_once_at_its_point_and_step(tmp_path, monkeypatch):
    path = _faults(tmp_path, [{"at": "rollout", "step": 3, "action": "kill_server", "delay_s": 0.2}])
    monkeypatch.setenv(fault_injection.ENV, str(path))
    server = subprocess.Popen(["sleep", "60"], start_new_session=True)  # a process group, as a launched server
    engine = SimpleNamespace(servers=[SimpleNamespace(process=server)])
    try:
        fault_injection.at("rollout", 2, engine)
        fault_injection.at("weight_sync", 3, engine)
        fault_injection.at("rollout", 3, None)  # not rank 0: no engine, nothing fires
        assert server.poll() is None and not list(tmp_path.glob("*.fired.*"))
        fault_injection.at("rollout", 3, engine)
        assert server.poll() is None  # the kill lands delay_s later (mid-generation)
        assert server.wait(timeout=10) == -9
        assert json.loads((tmp_path / "faults.json.fired.0").read_text())["step"] == 3
        again = subprocess.Popen(["sleep", "60"], start_new_session=True)
        fault_injection.at("rollout", 3, SimpleNamespace(servers=[SimpleNamespace(process=again)]))  # a rerun step
        time.sleep(0.5)
        assert again.poll() is None
        again.kill()
    finally:
        server.kill()


def test_kill_rank_kills_only_that_rank(tmp_path):
    path = _faults(tmp_path, [{"at": "checkpoint_written", "step": 5, "action": "kill_rank", "rank": 1}])
    code = "from gspo_megatron.train.resilience import fault_injection; fault_injection.at('checkpoint_written', 5); print('alive')"
    runs = {rank: subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                 env=dict(os.environ, GSPO_FAULTS=str(path), RANK=str(rank), PYTHONPATH=str(ROOT)))
            for rank in (0, 1)}
    assert runs[0].returncode == 0 and "alive" in runs[0].stdout
    assert runs[1].returncode == -9 and "alive" not in runs[1].stdout


def test_signal_rank_signals_only_that_rank(tmp_path):
    path = _faults(tmp_path, [{"at": "rollout", "step": 2, "action": "signal_rank", "rank": 1, "signal": "SIGUSR1"}])
    code = ("import signal; from gspo_megatron.train.resilience import fault_injection; "
            "signal.signal(signal.SIGUSR1, lambda *a: print('got', signal.Signals(a[0]).name)); "
            "fault_injection.at('rollout', 1); fault_injection.at('rollout', 2); print('alive')")
    runs = {rank: subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                                 env=dict(os.environ, GSPO_FAULTS=str(path), RANK=str(rank), PYTHONPATH=str(ROOT)))
            for rank in (0, 1)}
    assert runs[0].returncode == 0 and runs[0].stdout.split("\n")[-2:] == ["alive", ""], runs[0].stdout
    assert runs[1].returncode == 0 and "got SIGUSR1\nalive" in runs[1].stdout, runs[1].stdout + runs[1].stderr


def test_no_schedule_no_faults(tmp_path, monkeypatch):
    """Without GSPO_FAULTS a schedule that would fire here does nothing; with it set, the same call fires."""
    path = _faults(tmp_path, [{"at": "rollout", "step": 1, "action": "kill_server"}])
    server = subprocess.Popen(["sleep", "60"], start_new_session=True)
    engine = SimpleNamespace(servers=[SimpleNamespace(process=server)])
    try:
        monkeypatch.delenv(fault_injection.ENV, raising=False)
        fault_injection.at("rollout", 1, engine)
        time.sleep(0.2)
        assert server.poll() is None and not list(tmp_path.glob("*.fired.*"))
        monkeypatch.setenv(fault_injection.ENV, str(path))  # the same call, scheduled: it fires
        fault_injection.at("rollout", 1, engine)
        assert server.wait(timeout=10) == -9 and (tmp_path / "faults.json.fired.0").exists()
    finally:
        server.kill()
