#!/usr/bin/env python
"""Soak run: the CPU example for a few hundred steps on 2 ranks while faults hit it on a schedule.

    .venv/bin/python bench/soak.py                 # 200 steps, ~15-25 min on 2 cores; runs/soak/
    .venv/bin/python bench/soak.py --steps 60      # a quicker pass

The trainer (``torchrun --nproc-per-node 2 --max-restarts 2``, data parallel, the real SGLang CPU server launched
by rank 0) meets, at fixed steps (``train/resilience/fault_injection.py`` through ``GSPO_FAULTS``, and this script):

- the server SIGKILLed mid-generation, and again as a weight sync begins (restarted, the sync or the requests
  redone: ``rollout/server_restarts``);
- rewards that hang (the pool's time limit masks them: ``reward_timeouts``) and raise (masked: ``reward_masked``),
  from ``bench/soak_reward.py``, throughout;
- trainer rank 1 SIGKILLed with its checkpoint shards written but the checkpoint not yet published (torchrun
  restarts the workers, they resume from the last published checkpoint, the server kept);
- SIGTERM to every rank (as a scheduler's time limit): the run saves and exits 0; relaunched with ``--resume``.

It then checks what the issue asks: the run ended at the configured step with exit status 0; ``latest`` is the
last step's complete checkpoint and no partial one is left; metrics cover every step; reward rose (mean of the last
quarter of steps above the first quarter's); and prints the count of each fault survived. The plot
(``runs/soak/soak.png``) marks the faults on the reward curve.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from gspo_megatron.train.resilience import fault_injection

ROOT = Path(__file__).resolve().parents[1]


def schedule(steps: int, checkpoint_every: int) -> dict:
    """Fault steps spread over the run: server kills in the first half, the rank kill at a checkpoint step, the
    SIGTERM at three quarters."""
    kill_ckpt = max(checkpoint_every, (steps // 2) // checkpoint_every * checkpoint_every)
    return {"faults": [
        {"at": "rollout", "step": max(2, steps // 8), "action": "kill_server", "delay_s": 0.3},
        {"at": "weight_sync", "step": max(3, steps // 4), "action": "kill_server"},
        {"at": "checkpoint_written", "step": kill_ckpt, "action": "kill_rank", "rank": 1},
    ], "sigterm_at": max(kill_ckpt + 2, (3 * steps) // 4)}


def command(out: Path, steps: int, checkpoint_every: int, *extra: str) -> list[str]:
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"
    return [torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "2", "-m", "gspo_megatron.cli",
            "train", str(ROOT / "examples/tiny_moe_cpu.yaml"), f"train.steps={steps}", "train.eval_every=0",
            f"model.hf_dir={out / 'model'}", f"logging.dir={out / 'run'}", f"checkpoint.dir={out / 'ck'}",
            f"checkpoint.every={checkpoint_every}", "logging.plot_every=0", "logging.tensorboard=false",
            "parallel.micro_batch_size=16", "data.reward=bench.soak_reward:reward",
            "data.reward_workers=2", "data.reward_timeout_s=2", "data.on_reward_error=mask",
            "rollout.max_server_restarts=4", *extra]


def env(scheduled: dict) -> dict:
    """This environment without a launcher's rank variables, with the fault schedule ``scheduled`` turns on."""
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return dict(clean, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), **scheduled)


def records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().split("\n")[:-1]] if path.is_file() else []


def workers(agent: subprocess.Popen) -> list[psutil.Process]:
    found = []
    for child in psutil.Process(agent.pid).children(recursive=True):
        try:
            if "RANK" in child.environ() and "gspo_megatron.cli" in " ".join(child.cmdline()):
                found.append(child)
        except psutil.Error:
            continue
    return found


