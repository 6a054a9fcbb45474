#!/usr/bin/env python
"""The GSPO paper's tolerance claim in numbers: how far a bf16 engine's per-sequence mean log-prob is from the
trainer's, by response length, and how many sequences that puts beyond GSPO's clip range.

One tiny Qwen3-MoE (the CPU example's shape by default: 2 layers, hidden 128, 4 experts top-2, vocabulary 128;
random weights, or ``--hf-dir`` for a trained one). The engine (``--engine sglang``, the default) is a CPU SGLang
server started with ``--dtype bfloat16``: it samples ``--sequences`` responses of exactly each length (ignore_eos)
and returns each token's log-prob, as in a rollout. ``--engine transformers`` stands in without SGLang: transformers
in bf16 decoding with its KV cache, each token's log-prob from its bf16 logits (log-softmax in fp32). The trainer
recomputes the same tokens in one forward (transformers, the same weights): in fp32 (the default trainer here) and in
bf16 (the gap large runs have).

    .venv/bin/python bench/mismatch.py                       # lengths 4..512, 32 sequences each
    .venv/bin/python bench/mismatch.py --lengths 4 64 --sequences 8

Per length and trainer dtype: the mean |per-token gap|, the mean and max |per-sequence mean gap| (GSPO's log
sequence ratio at unchanged weights, were the engine's log-probs pi_old) and the share of sequences whose ratio
exp(mean gap) lies outside GSPO's clip range [1 - 3e-4, 1 + 4e-4]. Printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import math
import tempfile
import time
from pathlib import Path

import torch

CLIP = (3e-4, 4e-4)  # GSPO's (algo.defaults.CLIP_RANGES["gspo"])


@torch.no_grad()
def engine_samples(model, prompt: torch.Tensor, length: int, sequences: int, seed: int):
    """``sequences`` responses of exactly ``length`` tokens decoded by the bf16 ``model`` with its KV cache:
    (token ids [n, P + length], the engine's log-prob of each response token [n, length])."""
    torch.manual_seed(seed)
    prompt = prompt.expand(sequences, -1)
    out = model.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True, temperature=1.0, top_p=1.0,
                         top_k=0, max_new_tokens=length, min_new_tokens=length, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    logits = torch.stack(out.logits, dim=1).float()  # [n, length, V]: each step's bf16 logits
    response = out.sequences[:, prompt.shape[1]:]
    logprobs = torch.log_softmax(logits, dim=-1).gather(-1, response.unsqueeze(-1)).squeeze(-1)
    return out.sequences, logprobs


def sglang_samples(engine, prompt: torch.Tensor, length: int, sequences: int, seed: int):
    """The same from a (bf16) SGLang server: ``sequences`` responses of exactly ``length`` tokens."""
    from gspo_megatron.rollout.types import SamplingParams

    sampling = SamplingParams(max_new_tokens=length, ignore_eos=True, seed=seed)
    samples = engine.generate([prompt[0].tolist()], sequences, sampling)[0].samples
    if any(len(s.response_ids) != length for s in samples):
        raise RuntimeError(f"the server returned responses of {sorted({len(s.response_ids) for s in samples})} "
                           f"tokens, not {length}")
    ids = torch.tensor([s.prompt_ids + s.response_ids for s in samples])
    return ids, torch.tensor([s.logprobs for s in samples], dtype=torch.float32)


@torch.no_grad()
def trainer_logprobs(model, ids: torch.Tensor, prompt_len: int) -> torch.Tensor:
    """The response tokens' log-probs from one forward over the whole sequence (the trainer's pass): [n, length]."""
    logits = model(ids).logits[:, prompt_len - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, prompt_len:].unsqueeze(-1)).squeeze(-1)


def row(gap: torch.Tensor) -> dict[str, float]:
    """[n, length] per-token gaps (trainer - engine) -> the table's numbers."""
    seq = gap.double().mean(dim=1)
    ratio = torch.exp(seq)
    beyond = ((ratio < 1 - CLIP[0]) | (ratio > 1 + CLIP[1])).double().mean()
    return {"token_mean_abs": gap.abs().mean().item(), "seq_mean_abs": seq.abs().mean().item(),
            "seq_max_abs": seq.abs().max().item(), "beyond_clip": beyond.item()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="*", default=[4, 8, 16, 32, 64, 128, 256, 512])
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--hf-dir", default=None, help="a model directory (default: a random tiny Qwen3-MoE)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--engine", choices=("sglang", "transformers"), default="sglang")
    parser.add_argument("--device", default="cpu", help="cuda: the engine and trainer on the GPU (--engine "
                        "transformers; bench/gpu_check.sh)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoModelForCausalLM

    hf_dir = args.hf_dir
    if hf_dir is None:
        from gspo_megatron.rewards.synthetic import save_tiny_model

        hf_dir = str(save_tiny_model(tempfile.mkdtemp(prefix="gspo_mismatch_"), seed=args.seed,
                                     max_position_embeddings=1024))  # the prompt + 512 tokens and more
    if args.device != "cpu" and args.engine == "sglang":
        parser.error("--device cuda needs --engine transformers (the SGLang engine here is a CPU server)")
    fp32 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(args.device).eval()
    bf16 = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).to(args.device).eval()
    prompt = torch.tensor([[1, 5, 9, 17, 33]], device=args.device)
    start = time.time()
    engine = None
    if args.engine == "sglang":
        from gspo_megatron.rollout import SGLangConfig, SGLangEngine

        longest = prompt.shape[1] + max(args.lengths)
        engine = SGLangEngine(SGLangConfig(
            model_path=hf_dir, device="cpu", dtype="bfloat16",
            max_total_tokens=max(16384, 2 * longest * args.sequences),
            context_length=max(256, longest + 8), log_dir=str(Path(tempfile.mkdtemp(prefix="gspo_mismatch_logs_"))),
            startup_timeout_s=600, cpu_threads=args.threads, concurrency=1, prompts_per_request=1))
    print(f"model {hf_dir} on {args.device}; {args.sequences} sequences per length; engine: "
          f"{'SGLang server --dtype bfloat16' if engine else 'transformers bf16 decoding (KV cache)'}; "
          f"GSPO clip [1 - {CLIP[0]}, 1 + {CLIP[1]}]")
    print("| length | trainer | token mean \\|gap\\| | seq mean \\|mean gap\\| | seq max \\|mean gap\\| "
          "| beyond clip |")
    print("|---|---|---|---|---|---|")
    for length in args.lengths:
        if engine is not None:
            ids, engine_logprobs = sglang_samples(engine, prompt, length, args.sequences, args.seed + length)
        else:
            ids, engine_logprobs = engine_samples(bf16, prompt, length, args.sequences, args.seed + length)
        for name, model in (("fp32", fp32), ("bf16", bf16)):
            trainer = trainer_logprobs(model, ids.to(args.device), prompt.shape[1])
            r = row((trainer - engine_logprobs.to(args.device)).cpu())
            print(f"| {length} | {name} | {r['token_mean_abs']:.2e} | {r['seq_mean_abs']:.2e} | "
                  f"{r['seq_max_abs']:.2e} | {r['beyond_clip']:.0%} |", flush=True)
    if engine is not None:
        engine.close()
    print(f"({time.time() - start:.0f} s; log sequence ratio bounds: {math.log(1 - CLIP[0]):.2e}, "
          f"{math.log(1 + CLIP[1]):.2e})")


if __name__ == "__main__":
    main()
