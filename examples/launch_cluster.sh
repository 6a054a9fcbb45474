#!/usr/bin/env bash
# Multi-node GSPO training on H100 nodes with torchrun; SGLang rollout servers on their own nodes or colocated.
#
# On every training node (same command, its own NODE_RANK):
#   CONFIG=examples/qwen3_30b_a3b/train.yaml NNODES=2 NODE_RANK=0 MASTER_ADDR=trainer-0 \
#   HF_DIR=/models/Qwen3-30B-A3B ROLLOUT_URLS=http://rollout-0:30000,http://rollout-0:30001 \
#   bash examples/launch_cluster.sh [section.field=value ...]
#
# ROLLOUT=separate (default): start the servers first on the rollout nodes, one per TP group, e.g.
#   python -m sglang.launch_server --model-path $HF_DIR --tp 4 --host 0.0.0.0 --port 30000 --dtype bfloat16
#   python -m sglang.launch_server --model-path $HF_DIR --tp 4 --host 0.0.0.0 --port 30001 \
#          --base-gpu-id 4 --dtype bfloat16
# and pass them as ROLLOUT_URLS (the trainer talks to each worker directly for weight updates; an
# sglang-router may front them for generation: ROUTER_URL=http://rollout-0:29000).
# ROLLOUT=colocated: node 0 of the training job launches SGLang servers on the training GPUs themselves with
# a static memory fraction (SGLANG_MEM_FRACTION, default 0.2); check with `gspo-megatron plan` that the
# trainer's estimate plus the servers' share fits.
#
# MEGATRON_DIR (optional): a checkpoint from tools/convert_hf_to_megatron.py, for a faster start than
# resharding the HF safetensors on every launch.
set -euo pipefail
: "${CONFIG:?set CONFIG to an example train.yaml}"
: "${HF_DIR:?set HF_DIR to the Hugging Face checkpoint directory}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
ROLLOUT="${ROLLOUT:-separate}"
VENV="${VENV:-.venv}"

overrides=("model.hf_dir=$HF_DIR")
[[ -n "${MEGATRON_DIR:-}" ]] && overrides+=("model.megatron_checkpoint=$MEGATRON_DIR")
case "$ROLLOUT" in
  separate)
    : "${ROLLOUT_URLS:?set ROLLOUT_URLS to the SGLang workers (comma separated)}"
    overrides+=("rollout.urls=$ROLLOUT_URLS")
    [[ -n "${ROUTER_URL:-}" ]] && overrides+=("rollout.server_args={router_url: $ROUTER_URL}")
    ;;
  colocated)
    overrides+=("rollout.server_args={dtype: bfloat16, tp_size: $GPUS_PER_NODE, mem_fraction_static: ${SGLANG_MEM_FRACTION:-0.2}}")
    ;;
  *) echo "ROLLOUT must be separate or colocated, got $ROLLOUT" >&2; exit 2 ;;
esac

# The layout check and memory estimate first: a wrong layout fails here, not after minutes of start-up.
"$VENV/bin/gspo-megatron" plan "$CONFIG" --nodes "$NNODES" --gpus-per-node "$GPUS_PER_NODE" "${overrides[@]}" "$@"

export CUDA_DEVICE_MAX_CONNECTIONS=1   # megatron's TP/SP comm-compute overlap needs one queue
exec "$VENV/bin/torchrun" --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  "$VENV/bin/gspo-megatron" train "$CONFIG" "${overrides[@]}" "$@"
