"""The machine this process runs on: where the model and its batches live, and whether the installed stack fits.

- ``device()`` is the one place that decides the device: this rank's GPU under CUDA, else the CPU. The model
  provider moves models there; ``to_device`` moves batches there; results come back with ``.cpu()``.
- ``check_torch_fits_machine()`` refuses a CPU-only torch (or a CUDA torch that sees no GPU) on a machine that
  has NVIDIA GPUs: such a run would train on the CPU, silently and a thousand times slower.
- ``transformer_engine_available()`` falls back to megatron's local spec only where that is right (TE is not
  installed, or this machine has no CUDA, where TE cannot import at all); a TE that is installed but fails to
  import on a CUDA machine is a broken install and stops the run with its import error.
- megatron-core warns four times on import that TE and apex are missing; ``note_fallbacks`` says it once, in our
  words, when a model is built (the package's ``__init__`` silences megatron's copies).
"""

from __future__ import annotations

import glob
import importlib.util
import os
import sys
from pathlib import Path

import torch

ALLOW_CPU_ENV = "GSPO_MEGATRON_ALLOW_CPU"


class EnvironmentMismatch(RuntimeError):
    """The installed packages do not fit this machine; the message says what to install or set."""


def device() -> torch.device:
    """Where models and batches live: ``cuda:<current device>`` under CUDA (torchrun's LOCAL_RANK, set by
    ``parallel.groups.init_distributed``), else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def to_device(batch: dict, target: torch.device) -> dict:
    """``batch``'s tensors on ``target``; other values as they are. To a GPU through pinned host memory with a
    non-blocking copy (the stream orders it before the kernels that read it)."""
    target = torch.device(target)
    gpu = target.type == "cuda"

    def move(value):
        if not torch.is_tensor(value) or value.device == target:
            return value
        if gpu and value.device.type == "cpu":
            return value.pin_memory().to(target, non_blocking=True)
        return value.to(target)

    return {key: move(value) for key, value in batch.items()}


def gpus_on_this_machine(root: str | Path = "/") -> int:
    """NVIDIA GPUs the driver exposes, whatever torch was built for (``/proc/driver/nvidia/gpus``, else
    ``/dev/nvidiaN``)."""
    root = Path(root)
    gpus = glob.glob(str(root / "proc/driver/nvidia/gpus/*"))
    if not gpus:
        gpus = [p for p in glob.glob(str(root / "dev/nvidia*")) if p[len(str(root / "dev/nvidia")):].isdigit()]
    return len(gpus)


def check_torch_fits_machine(root: str | Path = "/") -> None:
    """Raise ``EnvironmentMismatch`` if this machine has NVIDIA GPUs that torch cannot use.

    ``CUDA_VISIBLE_DEVICES=""`` (GPUs hidden on purpose) and ``GSPO_MEGATRON_ALLOW_CPU=1`` allow a CPU run.
    """
    if torch.cuda.is_available() or os.environ.get(ALLOW_CPU_ENV) == "1" or os.environ.get("CUDA_VISIBLE_DEVICES") == "":
        return
    count = gpus_on_this_machine(root)
    if not count:
        return
    if torch.version.cuda is None:
        why = (f"torch {torch.__version__} is a CPU-only build (tools/install.sh builds such an environment for "
               "development machines): install a CUDA build of torch, then `pip install -e .[gpu]`")
    else:
        why = (f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees none of them "
               "(torch.cuda.is_available() is False): check the driver version and CUDA_VISIBLE_DEVICES")
    raise EnvironmentMismatch(f"this machine has {count} NVIDIA GPU(s) but {why}. Set {ALLOW_CPU_ENV}=1 to run on "
                              "the CPU anyway.")


def transformer_engine_available() -> bool:
    """Whether TransformerEngine's PyTorch layers import (then models use TE's layer specs)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception as error:  # TE raises OSError / RuntimeError (missing libcuda, NCCL) as well as ImportError
        if torch.cuda.is_available():
            raise EnvironmentMismatch(
                f"transformer_engine is installed but does not import on this CUDA machine ({type(error).__name__}: "
                f"{error}); fix the install (a TE build matching this torch and CUDA) or uninstall it to run "
                "megatron's local layers"
            ) from error
        return False  # no CUDA: TE cannot import here at all, megatron's local layers are the right fallback
    return True


_noted = False


def note_fallbacks() -> None:
    """Once per job (rank 0), when TransformerEngine is not used: what megatron-core falls back to."""
    global _noted
    if _noted or transformer_engine_available():
        return
    _noted = True
    if os.environ.get("RANK", "0") == "0":
        where = "GPU" if torch.cuda.is_available() else "CPU"
        print(f"gspo-megatron: TransformerEngine is not installed, so on this {where} megatron-core runs its local "
              "layers (no context parallelism) and torch's optimizers and norms.", file=sys.stderr)


# Third-party start-up noise that says nothing a user can act on: (message prefix, category). The first two are
# megatron-core's on a machine without Apex / with its own deprecated default (note_fallbacks says the one useful
# thing once); the next two are torch's checkpoint reader's on every resume; the next two, torch's on megatron-core's
# gradient buffers' all-gather and (distributed optimizer, sequence parallelism) reduce-scatter, once per rank at the
# first update of a data-parallel run; the last, torch's when megatron-core's distributed optimizer zeroes the grads of
# its shards, views of its buffer, not leaf tensors (parallel.distributed_optimizer, the default), once per rank
# (no commas or colons: they travel in PYTHONWARNINGS).
KNOWN_NOISE = (
    ("Apex is not installed", "UserWarning"),
    ("full scope is deprecated", "UserWarning"),
    ("Please use DTensor instead and we are deprecating ShardedTensor", "FutureWarning"),
    ("`load_state_dict` is deprecated and will be removed in future versions", "FutureWarning"),
    ("`torch.distributed.all_gather_into_tensor` is deprecated", "FutureWarning"),
    ("`torch.distributed.reduce_scatter_tensor` is deprecated", "FutureWarning"),
    ("The .grad attribute of a Tensor that is not a leaf Tensor is being accessed", "UserWarning"),
)


def quiet_start() -> None:
    """Silence ``KNOWN_NOISE`` and transformers' / huggingface_hub's progress bars (loading a tiny model's weights
    draws one inside the training bar at every weight sync), here and in the processes this one starts (torchrun
    ranks, ``run_on_ranks``, reward workers inherit the environment). A user's own ``PYTHONWARNINGS`` comes after
    ours, so it can turn any of them back on."""
    import builtins
    import re
    import warnings

    theirs = os.environ.get("PYTHONWARNINGS", "")
    ours = [f for f in (f"ignore:{message}:{category}" for message, category in KNOWN_NOISE) if f not in theirs]
    os.environ["PYTHONWARNINGS"] = ",".join([*ours, *filter(None, [theirs])])
    for message, category in KNOWN_NOISE:
        warnings.filterwarnings("ignore", message=re.escape(message), category=getattr(builtins, category))
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    if "transformers" in sys.modules:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
