"""Rollout routing replay (R3) against a bf16 CPU SGLang server: how far the fp32 trainer's log-probs are from the
server's with its own routing and with the server's experts replayed, on the same samples.

    .venv/bin/python bench/routing_replay.py            # random Qwen3-MoE, 4 layers, 8 experts top-2 (~2 min)
    .venv/bin/python bench/routing_replay.py --record   # also append the result to bench/RESULTS.md

One server (``--dtype bfloat16``, ``--enable-return-routed-experts``) samples 16 prompts x 4 responses of 32
tokens (temperature 1); the Megatron policy (fp32, world=1, the same weights through the bridge) scores them
twice with ``logprob_pass``: routing freely (recording its experts, compared with the server's for every
token the server routed) and replaying the server's experts (``rollout_routing``). Reported: the fraction of
(token, layer) decisions whose top-k set differs, and the per-token gap |log pi_trainer - log pi_server| (mean,
max) and the largest sequence mean of the log-ratio under each.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MODEL = dict(vocab_size=128, hidden_size=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32, num_experts=8,
             top_k=2, moe_intermediate_size=64)


def score(model_dir: str, samples) -> dict:
    """Rank function (world=1): the trainer's log-probs of ``samples`` routing freely and replaying the server."""
    from gspo_megatron.model.bridge import Bridge
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.model.provider import build_gpt_model
    from gspo_megatron.rollout import logprob_mismatch, samples_to_batch
    from gspo_megatron.train.update.schedules import logprob_pass

    spec = read_hf_config(model_dir)
    model = build_gpt_model(spec, calculate_per_token_loss=True, moe_enable_routing_replay=True)
    Bridge(spec).load_hf_weights(model, model_dir)
    batch = samples_to_batch(samples)
    plain = {k: batch[k] for k in ("input_ids", "labels", "loss_mask")}
    free = logprob_pass(model, [plain], record_old_routing=True)
    replayed = logprob_pass(model, [dict(plain, rollout_routing=batch["rollout_routing"])])
    ours = free["old_routing"].transpose(1, 2)  # [b, S, L, k], like rollout_routing
    routed = torch.zeros(ours.shape[:2], dtype=torch.bool)
    for b, s in enumerate(samples):
        routed[b, :s.rollout_routing.shape[0]] = True
    differs = (ours.sort(-1).values != batch["rollout_routing"].sort(-1).values).any(-1)[routed]  # [tokens, L]
    return {"routes_differ": differs.float().mean().item(), "decisions": differs.numel(),
            "tokens_with_a_differing_route": differs.any(-1).float().mean().item(),
            "free": logprob_mismatch(free["logprobs"], batch["rollout_logprobs"], batch["loss_mask"]),
            "r3": logprob_mismatch(replayed["logprobs"], batch["rollout_logprobs"], batch["loss_mask"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    args = parser.parse_args()
    from gspo_megatron.parallel.groups import Layout
    from gspo_megatron.parallel.launch import run_on_ranks
    from gspo_megatron.rewards.synthetic import save_tiny_model
    from gspo_megatron.rollout import SamplingParams, SGLangConfig, SGLangEngine, flatten

    work = Path(tempfile.mkdtemp(prefix="bench_r3_"))
    model_dir = str(save_tiny_model(work / "model", seed=0, **MODEL))
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 120, (int(n),), generator=g).tolist() for n in torch.randint(4, 17, (16,), generator=g)]
    config = SGLangConfig(model_path=model_dir, device="cpu", dtype="bfloat16", max_total_tokens=8192,
                          context_length=256, cpu_threads=1, startup_timeout_s=600, log_dir=str(work / "logs"),
                          return_routed_experts=True)
    with SGLangEngine(config) as engine:
        samples = flatten(engine.generate(prompts, n=4, sampling=SamplingParams(max_new_tokens=32, seed=1)))
    (result,) = run_on_ranks(score, 1, Layout(), model_dir, samples)
    print(json.dumps(result, indent=2))
    if args.record:
        f, r = result["free"], result["r3"]
        text = (
            "\n## routing_replay (R3 against a bf16 CPU SGLang server, `bench/routing_replay.py`)\n\n"
            f"Random Qwen3-MoE {MODEL['num_layers']} layers, {MODEL['num_experts']} experts top-{MODEL['top_k']}, "
            "hidden 128; server bf16, trainer fp32 (world=1); 16 prompts x 4 responses x 32 tokens.\n"
            f"The trainer's own routing differs from the server's in {result['routes_differ']:.2%} of "
            f"{result['decisions']} (token, layer) decisions ({result['tokens_with_a_differing_route']:.1%} of "
            "tokens have at least one).\n\n"
            "| trainer routing | gap per token, mean | max | largest sequence log-ratio |\n|---|---|---|---|\n"
            f"| its own | {f['mismatch/token_mean_abs']:.2e} | {f['mismatch/token_max_abs']:.2e} | "
            f"{f['mismatch/seq_log_ratio_max_abs']:.2e} |\n"
            f"| the server's, replayed (R3) | {r['mismatch/token_mean_abs']:.2e} | {r['mismatch/token_max_abs']:.2e} | "
            f"{r['mismatch/seq_log_ratio_max_abs']:.2e} |\n")
        with open(ROOT / "bench/RESULTS.md", "a") as out:
            out.write(text)
        print(text)


if __name__ == "__main__":
    main()
