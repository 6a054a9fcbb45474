"""SGLang servers and weight-sync time for a model at scale, on paper (``train.plan_servers``; nothing runs on a GPU).

    .venv/bin/python -m bench.rollout_at_scale examples/deepseek_v3_671b/hf_config --layouts 16:16:16:1 32:32:32:2
    .venv/bin/python -m bench.rollout_at_scale examples/glm_4_5_355b/hf_config --layouts 8:1:8:2 16:1:16:2

A layout is tp:attn_dp:ep:weight_bytes (weight_bytes 2 bf16, 1 FP8), on ``--gpus-per-node`` GPUs per node and
``--gpu-memory-gib`` each. Printed per layout: weights and KV cache per GPU, KV tokens per server, the SGLang flags;
then the weight sync's estimate in bf16 and FP8, with 256 MiB and 1 GiB buckets.
"""

from __future__ import annotations

import argparse

from gspo_megatron.model.hf_config import read_hf_config
from gspo_megatron.plan.memory import GIB
from gspo_megatron.plan.layouts import H100_GIB
from gspo_megatron.plan.servers import ServerLayout, model_sync_estimate, server_memory


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("hf_dir")
    parser.add_argument("--layouts", nargs="+", default=["8:1:8:2"])
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory-gib", type=float, default=H100_GIB)
    parser.add_argument("--mem-fraction-static", type=float, default=0.8)
    args = parser.parse_args(argv)
    spec = read_hf_config(f"{args.hf_dir}/config.json")
    print(f"| server (nodes x {args.gpus_per_node} GPUs) | weights | weights / GPU | KV cache / GPU | KV bytes / token "
          "/ GPU | KV tokens per server |")
    print("| --- | --- | --- | --- | --- | --- |")
    for text in args.layouts:
        tp, attn_dp, ep, weight_bytes = text.split(":")
        layout = ServerLayout(tp=int(tp), attn_dp=int(attn_dp), ep=int(ep), weight_bytes=float(weight_bytes),
                              mem_fraction_static=args.mem_fraction_static)
        m = server_memory(spec, layout, args.gpu_memory_gib)
        nodes = -(-layout.tp // args.gpus_per_node)
        kv = f"{m.kv_per_gpu / GIB:.1f} GiB" if m.fits else "- (does not load)"
        tokens = f"{m.tokens_per_server / 1e3:,.0f}k" if m.fits else "-"
        dtype = "FP8" if layout.weight_bytes == 1 else "bf16"
        print(f"| `{layout.flags()}` ({nodes} x {args.gpus_per_node}) | {dtype} "
              f"| {m.weights_per_gpu / GIB:.1f} GiB | {kv} | {m.kv_bytes_per_token / 1024:.1f} KiB | {tokens} |")
    print()
    print("| weight sync | GB into every server GPU | buckets | wire at 45 GB/s | calls (3 ms each) | load_weights "
          "(20-50 us per tensor) | total |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for dtype, bytes_per_parameter in (("bf16", 2), ("FP8", 1)):
        for bucket in (256 << 20, 1 << 30):
            e = model_sync_estimate(spec, bucket, bytes_per_parameter)
            low, high = e.seconds
            print(f"| {dtype}, {bucket >> 20} MiB buckets | {e.gigabytes:.0f} | {e.buckets} | {e.wire_s:.1f} s | "
                  f"{e.calls_s:.1f} s | {e.load_s[0]:.1f}-{e.load_s[1]:.1f} s | **{low:.1f}-{high:.1f} s** |")


if __name__ == "__main__":
    main()
