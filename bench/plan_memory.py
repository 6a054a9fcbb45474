"""`plan`'s memory figures against measured peaks of real CPU training steps.

    .venv/bin/python bench/plan_memory.py            # every case below (~6 minutes on 2 cores)
    .venv/bin/python bench/plan_memory.py --quick    # world=1 and TP2 at 256 tokens

Each case runs the loop's own path on real Megatron-Core over gloo (``parallel.launch.run_on_ranks``):
``build_policy`` (DDP, distributed optimizer, bf16 unless stated), the old-policy log-prob pass, then two update
steps on a rollout padded to the case's length (``plan.probe.measure_training_memory``). Memory is the
live bytes of tensor storages (``memory_probe.LiveTensorBytes``: every storage an aten op creates is counted
until it is freed; the CPU analogue of torch.cuda.max_memory_allocated). The second step's peak is the
steady state (the first step also creates the optimizer state). It is compared with ``plan.memory``'s estimate
for the same config and megatron's local spec (what CPU runs build), without the GPU-only overhead (CUDA
context, NCCL buffers, allocator slack): "peak" is everything, "above state" is the peak minus what stays
allocated between steps (weights, gradients, optimizer state), i.e. activations and the working set.
For pipeline runs both stages are shown; with several ranks per stage the busiest is compared (EP ranks
receive different numbers of tokens: "spread" is the busiest rank's peak over the least busy one's).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.train.startup.config import load_config
from gspo_megatron.plan.probe import compare_with_plan, measure_layouts

MIB = 2**20
# A Qwen3-MoE of 14M parameters: 4 layers, hidden 256, 4 heads of 64 (2 KV heads), 8 experts of width 512, top-4.
MODEL = dict(vocab_size=1024, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
             num_experts=8, top_k=4, moe_intermediate_size=512, max_position_embeddings=4096)
# 8 sequences per step in 2 minibatches, micro batches of 2 sequences.
BASE = ["data.task=reverse", "model.dtype=bfloat16", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "algo.minibatches=2", "parallel.micro_batch_size=2"]

# (world size, name, overrides, sequence lengths)
CASES = [
    (1, "world=1", [], (256, 512, 1024)),
    (1, "world=1 no recompute", ["recompute.granularity=none"], (1024,)),
    (1, "world=1 recompute moe", ["recompute.modules=[moe]"], (1024,)),
    (1, "world=1 full recompute", ["recompute.granularity=full"], (1024,)),
    (1, "world=1 fp32", ["model.dtype=float32"], (512,)),
    (1, "world=1 KL reference", ["algo.kl_coef=0.01"], (512,)),
    (2, "TP2 (SP)", ["parallel.tensor=2"], (256, 1024)),
    (2, "EP2", ["parallel.expert=2"], (256, 1024)),
    (2, "PP2", ["parallel.pipeline=2"], (512,)),
    (4, "TP2 x EP2", ["parallel.tensor=2", "parallel.expert=2"], (512,)),
]
QUICK = [(1, "world=1", [], (256,)), (2, "TP2 (SP)", ["parallel.tensor=2"], (256,))]


def run(cases, hf_dir: Path) -> list[dict]:
    rows = []
    for world in sorted({c[0] for c in cases}):
        batch = [(name, load_config(None, BASE + [f"model.hf_dir={hf_dir}"] + overrides), seq)
                 for w, name, overrides, seqs in cases if w == world for seq in seqs]
        start = time.perf_counter()
        per_rank = run_on_ranks(measure_layouts, world, None, [(cfg, seq) for _, cfg, seq in batch], str(hf_dir),
                                timeout=1800)
        print(f"world={world}: {len(batch)} cases in {time.perf_counter() - start:.0f} s", flush=True)
        for i, (name, cfg, seq) in enumerate(batch):
            result = compare_with_plan(cfg, world, seq, str(hf_dir), [rank[i] for rank in per_rank])
            for row in result["rows"]:
                rows.append({"case": name, "seq": seq, **row})
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| case | tokens | stage | measured peak MiB | plan MiB | ratio | measured above state MiB | "
             "plan MiB | ratio | spread |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['seq']} | {r['stage']} | {r['measured_peak'] / MIB:.1f} | {r['plan_peak'] / MIB:.1f} "
            f"| {r['peak_ratio']:.3f} | {r['measured_above_state'] / MIB:.1f} | {r['plan_above_state'] / MIB:.1f} "
            f"| {r['above_state_ratio']:.3f} | {r['spread']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from gspo_megatron.rewards.synthetic import save_tiny_model

    with tempfile.TemporaryDirectory(prefix="plan_memory_") as tmp:
        hf_dir = save_tiny_model(Path(tmp) / "model", seed=0, **MODEL)
        rows = run(QUICK if args.quick else CASES, hf_dir)
    print(table(rows))
    ratios = [r["peak_ratio"] for r in rows]
    above = [r["above_state_ratio"] for r in rows]
    print(f"measured / plan: peak {min(ratios):.3f} .. {max(ratios):.3f}; above state {min(above):.3f} .. {max(above):.3f}")


if __name__ == "__main__":
    main()
