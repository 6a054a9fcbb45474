#!/usr/bin/env bash
# Multi-node GSPO training with torchrun, and the SGLang rollout servers it attaches to, on their own nodes.
# Run from the repository root; the code run is this checkout's (it leads PYTHONPATH).
#
# 1. On each rollout node (ROLE=rollout): one SGLang server per SERVER_TP GPUs, listening on SERVER_HOST:SERVER_PORT.
#      ROLE=rollout VENV=/envs/gspo HF_DIR=/models/Qwen3-30B-A3B SERVER_TP=4 SERVER_PORT=30000 \
#        bash examples/launch_cluster.sh                             # GPUs 0-3
#      ROLE=rollout VENV=/envs/gspo HF_DIR=/models/Qwen3-30B-A3B SERVER_TP=4 SERVER_PORT=30001 \
#        bash examples/launch_cluster.sh --base-gpu-id 4             # GPUs 4-7
#    Arguments go to sglang.launch_server as they are (--ep-size 8; a server over two nodes: --nnodes 2
#    --node-rank R --dist-init-addr rollout-0:5000). Each server must see the same HF_DIR as the trainers.
#
# 2. On every training node (ROLE=train, the default): the same command, each with its own NODE_RANK.
#      VENV=/envs/gspo CONFIG=examples/qwen3_30b_a3b/train.yaml NNODES=2 NODE_RANK=0 MASTER_ADDR=trainer-0 \
#      NET_IF=ib0 HF_DIR=/models/Qwen3-30B-A3B ROLLOUT_URLS=http://rollout-0:30000,http://rollout-0:30001 \
#        bash examples/launch_cluster.sh [section.field=value ...]
#    `gspo-megatron plan` checks the layout first; then torchrun starts GPUS_PER_NODE ranks per node
#    (static rendezvous at MASTER_ADDR:MASTER_PORT, global rank 0 on NODE_RANK 0). Rank 0 attaches to
#    ROLLOUT_URLS (an sglang-router may front them for generation: ROUTER_URL=http://rollout-0:29000); weights
#    reach every server from each pipeline stage's first rank, through a process group the servers join at that
#    rank's node: its fully qualified name (rollout.weight_sync_address=ADDR for rank 0's node when that name does
#    not resolve from the rollout nodes).
#
# 3. Colocated rollouts (ROLLOUT=colocated): no rollout nodes; each node's local rank 0 launches SGLang on its
#    node's training GPUs (rollout.colocate=true: --enable-memory-saver, the servers release their memory while
#    training and take the new weights as CUDA IPC handles through update_weights_from_tensor, not a process group,
#    which NCCL would refuse with a server rank and a trainer rank on one GPU). The config sizes the servers' share
#    (rollout.server_args.mem_fraction_static, tp_size) and may move the trainer's optimizer state to the host
#    between updates (rollout.colocate_offload=optimizer); `plan` checks both sides in every phase.
#      ROLLOUT=colocated VENV=/envs/gspo CONFIG=examples/qwen3_30b_a3b/colocated.yaml HF_DIR=/models/Qwen3-30B-A3B \
#        bash examples/launch_cluster.sh
#    On several nodes every node runs the same command with its NODE_RANK (as in 2.); rank 0 generates on every
#    node's servers by URL (they listen on their node's address toward MASTER_ADDR, on free ports: node 0 must reach
#    the others over TCP) and each node's leader writes the updates into its own servers from its own copy of the
#    export (parallel.pipeline=1):
#      ROLLOUT=colocated VENV=/envs/gspo CONFIG=examples/qwen3_30b_a3b/colocated_2nodes.yaml NNODES=2 NODE_RANK=0 \
#        MASTER_ADDR=trainer-0 NET_IF=ib0 HF_DIR=/models/Qwen3-30B-A3B bash examples/launch_cluster.sh
#    Not run on GPUs yet (docs/colocation.md): the protocol ran against SGLang's CPU server, on one node and on two
#    ranks acting as two nodes.
#
# Environment (defaults in brackets):
#   VENV           required: the environment to run, with CUDA torch, this package and SGLang
#                  (`pip install -e .[gpu,sglang]`). tools/install.sh's .venv is CPU-only: for CPU tests.
#   HF_DIR         required: the Hugging Face checkpoint directory (the same path on every node).
#   NET_IF         the interface the nodes reach each other on (ib0, bond0, eth0): NCCL_SOCKET_IFNAME and
#                  GLOO_SOCKET_IFNAME. Unset, each library picks one itself, which may be a docker or
#                  link-local interface the other nodes cannot reach (a hang at the first collective).
#   IB_HCA         InfiniBand adapters for NCCL (NCCL_IB_HCA, e.g. mlx5_0,mlx5_1); unset: NCCL finds them.
#                  Any other NCCL_* variable set by the caller (NCCL_IB_GID_INDEX for RoCE, NCCL_IB_DISABLE=1 on
#                  Ethernet-only clusters, NCCL_DEBUG=INFO) passes through unchanged.
#   ROLE=train:    CONFIG (required), NNODES [1], NODE_RANK [0], GPUS_PER_NODE [8] (ranks per node),
#                  MASTER_ADDR [127.0.0.1], MASTER_PORT [29500], ROLLOUT_URLS (required), ROUTER_URL,
#                  SERVER_WAIT_S [900] (how long to wait for the servers to answer before starting),
#                  MEGATRON_DIR (a checkpoint of tools/convert_hf_to_megatron.py: a faster start than resharding
#                  the safetensors at every launch).
#   ROLLOUT        separate [default]: servers started with ROLE=rollout, attached through ROLLOUT_URLS;
#                  colocated: on the training GPUs (3. above; ROLLOUT_URLS unused).
#   DRY_RUN=1      print the commands (plan, torchrun) instead of running them.
#   GPU_MEMORY_GIB what `plan` checks against (its default: an H100's 79.1; 139 for an H200).
#   ROLE=rollout:  SERVER_TP [8] (GPUs per server), SERVER_HOST [0.0.0.0], SERVER_PORT [30000], DTYPE [bfloat16],
#                  DEVICE [cuda] (cpu: SGLang's CPU backend with this repo's stand-ins, for tests).
# Set here for the training ranks (not the servers, which manage their memory and streams themselves):
#   PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True  (unless set) rollouts of every length reshape the activations
#                  each step; expandable segments keep the caching allocator's fragmentation from growing into an OOM.
#   CUDA_DEVICE_MAX_CONNECTIONS=1  megatron's TP/SP communication overlap relies on kernels running in the order
#                  they are issued (one hardware queue).
set -euo pipefail
VENV_HELP="set VENV to the environment to run (CUDA torch + this package + SGLang: pip install -e .[gpu,sglang]);"
: "${VENV:?$VENV_HELP tools/install.sh builds a CPU-only .venv, for CPU tests}"
: "${HF_DIR:?set HF_DIR to the Hugging Face checkpoint directory}"
ROLE="${ROLE:-train}"
ROLLOUT="${ROLLOUT:-separate}"
case "$ROLLOUT" in
  separate) ;;
  colocated)
    if [[ "$ROLE" != train ]]; then
      echo "ROLLOUT=colocated runs training and its servers together (ROLE=train; got ROLE=$ROLE): each training" \
           "node's local rank 0 launches that node's servers. Separate servers: ROLE=rollout with ROLLOUT=separate" >&2
      exit 2
    fi ;;
  *) echo "ROLLOUT must be separate or colocated, got $ROLLOUT" >&2; exit 2 ;;
