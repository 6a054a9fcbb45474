"""Fused vocab-parallel log-prob op vs the naive path: peak extra memory and time, forward and backward.

    .venv/bin/python bench/logprob.py            # T=8192, H=2048, V=151936, TP=1 and TP=2 (several minutes)
    .venv/bin/python bench/logprob.py --quick    # small sizes, seconds

Variants (fp32 inputs, fp32 logits, upstream gradient random on every token's log-prob):
  naive  TP=1: logits = hidden @ W.T [T, V]; log_softmax; gather.
         TP=2: local logits [T, V/2] + Megatron-Core's vocab_parallel_cross_entropy (the standard vocab-parallel
               path; all-gathering [T, V] logits on each rank would not fit two ranks in this machine's memory).
  fused  vocab_parallel_logprobs (chunked, recomputes chunk logits in backward).
  fused_loss  vocab_parallel_sequence_loss, what the update pass runs: the T tokens as T/seq sequences of --seq
         positions, the loss sum(logp * upstream gradient) (the same gradient as the other variants) formed chunk
         by chunk in forward, so its "fwd" already includes the gradient matmuls and backward only scales them.

Each variant runs in fresh processes (run_on_ranks: 1 rank with 2 threads, or 2 ranks with 1 thread each).
Memory: the process's peak RSS (VmHWM, reset via /proc/self/clear_refs once the inputs exist) minus the RSS
then; the TP=2 figure is the larger rank's. "working" also subtracts the gradients and outputs both variants
must create (hidden.grad, weight.grad, logp), i.e. the op's own temporaries.
"""

from __future__ import annotations

import argparse
import gc
import resource
import time

import torch

from gspo_megatron.ops import vocab_parallel_logprobs, vocab_parallel_sequence_loss
from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks

MB = 2**20


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field))


def _reset_peak_rss() -> int:
    """Reset the high-water mark to the current RSS; return the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kb("VmRSS:") * 1024


def _peak_rss() -> int:
    return _status_kb("VmHWM:") * 1024


def _cpu_s() -> float:
    """CPU seconds of this process (all threads): less sensitive than wall time to other load on the machine."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def naive_tp1(hidden, weight, targets):
    logits = hidden @ weight.T  # [T, V] fp32
    return torch.log_softmax(logits, dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)


def naive_vocab_parallel(hidden, weight, targets):
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    logits = hidden @ weight.T  # [T, V/tp] fp32
    return -vocab_parallel_cross_entropy(logits.unsqueeze(1), targets.unsqueeze(1)).squeeze(1)


def measure(variant: str, tokens: int, hidden_size: int, vocab: int, chunk_size: int | None, seq: int) -> dict:
    """On each rank: one forward and one backward of ``variant``; times in s, memory in bytes."""
    from megatron.core import parallel_state as ps

    group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    g = torch.Generator().manual_seed(0)  # the same problem on every rank; each keeps its vocab shard
    hidden = torch.randn(tokens, hidden_size, generator=g).requires_grad_()
    weight = torch.randn(vocab // tp, hidden_size, generator=g).mul_(0.05).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    grad = torch.randn(tokens, generator=g)
    backward = lambda out: out.backward(grad)  # noqa: E731
    if variant == "fused":
        def fn():
            return vocab_parallel_logprobs(hidden, weight, targets, tp_group=group, chunk_size=chunk_size)
    elif variant == "fused_loss":
        b = tokens // seq
        per_sequence_grad = grad.view(b, seq)

        def loss_fn(sequences, logp, entropy):
            return (logp * per_sequence_grad[sequences]).sum(), {}

        def fn():
            return vocab_parallel_sequence_loss(hidden.view(b, seq, -1).transpose(0, 1), weight,
                                                targets.view(b, seq).t(), loss_fn, tp_group=group,
                                                chunk_size=chunk_size)

        backward = lambda out: out.loss.backward()  # noqa: E731
    else:
        def fn():
            return (naive_tp1 if tp == 1 else naive_vocab_parallel)(hidden, weight, targets)
    gc.collect()
    torch.distributed.barrier()
    base = _reset_peak_rss()
    start, cpu = time.perf_counter(), _cpu_s()
    out = fn()
    fwd, fwd_cpu = time.perf_counter() - start, _cpu_s() - cpu
    fwd_peak = _peak_rss() - base
    backward(out)
    logp = out.logp if variant == "fused_loss" else out
    total, total_cpu = time.perf_counter() - start, _cpu_s() - cpu
    outputs = hidden.grad.nbytes + weight.grad.nbytes + logp.nbytes
    return {"fwd_s": fwd, "total_s": total, "fwd_cpu_s": fwd_cpu, "total_cpu_s": total_cpu, "fwd_peak": fwd_peak,
            "peak": _peak_rss() - base, "outputs": outputs, "logp_sum": logp.sum().item()}


def run(variant: str, tp: int, args) -> dict:
    # A full-size variant takes minutes, more on a shared machine: allow an hour before calling a rank hung.
    ranks = run_on_ranks(measure, tp, Layout(tensor=tp), variant, args.tokens, args.hidden, args.vocab, args.chunk,
                         args.seq, timeout=3600)
    return {k: max(r[k] for r in ranks) for k in ranks[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="T=4096, H=256, V=32768")
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--chunk", type=int, default=None, help="tokens per chunk (default: the op's auto size)")
    parser.add_argument("--seq", type=int, default=256, help="positions per sequence (fused_loss; divides --tokens)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--variants", nargs="+", default=["fused", "fused_loss", "naive"])
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.hidden, args.vocab = 4096, 256, 32768
    if args.tokens % args.seq:
        parser.error(f"--seq {args.seq} must divide --tokens {args.tokens}")
    print(f"T={args.tokens} H={args.hidden} V={args.vocab} chunk={args.chunk or 'auto'} seq={args.seq} fp32, "
          f"{torch.get_num_threads()} CPU threads in all", flush=True)
    rows = {}
    for tp in args.tp:
        for variant in args.variants:
            rows[variant, tp] = r = run(variant, tp, args)
            print(f"  done {variant} TP={tp}: {r['total_s']:.1f} s", flush=True)

    header = ("variant", "TP", "fwd s", "fwd+bwd s", "fwd+bwd CPU s", "fwd peak MB", "peak MB", "working MB",
              "peak/naive", "working/naive", "fwd s/naive", "fwd+bwd s/naive", "CPU s/naive")
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for (variant, tp), r in rows.items():
        naive = rows.get(("naive", tp))

        def vs_naive(key, value=lambda x, k: x[k]):
            return f"{value(r, key) / value(naive, key):.3f}" if naive else "-"

        working = lambda x, _: x["peak"] - x["outputs"]  # noqa: E731
        cells = (variant, tp, f"{r['fwd_s']:.1f}", f"{r['total_s']:.1f}", f"{r['total_cpu_s']:.1f}",
                 f"{r['fwd_peak'] / MB:.0f}", f"{r['peak'] / MB:.0f}", f"{working(r, 0) / MB:.0f}",
                 vs_naive("peak"), vs_naive("working", working), vs_naive("fwd_s"), vs_naive("total_s"),
                 vs_naive("total_cpu_s"))
        print("| " + " | ".join(map(str, cells)) + " |")
    for tp in args.tp:
        sums = ", ".join(f"{v} {rows[v, tp]['logp_sum']:.6e}" for v in args.variants if (v, tp) in rows)
        print(f"TP={tp}: sum(logp) {sums}")


if __name__ == "__main__":
    main()
