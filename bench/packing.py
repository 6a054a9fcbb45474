#!/usr/bin/env python
"""The trainer side of an RL step on long-tailed response lengths: padded vs packed vs packed + token budget.

    .venv/bin/python bench/packing.py                 # world=1 (~2 minutes on a quiet 2-core machine)
    .venv/bin/python bench/packing.py --world 2       # two data-parallel ranks over gloo
    .venv/bin/python bench/packing.py --quick         # a smaller batch and cap, one timed step (~20 s)

Rollouts are synthetic, with the lengths a reasoning policy gives: prompts uniform in [16, 64) tokens, responses
geometric with mean ``--cap`` / 4, capped at ``--cap`` (max_new_tokens). Each mode runs the loop's own
functions on real Megatron-Core over gloo (``parallel.launch.run_on_ranks``): one ``build_policy`` per mode from
the same HF weights, then per step, each mode in turn (load on a shared machine falls on every mode alike),
``train.update.passes.old_logprobs`` (the old-policy pass over every row) and ``train.update.passes.update``
(``algo.minibatches`` optimizer steps), on the same rollout batches. The first step is a warm-up.

Modes: ``padded`` (micro batches of ``parallel.micro_batch_size`` rows [b, S], S the batch's longest row, as the
loop pads a rollout), ``packed`` (the same micro batches as one row of their tokens: ``parallel.pack_sequences``)
and ``packed+budget B`` (token-balanced micro batches within ``parallel.max_tokens_per_micro_batch`` B; by
default the longest possible sequence, prompt + cap, and micro_batch_size times that, the padded micro batch's
worst case). "computed" counts the token positions the model runs in one pass (all ranks); "padding" is the share
of them that hold no sequence token; "tokens/s" is the sequences' tokens (prompt + response) of both passes (old
log-probs + update) per second of step; times are the fastest timed step (each step's slowest rank; old log-probs: its fastest pass), the
least disturbed on a shared machine; every step's time is printed too. Equal losses across modes check that they train the same thing.

On CPU the packed row's attention is megatron's local ``DotProductAttention`` with a dense block-diagonal
[N, N] mask, so its attention FLOPs grow with N^2 (the masked blocks are computed and discarded); the GPU's THD
attention computes only the diagonal blocks. The MLP / MoE / projection FLOPs are linear in computed tokens on both.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch

# A ~8M-parameter Qwen3-MoE: 4 layers, hidden 256, 4 heads of 64 (2 KV heads), 8 experts of width 256, top-2,
# vocabulary 2048.
MODEL = dict(vocab_size=2048, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
             num_experts=8, top_k=2, moe_intermediate_size=256, max_position_embeddings=4096)


def long_tailed_rollout(rows: int, cap: int, vocab_size: int, seed: int) -> dict:
    """A rollout batch of the loop's layout (``rollout.batch.samples_to_batch``): ``rows`` rows right-padded to
    the longest one; prompts uniform in [16, 64), responses geometric with mean cap / 4, capped at ``cap``."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(16, 64, (rows,), generator=g)
    # Geometric on {1, 2, ...} with mean cap / 4: floor(log U / log(1 - p)) + 1, p = 4 / cap.
    p = 4.0 / cap
    u = torch.rand(rows, generator=g).clamp_min(1e-12)
    response = (torch.floor(torch.log(u) / torch.log1p(torch.tensor(-p))) + 1).long().clamp(1, cap)
    length = prompt + response
    width = int(length.max())
    tokens = torch.randint(0, vocab_size, (rows, width + 1), generator=g)
    positions = torch.arange(width).unsqueeze(0)
    keep = positions < length.unsqueeze(1)
    tokens[:, :-1][~keep] = 0  # the pad id, as samples_to_batch pads
    loss_mask = (positions >= prompt.unsqueeze(1) - 1) & (positions < length.unsqueeze(1) - 1)
    return {
        "input_ids": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous() * keep,
        "loss_mask": loss_mask,
        "rollout_logprobs": -torch.rand(rows, width, generator=g) * 3 * loss_mask,
        "advantages": torch.randn(rows, generator=g),
        "prompt_lengths": prompt,
        "response_lengths": response,
    }