esac
# DRY_RUN=1: say what would run (one line per command), run nothing
run() { if [[ "${DRY_RUN:-0}" == 1 ]]; then printf '%q ' "$@"; echo; else "$@"; fi; }
launch() { if [[ "${DRY_RUN:-0}" == 1 ]]; then run "$@"; else exec "$@"; fi; }

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
if [[ -n "${NET_IF:-}" ]]; then
  export NCCL_SOCKET_IFNAME="$NET_IF" GLOO_SOCKET_IFNAME="$NET_IF"
fi
if [[ -n "${IB_HCA:-}" ]]; then
  export NCCL_IB_HCA="$IB_HCA"
fi
PYTHON="$VENV/bin/python"

case "$ROLE" in
  rollout)
    exec "$PYTHON" -m gspo_megatron.rollout.serve --model-path "$HF_DIR" --host "${SERVER_HOST:-0.0.0.0}" \
      --port "${SERVER_PORT:-30000}" --tp-size "${SERVER_TP:-8}" --dtype "${DTYPE:-bfloat16}" \
      --device "${DEVICE:-cuda}" "$@"
    ;;
  train) ;;
  *) echo "ROLE must be train or rollout, got $ROLE" >&2; exit 2 ;;
esac

: "${CONFIG:?set CONFIG to an example train.yaml}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
if [[ "$ROLLOUT" == colocated ]]; then
  overrides=("model.hf_dir=$HF_DIR" "rollout.colocate=true" "rollout.urls=")
else
  : "${ROLLOUT_URLS:?set ROLLOUT_URLS to the SGLang servers (comma separated), started with ROLE=rollout}"
  overrides=("model.hf_dir=$HF_DIR" "rollout.urls=$ROLLOUT_URLS")
fi
if [[ -n "${MEGATRON_DIR:-}" ]]; then overrides+=("model.megatron_checkpoint=$MEGATRON_DIR"); fi
if [[ -n "${ROUTER_URL:-}" ]]; then overrides+=("rollout.server_args={router_url: $ROUTER_URL}"); fi

export PYTORCH_CUDA_ALLOC_CONF="${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}"
export CUDA_DEVICE_MAX_CONNECTIONS=1

# The layout check and memory estimate first: a wrong layout fails here, not after minutes of start-up.
run "$PYTHON" -m gspo_megatron.cli plan "$CONFIG" --nodes "$NNODES" --gpus-per-node "$GPUS_PER_NODE" "${overrides[@]}" \
  ${GPU_MEMORY_GIB:+--gpu-memory-gib "$GPU_MEMORY_GIB"} "$@"
if [[ "$ROLLOUT" == separate ]]; then
  # Servers started in the same job may still be loading their weights: wait until each generates.
  run "$PYTHON" -m gspo_megatron.rollout.serve --wait-for "$ROLLOUT_URLS" --timeout "${SERVER_WAIT_S:-900}"
fi

launch "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --nproc-per-node "$GPUS_PER_NODE" --master-addr "${MASTER_ADDR:-127.0.0.1}" --master-port "${MASTER_PORT:-29500}" \
  -m gspo_megatron.cli train "$CONFIG" "${overrides[@]}" "$@"
