#!/usr/bin/env bash
# The GPU paths, proven in one short call on a CUDA machine (the device tool's H200: at most 8 minutes).
#
# Here first:   bash bench/gpu_wheels.sh        (megatron-core's wheel into .whl/)
# Then there:   bash bench/gpu_check.sh         (device tool: carry [".whl"], timeout_s 540)
#
# It installs the carried wheels (no network there), prints the machine, then runs tests/gpu/ (skipped on machines
# without CUDA): the update step and the log-prob pass on the GPU equal to the CPU's on the same weights and batch,
# every parameter and batch on the device (megatron's CPU-created router weights included), bf16 with the
# non-distributed optimizer, `score` against transformers, the trainer for two steps on NCCL, the triton log-prob
# backend in bf16 against float64 (tests/gpu/test_logprob_kernel.py) and, where TransformerEngine is installed, the
# grouped-GEMM experts' step against SequentialMLP's and TE's fused permutation and RoPE against the unfused step, and
# colocation's trainer side (tests/gpu/test_colocate_ipc.py: the bucketed export's CUDA IPC handles opened by a second
# process, the optimizer state offloaded and regained per torch.cuda.memory_reserved; written in a session without a
# GPU, not run yet; SGLang's side of colocation is not on the check machine at all). Then bench/logprob_gpu.py: the triton backend against naive
# bf16 logits + log_softmax at T=8192, H=2048, V=151936 (time, peak memory, TFLOP/s against a GEMM peak measured
# in the same run). What it printed goes into bench/RESULTS.md. Without TransformerEngine, megatron-core 0.16.1's
# router needs patches/megatron_no_te on the GPU too: the model provider applies it to every build without TE.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
LOG_DIR="${OUT:-/tmp/gpu_check}"
mkdir -p "$LOG_DIR"
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "gpu_check: installing the carried wheels failed" >&2; exit 1; }
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 - <<'PY' || exit 1
import torch, transformers
import megatron.core
print(f"python {__import__('sys').version.split()[0]} | torch {torch.__version__} (CUDA {torch.version.cuda}) | "
      f"megatron-core {megatron.core.__version__} | transformers {transformers.__version__} | "
      f"cuda available: {torch.cuda.is_available()}")
assert torch.cuda.is_available(), "gpu_check: torch sees no GPU"
PY
start=$SECONDS
timeout 370 python3 -m pytest tests/gpu -q -rA -p no:cacheprovider 2>&1 | tee "$LOG_DIR/gpu_check.log"
rc=${PIPESTATUS[0]}
echo "gpu_check: pytest exit $rc after $((SECONDS - start)) s"
start=$SECONDS
timeout 100 python3 bench/logprob_gpu.py --json "$LOG_DIR/logprob_gpu.json" 2>&1 | tee "$LOG_DIR/logprob_gpu.log"
bench=${PIPESTATUS[0]}
echo "gpu_check: bench/logprob_gpu.py exit $bench after $((SECONDS - start)) s"
[[ $rc -ne 0 ]] && exit "$rc"
exit "$bench"
