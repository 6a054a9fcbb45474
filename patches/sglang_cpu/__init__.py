"""sglang 0.5.23 serving on CPU: two stand-in modules and four patches on the *server's* PYTHONPATH (never the
trainer's).

Measured in shared/notes/sglang-on-cpu.md. ``python -m sglang.launch_server --device cpu`` (torch_native attention,
pytorch sampling) needs, in the CPU environment ``tools/install.sh`` builds:

- ``vllm._custom_ops.rotary_embedding``: SGLang's rotary embedding takes it from vLLM when neither CUDA nor its own
  CPU engine (``SGLANG_USE_CPU_ENGINE=1``, whose sgl-kernel CPU build is not on PyPI) is in use. The stand-in is a
  pure-torch version of the same in-place op (``site/vllm/_custom_ops.py``).
- ``torchvision``: imported at start-up by SGLang's multimodal configs even for text models, and PyPI's wheels do
  not load beside CPU torch 2.13. The stand-in binds the imported names and raises if any is called.

- ``sitecustomize`` (``site/_gspo_batched_decode.py``): not a stand-in but a speed patch. The ``torch_native``
  backend's decode attention loops over the running requests in Python, one SDPA call per request and layer; the
  patch attends every request in one masked SDPA call when sglang imports that backend (34% of a 115M MoE server's
  forward was that loop; 64 x 128-token rollouts 25.8 s -> ~19.6 s, bench/RESULTS.md). Only for sglang 0.5.23.
- ``sitecustomize`` (``site/_gspo_fork_children.py``): a speed patch too. The server's scheduler and detokenizer
  processes are forked from the launcher, which has imported what they run, instead of spawned (each import of
  sglang, torch and transformers again): a tiny model's server is healthy after 12.1 s and 9.9 CPU-seconds instead of
  18.6 s and 23.1 (``bench/server_start.py``). ``GSPO_SGLANG_START_METHOD=spawn`` restores SGLang's choice.
- ``sitecustomize`` (``site/_gspo_cpu_host_alloc.py``): host buffers on a CPU device unpinned. Without it a server
  started with ``--enable-return-routed-experts`` (rollout routing replay) dies at start-up: the routed-experts
  capture's host cache is pinned and cudaHostRegistered ("Torch not compiled with CUDA enabled").

- ``sitecustomize`` (``site/_gspo_gated_deltanet.py``): pure-torch stand-ins for the Triton kernels of the
  gated-DeltaNet hybrids (Qwen3.5, Qwen3-Next): the causal convolution, the gates, the chunked and recurrent delta
  rules, the gated norms, the projection splits and the sigmoid gates, bound where sglang defines each (its GDN
  backend takes the Triton path off ``SGLANG_USE_CPU_ENGINE``), so that a CPU server serves those families.
- ``sitecustomize`` (``site/_gspo_fp8_block.py``): block-FP8 linear and expert layers (FP8 rollouts) through a torch
  stand-in of SGLang's W8A8 block GEMM, which SGLang runs on GPUs or AMX CPUs only; the same numbers, not the speed.

The stand-ins refuse any sglang other than 0.5.23 when imported. ``server_env`` adds them only when no CUDA device is
present; on GPUs SGLang is installed normally with its real dependencies and nothing here applies.
"""

from __future__ import annotations

import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

SUPPORTED_VERSION = "0.5.23"
SITE = Path(__file__).resolve().parent / "site"


class UnsupportedSGLang(RuntimeError):
    """The installed sglang is not the version these stand-ins were written and tested for."""


def installed_version() -> str | None:
    try:
        return version("sglang")
    except PackageNotFoundError:
        return None


def check_version() -> str:
    """The installed sglang version; raises ``UnsupportedSGLang`` unless it is 0.5.23."""
    found = installed_version()
    if found is None:
        raise UnsupportedSGLang(
            "sglang is not installed in this environment: run `bash tools/install.sh` (CPU) or "
            "`pip install -e .[sglang]` (GPU)"
        )
    if found != SUPPORTED_VERSION:
        raise UnsupportedSGLang(
            f"patches.sglang_cpu supports sglang=={SUPPORTED_VERSION} on CPU, found {found}: install "
            f"sglang=={SUPPORTED_VERSION} (tools/install.sh) or check and update the stand-ins in {SITE}"
        )
    return found


def needed(device: str) -> bool:
    """True when a server on ``device`` needs the stand-ins: CPU serving in the CPU environment."""
    return device == "cpu"


def server_env(env: dict[str, str], device: str) -> dict[str, str]:
    """A copy of ``env`` for launching an SGLang server on ``device``: on CPU, the stand-ins lead PYTHONPATH."""
    env = dict(env)
    if not needed(device):
        return env
    check_version()
    parts = [str(SITE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(parts)
    return env
