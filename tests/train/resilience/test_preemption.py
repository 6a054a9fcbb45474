"""Preemption through the CLI on 2 ranks (torchrun, EP 2, local engine): SIGUSR1 sent to rank 1 alone (in step 2) stops
both ranks after the same step with a checkpoint of it and exit status 0; ``--resume`` then finishes the run with final
weights bit-identical to an uninterrupted run's (CPU, fp32).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gspo_megatron.cli import main
from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.train.resilience import fault_injection
from tests.train.saved import final_weights
from tests.train.torchrun_runs import ROOT, STEPS, env, logged_steps, two_ranks

pytestmark = pytest.mark.megatron  # trains the Megatron policy through the CLI


def _command(run: Path, model: Path, *extra: str) -> list[str]:
    return two_ranks(run, model, "rollout.engine=local", "checkpoint.every=0", *extra)


# What these add to the policy's step and checkpoints (which run on megatron-core 0.19 in the covering tests) is the
# loop's own: when every rank stops, and what a signal does to a wait. Not run again on 0.19.
@pytest.mark.megatron_covered_by("tests/train/records/test_checkpoint.py::test_resume_is_exact_ep2_distributed_optimizer")
def test_a_signal_on_one_rank_stops_every_rank_after_the_same_step_and_resume_is_exact(tmp_path, capsys, monkeypatch,
                                                                                        uninterrupted_two_ranks):
    uninterrupted, model = uninterrupted_two_ranks
    preempted = tmp_path / "b"
    # SIGUSR1 to rank 1 only, as it starts waiting for step 2's rollout (the fault schedule: the same point whatever
    # the machine's load); rank 0 learns of it at the step boundary.
    scheduled = fault_injection.write(tmp_path / "faults.json", [{"at": "rollout", "step": 2, "action": "signal_rank",
                                                                  "rank": 1, "signal": "SIGUSR1"}])
    process = subprocess.Popen(_command(preempted, model), cwd=ROOT, env=dict(env(), **scheduled),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    assert process.returncode == 0, stderr[-3000:]
    stopped = 2  # the step the signal arrived in, finished by every rank
    assert logged_steps(preempted) == list(range(1, stopped + 1)), stderr[-3000:]
    assert (preempted / "ck" / "latest").read_text() == f"step_{stopped:06d}"
    assert f"stopped by a signal after step {stopped} of {STEPS}" in stdout and "SIGUSR1" in stderr

    # Resumed under another expert split (EP 1, DP 2): refused before anything is built, naming the field and the way
    # on (megatron's load would fail listing every key)
    command = _command(preempted, model, "--resume", "parallel.expert=1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert main(command[command.index("train"):]) == 2
    assert (f"--resume: {preempted / 'ck' / 'step_000002'} was saved under another layout: parallel.expert=1 (saved "
            "with 2)" in capsys.readouterr().err)

    out = subprocess.run(_command(preempted, model, "--resume"), cwd=ROOT, env=env(), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert logged_steps(preempted) == list(range(1, STEPS + 1))
    (a, b), = run_on_ranks(final_weights, 1, None, str(uninterrupted / "ck" / f"step_{STEPS:06d}"),
                           str(preempted / "ck" / f"step_{STEPS:06d}"))
    assert a.keys() == b.keys() and len(a) > 10
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"resumed weights differ from the uninterrupted run: {different[:5]}"


@pytest.mark.megatron_covered_by("tests/train/test_loop.py::test_train_logs_plots_and_resumes_exactly")
def test_a_signal_while_waiting_for_the_rollout_servers_stops_the_wait(tmp_path):
    """SIGTERM while the trainer waits for an attached server that accepts connections but never answers (still
    loading, or hung): the wait ends at its next poll instead of rollout.startup_timeout_s (300 s), the run exits
    128+15 with a sentence saying nothing was trained, and nothing was saved. World 1, a real process."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    accepted: list[socket.socket] = []

    def accept() -> None:  # hold every connection open, answer none
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    command = [sys.executable, "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
               f"model.hf_dir={tmp_path / 'model'}", "model.warm_start_steps=0", f"logging.dir={tmp_path / 'run'}",
               f"checkpoint.dir={tmp_path / 'run' / 'ck'}", f"rollout.urls=[{url}]", "data.reward_workers=0"]
    process = subprocess.Popen(command, cwd=ROOT, env=dict(env(), WORLD_SIZE="1"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        # The first connection is the pre-flight check (accepts?); the next ones are the engine's health probes.
        while len(accepted) < 2 and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process.poll() is None, process.communicate()[1][-3000:]
        signalled = time.monotonic()
        process.send_signal(signal.SIGTERM)
        stdout, stderr = process.communicate(timeout=120)
        stopped_in = time.monotonic() - signalled
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
        listener.close()
    assert process.returncode == 128 + signal.SIGTERM, stderr[-3000:]
    assert f"stopped before the first step: SIGTERM while waiting for {url} to answer" in stderr, stderr[-3000:]
    assert stopped_in < 30, f"the wait went on {stopped_in:.0f} s after the signal"
    assert not (tmp_path / "run" / "ck").exists() or not any((tmp_path / "run" / "ck").iterdir())


def _ctrl_c_run(tmp_path: Path, name: str, presses: int) -> tuple[int, str, str, Path]:
    """The CPU example at world 1 (local engine, 5 steps, no periodic checkpoint) in a process group of its own, as
    a terminal runs it; once step 1 is logged, ``presses`` SIGINTs to the whole group (Ctrl-C), 0.3 s apart.
    -> (exit status, stdout, stderr, run dir)."""
    run = tmp_path / name
    command = [sys.executable, "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
               "rollout.engine=local", "train.steps=5", "train.eval_every=0", "model.warm_start_steps=0",
               f"model.hf_dir={tmp_path / 'model'}", f"logging.dir={run}", f"checkpoint.dir={run / 'ck'}",
               "logging.plot_every=0", "rollout.prompts_per_step=2", "parallel.micro_batch_size=8",
               "data.reward_workers=1"]
    process = subprocess.Popen(command, cwd=ROOT, env=dict(env(), WORLD_SIZE="1"), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while not logged_steps(run) and process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert process.poll() is None, process.communicate()[1][-3000:]
        for _ in range(presses):
            os.killpg(process.pid, signal.SIGINT)
            time.sleep(0.3)
        stdout, stderr = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    return process.returncode, stdout, stderr, run


@pytest.mark.megatron_covered_by("tests/train/test_loop.py::test_train_logs_plots_and_resumes_exactly")
def test_ctrl_c_saves_the_step_and_a_second_stops_at_once(tmp_path):
    """Ctrl-C as a terminal sends it (SIGINT to the process group, reward worker included): the first finishes the
    step, saves it and exits 0 saying so; a second stops at once (130, nothing saved: checkpoint.every=0)."""
    status, stdout, stderr, run = _ctrl_c_run(tmp_path, "once", 1)
    assert status == 0, stderr[-3000:]
    stopped = logged_steps(run)[-1]
    assert 1 <= stopped < 5 and logged_steps(run) == list(range(1, stopped + 1))
    assert (run / "ck" / "latest").read_text() == f"step_{stopped:06d}"
    assert "Ctrl-C (SIGINT): finishing this step, then saving a checkpoint and stopping (press Ctrl-C again" in stderr
    assert f"stopped by Ctrl-C (SIGINT) after step {stopped} of 5" in stdout and "Traceback" not in stderr

    status, stdout, stderr, run = _ctrl_c_run(tmp_path, "twice", 2)
    assert status == 128 + signal.SIGINT, stderr[-3000:]
    assert "Ctrl-C (SIGINT) again: stopping now, without saving this step" in stderr
    assert len(logged_steps(run)) < 5 and not (run / "ck" / "latest").exists()


def test_a_process_started_ignoring_ctrl_c_keeps_ignoring_it():
    """A background job (``cmd &`` in a script, nohup) starts with SIGINT ignored: ``install`` leaves it so (SIGTERM
    is still caught), in a process of its own started that way."""
    code = ("import signal; from gspo_megatron.train.resilience import preemption; preemption.install(); "
            "print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN, "
            "signal.getsignal(signal.SIGTERM) is preemption._handler)")
    for ignored, expected in ((True, "True True"), (False, "False True")):
        start = (lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignored else None
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True,
                             timeout=120, preexec_fn=start)
        assert out.stdout.split() == expected.split(), out.stderr[-2000:]


def _run_python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env(), capture_output=True, text=True,
                          timeout=120)


def test_a_forked_child_ignores_ctrl_c_and_leaves_the_decision_to_the_trainer():
    """Megatron's async checkpoint writer forks its workers while the trainer saves; a Ctrl-C (to the whole group)
    that killed a worker left the trainer waiting on the worker's queue forever (a CI run hung on it). A child forked after
    ``install`` ignores SIGINT, SIGTERM and SIGUSR1; the trainer itself still catches them."""
    code = ("import os, signal, time; from gspo_megatron.train.resilience import preemption; preemption.install()\n"
            "child = os.fork()\n"
            "if child == 0:\n"
            "    for number in (signal.SIGINT, signal.SIGINT, signal.SIGTERM, signal.SIGUSR1):\n"
            "        os.kill(os.getpid(), number); time.sleep(0.05)\n"
            "    os._exit(7)\n"
            "print(os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]), signal.getsignal(signal.SIGINT) is "
            "preemption._handler)")
    out = _run_python(code)
    assert out.stdout.split() == ["7", "True"], out.stderr[-2000:]


def test_a_second_ctrl_c_swallowed_where_python_cannot_raise_still_stops_the_run():
    """A second Ctrl-C handled inside a ``__del__`` or a fork callback raises its ``SystemExit`` where Python only
    prints it ("Exception ignored in"); the signal is delivered again and stops the process (130) right after, not
    at the end of the step."""
    code = ("import signal, time; from gspo_megatron.train.resilience import preemption; preemption.install()\n"
            "signal.raise_signal(signal.SIGINT)\n"  # the first: finish the step
            "class Finalized:\n"
            "    def __del__(self):\n"
            "        signal.raise_signal(signal.SIGINT)\n"  # the second, handled inside __del__
            "        sum(range(100))\n"
            "Finalized()\n"
            "time.sleep(5)\n"  # the rest of the step
            "print('went on')")
    out = _run_python(code)
    assert out.returncode == 128 + signal.SIGINT and "went on" not in out.stdout, (out.stdout, out.stderr[-2000:])
    assert "Exception ignored in" in out.stderr  # the swallowed one, then the delivered one
    assert out.stderr.count("Ctrl-C (SIGINT) again: stopping now") == 2
