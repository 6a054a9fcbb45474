"""Hugging Face repo ids where a model directory is expected: ``model.hf_dir``, ``gspo-megatron score --model``, the
converters' ``--hf-dir`` and ``--hf-config``. ``Qwen/Qwen3-30B-A3B``, with nothing of that name on disk, is its
snapshot in huggingface_hub's cache, downloaded into it first when the machine is online (``HF_HOME``,
``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE`` as huggingface_hub reads them)."""

from __future__ import annotations

import os
import re
from pathlib import Path

from .errors import ModelNotFound

MODEL_FILES = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja", "*.tiktoken"]  # config, weights, tokenizer
CONFIG_FILES = [pattern for pattern in MODEL_FILES if pattern != "*.safetensors"]  # config and tokenizer only


def is_repo_id(value: str) -> bool:
    """``org/name`` as the Hugging Face Hub spells repo ids (not ``./x``, ``/x``, ``~/x`` or a deeper path)."""
    return re.fullmatch(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*", value) is not None and ".." not in value


def resolve(value: str, option: str, files: list[str] = MODEL_FILES) -> str:
    """``value`` itself when something exists at that path or it is no repo id; else the local snapshot of the
    repo's ``files``. ``option`` names where the value came from in messages (``model.hf_dir``, ``--model``).
    Not cached while offline (``HF_HUB_OFFLINE=1``), or not on the Hub: a ``ModelNotFound`` saying so."""
    if not value or Path(value).exists() or not is_repo_id(value):
        return value
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError, RepositoryNotFoundError

    given = f"{option} {value}" if option.startswith("-") else f"{option}={value!r}"
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    cache = os.environ.get("HF_HUB_CACHE") or None  # read now: huggingface_hub reads it once, at its import
    try:
        return snapshot_download(value, allow_patterns=files, cache_dir=cache, local_files_only=offline)
    except LocalEntryNotFoundError:
        where = "offline (HF_HUB_OFFLINE=1)" if offline else "unable to reach the Hugging Face Hub"
        raise ModelNotFound(f"{given} is not a directory, and as a Hugging Face repo id it is not in the cache and "
                            f"this machine is {where}: download it where there is a network "
                            f"(`huggingface-cli download {value}`, into the same HF_HOME) or give a local "
                            "directory") from None
    except (RepositoryNotFoundError, HfHubHTTPError) as e:
        raise ModelNotFound(f"{given} is neither a directory nor a Hugging Face repo the Hub serves "
                            f"({type(e).__name__})") from None
