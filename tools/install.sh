#!/usr/bin/env bash
# Build the complete CPU environment for gspo-megatron in .venv/ (or $VENV): torch (CPU), megatron-core,
# transformers, the test tools, and this package in editable mode.
#
# Idempotent: a stamp records what was installed; a second run with nothing to do checks the stamp and the
# imports and finishes in seconds.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3

# Pinned where the code depends on the exact version (patches/ checks megatron-core's; SGLang 0.5.23, added
# by the rollout work, pins transformers 5.19.0 and tokenizers 0.23.x, so we use the same here).
TORCH="torch==2.13.0"
PACKAGES=(
  "megatron-core==0.16.1"
  "psutil"            # the torch_dist checkpoint writer needs it; megatron-core does not declare it
  "numpy"
  "transformers==5.19.0"
  "tokenizers>=0.23,<0.24"
  "safetensors"
  "pyyaml"
  "pytest"
)

STAMP="$VENV/.gspo-megatron-install"
WANT="$(printf '%s\n' "$TORCH" "${PACKAGES[@]}" | sha256sum | cut -d' ' -f1) $(sha256sum "$ROOT/setup.py" | cut -d' ' -f1)"

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] &&
   "$VENV/bin/python" -c "import torch, megatron.core, transformers, gspo_megatron, patches" 2>/dev/null; then
  echo "install.sh: $VENV is up to date"
  exit 0
fi

echo "install.sh: building $VENV"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# torch first and alone: with torch 2.13.0 (CPU) in place, nothing later can pull a CUDA build.
"${PIP[@]}" install "$TORCH"
"${PIP[@]}" install "${PACKAGES[@]}"
"${PIP[@]}" install --no-deps -e "$ROOT"
"$VENV/bin/python" -c "import torch, megatron.core, transformers, gspo_megatron, patches; print('install.sh: torch', torch.__version__, '| megatron-core', megatron.core.__version__, '| transformers', transformers.__version__)"
echo "$WANT" > "$STAMP"
