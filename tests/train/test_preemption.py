"""Preemption through the CLI on 2 ranks (torchrun, EP 2, local engine): SIGUSR1 sent to rank 1 alone stops both
ranks after the same step with a checkpoint of it and exit status 0; ``--resume`` then finishes the run with final
weights bit-identical to an uninterrupted run's (CPU, fp32).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import torch

from gspo_megatron.parallel.launch import run_on_ranks
from tests.train.saved import final_weights

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4


def _command(run: Path, *extra: str) -> list[str]:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    return [torchrun, "--standalone", "--nproc-per-node", "2", "-m", "gspo_megatron.cli", "train",
            str(ROOT / "examples/tiny_moe_cpu.yaml"), "rollout.engine=local", f"train.steps={STEPS}",
            "train.eval_every=0", "model.warm_start_steps=2", f"model.hf_dir={run.parent / 'model'}",
            f"logging.dir={run}", f"checkpoint.dir={run / 'ck'}", "checkpoint.every=0", "logging.plot_every=0",
            "rollout.prompts_per_step=2", "parallel.micro_batch_size=4", "parallel.expert=2",
            "data.reward_workers=0", *extra]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return dict(env, OMP_NUM_THREADS="1")


def _run(run: Path, *extra: str) -> subprocess.CompletedProcess:
    out = subprocess.run(_command(run, *extra), cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def _steps(run: Path) -> list[int]:
    """Steps logged so far (complete lines only: the trainer may be writing the next)."""
    path = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().split("\n")[:-1]] if path.is_file() else []


def _rank(process: subprocess.Popen, rank: int) -> psutil.Process:
    for child in psutil.Process(process.pid).children(recursive=True):
        try:
            if child.environ().get("RANK") == str(rank) and "gspo_megatron.cli" in " ".join(child.cmdline()):
                return child
        except psutil.Error:
            continue
    raise AssertionError(f"no rank {rank} under torchrun")


def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step_and_resume_is_exact(tmp_path):
    uninterrupted = tmp_path / "a"
    _run(uninterrupted)
    assert _steps(uninterrupted) == list(range(1, STEPS + 1))

    preempted = tmp_path / "b"
    process = subprocess.Popen(_command(preempted), cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 600
        while not _steps(preempted) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        _rank(process, 1).send_signal(signal.SIGUSR1)  # rank 1 only: rank 0 learns of it at the step boundary
        stdout, stderr = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, stderr[-3000:]
    stopped = _steps(preempted)[-1]
    assert 1 < stopped < STEPS, f"stopped after step {stopped}: the signal came too late to test resume"
    assert _steps(preempted) == list(range(1, stopped + 1))
    assert (preempted / "ck" / "latest").read_text() == f"step_{stopped:06d}"
    assert f"stopped by a signal after step {stopped} of {STEPS}" in stdout and "SIGUSR1" in stderr

    _run(preempted, "--resume")
    assert _steps(preempted) == list(range(1, STEPS + 1))
    (a, b), = run_on_ranks(final_weights, 1, None, str(uninterrupted / "ck" / f"step_{STEPS:06d}"),
                           str(preempted / "ck" / f"step_{STEPS:06d}"))
    assert a.keys() == b.keys() and len(a) > 10
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"resumed weights differ from the uninterrupted run: {different[:5]}"
