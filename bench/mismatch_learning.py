#!/usr/bin/env python
"""Learning under the training-inference mismatch: the CPU example (``examples/tiny_moe_cpu.yaml``, in the paper
comparison's setting: 4 minibatches per rollout batch, ``examples/paper/run.py``) with rollouts from a bf16 SGLang
server and the fp32 trainer, one seed, for GSPO and GRPO:

- ``recompute``: pi_old recomputed by the trainer (the default);
- ``bypass``: the engine's log-probs as pi_old (``rollout.reuse_rollout_logprobs=true``), no correction;
- ``bypass_tis``: bypass with token-level truncated weights (slime's / verl's TIS, C = 2);
- ``bypass_geo_rs``: bypass with geometric rejection at 0.999-1.001 (verl's Geo-RS);
- ``bypass_k3_rs``: bypass with k3 rejection of the sequence mean above 0.01 (verl's K3-RS).

Runs go one after another (same seeds: same starting model, prompts and sampling seeds) and print one Markdown row
each: reward over the first 10 and the last 10 steps, the clipped share of tokens (``clip_frac_tokens``), the
corrected share (masked, truncated or rejected tokens), the median ``time/step`` and ``time/old_logprobs`` over steps
2.., and the run's wall time.

    .venv/bin/python bench/mismatch_learning.py --steps 50
    .venv/bin/python bench/mismatch_learning.py --runs gspo_recompute,gspo_bypass
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BF16 = ["rollout.server_args.dtype=bfloat16"]
BYPASS = BF16 + ["rollout.reuse_rollout_logprobs=true"]
CORRECTIONS = {
    "recompute": BF16,
    "bypass": BYPASS,
    "bypass_tis": BYPASS + ["correction.level=token"],
    "bypass_geo_rs": BYPASS + ["correction.rejection=mean", "correction.rejection_low=-0.0010005",
                               "correction.rejection_high=0.0009995"],
    "bypass_k3_rs": BYPASS + ["correction.rejection=mean", "correction.rejection_estimator=k3",
                              "correction.rejection_high=0.01"],
}
RUNS = {f"{algo}_{name}": [f"algo.name={algo}", *overrides] for algo in ("gspo", "grpo")
        for name, overrides in CORRECTIONS.items()}
# examples/paper/run.py's setting: the paper's 4 minibatches per rollout batch, no eval, nothing saved.
COMMON = ["algo.minibatches=4", "train.eval_every=0", "checkpoint.dir=", "logging.plot_every=0",
          "logging.tensorboard=false"]


def run(name: str, work: Path, steps: int, seed: int) -> tuple[list[dict], float]:
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"), *COMMON,
           *RUNS[name], f"train.steps={steps}", f"train.seed={seed}", f"data.seed={1234 + seed}",
           f"model.hf_dir={work / f'model_seed{seed}'}", f"logging.dir={work / name}", "--overwrite"]
    env = dict(os.environ, WORLD_SIZE="1", PYTHONPATH=str(ROOT))  # this checkout's package
    start = time.perf_counter()
    with (work / f"{name}.log").open("w") as log:
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    records = [json.loads(line) for line in (work / name / "metrics.jsonl").read_text().splitlines()]
    return records, time.perf_counter() - start


def row(name: str, records: list[dict], seconds: float) -> str:
    mean = lambda key, rs: statistics.fmean(r.get(key, 0.0) for r in rs)  # noqa: E731
    corrected = mean("correction_masked_tokens", records) + mean("correction_truncated_tokens", records) + \
        mean("correction_rejected_tokens", records)
    later = records[1:] or records
    old_pass = statistics.median(r.get("time/old_logprobs", 0.0) for r in later)
    return (f"| {name} | {mean('reward_mean', records[:10]):.3f} | {mean('reward_mean', records[-10:]):.3f} | "
            f"{mean('clip_frac_tokens', records):.1%} | {corrected:.1%} | "
            f"{statistics.median(r['time/step'] for r in later):.2f} | {old_pass:.2f} | {seconds:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {list(RUNS)}")
    parser.add_argument("--work", default="/tmp/gspo_bench_mismatch_learning")
    args = parser.parse_args()
    names = [n for n in args.runs.split(",") if n]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        parser.error(f"--runs: unknown {unknown}; known: {list(RUNS)}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    print(f"CPU example, bf16 SGLang server, fp32 trainer; {args.steps} steps, seed {args.seed}")
    print("| run | reward, first 10 steps | reward, last 10 steps | clipped tokens | corrected tokens | "
          "step s (median) | old-policy pass s | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        records, seconds = run(name, work, args.steps, args.seed)
        print(row(name, records, seconds), flush=True)


if __name__ == "__main__":
    main()
