#!/usr/bin/env bash
# What bench/gpu_check.sh needs on a GPU machine that has torch, Triton, transformers and pytest but no
# megatron-core and no network (the lent H200: Python 3.12): megatron-core's wheel, downloaded here into .whl/
# (git-ignored through .git/info/exclude), to carry with the device tool's `carry: [".whl"]`.
#   MCORE=0.19.2 bash bench/gpu_wheels.sh     # another megatron-core (default 0.16.1)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
MCORE="${MCORE:-0.16.1}"
PY="${PY_VERSION:-3.12}"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir .whl
PLATFORMS=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do
  PLATFORMS+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PY" --implementation cp "${PLATFORMS[@]}" \
  -d .whl "megatron-core==$MCORE"
ls -l .whl
