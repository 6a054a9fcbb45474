"""A trainer rank that dies, under torchrun's elastic agent (`torchrun --nproc-per-node 2 --max-restarts 1`, gloo,
EP 2): rank 1 SIGKILLed in the middle of step 4 (as it waits for the rollout rank 0 generates; the checkpoint of
step 2 on disk) makes the agent restart both workers, which resume from step 2 on their own (no --resume) and finish
the run; nothing of the run outlives it (the killed rank's checkpoint writer included).

- With the local engine the final weights are bit-identical to an uninterrupted run's (CPU, fp32).
- With the real SGLang server on 127.0.0.1 that rank 0 launches, the restarted rank 0 adopts the same server process
  (same pid: not launched again) and syncs the resumed weights to it (the trainer's log-probs of the resumed steps'
  rollouts equal the server's); at the end the server and its watchdog are gone. Its weights are not compared: SGLang
  samples from its own RNG stream (per-request seeds only with --enable-deterministic-inference), which the failed
  attempt's rollouts advanced.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.rollout.server_watchdog import running
from gspo_megatron.train.records.metrics_log import read_metrics
from gspo_megatron.train.resilience import fault_injection
from tests.processes import in_session, still_running
from tests.processes import running as process_running
from tests.rollout.helpers import require_sglang
from tests.train.saved import final_weights
from tests.train.torchrun_runs import ROOT, STEPS, env, logged_steps, two_ranks

pytestmark = pytest.mark.megatron  # trains the Megatron policy through the CLI


# What these add to the policy's step and checkpoints (which run on megatron-core 0.19 in the covering test, and the
# checkpoint writer's patch in tests/patches) is torchrun's restart and the loop's resume: not run again on 0.19.
COVERED = pytest.mark.megatron_covered_by(
    "tests/train/records/test_checkpoint.py::test_resume_is_exact_ep2_distributed_optimizer")


def _run_killing_rank_1(run: Path, command: list[str]) -> str:
    """Run ``command`` with rank 1 SIGKILLed as step 4's rollout starts (rank 0 generating, step 2's checkpoint the
    latest), by the fault schedule (``train.resilience.fault_injection``): the point is fixed whatever the load, as
    a kill timed from outside is not; the output."""
    run.mkdir(parents=True)
    log = run.parent / f"{run.name}.out"
    scheduled = fault_injection.write(run.parent / f"{run.name}.faults.json",
                                      [{"at": "rollout", "step": 4, "action": "kill_rank", "rank": 1}])
    with open(log, "w") as out:  # a file, not a pipe: a killed rank's children keep what they inherited open
        process = subprocess.Popen(command, cwd=ROOT, env=dict(env(), **scheduled), stdout=out,
                                   stderr=subprocess.STDOUT, start_new_session=True)
        try:
            process.wait(timeout=600)
        finally:
            left = still_running(in_session(process.pid), seconds=10)
            if process.poll() is None or left:
                os.killpg(process.pid, signal.SIGKILL)
    text = log.read_text(errors="replace")
    assert process.returncode == 0, text[-4000:]
    # The killed rank's checkpoint-writer Manager (started at step 2) dies with it: patches.megatron_checkpoint_writer
    assert not left, f"processes of the run outlived it (pids {left})"
    assert "fault injection: {'at': 'rollout', 'step': 4, 'action': 'kill_rank', 'rank': 1}" in text, text[-3000:]
    assert "torchrun restart 1 of 1: resuming from" in text and "step_000002" in text, text[-3000:]
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert logged_steps(run) == list(range(1, STEPS + 1))  # the resumed run kept metrics.jsonl up to its checkpoint
    assert text.count(f"gspo step 3/{STEPS}:") == 2, text[-3000:]  # step 3 done twice: then from step 2's checkpoint
    assert (run / "ck" / "latest").read_text() == f"step_{STEPS:06d}"
    return text


@COVERED
def test_a_killed_rank_is_restarted_and_the_run_resumes_exactly(tmp_path, uninterrupted_two_ranks):
    uninterrupted, model = uninterrupted_two_ranks
    restarted = tmp_path / "b"
    _run_killing_rank_1(restarted, two_ranks(restarted, model, "rollout.engine=local", "checkpoint.every=2",
                                             max_restarts=1))
    (a, b), = run_on_ranks(final_weights, 1, None, str(uninterrupted / "ck" / f"step_{STEPS:06d}"),
                           str(restarted / "ck" / f"step_{STEPS:06d}"))
    assert a.keys() == b.keys() and len(a) > 10
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"restarted weights differ from the uninterrupted run: {different[:5]}"


def _gone(record: dict, seconds: float = 30.0) -> bool:
    """The recorded server(s) and their watchdog no longer run (within ``seconds``)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        servers = any(running(s["pid"], s["started"]) for s in record["servers"])
        if not process_running(record["watchdog"]) and not servers:
            return True
        time.sleep(0.2)
    return False


