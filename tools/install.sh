#!/usr/bin/env bash
# Build the complete CPU environment for gspo-megatron in .venv/ (or $VENV): torch (CPU), megatron-core,
# transformers, SGLang (CPU serving, see below), the test tools, and this package in editable mode.
#
# Idempotent: a stamp records what was installed; a second run with nothing to do checks the stamp and the
# imports and finishes in seconds.
#
# SGLang on CPU (measured in shared/notes/sglang-on-cpu.md): `pip install sglang==0.5.23` would pull CUDA
# torch 2.14.1 and ~200 CUDA packages (11 GB). Instead its non-CUDA dependencies are listed here explicitly and
# sglang itself is installed with --no-deps beside CPU torch 2.13.0. Two stand-in modules it needs on CPU live
# in patches/sglang_cpu/ and are put on the server's PYTHONPATH by gspo_megatron.rollout only on CPU.
# On a GPU machine install SGLang normally instead (`pip install -e .[sglang]`); no stand-in applies there.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3

# Pinned where the code depends on the exact version (patches/ checks megatron-core's and sglang's; SGLang
# 0.5.23 pins transformers 5.19.0 and tokenizers 0.23.x, so we use the same here).
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
  "triton==3.9.0"     # tests/ops/test_triton_backend.py runs the CUDA kernels under TRITON_INTERPRET=1 (xgrammar pulls the same)
  "matplotlib"        # the trainer's PNG plots
  "tqdm"              # the trainer's progress bar
)
# sglang 0.5.23's dependencies that do not need CUDA (the list measured to serve on CPU). Not in it on purpose:
# torch (CPU 2.13.0 above), torchvision (PyPI's breaks beside CPU torch 2.13: patches/sglang_cpu stands in), timm (below),
# flashinfer, sglang-kernel, cuda-python, nvidia-* and the other CUDA-only pins.
SGLANG_DEPS=(
  aiohttp anthropic "blobfile==3.0.0" build "compressed-tensors==0.18.0" datasets distro easydict einops
  fastapi gguf interegular IPython "llguidance>=1.7.6,<2" "mistral_common>=1.11.5" modelscope msgspec ninja
  "numba==0.65.1" numpy "openai==2.8.0" "openai-harmony==0.0.4" orjson "outlines==0.1.11" packaging
  partial_json_parser pillow prometheus-client psutil pybase64 pydantic python-dateutil python-multipart
  "pyzmq>=25.1.2" regex requests scipy "sentencepiece==0.2.1" setproctitle "smg-grpc-servicer>=0.9.0"
  "soundfile==0.13.1" tiktoken "tokenizers==0.23.2" "transformers==5.19.0" "uvicorn>=0.51"
  uvloop watchfiles "xgrammar==0.2.7" xxhash zstandard "apache-tvm-ffi==0.1.11"
)
# Installed with --no-deps: sglang's own requirements pull CUDA torch, and timm's pull PyPI's torchvision, which
# does not load beside CPU torch (timm's other requirements, pyyaml, huggingface_hub and safetensors, are in).
SGLANG_NO_DEPS=("sglang==0.5.23" "timm==1.0.25")
SGLANG_ROUTER="sglang-router==0.3.2"   # Rust binary, light dependencies, runs on CPU

STAMP="$VENV/.gspo-megatron-install"
WANT="$(printf '%s\n' "$TORCH" "${PACKAGES[@]}" "${SGLANG_DEPS[@]}" "${SGLANG_NO_DEPS[@]}" "$SGLANG_ROUTER" | sha256sum | cut -d' ' -f1) $(sha256sum "$ROOT/setup.py" | cut -d' ' -f1)"
# sglang is only looked up (importing it takes ~10 CPU-seconds): it runs in the server processes, not here.
CHECK='import torch, megatron.core, transformers, gspo_megatron, patches, importlib.util as u, importlib.metadata as m
assert u.find_spec("sglang_router") and m.version("sglang") == "0.5.23"'

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && "$VENV/bin/python" -c "$CHECK" 2>/dev/null; then
  echo "install.sh: $VENV is up to date"
  exit 0
fi

echo "install.sh: building $VENV"
[[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# torch first and alone: with torch 2.13.0 (CPU) in place, nothing later can pull a CUDA build.
"${PIP[@]}" install "$TORCH"
# One resolver run for our packages and SGLang's CPU dependencies, with torch held at what is installed, so
# pip can neither replace torch nor pick a transformers/tokenizers that the other list rejects.
TORCH_INSTALLED="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
"${PIP[@]}" install "torch==$TORCH_INSTALLED" "${PACKAGES[@]}" "${SGLANG_DEPS[@]}" "$SGLANG_ROUTER"
"${PIP[@]}" install --no-deps "${SGLANG_NO_DEPS[@]}"
"${PIP[@]}" install --no-deps -e "$ROOT"
"$VENV/bin/python" - <<'PY'
import torch, megatron.core, transformers, sglang, sglang_router, patches, gspo_megatron  # noqa: F401
from importlib.metadata import version
assert torch.__version__.startswith("2.13.0"), f"pip replaced torch 2.13.0 with {torch.__version__}"
assert transformers.__version__ == "5.19.0", f"pip replaced transformers 5.19.0 with {transformers.__version__}"
print("install.sh: torch", torch.__version__, "| megatron-core", megatron.core.__version__,
      "| transformers", transformers.__version__, "| sglang", version("sglang"), "| sglang-router",
      version("sglang-router"))
PY
echo "$WANT" > "$STAMP"
