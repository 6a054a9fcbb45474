"""An output directory that appears complete or not at all.

``atomic_output_dir(out)`` yields a hidden temporary sibling (``.NAME.partial-XXXX``) that every rank writes
into; on success rank 0 renames it to ``out`` (one ``os.replace``, atomic on a POSIX file system), on an
exception it is removed. A run killed outright (SIGKILL, power loss) can leave the hidden ``.partial``
directory behind, never a half-written ``out``. SIGTERM is turned into an exception by the tools so that it
cleans up too. ``replaced_dir(out)`` does the same for one process refreshing a copy of its own (the servers'
model directories), replacing an ``out`` already there.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
from pathlib import Path


def _dist():
    """torch.distributed if a process group is up, else None (imported lazily: this module is stdlib-only)."""
    import sys

    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def _broadcast_path(path: str | None) -> str:
    dist = _dist()
    if dist is None or dist.get_world_size() == 1:
        return path
    holder = [path]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _rank() -> int:
    dist = _dist()
    return dist.get_rank() if dist is not None else 0


def _barrier() -> None:
    dist = _dist()
    if dist is not None and dist.get_world_size() > 1:
        dist.barrier()


def check_output_dir(out: str | Path) -> Path:
    """The output must not exist yet (conversions never overwrite); its parent is created."""
    out = Path(out).absolute()
    if out.exists():
        raise FileExistsError(f"output directory {out} already exists: remove it or choose another --out")
    out.parent.mkdir(parents=True, exist_ok=True)
    return out


@contextlib.contextmanager
def atomic_output_dir(out: str | Path):
    """Yield a temporary directory (the same path on every rank) that becomes ``out`` on success."""
    out = Path(out).absolute()
    tmp = None
    if _rank() == 0:
        check_output_dir(out)
        tmp = tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent)
    tmp = Path(_broadcast_path(tmp))
    try:
        yield tmp
        _barrier()  # every rank has finished writing
        if _rank() == 0:
            os.replace(tmp, out)
        _barrier()
    except BaseException:
        if _rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def replaced_dir(out: str | Path):
    """For this process alone (no ranks, no collectives: a copy rank 0 writes for its servers): yield a temporary
    sibling of ``out`` that replaces it on success (an ``out`` already there is removed then); on an exception the
    temporary directory is removed and ``out`` is left as it was."""
    out = Path(out).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        yield tmp
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def exit_on_sigterm() -> None:
    """Make SIGTERM raise SystemExit, so ``atomic_output_dir`` removes its temporary directory."""

    def handler(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, handler)
