#!/usr/bin/env python
"""Wall time of one full RL step: gspo-megatron (SGLang rollout + Megatron) vs TRL's GRPOTrainer, same run.

Both sides get the same Hugging Face Qwen3-MoE model, the same prompts (the CPU example's synthetic task),
the same group size, completion length, minibatching and router auxiliary-loss coefficient (0), and GSPO's
sequence-level importance ratio (TRL: ``importance_sampling_level="sequence"``, eps 3e-4 / 4e-4, beta 0).
A step is: rollout -> old log-probs -> ``minibatches`` optimizer steps (-> weight sync, ours only: TRL
generates with the training model itself). Start-up and the first (warm-up) step are excluded.

    .venv/bin/pip install trl==1.16.0          # bench-only dependency
    .venv/bin/python bench/rl_step.py --size tiny
    .venv/bin/python bench/rl_step.py --size 100m
    .venv/bin/python bench/rl_step.py --size tiny --runs sync,one_step_off --no-trl   # rollout.mode only
    .venv/bin/python bench/rl_step.py --size 100m --lengths long_tail --runs padded,packed,packed+one_step_off,packed+async

Runs: ``padded`` / ``packed`` (``parallel.pack_sequences``), optionally ``+<rollout.mode>`` (default sync); a bare
mode is padded. ``--lengths long_tail`` gives both sides the same stop tokens (the top vocab * 4 / new_tokens ids
of the vocabulary, which a near-uniform random policy samples with probability ~4 / new_tokens a step): response
lengths are then ~geometric with mean ~new_tokens / 4, capped at new_tokens, as RL's long-tailed lengths.
Printed per run: the step, its phases, the padding share of the update's token positions (``padding_frac``), and
idle shares: of the trainer (waiting for its batch) and of the rollout server (not generating), per step.

Sizes: ``tiny`` is the CPU example's model (2 layers, hidden 128, 4 experts) at 32 samples x 16 tokens;
``100m`` is a ~115M-parameter Qwen3-MoE (8 layers, hidden 512, 16 experts top-2, vocab 8192) at
64 samples x 128 new tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SIZES = {
    "tiny": dict(model=dict(vocab_size=128, hidden_size=128, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32,
                            num_experts=4, top_k=2, moe_intermediate_size=64),
                 prompts=4, group=8, new_tokens=16, minibatches=2),
    "100m": dict(model=dict(vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                            num_experts=16, top_k=2, moe_intermediate_size=512, initializer_range=0.02),
                 prompts=8, group=8, new_tokens=128, minibatches=4),
}
STEPS = 4  # the first is warm-up


def build_model(size: str, directory: Path) -> Path:
    from gspo_megatron.rewards.synthetic import save_tiny_model

    path = directory / f"model-{size}"
    if not (path / "config.json").is_file():
        save_tiny_model(path, seed=0, **SIZES[size]["model"])
        config = json.loads((path / "config.json").read_text())
        config["router_aux_loss_coef"] = 0.0  # the same (zero) auxiliary loss on both sides
        (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def stop_tokens(size: str, lengths: str) -> list[int]:
    """The stop token ids of ``--lengths``: none (fixed lengths: every response runs to new_tokens) or the top
    ``vocab * 4 / new_tokens`` ids (long_tail)."""
    if lengths == "fixed":
        return []
    s = SIZES[size]
    vocab = s["model"]["vocab_size"]
    return list(range(vocab - vocab * 4 // s["new_tokens"], vocab))


def parse_run(name: str) -> tuple[bool, str]:
    """``padded`` | ``packed`` [+ mode], or a bare mode (padded): (pack_sequences, rollout.mode)."""
    parts = name.split("+")
    pack = parts[0] == "packed"
    if parts[0] in ("padded", "packed"):
        parts = parts[1:]
    return pack, parts[0] if parts else "sync"


def run_ours(size: str, model_dir: Path, out: Path, name: str = "sync", stops: list[int] = (),
             threads: tuple[int | None, int | None] = (None, None)) -> dict:
    s = SIZES[size]
    pack, mode = parse_run(name)
    run = out / f"ours-{name}"
    shutil.rmtree(run, ignore_errors=True)  # metrics.jsonl appends: a rerun in the same work dir starts clean
    cmd = [sys.executable, "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
           f"model.hf_dir={model_dir}", "model.warm_start_steps=0", f"train.steps={STEPS}", "train.eval_every=0",
           "optimizer.lr=3e-3", "algo.entropy_coef=0",  # as TRL's learning_rate and (no) entropy bonus below
           f"rollout.prompts_per_step={s['prompts']}", f"rollout.group_size={s['group']}",
           f"rollout.max_new_tokens={s['new_tokens']}", f"algo.minibatches={s['minibatches']}",
           f"parallel.micro_batch_size={s['prompts'] * s['group'] // s['minibatches']}",
           "rollout.max_prompt_tokens=32",
           f"rollout.server_args={{dtype: float32, max_total_tokens: {16384 * 4}, cpu_threads: {threads[1] or 'null'}}}",
           f"train.cpu_threads={threads[0] or 'null'}",
           f"logging.dir={run}", "checkpoint.dir=", "logging.plot_every=0", "logging.tensorboard=false",
           f"rollout.mode={mode}", f"parallel.pack_sequences={str(pack).lower()}",
           f"rollout.stop_token_ids={list(stops)}"]
    subprocess.run(cmd, check=True, cwd=ROOT, env=dict(os.environ, WORLD_SIZE="1"))
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()][1:]
    phases = ["time/rollout", "time/old_logprobs", "time/update", "time/weight_sync"]
    mean = lambda key: sum(r.get(key, 0.0) for r in records) / len(records)  # noqa: E731
    # rollout_wait: how long the trainer waited for its batch (one_step_off: only what the update did not hide)
    wait = mean("time/rollout") if mode == "sync" else mean("time/rollout_wait")
    step = mean("time/step")
    return {"step": step, "rollout_wait": wait, "staleness": mean("staleness_mean"),
            "padding": mean("padding_frac"), "length": mean("response_length_mean"),
            "truncated": mean("truncated_frac"), "trainer_idle": wait / step,
            "server_idle": max(0.0, 1.0 - mean("time/rollout") / step),
            **{p.split("/")[1]: mean(p) for p in phases}}


def run_trl(size: str, model_dir: Path, out: Path, stops: list[int] = ()) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from gspo_megatron.rewards.rewards import synthetic_reward
    from gspo_megatron.rewards.synthetic import make_problems

    s = SIZES[size]
    samples = s["prompts"] * s["group"]
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    problems = make_problems("reverse", s["prompts"] * STEPS, seed=0)
    dataset = Dataset.from_list([{"prompt": p.prompt, "answer": p.answer} for p in problems])

    def reward(prompts, completions, answer, **kwargs):
        return [synthetic_reward(p, c, a) for p, c, a in zip(prompts, completions, answer)]

    args = GRPOConfig(
        output_dir=str(out / "trl"), importance_sampling_level="sequence", epsilon=3e-4, epsilon_high=4e-4, beta=0.0,
        loss_type="grpo", num_generations=s["group"], max_completion_length=s["new_tokens"],
        per_device_train_batch_size=samples // s["minibatches"], gradient_accumulation_steps=1,
        steps_per_generation=s["minibatches"], num_iterations=1, learning_rate=3e-3, max_steps=STEPS * s["minibatches"],
        temperature=1.0, router_aux_loss_coef=0.0, use_vllm=False, report_to=[], logging_steps=1, save_strategy="no",
        use_cpu=True, bf16=False, dataloader_num_workers=0, seed=0,
    )
    marks = []

    class Clock(TrainerCallback):
        def on_step_end(self, *a, **k):
            marks.append(time.perf_counter())

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    if stops:  # TRL stops at (and masks after) every id of the generation config's eos_token_id
        model.generation_config.eos_token_id = [tokenizer.eos_token_id, *stops]
    lengths, padded = [], []
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                          processing_class=tokenizer, callbacks=[Clock()])
    # TRL's rollout phase: generation, rewards and the old-policy log-probs, all in this one method.
    rollout_times = []
    generate_and_score = trainer._generate_and_score_completions

    def timed(*a, **k):
        start = time.perf_counter()
        out = generate_and_score(*a, **k)
        rollout_times.append(time.perf_counter() - start)
        mask = out["completion_mask"]  # TRL trains on [B, prompt + longest completion]: the rest is padding
        lengths.append(float(mask.sum(1).float().mean()))
        real = out["prompt_mask"].sum() + mask.sum()
        padded.append(1.0 - float(real) / (mask.shape[0] * (mask.shape[1] + out["prompt_mask"].shape[1])))
        return out

    trainer._generate_and_score_completions = timed
    trainer.train()
    # One RL step = ``minibatches`` optimizer steps (generation happens at the first of them).
    ends = marks[s["minibatches"] - 1 :: s["minibatches"]]
    per_step = [b - a for a, b in zip(ends, ends[1:])]
    step = sum(per_step) / len(per_step)
    rollout = sum(rollout_times[1:]) / len(rollout_times[1:])
    return {"step": step, "rollout_and_old_logprobs": rollout, "update": step - rollout,
            "length": sum(lengths[1:]) / len(lengths[1:]), "padding": sum(padded[1:]) / len(padded[1:])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--work-dir", default=None)
    parser.add_argument("--runs", "--modes", default="sync",
                        help="ours: padded|packed[+sync|one_step_off|async] or a bare mode, comma-separated")
    parser.add_argument("--lengths", choices=("fixed", "long_tail"), default="fixed")
    parser.add_argument("--threads", default="",
                        help="TRAINER,SERVER torch threads of ours (e.g. 1,1: one core each on a 2-core CPU); "
                             "default: torch's (every core) for both")
    parser.add_argument("--no-trl", action="store_true", help="skip TRL (compare rollout modes only)")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench_rl_step_"))
    model_dir = build_model(args.size, work)
    names = args.runs.split(",")
    stops = stop_tokens(args.size, args.lengths)
    threads = tuple(int(t) if t else None for t in args.threads.split(",")) if args.threads else (None, None)
    runs = {}
    for name in names:
        runs[name] = run_ours(args.size, model_dir, work, name, stops, threads)
        print(f"[bench] {name}: {runs[name]}", flush=True)
    s = SIZES[args.size]
    print(f"\nRL step, {args.size}: {s['prompts']} prompts x {s['group']} samples x {s['new_tokens']} new tokens "
          f"({args.lengths} lengths, {len(stops)} stop tokens), {s['minibatches']} minibatches, threads (trainer, "
          f"server) {threads} "
          f"(mean of {STEPS - 1} steps after a warm-up)")
    base = runs[names[0]]["step"]
    for name, ours in runs.items():
        print(f"  gspo-megatron {name}: {ours['step']:.2f} s = {base / ours['step']:.2f}x {names[0]}  (rollout "
              f"{ours['rollout']:.2f}, waited for {ours['rollout_wait']:.2f}, old log-probs {ours['old_logprobs']:.2f}, "
              f"update {ours['update']:.2f}, weight sync {ours['weight_sync']:.2f}; staleness {ours['staleness']:.2f}; "
              f"response length {ours['length']:.1f}, truncated {ours['truncated']:.1%}; padding {ours['padding']:.1%}, "
              f"trainer idle {ours['trainer_idle']:.0%}, server idle {ours['server_idle']:.0%})")
    if args.no_trl:
        return 0
    trl = run_trl(args.size, model_dir, work, stops)
    print(f"  TRL GRPOTrainer (sequence-level IS): {trl['step']:.2f} s  (generation + rewards + old log-probs "
          f"{trl['rollout_and_old_logprobs']:.2f}, update {trl['update']:.2f}; response length {trl['length']:.1f}, "
          f"padding {trl['padding']:.1%})")
    for name, ours in runs.items():
        print(f"  ratio TRL / gspo-megatron {name}: {trl['step'] / ours['step']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
