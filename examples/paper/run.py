#!/usr/bin/env python
"""The GSPO paper's comparison on the CPU example's tiny MoE: one command runs every algorithm for several seeds,
then writes the plots and the results table into examples/paper/README.md.

    .venv/bin/python examples/paper/run.py                      # all runs (resumes finished ones), then the report
    .venv/bin/python examples/paper/run.py --seeds 1 --steps 20 --out /tmp/paper   # a quick look
    .venv/bin/python examples/paper/run.py --report-only

Each run is ``gspo-megatron train examples/tiny_moe_cpu.yaml`` with the overrides of RUNS, a real SGLang server on
127.0.0.1 included; a seed's runs share one starting model (built and warm-started by its first run), its prompts
and its sampling seeds, so the algorithms are compared from the same policy on the same data.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE = ROOT / "examples/tiny_moe_cpu.yaml"
# The paper's setting on the example: 4 minibatches (optimizer steps) per rollout batch, its clip ranges (GSPO
# 3e-4 / 4e-4, GRPO 0.2 / 0.27: the config's defaults), no KL; held-out reward every 25 steps.
COMMON = ["algo.minibatches=4", "train.eval_every=25", "checkpoint.dir=", "logging.plot_every=0",
          "logging.tensorboard=false"]
# name -> (label, overrides). *_bf16: rollouts from a bf16 server, its log-probs as pi_old (no old-policy pass).
RUNS = {
    "gspo": ("GSPO", []),
    "gspo_token": ("GSPO-token (per-character rewards)",
                   ["algo.name=gspo_token", "algo.token_advantages=segments", "data.segment_reward=synthetic"]),
    "grpo": ("GRPO", ["algo.name=grpo"]),
    "grpo_rr": ("GRPO + Routing Replay", ["algo.name=grpo", "algo.routing_replay=old"]),
    "gspo_bf16": ("GSPO, bf16 rollouts as pi_old",
                  ["rollout.server_args.dtype=bfloat16", "rollout.reuse_rollout_logprobs=true"]),
    "grpo_bf16": ("GRPO, bf16 rollouts as pi_old",
                  ["algo.name=grpo", "rollout.server_args.dtype=bfloat16", "rollout.reuse_rollout_logprobs=true"]),
    "grpo_r3_bf16": ("GRPO + R3, bf16 rollouts as pi_old",
                     ["algo.name=grpo", "algo.routing_replay=rollout", "rollout.server_args.dtype=bfloat16",
                      "rollout.reuse_rollout_logprobs=true"]),
}


def command(name: str, seed: int, steps: int, out: Path, config: Path = BASE) -> list[str]:
    return [sys.executable, "-m", "gspo_megatron.cli", "train", str(config), *COMMON, *RUNS[name][1],
            f"train.steps={steps}", f"train.seed={seed}", f"data.seed={1234 + seed}",
            f"model.hf_dir={out / f'model_seed{seed}'}", f"logging.dir={out / f'{name}_seed{seed}'}",
            "--overwrite"]  # an unfinished run (no checkpoints: checkpoint.dir is empty) starts again from step 1


def finished(run: Path, steps: int) -> bool:
    metrics = run / "metrics.jsonl"
    if not metrics.is_file():
        return False
    lines = metrics.read_text().splitlines()
    return bool(lines) and json.loads(lines[-1])["step"] >= steps


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=2, help="seeds 1..N (default 2)")
    parser.add_argument("--steps", type=int, default=150, help="RL steps per run (default 150)")
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {list(RUNS)}")
    parser.add_argument("--out", default=str(ROOT / "runs/paper"), help="run directories (default runs/paper)")
    parser.add_argument("--config", default=str(BASE), help="the base config (default examples/tiny_moe_cpu.yaml)")
    parser.add_argument("--readme", default=str(ROOT / "examples/paper/README.md"),
                        help="where the results table goes (between its results markers)")
    parser.add_argument("--report-only", action="store_true", help="only plot and tabulate the finished runs")
    args = parser.parse_args(argv)
    names = [n for n in args.runs.split(",") if n]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        parser.error(f"--runs: unknown {unknown}; known: {list(RUNS)}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not args.report_only:
        env = dict(os.environ, WORLD_SIZE="1", PYTHONPATH=f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
        for seed in range(1, args.seeds + 1):
            for name in names:
                run = out / f"{name}_seed{seed}"
                if finished(run, args.steps):
                    print(f"{run.name}: done already")
                    continue
                t = time.perf_counter()
                with open(out / f"{run.name}.log", "w") as log:
                    code = subprocess.call(command(name, seed, args.steps, out, Path(args.config)), cwd=ROOT, env=env,
                                           stdout=log, stderr=subprocess.STDOUT)
                if code != 0:
                    print(f"{run.name}: failed (exit {code}); see {out / f'{run.name}.log'}", file=sys.stderr)
                    return code
                seconds = time.perf_counter() - t
                (run / "wall_seconds").write_text(f"{seconds:.1f}\n")  # start-up included; the report sums them
                print(f"{run.name}: {seconds:.0f} s", flush=True)
    from report import report  # examples/paper/report.py, beside this file

    report(out, names, args.seeds, args.steps, Path(args.readme))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
