"""A CPU SGLang server's start: its children forked (``patches/sglang_cpu``'s default) vs spawned (SGLang's own).

    .venv/bin/python bench/server_start.py               # 3 starts of each, alternating (~3 min on 2 cores)
    .venv/bin/python bench/server_start.py --rounds 1

Each start launches one server of the tiny random Qwen3-MoE (fp32, the tests' size) with ``start_servers``, waits
until it is healthy and generates one short request, then stops it. Reported per start method: the median wall time
from launch to healthy, and the CPU-seconds its processes used until then (the launcher, the scheduler, the
detokenizer: read from /proc before the stop), with ratios against spawn. Nothing else should run meanwhile: on 2
cores the three processes of one start compete with each other already.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import psutil
import requests

from gspo_megatron.rewards import synthetic
from gspo_megatron.rollout import SGLangConfig
from gspo_megatron.rollout.server import start_servers

ENV = "GSPO_SGLANG_START_METHOD"  # patches/sglang_cpu/site/_gspo_fork_children.py


def _cpu_seconds(pid: int) -> float:
    root = psutil.Process(pid)
    total = 0.0
    for process in [root, *root.children(recursive=True)]:
        try:
            times = process.cpu_times()
            total += times.user + times.system
        except psutil.Error:
            continue
    return total


def start_once(config: SGLangConfig, method: str) -> tuple[float, float]:
    """Wall seconds to healthy and CPU-seconds used by then, for one server started with ``method``."""
    os.environ[ENV] = method  # the server's environment is this one's (server_env copies it)
    t = time.perf_counter()
    server, = start_servers(config)
    try:
        server.wait_ready(config.startup_timeout_s)
        wall = time.perf_counter() - t
        cpu = _cpu_seconds(server.process.pid)
        out = requests.post(f"{server.url}/generate", json={"text": "rev abc=", "sampling_params": {
            "max_new_tokens": 4, "temperature": 0.0}}, timeout=60)
        out.raise_for_status()
    finally:
        server.shutdown()
    return wall, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="gspo_server_start_"))
    model = synthetic.save_tiny_model(work / "model", seed=0)
    config = SGLangConfig(model_path=str(model), device="cpu", dtype="float32", max_total_tokens=16384,
                          context_length=512, log_dir=str(work / "logs"), startup_timeout_s=600, cpu_threads=1)
    results: dict[str, list[tuple[float, float]]] = {"spawn": [], "fork": []}
    for round_ in range(args.rounds):
        for method in results:
            wall, cpu = start_once(replace(config, log_dir=str(work / "logs" / f"{method}{round_}")), method)
            results[method].append((wall, cpu))
            print(f"  round {round_ + 1}/{args.rounds} {method}: healthy after {wall:.1f} s, {cpu:.1f} CPU-s",
                  flush=True)
    base_wall = statistics.median(w for w, _ in results["spawn"])
    base_cpu = statistics.median(c for _, c in results["spawn"])
    print(f"\nCPU server start, tiny Qwen3-MoE fp32, {psutil.cpu_count()} cores, median of {args.rounds}:")
    print("| children | to healthy s | CPU-s | wall / spawn | CPU / spawn |")
    print("| --- | --- | --- | --- | --- |")
    for method, runs in results.items():
        wall, cpu = statistics.median(w for w, _ in runs), statistics.median(c for _, c in runs)
        print(f"| {method} | {wall:.1f} | {cpu:.1f} | {wall / base_wall:.2f} | {cpu / base_cpu:.2f} |")


if __name__ == "__main__":
    main()
