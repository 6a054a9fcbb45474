#!/usr/bin/env bash
# Build the complete CPU environment for gspo-megatron in .venv/ (or $VENV): torch (CPU), megatron-core 0.16.1,
# transformers, SGLang (CPU serving, see below), the test tools, and this package in editable mode; then the
# megatron-core 0.19 environment in .venv312/ (Python 3.12, see the end of this file).
#
# Idempotent: a stamp in each environment records what was installed; a second run with nothing to do checks
# the stamps and the imports and finishes in seconds.
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
MEGATRON="megatron-core==0.16.1"   # the last release for Python 3.11
# Also installed in .venv312, beside megatron-core 0.19.2.
PACKAGES=(
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
  "pyarrow"           # data.prompts in parquet
  "datasets"          # data.prompts as a Hugging Face datasets dir (load_from_disk)
  "math-verify[antlr4_13_2]==0.9.0"  # the math reward (rewards/math_answer.py): pure Python, ~5 MB with its LaTeX parser
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
WANT="$(printf '%s\n' "$TORCH" "$MEGATRON" "${PACKAGES[@]}" "${SGLANG_DEPS[@]}" "${SGLANG_NO_DEPS[@]}" "$SGLANG_ROUTER" | sha256sum | cut -d' ' -f1) $(sha256sum "$ROOT/setup.py" | cut -d' ' -f1)"
# sglang is only looked up (importing it takes ~10 CPU-seconds): it runs in the server processes, not here.
CHECK='import torch, megatron.core, transformers, gspo_megatron, patches, importlib.util as u, importlib.metadata as m
assert u.find_spec("sglang_router") and m.version("sglang") == "0.5.23"'

build_main() {
  echo "install.sh: building $VENV"
  [[ -x "$VENV/bin/python" ]] || "$PYTHON" -m venv "$VENV"
  local pip=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
  # torch first and alone: with torch 2.13.0 (CPU) in place, nothing later can pull a CUDA build.
  "${pip[@]}" install "$TORCH"
  # One resolver run for our packages and SGLang's CPU dependencies, with torch held at what is installed, so
  # pip can neither replace torch nor pick a transformers/tokenizers that the other list rejects.
  local torch_installed
  torch_installed="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)')"
  "${pip[@]}" install "torch==$torch_installed" "$MEGATRON" "${PACKAGES[@]}" "${SGLANG_DEPS[@]}" "$SGLANG_ROUTER"
  "${pip[@]}" install --no-deps "${SGLANG_NO_DEPS[@]}"
  "${pip[@]}" install --no-deps -e "$ROOT"
  "$VENV/bin/python" - <<'PY'
import gspo_megatron  # noqa: F401  (first: it quiets megatron-core's import-time TE/apex warnings)
import torch, megatron.core, transformers, sglang, sglang_router, patches  # noqa: F401
from importlib.metadata import version
assert torch.__version__.startswith("2.13.0"), f"pip replaced torch 2.13.0 with {torch.__version__}"
assert transformers.__version__ == "5.19.0", f"pip replaced transformers 5.19.0 with {transformers.__version__}"
print("install.sh: torch", torch.__version__, "| megatron-core", megatron.core.__version__,
      "| transformers", transformers.__version__, "| sglang", version("sglang"), "| sglang-router",
      version("sglang-router"))
PY
  echo "$WANT" > "$STAMP"
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && "$VENV/bin/python" -c "$CHECK" 2>/dev/null; then
  echo "install.sh: $VENV is up to date"
else
  build_main
fi

# --------------------------------------------------------------------------------------------------------------
# The megatron-core 0.19 environment, .venv312/ (or $VENV312): Python 3.12, torch 2.14.1, megatron-core 0.19.2,
# the packages above, no SGLang. Every megatron-core release after 0.16.1 requires Python >= 3.12, and that is
# what clusters run; tests/test_megatron_019.py runs the Megatron-side tests in it. PyPI has no CPU build of torch
# for it, so it gets PyPI's CUDA build, which runs on CPU: 5.7 GB installed (3.2 GB of nvidia-* libraries),
# 2-4 min to build, and ~420 MB more resident memory per process than CPU torch.
VENV312="${VENV312:-$ROOT/.venv312}"
TORCH312="torch==2.14.1"
MEGATRON312="megatron-core==0.19.2"
# torch 2.14.1's CUDA build pins its own triton: the 3.11 environment's triton pin is not for this one.
PACKAGES312=()
for package in "${PACKAGES[@]}"; do [[ $package == triton* ]] || PACKAGES312+=("$package"); done
STAMP312="$VENV312/.gspo-megatron-install"
WANT312="$(printf '%s\n' "$TORCH312" "$MEGATRON312" "${PACKAGES312[@]}" | sha256sum | cut -d' ' -f1) $(sha256sum "$ROOT/setup.py" | cut -d' ' -f1)"
CHECK312='import torch, transformers, gspo_megatron, patches, importlib.metadata as m
assert m.version("megatron-core") == "0.19.2"'

# $PYTHON312, else pyenv's newest 3.12, else python3.12 on PATH (a pyenv shim counts only if it runs).
find_python312() {
  local candidate
  for candidate in "${PYTHON312:-}" \
      $(ls -d "$(pyenv root 2>/dev/null || echo /nonexistent)"/versions/3.12*/bin/python 2>/dev/null | sort -V -r) \
      "$(command -v python3.12 || true)"; do
    if [[ -n "$candidate" ]] && "$candidate" -c 'import sys; assert sys.version_info[:2] == (3, 12)' 2>/dev/null; then
      echo "$candidate"
      return 0
    fi
  done
  return 1
}

build_312() {
  echo "install.sh: building $VENV312 with $1 (megatron-core 0.19.2, PyPI's torch: ~5.7 GB)"
  [[ -x "$VENV312/bin/python" ]] || "$1" -m venv "$VENV312"
  local pip=("$VENV312/bin/python" -m pip --disable-pip-version-check -q)
  "${pip[@]}" install "$TORCH312"
  "${pip[@]}" install "$TORCH312" "$MEGATRON312" "${PACKAGES312[@]}"
  "${pip[@]}" install --no-deps -e "$ROOT"
  "$VENV312/bin/python" -W ignore - <<'PY'
import torch, transformers, patches, gspo_megatron  # noqa: F401
from importlib.metadata import version
assert transformers.__version__ == "5.19.0", f"pip replaced transformers 5.19.0 with {transformers.__version__}"
print("install.sh: torch", torch.__version__, "| megatron-core", version("megatron-core"),
      "| transformers", transformers.__version__, "(the megatron-core 0.19 environment)")
PY
  echo "$WANT312" > "$STAMP312"
}

if [[ -f "$STAMP312" && "$(cat "$STAMP312")" == "$WANT312" ]] && "$VENV312/bin/python" -c "$CHECK312" 2>/dev/null; then
  echo "install.sh: $VENV312 is up to date"
elif PYTHON312_FOUND="$(find_python312)"; then
  build_312 "$PYTHON312_FOUND"
else
  cat >&2 <<EOF
install.sh: ##########################################################################################
install.sh: NO PYTHON 3.12 FOUND (tried \$PYTHON312, \$(pyenv root)/versions/3.12*, python3.12 on PATH).
install.sh: $VENV312 is NOT built, so the tests will NOT run on megatron-core 0.19:
install.sh: tests/test_megatron_019.py skips (under CI=true it fails). Install Python 3.12 and rerun.
install.sh: ##########################################################################################
EOF
fi
