"""examples/launch_cluster.sh, run as on a cluster, on one machine: a rollout node and two training nodes.

The command lines are the ones examples/slurm_cluster.sbatch would have srun start on each node (its DRY_RUN mode,
the allocation's hosts all 127.0.0.1): ROLE=rollout starts the SGLang server (CPU backend, float32) and, at the same
time, two training "nodes" (two torchrun agents, NNODES=2, two gloo ranks each, rendezvous at 127.0.0.1) wait until
it generates, then train the tiny CPU example under TP=2 x EP=2 (data parallel across the nodes) for two steps
attached to that server. Each step syncs the
updated shards to the server; the rollout's log-probs then equal the trainer's only if the synced weights are the
trained ones, and the server must report the second weight version. The callers' GLOO_SOCKET_IFNAME names an
interface that does not exist: the run only works if the script's NET_IF reaches every rank and the server.
This is also the test of the README's CPU example under torchrun at TP=2 x EP=2 (docs/getting-started.md): its
config, its overrides, metrics gathered over both data-parallel ranks, the plot, and the dist checkpoint the last
step writes from both nodes. Its other half, rank 0 launching the server under `torchrun --standalone`, is
tests/test_tool_use_example.py's four-rank run.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from gspo_megatron.parallel.groups import free_port
from tests.rollout.helpers import require_sglang

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples/launch_cluster.sh"
SBATCH = ROOT / "examples/slurm_cluster.sbatch"
EXAMPLE = ROOT / "examples/tiny_moe_cpu.yaml"


def _tail(path: Path, lines: int = 40) -> str:
    text = path.read_text(errors="replace").splitlines() if path.exists() else ["(no log)"]
    return "\n".join(line[:300] for line in text[-lines:])


def _stop(process: subprocess.Popen) -> None:
    """Kill the process group the script started (the server and its workers, or an agent and its ranks)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait(timeout=30)


def _example_model(tmp_path: Path) -> Path:
    """The CPU example's model as its trainer builds it, from a shorter warm start (5 steps)."""
    from gspo_megatron.train.startup.bootstrap import build_tiny_model
    from gspo_megatron.train.startup.config import load_config

    model = tmp_path / "model"
    build_tiny_model(load_config(EXAMPLE, ["model.warm_start_steps=5"]), model)
    return model


def _wait_for_nodes(nodes: dict[str, subprocess.Popen], logs: dict[str, Path]) -> None:
    """Wait (10 minutes in all) for each of ``nodes`` to exit 0; a failure shows its log's tail and the others'."""
    deadline = time.monotonic() + 600
    for name, process in nodes.items():
        try:
            code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            code = "timed out"
        others = "".join(f"\n--- {other}:\n{_tail(log, 15)}" for other, log in logs.items() if other != name)
        assert code == 0, f"{name}: {code}\n{_tail(logs[name])}{others}"


