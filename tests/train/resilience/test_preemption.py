"""Preemption through the CLI on 2 ranks (torchrun, EP 2, local engine): SIGUSR1 sent to rank 1 alone stops both
ranks after the same step with a checkpoint of it and exit status 0; ``--resume`` then finishes the run with final
weights bit-identical to an uninterrupted run's (CPU, fp32).
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from gspo_megatron.parallel.launch import run_on_ranks
from tests.train.saved import final_weights
from tests.train.torchrun_runs import ROOT, STEPS, env, logged_steps, rank_process, two_ranks

pytestmark = pytest.mark.megatron  # trains the Megatron policy through the CLI


def _command(run: Path, model: Path, *extra: str) -> list[str]:
    return two_ranks(run, model, "rollout.engine=local", "checkpoint.every=0", *extra)


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step_and_resume_is_exact(tmp_path,
                                                                                        uninterrupted_two_ranks):
    uninterrupted, model = uninterrupted_two_ranks
    preempted = tmp_path / "b"
    process = subprocess.Popen(_command(preempted, model), cwd=ROOT, env=env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not logged_steps(preempted) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        rank_process(process.pid, 1).send_signal(signal.SIGUSR1)  # rank 1 only: rank 0 learns of it at the step boundary
        stdout, stderr = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, stderr[-3000:]
    stopped = logged_steps(preempted)[-1]
    assert 1 < stopped < STEPS, f"stopped after step {stopped}: the signal came too late to test resume"
    assert logged_steps(preempted) == list(range(1, stopped + 1))
    assert (preempted / "ck" / "latest").read_text() == f"step_{stopped:06d}"
    assert f"stopped by a signal after step {stopped} of {STEPS}" in stdout and "SIGUSR1" in stderr

    out = subprocess.run(_command(preempted, model, "--resume"), cwd=ROOT, env=env(), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert logged_steps(preempted) == list(range(1, STEPS + 1))
    (a, b), = run_on_ranks(final_weights, 1, None, str(uninterrupted / "ck" / f"step_{STEPS:06d}"),
                           str(preempted / "ck" / f"step_{STEPS:06d}"))
    assert a.keys() == b.keys() and len(a) > 10
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"resumed weights differ from the uninterrupted run: {different[:5]}"
