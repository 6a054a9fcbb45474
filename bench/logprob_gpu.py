"""The log-prob op on a GPU: the triton backend (bf16) against naive bf16 logits + log_softmax, in one run.

    python bench/logprob_gpu.py                  # CUDA: T=8192, H=2048, V=151936 (Qwen3-30B-A3B's head), TP=1
    python bench/logprob_gpu.py --device cpu     # the harness on the CPU: tiny shapes, fp16, Triton's interpreter

Variants, each one forward and one backward with a random upstream gradient on every token's log-prob:
  naive        logits = hidden @ W.T in bf16 [T, V], log_softmax in fp32, gather; autograd's backward (Megatron's
               bf16 output layer + cross entropy without TP, the baseline).
  triton       ``vocab_parallel_logprobs(backend="triton")``: statistics kernel; gradient kernel + two cuBLAS GEMMs.
  triton_loss  ``vocab_parallel_sequence_loss(backend="triton")``, what the update pass runs: the T tokens as
               T / --seq sequences, the loss sum(logp x the same upstream gradient).
  torch_fp32   ``vocab_parallel_logprobs(backend="torch")``: fp32 copies and fp32 GEMMs (TF32 off), what CUDA ran
               before the triton backend.

Per variant: the median time of --repeat runs after --warmup (CUDA events; perf_counter on the CPU), peak memory
above the inputs (``torch.cuda.max_memory_allocated``; not measured on the CPU), achieved TFLOP/s counted as the
naive path's three GEMMs (6 T V H flops: the useful work, the same for every variant) and as a fraction of a bf16
GEMM peak measured here in the same run (``torch.mm`` of [T, H] x [H, V]), the ratios to naive, and the largest
log-prob error against float64.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

VARIANTS = ("naive", "triton", "triton_loss", "torch_fp32")


def parse(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tokens", type=int, default=None, help="default 8192 (cuda), 64 (cpu)")
    parser.add_argument("--hidden", type=int, default=None, help="default 2048 (cuda), 32 (cpu)")
    parser.add_argument("--vocab", type=int, default=None, help="default 151936 (cuda), 100 (cpu)")
    parser.add_argument("--seq", type=int, default=None, help="positions per sequence (triton_loss); default 1024 / 16")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--warmup", type=int, default=None, help="default 2 (cuda: compiles the kernels), 0 (cpu)")
    parser.add_argument("--repeat", type=int, default=None, help="default 5 (cuda), 1 (cpu)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    for name, on_cuda, on_cpu in (("tokens", 8192, 64), ("hidden", 2048, 32), ("vocab", 151936, 100),
                                  ("seq", 1024, 16), ("warmup", 2, 0), ("repeat", 5, 1)):
        if getattr(args, name) is None:
            setattr(args, name, on_cuda if cuda else on_cpu)
    if args.tokens % args.seq:
        parser.error(f"--seq {args.seq} must divide --tokens {args.tokens}")
    return args


class Clock:
    """Elapsed seconds of ``fn()``: CUDA events on the GPU, perf_counter on the CPU."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"

    def __call__(self, fn) -> float:
        import torch

        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop) / 1e3


def problem(args, device, dtype):
    import torch

    g = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype)
    weight = (torch.randn(args.vocab, args.hidden, generator=g) * args.hidden ** -0.5 * 2).to(device, dtype)
    targets = torch.randint(0, args.vocab, (args.tokens,), generator=g).to(device)
    grad = torch.randn(args.tokens, generator=g).to(device)
    return hidden, weight, targets, grad


def reference_logp(hidden, weight, targets, rows: int = 1024):
    """float64 log-probs of the (rounded) inputs, a block of rows at a time."""
    import torch

    out = []
    w = weight.double()
    for start in range(0, hidden.shape[0], rows):
        logits = hidden[start:start + rows].double() @ w.T
        out.append(torch.log_softmax(logits, -1).gather(1, targets[start:start + rows, None]).squeeze(1))
    return torch.cat(out)