def launch(cmd: list[str], environ: dict, log: Path, sigterm_at: int | None, run: Path) -> tuple[int, float]:
    """Run ``cmd`` to its end, SIGTERMing every rank once ``sigterm_at`` steps are logged; (exit status, seconds)."""
    start = time.time()
    with open(log, "a") as out:
        agent = subprocess.Popen(cmd, cwd=ROOT, env=environ, stdout=out, stderr=subprocess.STDOUT)
        sent, last = False, 0
        while agent.poll() is None:
            time.sleep(1.0)
            done = records(run)
            if done and done[-1]["step"] != last:
                last = done[-1]["step"]
                r = done[-1]
                print(f"  step {last}: reward {r.get('reward_mean', float('nan')):.3f}  "
                      f"server restarts {r.get('rollout/server_restarts', 0):.0f}  "
                      f"reward timeouts {r.get('reward_timeouts', 0):.0f}  {time.time() - start:.0f} s", flush=True)
            if sigterm_at is not None and not sent and last >= sigterm_at:
                for worker in workers(agent):
                    worker.send_signal(signal.SIGTERM)
                sent = True
                print(f"  SIGTERM to every rank after step {last}", flush=True)
    return agent.returncode, time.time() - start


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--checkpoint-every", type=int, default=20)
    parser.add_argument("--out", default=str(ROOT / "runs/soak"))
    args = parser.parse_args()
    out = Path(args.out)
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    plan = schedule(args.steps, args.checkpoint_every)
    scheduled = fault_injection.write(out / "faults.json", plan["faults"])
    print(f"soak: {args.steps} steps, faults {plan['faults']}, SIGTERM after step {plan['sigterm_at']}")
    cmd = command(out, args.steps, args.checkpoint_every)
    status1, seconds1 = launch(cmd, env(scheduled), out / "trainer.log", plan["sigterm_at"], out / "run")
    print(f"first launch: exit {status1} after {seconds1:.0f} s")
    status2, seconds2 = launch(cmd + ["--resume"], env(scheduled), out / "trainer.log", None, out / "run")
    print(f"resumed: exit {status2} after {seconds2:.0f} s")
    return report(out, args.steps, plan, [status1, status2], seconds1 + seconds2)


def report(out: Path, steps: int, plan: dict, statuses: list[int], seconds: float) -> int:
    recs = records(out / "run")
    by_step = {r["step"]: r for r in recs}  # steps redone after a restart: the later record
    latest = (out / "ck" / "latest").read_text().strip() if (out / "ck" / "latest").is_file() else None
    partial = sorted(p.name for p in (out / "ck").glob("*.tmp"))
    fired = sorted(int(p.name.rsplit(".", 1)[1]) for p in out.glob("faults.json.fired.*"))
    log = (out / "trainer.log").read_text()
    quarter = max(1, steps // 4)
    first = [by_step[s]["reward_mean"] for s in range(1, quarter + 1) if s in by_step]
    last = [by_step[s]["reward_mean"] for s in range(steps - quarter + 1, steps + 1) if s in by_step]
    survived = {
        "server killed mid-generation / inside a weight update (restarts)": log.count("restarting it (restart"),
        "rewards that hung (timed out, masked)": sum(r.get("reward_timeouts", 0) for r in by_step.values()),
        "rewards masked (raised or timed out)": sum(r.get("reward_masked", 0) for r in by_step.values()),
        "trainer rank SIGKILLed during a checkpoint write (workers restarted)":
            len(re.findall(r"torchrun restart \d+ of \d+: resuming", log)),
        "SIGTERM (stopped with a checkpoint, resumed)": log.count("stopped by SIGTERM after step"),
        "faults fired of the schedule": len(fired),
    }
    checks = {
        "exit status 0 (both launches)": statuses == [0, 0],
        f"ended at step {steps}": max(by_step, default=0) == steps,
        "every step logged": sorted(by_step) == list(range(1, steps + 1)),
        f"latest is step {steps}, no partial checkpoint left": latest == f"step_{steps:06d}" and not partial,
        "reward rose (last quarter > first quarter)": bool(first and last) and sum(last) / len(last) > sum(first) / len(first),
        "every scheduled fault fired": len(fired) == len(plan["faults"]),
        "each fault survived (2 server restarts, 1 worker restart, 1 SIGTERM)": (
            survived["server killed mid-generation / inside a weight update (restarts)"] >= 2
            and survived["trainer rank SIGKILLed during a checkpoint write (workers restarted)"] == 1
            and survived["SIGTERM (stopped with a checkpoint, resumed)"] == 1),
    }
    print(f"\nsoak: {steps} steps in {seconds / 60:.1f} min; reward first quarter "
          f"{sum(first) / max(1, len(first)):.3f} -> last quarter {sum(last) / max(1, len(last)):.3f}")
    for name, count in survived.items():
        print(f"  survived: {name}: {count:g}")
    for name, ok in checks.items():
        print(f"  {'ok ' if ok else 'FAIL'} {name}")
    plot(out, by_step, plan)
    return 0 if all(checks.values()) else 1


def plot(out: Path, by_step: dict, plan: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = sorted(by_step)
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.plot(steps, [by_step[s]["reward_mean"] for s in steps], linewidth=1.2, label="reward_mean")
    marks = [(f["step"], f"{f['action']} @ {f['at']}") for f in plan["faults"]]
    marks.append((plan["sigterm_at"], "SIGTERM, resumed"))
    for i, (step, label) in enumerate(marks):
        ax.axvline(step, color=f"C{i + 1}", linestyle="--", linewidth=1, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("reward")
    ax.set_title("soak: the CPU example on 2 ranks under injected faults")
    ax.legend(fontsize=7, loc="lower right")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out / "soak.png", dpi=110)
    print(f"plot: {out / 'soak.png'}")


if __name__ == "__main__":
    sys.exit(main())