def computed_tokens(batch: dict, rows: list[torch.Tensor], cfg) -> tuple[int, int]:
    """Token positions this rank's model runs in one pass over ``rows`` (its micro batches as the trainer forms
    them): b x S padded, the packed row's length N packed; and the attention scores computed per head and layer
    on CPU: b x S^2 padded, N^2 packed (megatron's local attention with a dense block-diagonal mask)."""
    from gspo_megatron.parallel import packing
    from gspo_megatron.train.update import passes
    from gspo_megatron.train.update.rows import micro_batch_rows, row_plan, sequence_lengths

    lengths = sequence_lengths(batch)
    total = scores = 0
    for minibatch_rows in rows:
        for part in micro_batch_rows(batch, minibatch_rows, cfg):
            if cfg.parallel.pack_sequences:
                n = packing.packed_length(lengths[minibatch_rows[part]])
                total, scores = total + n, scores + n * n
            else:
                width = batch["input_ids"].shape[1]
                total, scores = total + part.numel() * width, scores + part.numel() * width * width
    return total, scores


def run_modes(cfgs: list, hf_dir: str, batches: list[dict]) -> list[list[dict]]:
    """On each rank: one policy per mode (``cfgs``, built from the same weights), then for each batch one step
    (old log-prob pass + the updates) of every mode in turn, so that load on a shared machine falls on all modes
    alike. Returns per batch, per mode, the step's times and token counts."""
    import torch.distributed as dist

    from gspo_megatron.parallel import groups
    from gspo_megatron.train.update import passes
    from gspo_megatron.train.update.rows import micro_batch_rows, row_plan, sequence_lengths
    from gspo_megatron.train.startup.bootstrap import loss_config
    from gspo_megatron.train.startup.policy import build_policy, layout_of

    groups.init_model_parallel(layout_of(cfgs[0]), seed=cfgs[0].train.seed)
    algo = loss_config(cfgs[0])
    policies = [build_policy(cfg, hf_dir) for cfg in cfgs]
    out = []
    for batch in batches:
        out.append([])
        for cfg, policy in zip(cfgs, policies):
            step = dict(batch)
            rows = row_plan(step["input_ids"].shape[0], cfg)
            micro = sum(len(micro_batch_rows(step, r, cfg)) for r in rows)
            computed, scores = computed_tokens(step, rows, cfg)
            real = int(sequence_lengths(step)[torch.cat(rows)].sum())
            dist.barrier()
            start = time.perf_counter()
            routing = passes.old_logprobs(policy, step, rows, cfg, algo, {})
            old = time.perf_counter() - start
            metrics = passes.update(policy, step, rows, routing, cfg, algo)
            dist.barrier()
            out[-1].append(dict(step=time.perf_counter() - start, old=old, computed=computed, scores=scores,
                                real=real, micro_batches=micro, loss=metrics["loss"]))
    return out


def modes(args) -> list[tuple[str, int | None]]:
    """(name, token budget or None): padded, packed, then packed with each budget."""
    budgets = args.budget or [64 + args.cap, args.micro_batch_size * (64 + args.cap)]
    return [("padded", None), ("packed", None)] + [(f"packed+budget {b}", b) for b in budgets]


