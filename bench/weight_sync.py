"""Weight sync into a real CPU SGLang server: distributed broadcast (gloo) vs from disk, for a ~200M model, and the
trainer's own sync (one sender per pipeline stage, gathers onto the senders only) against the old way (every rank
all-gathers, rank 0 sends) from a Megatron policy on 2 gloo ranks.

    .venv/bin/python bench/weight_sync.py              # ~204M-parameter Qwen3-MoE, bf16, 5 rounds (~3 min)
    .venv/bin/python bench/weight_sync.py --quick      # tiny model, seconds after the server is up
    .venv/bin/python bench/weight_sync.py --record     # also append the result to bench/RESULTS.md

One server (``--device cpu``, ``--dtype bfloat16``) of a random Qwen3-MoE (hidden 1024, 5 layers, 16 experts of
512, vocab 32000: 204M parameters, 409 MB in bf16).

Part 1, the trainer is the same model in this process (bf16); each round sends all its weights every way, in
turn, as new versions:

  distributed       the engine's DistributedSender, gloo's default (per-tensor broadcasts): POST begin, then per
                    256 MiB bucket POST update_weights_from_distributed while broadcasting each tensor of it over
                    gloo (bucket k+1 produced while bucket k is on the wire), then POST end / update_weight_version /
                    flush_cache
  distributed_flat  the same with ``flatten=True`` (NCCL's default): each bucket packed into one of two reused
                    buffers, one broadcast per bucket
  disk              safetensors shards (256 MiB) + config under /tmp, POST update_weights_from_disk (the files
                    are not fsynced: the server reads them back from the page cache)

Part 2 (``--ranks 2``, the default; 0 skips it): the loop's policy (``build_policy``, bf16) under EP=2 on 2 gloo
ranks, synced alternately by ``train.weight_sync.sync``'s stage senders (experts gathered onto rank 0 only) and through
rank 0 (``pipeline_gathered``: every rank all-gathers every expert, the way weight sync worked before). Reported:
time, phases, and the bytes each rank received in the export's collectives.

Each time is the whole update call, including the version check. The first distributed update also forms the
process group: it is timed separately and not counted. Reported: the median of the rounds, per phase too, and
ratios against the same run's baselines (disk, and the through-rank-0 sync).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
import textwrap
import time
from dataclasses import replace
from pathlib import Path

import torch

from gspo_megatron.rewards import synthetic
from gspo_megatron.rollout import SGLangConfig, SGLangEngine, WeightSyncConfig, hf_weights

BENCH = dict(vocab_size=32000, hidden_size=1024, num_layers=5, num_heads=16, num_kv_heads=4, head_dim=64,
             num_experts=16, top_k=4, moe_intermediate_size=512, initializer_range=0.02)
QUICK = dict()  # the test model's sizes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=256)
    parser.add_argument("--record", action="store_true", help="append the result to bench/RESULTS.md")
    parser.add_argument("--ranks", type=int, default=2, choices=(0, 2),
                        help="part 2: the Megatron policy's sync on 2 gloo ranks (EP=2); 0 skips it")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    sizes = QUICK if args.quick else BENCH
    dtype = torch.bfloat16
    with tempfile.TemporaryDirectory(prefix="bench_weight_sync_") as tmp:
        model_dir = synthetic.save_tiny_model(Path(tmp) / "model", seed=0, **sizes)
        from transformers import AutoModelForCausalLM

        trainer = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=dtype).eval()
        params = sum(p.numel() for p in trainer.parameters())
        sync = WeightSyncConfig(bucket_bytes=args.bucket_mb << 20, disk_dir=str(Path(tmp) / "sync"))
        config = SGLangConfig(model_path=str(model_dir), device="cpu", dtype="bfloat16", max_total_tokens=4096,
                              max_running_requests=16, context_length=512, log_dir=str(Path(tmp) / "logs"),
                              startup_timeout_s=900, weight_sync=sync)
        start = time.perf_counter()
        with SGLangEngine(config) as engine:
            startup = time.perf_counter() - start
            first = engine.update_weights(hf_weights.checkpoint_tensors(trainer), "init", method="distributed")
            rounds = {"distributed": [], "distributed_flat": [], "disk": []}
            for r in range(args.rounds):
                for method in rounds:
                    with torch.no_grad():  # a new version of the weights each time, as after a training step
                        for p in trainer.parameters():
                            p.mul_(1.0 + 1e-3)
                    engine.config = replace(config, weight_sync=replace(sync, flatten=method.endswith("flat")))
                    stats = engine.update_weights(hf_weights.checkpoint_tensors(trainer), f"{method}-{r}",
                                                  method=method.removesuffix("_flat"))
                    rounds[method].append(stats)
                    phases = " ".join(f"{k} {v:.2f}" for k, v in stats.phases.items())
                    print(f"round {r} {method:11s} {stats.seconds:7.2f} s  {stats.num_bytes / 1e9:.3f} GB  "
                          f"{stats.num_buckets} buckets  {stats.gb_per_s:.3f} GB/s  ({phases})", flush=True)
            megatron = None
            if args.ranks:
                from gspo_megatron.parallel.groups import Layout
                from gspo_megatron.parallel.launch import run_on_ranks

                engine.update_weights(hf_weights.checkpoint_tensors(trainer), "before-megatron")
                megatron = run_on_ranks(megatron_rounds, args.ranks, Layout(expert=args.ranks), str(model_dir),
                                        engine.worker_urls[0], args.rounds, timeout=1800)
    result = {
        "params": params,
        "bytes": rounds["distributed"][0].num_bytes,
        "dtype": str(dtype).removeprefix("torch."),
        "bucket_mb": args.bucket_mb,
        "server_startup_s": startup,
        "first_distributed_with_group_init_s": first.seconds,
        "distributed_s": statistics.median(s.seconds for s in rounds["distributed"]),
        "distributed_flat_s": statistics.median(s.seconds for s in rounds["distributed_flat"]),
        "disk_s": statistics.median(s.seconds for s in rounds["disk"]),
        "rounds": args.rounds,
    }
    result["disk_over_distributed"] = result["disk_s"] / result["distributed_s"]
    result["best_s"] = {m: min(s.seconds for s in rounds[m]) for m in rounds}
    result["best_disk_over_best_distributed"] = result["best_s"]["disk"] / result["best_s"]["distributed"]
    result["phases"] = {m: {k: statistics.median(s.phases[k] for s in rounds[m]) for k in rounds[m][0].phases}
                        for m in rounds}
    if megatron is not None:
        result["megatron"] = summarize_megatron(megatron)
    print(json.dumps(result, indent=1))
    if args.record and not args.quick:
        record(result)


def megatron_rounds(model_dir: str, server_url: str, rounds: int) -> dict:
    """On each rank: ``rounds`` x (stage senders, through rank 0), each after the weights changed; per sync the
    seconds (rank 0's metrics) and the bytes this rank received in the export's gathers / all-gathers."""
    import torch.distributed as dist

    from gspo_megatron.rollout import SGLangConfig, SGLangEngine
    from gspo_megatron.train.weight_sync import sync as weight_sync
    from gspo_megatron.train.startup.config import load_config
    from gspo_megatron.train.startup.policy import build_policy

    cfg = load_config(None, ["data.task=reverse", f"model.hf_dir={model_dir}", "model.dtype=bfloat16",
                             f"parallel.expert={dist.get_world_size()}", "parallel.distributed_optimizer=false"])
    policy = build_policy(cfg, model_dir)
    rank0 = dist.get_rank() == 0
    engine = SGLangEngine(SGLangConfig(urls=(server_url,), device="cpu", request_timeout_s=600)) if rank0 else None
    received = {"bytes": 0}
    real_gather, real_all_gather = dist.gather, dist.all_gather

    def count(outputs):  # what lands on this rank from the others
        if outputs and len(outputs) > 1:
            received["bytes"] += sum(t.numel() * t.element_size() for t in outputs) * (len(outputs) - 1) // len(outputs)

    def gather(tensor, gather_list=None, *args, **kwargs):
        count(gather_list)
        return real_gather(tensor, gather_list, *args, **kwargs)

    def all_gather(tensor_list, tensor, *args, **kwargs):
        count(tensor_list)
        return real_all_gather(tensor_list, tensor, *args, **kwargs)

    dist.gather, dist.all_gather = gather, all_gather  # the bridge calls them through torch.distributed
    out = {"stage_senders": [], "through_rank0": []}
    try:
        for r in range(rounds + 1):  # round 0 forms the senders' groups: not counted
            for way, sync in (("stage_senders", weight_sync._sync_from_stage_senders),
                              ("through_rank0", weight_sync._sync_through_rank0)):
                with torch.no_grad():
                    for p in policy.model.parameters():
                        p.mul_(1.0 + 1e-3)
                received["bytes"] = 0
                target = weight_sync.control.broadcast_from_rank0(engine.sync_target() if rank0 else None)
                start = time.perf_counter()
                args = (policy, engine, f"{way}-{r}") + ((target,) if way == "stage_senders" else ())
                metrics = sync(*args)
                seconds = time.perf_counter() - start
                if r:
                    out[way].append({"seconds": seconds, "received_bytes": received["bytes"], "metrics": metrics})
    finally:
        if engine is not None:
            engine.close()
    return out


def summarize_megatron(per_rank: list[dict]) -> dict:
    summary = {}
    for way in ("stage_senders", "through_rank0"):
        runs = per_rank[0][way]
        phases = [k.removeprefix("weight_sync/").removesuffix("_seconds") for k in runs[0]["metrics"]
                  if k.endswith("_seconds") and k != "weight_sync/seconds"]
        summary[way] = {
            "seconds": statistics.median(r["seconds"] for r in runs),
            "best_s": min(r["seconds"] for r in runs),
            "gb": runs[0]["metrics"]["weight_sync/gb"],
            "received_mb_per_rank": [statistics.median(r["received_bytes"] for r in rank[way]) / 1e6 for rank in per_rank],
            "phases": {k: statistics.median(r["metrics"][f"weight_sync/{k}_seconds"] for r in runs) for k in phases},
        }
    summary["through_rank0_over_stage_senders"] = summary["through_rank0"]["seconds"] / summary["stage_senders"]["seconds"]
    return summary


def record(result: dict) -> None:
    path = Path(__file__).resolve().parent / "RESULTS.md"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    if "\n## weight_sync\n" in "\n" + text:
        raise SystemExit("bench/RESULTS.md already has a weight_sync section: edit it by hand")
    phases = lambda m: ", ".join(f"{k} {v:.2f}" for k, v in result["phases"][m].items())  # noqa: E731
    gbs = lambda seconds: result["bytes"] / seconds / 1e9  # noqa: E731
    section = (
        "\n## weight_sync\n\n"
        f"`bench/weight_sync.py` ({time.strftime('%Y-%m-%d')}): all weights of a {result['params'] / 1e6:.0f}M-parameter "
        f"Qwen3-MoE ({result['bytes'] / 1e6:.0f} MB in {result['dtype']}) from the trainer process into a running "
        f"sglang 0.5.23 CPU server on 127.0.0.1, median of {result['rounds']} rounds, {result['bucket_mb']} MiB "
        "buckets / shards. 2-core VM shared with other engineers (wall times are noisy), torch "
        f"{torch.__version__}, gloo over loopback TCP.\n\n"
        "| method | median s | best s | GB/s (median) | phases (median s) |\n| --- | --- | --- | --- | --- |\n"
        f"| distributed (gloo, one broadcast per tensor; default) | {result['distributed_s']:.2f} | "
        f"{result['best_s']['distributed']:.2f} | {gbs(result['distributed_s']):.2f} | {phases('distributed')} |\n"
        f"| distributed, flattened buckets (`flatten=True`) | {result['distributed_flat_s']:.2f} | "
        f"{result['best_s']['distributed_flat']:.2f} | {gbs(result['distributed_flat_s']):.2f} | "
        f"{phases('distributed_flat')} |\n"
        f"| disk (safetensors + update_weights_from_disk) | {result['disk_s']:.2f} | {result['best_s']['disk']:.2f} | "
        f"{gbs(result['disk_s']):.2f} | {phases('disk')} |\n\n"
        f"Disk / distributed: **{result['disk_over_distributed']:.2f}x** (medians; best / best "
        f"{result['best_disk_over_best_distributed']:.2f}x). The first distributed update, which also "
        f"forms the process group, took {result['first_distributed_with_group_init_s']:.2f} s; server start-up "
        f"{result['server_startup_s']:.0f} s.\n\n"
        "Reading: on one CPU machine the disk path never touches a disk: the shards go to the page cache and the "
        "server maps them back at memory speed, while gloo pushes every byte through loopback TCP (~1 GB/s at best "
        "here). Packing buckets into one buffer adds a copy of every byte into a freshly allocated buffer each "
        "update (the \"pack\" phase, slow on these contended cores) and buys nothing on gloo, hence `flatten=False` by "
        "default. Where disk sync normally runs (a shared file system between a trainer and servers on other nodes, "
        "fsynced) and with NCCL on GPUs, the order is expected to reverse; that is not measured here.\n"
    )
    lines = [line if line.startswith("|") else "\n".join(textwrap.wrap(line, 115, break_on_hyphens=False))
             for line in section.split("\n")]
    path.write_text(text.rstrip("\n") + "\n" + "\n".join(lines))
    print(f"recorded in {path}")


if __name__ == "__main__":
    main()
