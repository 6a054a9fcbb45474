#!/usr/bin/env python
"""Time to a reward: the CPU example (``examples/tiny_moe_cpu.yaml``) from a fresh run directory, as the README's
command runs it (model build, warm start, server start-up and training all counted), under several configurations,
one after another on the same machine.

    .venv/bin/python bench/cpu_example.py                     # the README's config vs the throughput settings
    .venv/bin/python bench/cpu_example.py --runs "readme=" "packed=parallel.pack_sequences=true"
    .venv/bin/python bench/cpu_example.py --reuse ...         # summary and plot of runs already made

Each run is ``name=override,override,...``. Printed per run: the wall time until the reward's running mean over
``--window`` steps first reaches ``--target`` (and at which step), the whole run's wall time, the median seconds
per step and the final running mean; plotted: the running mean against wall time (``--plot``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = [
    "readme=",
    # One torch thread for the trainer (the server has one: the config's cpu_threads) and packed rows.
    "packed_1thread=train.cpu_threads=1,parallel.pack_sequences=true",
    # ... and the next batch generated while the trainer updates (each on its own core).
    "overlapped=train.cpu_threads=1,parallel.pack_sequences=true,rollout.mode=one_step_off",
    # ... with the one-version-old samples clipped around the trainer's weights, weighted by the engine's
    # (algo.decoupled_clip: AReaL's decoupled objective).
    "decoupled=train.cpu_threads=1,parallel.pack_sequences=true,rollout.mode=one_step_off,algo.decoupled_clip=true",
    # ... or, instead of the overlap, DAPO's dynamic sampling (groups without reward variance dropped, refilled).
    "dynamic=train.cpu_threads=1,parallel.pack_sequences=true,rollout.filter_zero_variance_groups=true",
]


def run(name: str, overrides: list[str], work: Path, steps: int) -> dict:
    directory = work / name
    shutil.rmtree(directory, ignore_errors=True)
    cmd = [str(ROOT / ".venv/bin/gspo-megatron"), "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
           f"model.hf_dir={directory}/model", f"logging.dir={directory}", f"checkpoint.dir={directory}/checkpoints",
           f"train.steps={steps}", *overrides]
    print(f"[cpu_example] {name}: {' '.join(cmd[2:])}", flush=True)
    start = time.time()
    with (work / f"{name}.log").open("w") as log:
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    total = time.time() - start
    (work / f"{name}.run.json").write_text(json.dumps({"start": start, "total": total}))
    return load(name, work)


def load(name: str, work: Path) -> dict:
    """A finished run of ``run``: its start and wall time, and its metrics."""
    result = json.loads((work / f"{name}.run.json").read_text())
    records = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    return {**result, "records": records}


def running_mean(values: list[float], window: int) -> list[float]:
    return [sum(values[max(0, i + 1 - window):i + 1]) / len(values[max(0, i + 1 - window):i + 1])
            for i in range(len(values))]


def summary(result: dict, target: float, window: int) -> dict:
    records = result["records"]
    means = running_mean([r["reward_mean"] for r in records], window)
    reached = next((i for i, m in enumerate(means) if i + 1 >= window and m >= target), None)
    steps = sorted(r["time/step"] for r in records)
    clipped = [r["clip_frac_seqs"] for r in records[50:] if "clip_frac_seqs" in r]  # after the start-up steps
    return {
        "to_target_s": None if reached is None else records[reached]["time"] - result["start"],
        "target_step": None if reached is None else records[reached]["step"],
        "total_s": result["total"], "step_s_median": steps[len(steps) // 2], "final_mean": means[-1],
        "first_step_s": records[0]["time"] - result["start"],  # start-up: model build, warm start, server
        "clipped_seqs": sum(clipped) / len(clipped) if clipped else None,
        "curve": [(r["time"] - result["start"], m) for r, m in zip(records, means)],
    }


def plot(summaries: dict, target: float, window: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for name, s in summaries.items():
        xs, ys = zip(*s["curve"])
        ax.plot([x / 60 for x in xs], ys, label=name)
    ax.axhline(target, color="grey", linestyle="--", linewidth=1)
    ax.set_xlabel("wall time from the command's start (min)")
    ax.set_ylabel(f"reward, mean of the last {window} steps")
    ax.set_title("CPU example: reward against wall time")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", default=RUNS, help="name=override,override,...")
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--target", type=float, default=0.69)
    parser.add_argument("--window", type=int, default=20)
    parser.add_argument("--work-dir", default="/tmp/bench_cpu_example")
    parser.add_argument("--plot", default=str(ROOT / "bench/cpu_example.png"))
    parser.add_argument("--reuse", action="store_true",
                        help="summarise and plot the runs already in --work-dir instead of running them again")
    args = parser.parse_args()
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    summaries = {}
    for spec in args.runs:
        name, _, overrides = spec.partition("=")
        result = (load(name, work) if args.reuse
                  else run(name, [o for o in overrides.split(",") if o], work, args.steps))
        summaries[name] = summary(result, args.target, args.window)
        s = summaries[name]
        print(f"[cpu_example] {name}: {json.dumps({k: v for k, v in s.items() if k != 'curve'})}", flush=True)
    plot(summaries, args.target, args.window, Path(args.plot))
    base = next(iter(summaries.values()))
    print(f"\nCPU example, {args.steps} steps: wall time until the {args.window}-step mean reward reaches "
          f"{args.target}")
    for name, s in summaries.items():
        reached = (f"{s['to_target_s'] / 60:.2f} min (step {s['target_step']})" if s["to_target_s"] is not None
                   else "not reached")
        ratio = (f" = {base['to_target_s'] / s['to_target_s']:.2f}x {next(iter(summaries))}"
                 if s["to_target_s"] and base["to_target_s"] else "")
        print(f"  {name}: {reached}{ratio}; whole run {s['total_s'] / 60:.2f} min, "
              f"first step at {s['first_step_s']:.0f} s, median {s['step_s_median']:.2f} s/step, "
              f"final mean {s['final_mean']:.3f}"
              + (f", sequences clipped {s['clipped_seqs']:.0%}" if s["clipped_seqs"] is not None else ""))
    print(f"  plot: {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