@COVERED
def test_a_killed_rank_is_restarted_with_the_sglang_server_kept_and_synced(tmp_path, uninterrupted_two_ranks):
    require_sglang()
    _, model = uninterrupted_two_ranks
    run = tmp_path / "b"
    text = _run_killing_rank_1(run, two_ranks(run, model, "checkpoint.every=2", f"rollout.server_args.log_dir={run}",
                                              max_restarts=1))
    record = json.loads((run / "elastic_run.json").read_text())
    server, = record["servers"]  # the first attempt's: recorded once
    assert f"kept SGLang servers [('{server['url']}', {server['pid']})] adopted" in text, text[-3000:]
    assert (run / "sglang_server_0.log").read_text().count("Uvicorn running on") == 1, "the server started again"
    # The resumed steps' rollouts came from the server at the resumed weights: trainer and server log-probs agree.
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records[2:]] == [3, 4]  # (metrics.jsonl: the resumed run's steps replace the lost 3)
    assert max(r["logprob_diff_max"] for r in records[2:]) < 1e-4, [r["logprob_diff_max"] for r in records]
    assert _gone(record), "the server or its watchdog outlived the run"


def test_a_restart_resumes_only_from_checkpoints_this_run_wrote(tmp_path, monkeypatch):
    """``checkpoint_to_resume``'s choice (rank 0's; one process here): an earlier run's checkpoint is resumed only
    with --resume, this run's on any restart."""
    from gspo_megatron.train.resilience import elastic
    from gspo_megatron.train.startup.config import load_config

    monkeypatch.setattr(elastic.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(elastic.control, "broadcast_from_rank0", lambda obj: obj)
    cfg = load_config(None, [f"logging.dir={tmp_path / 'log'}", f"checkpoint.dir={tmp_path / 'ck'}"])
    ck = tmp_path / "ck"

    def save(step: int) -> Path:  # what checkpoint.save leaves: the directory and a replaced `latest`
        (ck / f"step_{step:06d}").mkdir(parents=True)
        (ck / "latest.tmp").write_text(f"step_{step:06d}")
        os.replace(ck / "latest.tmp", ck / "latest")
        return ck / f"step_{step:06d}"

    old = save(7)  # an earlier run's
    assert elastic.checkpoint_to_resume(cfg, resume=False) is None  # outside torchrun: --resume decides
    assert elastic.checkpoint_to_resume(cfg, resume=True) == old

    def attempt(restart: int, run_id: str = "run-a") -> None:
        monkeypatch.setenv("TORCHELASTIC_RUN_ID", run_id)
        monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))

    attempt(0)
    assert elastic.checkpoint_to_resume(cfg, resume=False) is None  # a fresh run beside an old checkpoint
    attempt(1)
    assert elastic.checkpoint_to_resume(cfg, resume=False) is None  # failed before its first checkpoint: afresh
    assert elastic.checkpoint_to_resume(cfg, resume=True) == old  # unless told to resume whatever is there
    mine = save(2)
    assert elastic.checkpoint_to_resume(cfg, resume=False) == mine  # this run's: resumed on its own
    attempt(2)
    assert elastic.checkpoint_to_resume(cfg, resume=False) == mine
    assert elastic.resumed_version(2) == "2-resumed-restart2"
    attempt(1, run_id="run-b")  # another torchrun's record does not count
    assert elastic.checkpoint_to_resume(cfg, resume=False) is None