def config(mode: str, budget: int | None, args, hf_dir: str):
    from gspo_megatron.train.startup.config import load_config

    overrides = [f"model.hf_dir={hf_dir}", "model.dtype=float32", "data.task=reverse",
                 f"rollout.prompts_per_step={args.prompts}", f"rollout.group_size={args.group}",
                 f"rollout.max_new_tokens={args.cap}", f"algo.minibatches={args.minibatches}",
                 f"parallel.micro_batch_size={args.micro_batch_size}", "parallel.distributed_optimizer=false",
                 "algo.entropy_coef=0", "logging.expert_volatility=false"]
    if mode != "padded":
        overrides.append("parallel.pack_sequences=true")
    if budget:
        overrides.append(f"parallel.max_tokens_per_micro_batch={budget}")
    return load_config(None, overrides)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world", type=int, default=1, help="data-parallel gloo ranks")
    parser.add_argument("--cap", type=int, default=512, help="max_new_tokens (responses: geometric, mean cap/4)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--minibatches", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--budget", type=int, nargs="*", default=None,
                        help="token budgets (default: 64 + cap, the longest sequence; and micro_batch_size x that, "
                             "the padded micro batch's worst case)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps (after one warm-up)")
    parser.add_argument("--quick", action="store_true", help="cap 128, 16 rows, one timed step")
    args = parser.parse_args()
    if args.quick:
        args.cap, args.prompts, args.steps = 128, 2, 1

    from gspo_megatron.parallel.launch import run_on_ranks
    from gspo_megatron.rewards.synthetic import save_tiny_model

    rows = args.prompts * args.group
    batches = [long_tailed_rollout(rows, args.cap, MODEL["vocab_size"], seed) for seed in range(args.steps + 1)]
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_packing_") as tmp:
        hf_dir = str(save_tiny_model(Path(tmp) / "model", seed=0, **MODEL))
        cfgs = [config(mode, budget, args, hf_dir) for mode, budget in modes(args)]
        t = time.perf_counter()
        per_rank = run_on_ranks(run_modes, args.world, None, cfgs, hf_dir, batches, timeout=1800)
        print(f"{len(cfgs)} modes x {len(batches)} steps: {time.perf_counter() - t:.0f} s with start-up", flush=True)
    for i, (mode, _) in enumerate(modes(args)):
        timed = [[rank[step][i] for rank in per_rank] for step in range(1, args.steps + 1)]  # [step][rank]
        results[mode] = dict(
            steps=[max(s["step"] for s in ranks) for ranks in timed],
            step=min(max(s["step"] for s in ranks) for ranks in timed),
            old=min(max(s["old"] for s in ranks) for ranks in timed),
            computed=sum(sum(s["computed"] for s in ranks) for ranks in timed) / len(timed),
            scores=sum(sum(s["scores"] for s in ranks) for ranks in timed) / len(timed),
            real=sum(sum(s["real"] for s in ranks) for ranks in timed) / len(timed),
            micro=sum(max(s["micro_batches"] for s in ranks) for ranks in timed) / len(timed),
            losses=[ranks[0]["loss"] for ranks in timed])
    lengths = torch.cat([update_lengths(b) for b in batches[1:]]).float()
    print(f"\nTrainer step (old log-prob pass + {args.minibatches} updates), world={args.world} (DP), "
          f"{rows} rows/step, cap {args.cap}, micro_batch_size {args.micro_batch_size}; best of {args.steps} steps "
          f"after a warm-up, modes interleaved; load average: "
          f"{os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    print(f"sequence tokens: mean {lengths.mean():.0f}, median {lengths.median():.0f}, max {lengths.max():.0f} "
          f"(responses geometric, mean cap/4, capped)")
    print("| mode | s/step | old log-probs s | update s | micro batches/rank | computed tokens/pass | padding | "
          "attention scores/pass (M) | tokens/s | step vs padded | tokens/s vs padded |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    base = results["padded"]
    for mode, r in results.items():
        rate = 2 * r["real"] / r["step"]
        print(f"| {mode} | {r['step']:.2f} | {r['old']:.2f} | {r['step'] - r['old']:.2f} | {r['micro']:.0f} | "
              f"{r['computed']:.0f} | {1 - r['real'] / r['computed']:.1%} | {r['scores'] / 1e6:.2f} | {rate:.0f} | "
              f"{r['step'] / base['step']:.2f}x | {rate / (2 * base['real'] / base['step']):.2f}x |")
    for mode, r in results.items():
        print(f"  {mode}: s/step {' '.join('%.2f' % x for x in r['steps'])}; losses "
              f"{' '.join('%.6f' % x for x in r['losses'])}")
    return 0


def update_lengths(batch: dict) -> torch.Tensor:
    return batch["prompt_lengths"] + batch["response_lengths"]


if __name__ == "__main__":
    raise SystemExit(main())