@pytest.mark.megatron  # trains the Megatron policy under torchrun
def test_two_training_nodes_and_a_rollout_node(tmp_path):
    require_sglang()
    model = _example_model(tmp_path)
    server_port, master_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env.update(VENV=sys.prefix, HF_DIR=str(model), NET_IF="lo", OMP_NUM_THREADS="1",
               GLOO_SOCKET_IFNAME="no-such-if0", NCCL_SOCKET_IFNAME="no-such-if0")
    logs = {name: tmp_path / f"{name}.log" for name in ("rollout", "node0", "node1")}
    processes = {}

    overrides = ["parallel.tensor=2", "parallel.expert=2", "train.steps=2", "train.eval_every=2",
                 "rollout.prompts_per_step=4", "parallel.micro_batch_size=8", f"logging.dir={tmp_path / 'run'}",
                 f"checkpoint.dir={tmp_path / 'ck'}", "checkpoint.every=0", "logging.plot_every=2"]
    plan = subprocess.run(["bash", str(SBATCH), *overrides], cwd=ROOT, capture_output=True, text=True, timeout=60,
                          env=dict(env, DRY_RUN="1", HOSTS="127.0.0.1 127.0.0.1 127.0.0.1", TRAIN_NODES="2",
                                   ROLLOUT_NODES="1", GPUS_PER_NODE="2", SERVER_TP="1", SERVER_PORT=str(server_port),
                                   MASTER_PORT=str(master_port), DEVICE="cpu", DTYPE="float32", CONFIG=str(EXAMPLE),
                                   SERVER_ARGS="--max-total-tokens 8192 --sleep-on-idle --random-seed 0"))
    assert plan.returncode == 0, plan.stderr
    lines = [line.split("\t", 1)[1] for line in plan.stdout.splitlines()]
    assert len(lines) == 3 and "ROLE=rollout" in lines[0], plan.stdout

    def start(name: str, line: str) -> None:
        with open(logs[name], "wb") as log:
            processes[name] = subprocess.Popen(["bash", "-c", line], cwd=ROOT, env=env, stdout=log,
                                               stderr=subprocess.STDOUT, start_new_session=True)

    try:
        # The server and both nodes start at once: rank 0 waits for the server to answer (as on a cluster).
        for name, line in zip(("rollout", "node0", "node1"), lines):
            start(name, line)
        _wait_for_nodes({node: processes[node] for node in ("node0", "node1")}, logs)

        records = [json.loads(line) for line in (tmp_path / "run/metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == [1, 2]
        # Step 2 rolls out with the weights synced after step 1's update, gathered from TP x EP shards on two nodes.
        assert all(r["logprob_diff_max"] < 1e-4 for r in records), [r["logprob_diff_max"] for r in records]
        assert all(r["weight_sync/tensors"] > 0 for r in records) and "eval_reward_mean" in records[1]
        assert records[0]["grad_norm"] > 0  # the update moved the weights the server must then serve
        # Metrics over both data-parallel ranks' sequences, and expert volatility summed over TP x EP ranks' routers.
        assert all(0 < r["clip_frac_seqs"] < 1 and 0 <= r["expert_volatility"] <= 1 for r in records), records
        assert (tmp_path / "run" / "metrics.png").read_bytes()[:4] == b"\x89PNG"
        assert (tmp_path / "ck" / "latest").read_text() == "step_000002"  # a dist checkpoint written from two nodes
        with urllib.request.urlopen(f"http://127.0.0.1:{server_port}/model_info", timeout=30) as answer:
            assert json.load(answer)["weight_version"] == "2"
    finally:
        for process in processes.values():
            _stop(process)


@pytest.mark.megatron  # trains the Megatron policy under torchrun
def test_two_colocated_training_nodes(tmp_path):
    """examples/launch_cluster.sh with ROLLOUT=colocated on two "nodes" of two ranks each (two torchrun agents,
    NNODES=2, static rendezvous at 127.0.0.1), the tiny CPU example at TP=2 x EP=2 with the optimizer offloaded
    (rollout.colocate_offload=optimizer). Each node's leader (LOCAL_RANK 0: ranks 0 and 2) launches its own colocated
    CPU server; rank 0 generates on both by URL and releases / resumes both; each leader writes every update into its
    own server from its own copy of the export (gathered over TP x EP onto it) through update_weights_from_tensor,
    while the other ranks wait for the release in the control group; every rank offloads its own shard of the
    optimizer state and gradient buffers after each update and regains it before the next. After each sync both
    servers roll out, and their log-probs equal the trainer's (fp32)."""
    require_sglang()
    model = _example_model(tmp_path)
    servers, run = tmp_path / "servers", tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                                                             "ROLLOUT_URLS", "GPU_MEMORY_GIB")}
    env.update(VENV=sys.prefix, HF_DIR=str(model), NET_IF="lo", OMP_NUM_THREADS="1", ROLLOUT="colocated",
               CONFIG=str(EXAMPLE), NNODES="2", GPUS_PER_NODE="2", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), GLOO_SOCKET_IFNAME="no-such-if0")
    overrides = ["parallel.tensor=2", "parallel.expert=2", "rollout.colocate_offload=optimizer", "train.steps=2",
                 "train.eval_every=0", "rollout.prompts_per_step=4", "parallel.micro_batch_size=8",
                 f"logging.dir={run}", "checkpoint.dir=", "logging.plot_every=0",
                 f"rollout.server_args.log_dir={servers}",
                 # the script's plan checks colocation as on GPUs: SGLang's share of the memory must be set
                 "rollout.server_args.mem_fraction_static=0.3",
                 "rollout.server_args.prompts_per_request=1"]  # 4 requests a step: both servers get some
    logs = {f"node{n}": tmp_path / f"node{n}.log" for n in range(2)}
    processes = {}
    try:
        for n, (name, log) in enumerate(logs.items()):
            with open(log, "wb") as out:
                processes[name] = subprocess.Popen(["bash", str(SCRIPT), *overrides], cwd=ROOT,
                                                   env=dict(env, NODE_RANK=str(n)), stdout=out,
                                                   stderr=subprocess.STDOUT, start_new_session=True)
        _wait_for_nodes(processes, logs)
    finally:
        for process in processes.values():
            _stop(process)
    assert "colocated: fits" in logs["node0"].read_text(errors="replace")  # the script's plan ran first on each node
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    diffs = [r["logprob_diff_max"] for r in records]
    server_logs = [(servers / f"node_{n}" / "sglang_server_0.log").read_text() for n in range(2)]
    after_sync = [log.split("/update_weights_from_tensor", 1)[1].count("POST /generate") for log in server_logs]
    print("two colocated nodes: logprob_diff_max per step", diffs, "generate requests per server after the first "
          "sync", after_sync, "offloaded per rank-0 GPU: bytes", [r["colocate/offload_bytes"] for r in records],
          "grad buffers", [r["colocate/grad_buffer_bytes"] for r in records])
    assert [r["step"] for r in records] == [1, 2] and max(diffs) < 1e-4, diffs
    assert all(r["weight_sync/tensors"] > 0 and r["weight_sync/senders"] == 2 for r in records), records
    assert all(r["colocate/release_seconds"] >= 0 for r in records), records
    assert all(r["colocate/offload_bytes"] > 0 and r["colocate/grad_buffer_bytes"] > 0 for r in records), records
    assert records[1]["colocate/reload_seconds"] >= 0
    assert all(log.count("POST /update_weights_from_tensor") >= 2 for log in server_logs)  # each leader sent its own
    assert all(n > 0 for n in after_sync), after_sync  # step 2 rolled out on both servers


