"""huggingface_hub's cache laid out on disk, for testing Hugging Face repo ids offline (nothing can be downloaded
here): ``models--org--name/snapshots/<revision>/`` with the model's files and ``refs/main`` naming the revision, as
a download leaves it (there the files are links into ``blobs/``, which readers follow)."""

from __future__ import annotations

import shutil
from pathlib import Path


def cached_repo(cache: Path, repo_id: str, model_dir: Path, revision: str = "0123abc") -> Path:
    """``model_dir``'s files as ``repo_id``'s snapshot in the cache at ``cache`` (``HF_HUB_CACHE``); its path."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / revision
    shutil.copytree(model_dir, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs/main").write_text(revision)
    return snapshot


def offline_env(cache: Path) -> dict[str, str]:
    """The environment of an offline machine whose hub cache is ``cache``."""
    return {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
