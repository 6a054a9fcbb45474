#!/usr/bin/env bash
# The wheels bench/gpu_check.sh needs on the lent H200, downloaded here into .whl/ (git-ignored) for the device
# tool's `carry: [".whl"]`. That machine has no network; its image (Python 3.12.3, torch 2.11.0 CUDA 13.0,
# triton 3.6.0, transformers 5.17.0, pytest, numpy, packaging, psutil, safetensors, pyyaml, tqdm, matplotlib,
# pyarrow: /work/.library/device/KINDS.md) lacks megatron-core and flash-linear-attention among what the GPU path
# imports (TransformerEngine and SGLang are absent too; the check runs megatron's local layers and the local engine).
# megatron-core 0.19.2 needs torch, numpy and packaging>=24.2, all there.
#   bash bench/gpu_wheels.sh                 # megatron-core 0.19.2, cp312; flash-linear-attention 0.6.0
#   MCORE=0.19.2 PY_VERSION=3.12 bash bench/gpu_wheels.sh
# Fails when the wheels and the checkout together exceed what the device tool carries (64 MiB).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MCORE="${MCORE:-0.19.2}"
PY="${PY_VERSION:-3.12}"
FLA="${FLA:-0.6.0}"
BUDGET=$((64 * 1024 * 1024))
git check-ignore -q .whl/x.whl || { echo "gpu_wheels: .whl/ is not git-ignored (.gitignore)" >&2; exit 1; }
rm -rf .whl && mkdir .whl
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64; do
  PLATFORMS+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp "${PLATFORMS[@]}" \
  -d .whl "megatron-core==$MCORE"
# flash-linear-attention's Triton kernels for the gated-DeltaNet hybrids (megatron's GatedDeltaNet imports them on
# CUDA: tests/gpu/test_gpu_deltanet.py); pure Python, ~1.5 MB; its einops and transformers are in the image.
python3 -m pip download -q --no-deps --only-binary=:all: -d .whl "flash-linear-attention==$FLA" "fla-core==$FLA"
# What travels besides the wheels: tracked files and untracked ones git does not ignore (the device tool's rule).
checkout=$( (git ls-files -z; git ls-files -z -o --exclude-standard) | xargs -0 stat -c %s 2>/dev/null \
  | awk '{s += $1} END {print s + 0}')
wheels=0
for w in .whl/*.whl; do
  size=$(stat -c %s "$w")
  wheels=$((wheels + size))
  printf '%10.2f MiB  %s\n' "$(echo "$size / 1048576" | bc -l)" "$(basename "$w")"
done
total=$((checkout + wheels))
printf '%10.2f MiB  wheels\n%10.2f MiB  checkout\n%10.2f MiB  total (limit %d MiB)\n' \
  "$(echo "$wheels / 1048576" | bc -l)" "$(echo "$checkout / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)" \
  $((BUDGET / 1048576))
if (( total > BUDGET )); then
  echo "gpu_wheels: $total bytes would travel, over the device tool's $BUDGET" >&2
  exit 1
fi