def test_slurm_script_plans_each_node(tmp_path):
    """The sbatch script's DRY_RUN: trainers first (the first is the rendezvous), then the rollout nodes, whose URLs
    every trainer gets; node ranks in order; config overrides to the trainers, SERVER_ARGS to the servers; too small
    an allocation is refused naming the node counts."""
    env = dict(os.environ, DRY_RUN="1", HOSTS="t0 t1 r0 r1", TRAIN_NODES="2", ROLLOUT_NODES="2", VENV="/v",
               HF_DIR="/m", CONFIG="c.yaml", NET_IF="ib0", SERVER_PORT="31000", SERVER_ARGS="--ep-size 8")
    out = subprocess.run(["bash", str(SBATCH), "train.steps=2"], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    plan = [line.split("\t") for line in out.stdout.splitlines()]
    assert [host for host, _ in plan] == ["r0", "r1", "t0", "t1"]
    for host, line in plan[:2]:
        assert "ROLE=rollout" in line and "SERVER_TP=8" in line and line.endswith("launch_cluster.sh --ep-size 8")
    for rank, (host, line) in enumerate(plan[2:]):
        assert f"NODE_RANK={rank} " in line and "NNODES=2 " in line and "MASTER_ADDR=t0 " in line, line
        assert "ROLLOUT_URLS=http://r0:31000\\,http://r1:31000 " in line and "NET_IF=ib0 " in line, line
        assert line.endswith("launch_cluster.sh train.steps=2"), line
    out = subprocess.run(["bash", str(SBATCH)], capture_output=True, text=True, env=dict(env, HOSTS="t0 t1 r0"),
                         timeout=60)
    assert out.returncode == 2 and "need 4 nodes, the allocation has 3: sbatch --nodes=4" in out.stderr


def test_script_names_what_is_missing_and_refuses_colocated_rollout_nodes(tmp_path):
    def run(**env):
        base = {k: v for k, v in os.environ.items() if k not in ("VENV", "HF_DIR", "ROLLOUT", "CONFIG", "ROLLOUT_URLS")}
        return subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=dict(base, **env), capture_output=True, text=True,
                              timeout=60)

    out = run(HF_DIR=str(tmp_path))
    assert out.returncode != 0 and "set VENV to the environment to run (CUDA torch" in out.stderr
    out = run(VENV=sys.prefix, HF_DIR=str(tmp_path), ROLLOUT="colocated", ROLE="rollout")
    assert out.returncode == 2 and "ROLLOUT=colocated runs training and its servers together" in out.stderr
    out = run(VENV=sys.prefix, HF_DIR=str(tmp_path), ROLLOUT="shared")
    assert out.returncode == 2 and "ROLLOUT must be separate or colocated, got shared" in out.stderr
    out = run(VENV=sys.prefix, HF_DIR=str(tmp_path), ROLE="trainer")
    assert out.returncode == 2 and "ROLE must be train or rollout, got trainer" in out.stderr


