#!/usr/bin/env python
"""Learning under the training-inference mismatch: the CPU example (``examples/tiny_moe_cpu.yaml``, in the paper
comparison's setting: 4 minibatches per rollout batch, ``examples/paper/run.py``) with rollouts from a bf16 SGLang
server and the fp32 trainer, one seed, for GSPO and GRPO:

- ``recompute``: pi_old recomputed by the trainer (the default);
- ``bypass``: the engine's log-probs as pi_old (``rollout.reuse_rollout_logprobs=true``), no correction;
- ``bypass_tis``: bypass with token-level truncated weights (slime's / verl's TIS, C = 2);
- ``bypass_geo_rs``: bypass with geometric rejection at 0.999-1.001 (verl's Geo-RS);
- ``bypass_k3_rs``: bypass with k3 rejection of the sequence mean above 0.01 (verl's K3-RS).

``--task copy_long`` runs the long-response task instead (copy a word of 64-72 letters: responses of 64-73 tokens,
8 prompts per step), where GSPO's sequence mean averages the gap over many tokens.

Runs go one after another (same seeds: same starting model, prompts and sampling seeds) and print one Markdown row
each (with several ``--seeds``, the mean over seeds and, for the rewards, each seed's): reward over the first 10 and
the last 10 steps, the clipped share of tokens (``clip_frac_tokens``), the
corrected share (masked, truncated or rejected tokens), the median ``time/step`` and ``time/old_logprobs`` over steps
2.., and the run's wall time.

    .venv/bin/python bench/mismatch_learning.py --steps 50
    .venv/bin/python bench/mismatch_learning.py --runs gspo_recompute,gspo_bypass
    .venv/bin/python bench/mismatch_learning.py --task copy_long --seeds 1,2 --steps 20
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
TASKS = {
    "reverse": [],  # the CPU example's own
    # "copy " + up to 72 letters + "=" after BOS; the answer, its end token and one more; 8 prompts x 8 samples
    "copy_long": ["data.task=copy_long", "rollout.max_prompt_tokens=80", "rollout.max_new_tokens=74",
                  "rollout.prompts_per_step=8", "parallel.micro_batch_size=16",
                  "rollout.server_args.max_total_tokens=16384"],
}


def run(name: str, task: str, work: Path, steps: int, seed: int) -> tuple[list[dict], float]:
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"), *COMMON,
           *TASKS[task], *RUNS[name], f"train.steps={steps}", f"train.seed={seed}", f"data.seed={1234 + seed}",
           f"model.hf_dir={work / f'model_{task}_seed{seed}'}", f"logging.dir={work / f'{task}_{name}_seed{seed}'}",
           "--overwrite"]
    env = dict(os.environ, WORLD_SIZE="1", PYTHONPATH=str(ROOT))  # this checkout's package
    start = time.perf_counter()
    with (work / f"{task}_{name}_seed{seed}.log").open("w") as log:
        subprocess.run(cmd, check=True, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    records = [json.loads(line) for line in (work / f"{task}_{name}_seed{seed}" / "metrics.jsonl").read_text()
               .splitlines()]
    return records, time.perf_counter() - start


def row(name: str, runs: list[tuple[list[dict], float]]) -> str:
    """One Markdown row of ``runs`` (one per seed): rewards per seed and their mean, the rest the mean over seeds."""
    def mean(key: str, records: list[dict]) -> float:
        return statistics.fmean(r.get(key, 0.0) for r in records)

    def over_seeds(value) -> float:
        return statistics.fmean(value(records) for records, _ in runs)

    def rewards(part) -> str:
        each = [mean("reward_mean", part(records)) for records, _ in runs]
        seeds = f" ({' / '.join(f'{r:.3f}' for r in each)})" if len(each) > 1 else ""
        return f"{statistics.fmean(each):.3f}{seeds}"

    corrected = over_seeds(lambda rs: sum(mean(f"correction_{what}_tokens", rs)
                                          for what in ("masked", "truncated", "rejected")))
    step = over_seeds(lambda rs: statistics.median(r["time/step"] for r in rs[1:] or rs))
    old_pass = over_seeds(lambda rs: statistics.median(r.get("time/old_logprobs", 0.0) for r in rs[1:] or rs))
    return (f"| {name} | {rewards(lambda rs: rs[:10])} | {rewards(lambda rs: rs[-10:])} | "
            f"{over_seeds(lambda rs: mean('clip_frac_tokens', rs)):.1%} | {corrected:.1%} | {step:.2f} | "
            f"{old_pass:.2f} | {statistics.fmean(s for _, s in runs):.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--seeds", default="1", help="comma-separated; each run once per seed")
    parser.add_argument("--task", default="reverse", choices=list(TASKS))
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated subset of {list(RUNS)}")
    parser.add_argument("--work", default="/tmp/gspo_bench_mismatch_learning")
    args = parser.parse_args()
    names = [n for n in args.runs.split(",") if n]
    unknown = sorted(set(names) - set(RUNS))
    if unknown:
        parser.error(f"--runs: unknown {unknown}; known: {list(RUNS)}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    seeds = [int(s) for s in args.seeds.split(",") if s]
    print(f"CPU example, task {args.task}, bf16 SGLang server, fp32 trainer; {args.steps} steps, seeds {seeds}")
    print("| run | reward, first 10 steps | reward, last 10 steps | clipped tokens | corrected tokens | "
          "step s (median) | old-policy pass s | wall s |")
    print("|---|---|---|---|---|---|---|---|")
    for name in names:
        print(row(name, [run(name, args.task, work, args.steps, seed) for seed in seeds]), flush=True)


if __name__ == "__main__":
    main()
