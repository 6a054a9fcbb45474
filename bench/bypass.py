#!/usr/bin/env python
"""What skipping the trainer's old-policy pass saves: the CPU example (``examples/tiny_moe_cpu.yaml``) trained for a
few steps with pi_old recomputed by the trainer, then with the engine's log-probs as pi_old
(``rollout.reuse_rollout_logprobs=true``, verl's bypass mode) and a rollout correction, one after another in the
same invocation on the same machine, and the ratio of their step times.

    .venv/bin/python bench/bypass.py                         # recompute vs bypass + geometric rejection
    .venv/bin/python bench/bypass.py --steps 8 --extra train.cpu_threads=1

Printed per run: the median over steps 2.. of ``time/step``, ``time/old_logprobs`` (the pass; absent in bypass),
``time/update`` and ``time/rollout``; then bypass / recompute for the step and for the trainer's share (old-policy
pass + update). The first step is left out (it warms the server and the kernels).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {
    "recompute": [],
    # The GSPO paper's claim: the engine's log-probs as pi_old. The correction rejects sequences whose geometric
    # mean weight (current policy against the engine) leaves verl's Geo-RS band 0.999-1.001.
    "bypass": ["rollout.reuse_rollout_logprobs=true", "correction.rejection=mean",
               "correction.rejection_low=-0.0010005", "correction.rejection_high=0.0009995"],
}
KEYS = ("time/step", "time/old_logprobs", "time/update", "time/rollout")


def run(name: str, overrides: list[str], work: Path, steps: int) -> list[dict]:
    directory = work / name
    shutil.rmtree(directory, ignore_errors=True)
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
           f"model.hf_dir={directory}/model", f"logging.dir={directory}", f"checkpoint.dir={directory}/checkpoints",
           f"train.steps={steps}", "checkpoint.every=0", "train.eval_every=0", "logging.plot_every=0", *overrides]
    print(f"[bypass] {name}: {' '.join(cmd[4:])}", flush=True)
    env = dict(os.environ, PYTHONPATH=str(ROOT))  # this checkout's package, whatever the venv's editable install
    with (work / f"{name}.log").open("w") as log:
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]


def medians(records: list[dict]) -> dict[str, float]:
    later = records[1:]
    return {key: statistics.median(r[key] for r in later) if all(key in r for r in later) else 0.0 for key in KEYS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--work", default="/tmp/gspo_bench_bypass")
    parser.add_argument("--extra", nargs="*", default=[], help="overrides for both runs")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    start = time.time()
    results = {name: medians(run(name, overrides + args.extra, work, args.steps)) for name, overrides in RUNS.items()}
    for name, m in results.items():
        print(f"{name:10s} " + "  ".join(f"{k} {v:.3f} s" for k, v in m.items()))
    base, bypass = results["recompute"], results["bypass"]
    trainer = lambda m: m["time/old_logprobs"] + m["time/update"]  # noqa: E731
    print(f"bypass / recompute: step {bypass['time/step'] / base['time/step']:.3f}, "
          f"old-policy pass + update {trainer(bypass) / trainer(base):.3f} "
          f"({args.steps} steps each, medians of steps 2..; {time.time() - start:.0f} s in all)")


if __name__ == "__main__":
    main()