def test_colocated_dry_run_plans_the_example_and_starts_no_servers():
    """ROLLOUT=colocated DRY_RUN=1: the plan and torchrun commands, with rollout.colocate=true and no server wait;
    the printed plan command, run, finds the one-node colocated example fitting 8 H200s (both sides, every phase)."""
    import shlex

    hf = ROOT / "examples/qwen3_30b_a3b/hf_config"
    env = {k: v for k, v in os.environ.items() if k not in ("ROLLOUT_URLS", "NNODES")}
    env.update(DRY_RUN="1", ROLLOUT="colocated", VENV=sys.prefix, HF_DIR=str(hf), GPU_MEMORY_GIB="139",
               CONFIG="examples/qwen3_30b_a3b/colocated.yaml")
    out = subprocess.run(["bash", str(SCRIPT), "train.steps=2"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    plan, train = out.stdout.strip().splitlines()
    assert " -m gspo_megatron.cli plan " in plan and "--gpu-memory-gib 139" in plan
    assert " -m torch.distributed.run " in train and "--nnodes 1 " in train and train.endswith("train.steps=2")
    for line in (plan, train):
        assert "rollout.colocate=true" in line and "rollout.urls= " in line
    assert "--wait-for" not in out.stdout  # no separate servers to wait for
    planned = subprocess.run(shlex.split(plan), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert planned.returncode == 0, planned.stdout[-3000:] + planned.stderr[-2000:]
    assert "colocated: fits" in planned.stdout and "mem_fraction_static 0.3 (at most 0.48 fits)" in planned.stdout

    # Two nodes (each node's leader launches its servers): the same commands with --nnodes 2 / --nodes 2; the
    # two-node example fits 2 x 8 H100s with the trainer's optimizer state on the host between updates.
    env.update(NNODES="2", NODE_RANK="1", MASTER_ADDR="trainer-0", CONFIG="examples/qwen3_30b_a3b/colocated_2nodes.yaml")
    del env["GPU_MEMORY_GIB"]
    out = subprocess.run(["bash", str(SCRIPT)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    plan, train = out.stdout.strip().splitlines()
    assert "--nodes 2 " in plan and "--nnodes 2 --node-rank 1 " in train and "--master-addr trainer-0 " in train
    assert all("rollout.colocate=true" in line for line in (plan, train))
    planned = subprocess.run(shlex.split(plan), cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert planned.returncode == 0, planned.stdout[-3000:] + planned.stderr[-2000:]
    assert "colocated: fits" in planned.stdout and "rollout.colocate_offload=optimizer: 37.73 GiB" in planned.stdout


def test_servers_launched_on_the_training_gpus_are_refused(tmp_path):
    from gspo_megatron.rollout import SGLangConfig
    from gspo_megatron.train.startup.config import ConfigError
    from gspo_megatron.train.sampling.engine import refuse_colocation

    two_servers = SGLangConfig(model_path=str(tmp_path), device="cuda", tp_size=4, num_servers=2)  # GPUs 0-7
    with pytest.raises(ConfigError, match=r"GPUs \[0, 1\], which this node's 2 training ranks use.*"
                                          r"rollout.server_args.first_gpu=2"):
        refuse_colocation(two_servers, trainer_gpus=2)
    refuse_colocation(SGLangConfig(model_path=str(tmp_path), device="cuda", tp_size=4, first_gpu=4), trainer_gpus=4)
    refuse_colocation(SGLangConfig(urls=("http://rollout-0:30000",), device="cuda"), trainer_gpus=8)
    refuse_colocation(SGLangConfig(model_path=str(tmp_path), device="cpu"), trainer_gpus=8)


def test_waiting_for_a_server_that_never_answers_names_it():
    from gspo_megatron.rollout.serve import wait_for

    url = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(SystemExit, match=f"serve: {url} not ready after 2 s \\(--timeout\\): .*refuses connections"):
        wait_for([url], timeout_s=2.0, poll_s=0.2)
    assert time.monotonic() - start < 10


H100_GIB = 81559 / 1024  # what an H100 80 GB reports
SGLANG_STATIC_FRACTION = 0.82  # SGLang 0.5.23's default --mem-fraction-static on it at TP 4-16 (weights + KV cache)


@pytest.mark.parametrize("example", ["qwen3_30b_a3b", "qwen3_235b_a22b"])
def test_documented_rollout_servers_fit_their_gpus(example):
    """Every SERVER_TP in the example's README leaves SGLang at least 5 GiB of KV cache per GPU next to the bf16
    weights (235B at --tp 4 would need 110 GiB per GPU for the weights alone)."""
    from gspo_megatron.model.hf_config import read_hf_config
    from gspo_megatron.plan.memory import model_parameters

    directory = ROOT / "examples" / example
    params, _ = model_parameters(read_hf_config(directory / "hf_config/config.json"))
    sizes = {int(tp) for tp in re.findall(r"SERVER_TP=(\d+)", (directory / "README.md").read_text())}
    assert sizes, f"{example}/README.md documents no server command (SERVER_TP=...)"
    for tp in sizes:
        weights_gib = params * 2 / tp / 2**30
        assert SGLANG_STATIC_FRACTION * H100_GIB - weights_gib >= 5, (example, tp, weights_gib)