def variant_fn(name, args, hidden, weight, targets, grad):
    """() -> log-probs, after one forward and backward of ``name`` (gradients land in hidden.grad / weight.grad)."""
    import torch

    from gspo_megatron.ops import vocab_parallel_logprobs, vocab_parallel_sequence_loss

    if name == "naive":
        def run():
            logits = hidden @ weight.T  # [T, V] in the inputs' dtype
            logp = torch.log_softmax(logits.float(), dim=-1).gather(1, targets.unsqueeze(1)).squeeze(1)
            logp.backward(grad)
            return logp
    elif name in ("triton", "torch_fp32"):
        backend = "triton" if name == "triton" else "torch"

        def run():
            logp = vocab_parallel_logprobs(hidden, weight, targets, backend=backend)
            logp.backward(grad)
            return logp
    else:
        b = args.tokens // args.seq
        per_sequence = grad.view(b, args.seq)

        def loss_fn(sequences, logp, entropy):
            return (logp * per_sequence[sequences]).sum(), {}

        def run():
            out = vocab_parallel_sequence_loss(hidden.view(b, args.seq, -1).transpose(0, 1), weight,
                                               targets.view(b, args.seq).t(), loss_fn, backend="triton")
            out.loss.backward()
            return out.logp.reshape(-1)
    return run


def measure(name, args, device, dtype, inputs, expected) -> dict:
    import torch

    hidden, weight, targets, grad = (t.detach().clone() for t in inputs)
    hidden.requires_grad_(), weight.requires_grad_()
    run = variant_fn(name, args, hidden, weight, targets, grad)
    clock = Clock(device)

    def once():
        hidden.grad = weight.grad = None
        return run()

    logp = None
    for _ in range(args.warmup):
        logp = once()
    del logp
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    times, result = [], {}

    def timed():
        result["logp"] = once()

    for _ in range(args.repeat):
        times.append(clock(timed))
    peak = torch.cuda.max_memory_allocated(device) - base if cuda else None
    error = (result["logp"].double() - expected).abs().max().item()
    return {"time_s": statistics.median(times), "peak_bytes": peak, "logp_err": error}


def gemm_peak(args, device, dtype, clock) -> float:
    """TFLOP/s of torch.mm [T, H] x [H, V] in ``dtype`` (the best of a few runs)."""
    import torch

    a = torch.randn(args.tokens, args.hidden, device=device, dtype=dtype)
    b = torch.randn(args.hidden, args.vocab, device=device, dtype=dtype)
    best = min(clock(lambda: torch.mm(a, b)) for _ in range(args.warmup + args.repeat))
    return 2 * args.tokens * args.hidden * args.vocab / best / 1e12


def main(argv=None) -> dict:
    args = parse(argv)
    if args.device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are imported
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import torch

    device = torch.device(args.device, torch.cuda.current_device()) if args.device == "cuda" else torch.device("cpu")
    # bf16 on the GPU; the interpreter cannot run a bf16 tl.dot (triton-lang/triton#11584): fp16 on the CPU.
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float16
    torch.backends.cuda.matmul.allow_tf32 = False  # torch_fp32 means fp32
    inputs = problem(args, device, dtype)
    expected = reference_logp(*inputs[:3])
    clock = Clock(device)
    peak = gemm_peak(args, device, dtype, clock)
    useful = 6 * args.tokens * args.hidden * args.vocab  # the naive path's three GEMMs
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (Triton interpreter)"
    print(f"{name} | torch {torch.__version__} | T={args.tokens} H={args.hidden} V={args.vocab} seq={args.seq} "
          f"{str(dtype)[6:]} | {dtype} GEMM peak here: {peak:.3g} TFLOP/s", flush=True)
    rows = {}
    for variant in args.variants:
        rows[variant] = r = measure(variant, args, device, dtype, inputs, expected)
        r["tflops"] = useful / r["time_s"] / 1e12
        r["of_peak"] = r["tflops"] / peak
        print(f"  done {variant}: {r['time_s'] * 1e3:.2f} ms", flush=True)

    naive = rows.get("naive")
    header = ("variant", "fwd+bwd ms", "peak MiB", "TFLOP/s", "of GEMM peak", "time/naive", "peak mem/naive",
              "max |logp - fp64|")
    print("\n| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for variant, r in rows.items():
        mem = "-" if r["peak_bytes"] is None else f"{r['peak_bytes'] / 2**20:.0f}"
        time_ratio = f"{r['time_s'] / naive['time_s']:.3f}" if naive else "-"
        mem_ratio = (f"{r['peak_bytes'] / naive['peak_bytes']:.3f}"
                     if naive and r["peak_bytes"] is not None and naive["peak_bytes"] else "-")
        print(f"| {variant} | {r['time_s'] * 1e3:.2f} | {mem} | {r['tflops']:.3g} | {r['of_peak']:.3g} | "
              f"{time_ratio} | {mem_ratio} | {r['logp_err']:.2e} |")
    result = {"device": name, "dtype": str(dtype), "args": vars(args), "gemm_peak_tflops": peak, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
