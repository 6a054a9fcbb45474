"""A run's output directories, checked before anything is built or written: never two runs mixed, none lost.

``logging.dir`` (metrics.jsonl) and ``checkpoint.dir`` (step_N/, latest) belong to one run. Without ``--resume`` a
directory that already holds a run is refused, naming it and the ways on; ``--overwrite`` deletes the earlier run's
metrics and checkpoints first. ``--resume`` says where it resumes from, or that there was nothing to resume (a fresh
start, so a job script can pass ``--resume`` on every submission). Every output directory must be creatable and
writable. Workers restarted by ``torchrun --max-restarts`` skip the used-dir check: they continue their own run.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from gspo_megatron.train.records.checkpoint import check_resumable
from gspo_megatron.train.startup.config import Config, ConfigError

METRICS = "metrics.jsonl"
ENGINE_MODEL = "engine_model"  # the dequantized copy an FP8 model.hf_dir is served from (bootstrap.engine_model_dir)
# What a run leaves in logging.dir beside metrics.jsonl (removed with it by --overwrite)
LOGGING_FILES = (METRICS, "metrics.png", "tensorboard", "elastic_run.json", ENGINE_MODEL)


def used_by(cfg: Config) -> list[str]:
    """What in the run's directories shows an earlier run: '<path> (what)' for each."""
    found = []
    metrics = Path(cfg.logging.dir) / METRICS
    if metrics.is_file() and metrics.stat().st_size:
        lines = metrics.read_text().splitlines()
        found.append(f"{metrics} ({len(lines)} logged steps)")
    if cfg.checkpoint.dir:
        ck = Path(cfg.checkpoint.dir)
        steps = sorted(p.name for p in ck.glob("step_*") if p.is_dir()) if ck.is_dir() else []
        if steps or (ck / "latest").is_file():
            found.append(f"{ck} (checkpoints {', '.join(steps) or 'latest'})")
    return found


def check_writable(path: str | Path, field: str) -> None:
    """``path`` is (or can be created as) a directory this process can write in; a probe file tests it (root passes
    every permission check, a read-only file system does not)."""
    path = Path(path).absolute()
    existing = path
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{field}={str(path)!r} cannot be created: {existing} is a file, not a directory")
    try:
        fd, probe = tempfile.mkstemp(prefix=".gspo_write_check_", dir=existing)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{field}={str(path)!r} is not writable: cannot write in {existing} ({e.strerror})") from None


def _remove_earlier_run(cfg: Config) -> None:
    for name in LOGGING_FILES:
        target = Path(cfg.logging.dir) / name
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        elif target.exists():
            target.unlink(missing_ok=True)
    if cfg.checkpoint.dir and Path(cfg.checkpoint.dir).is_dir():
        ck = Path(cfg.checkpoint.dir)
        for target in [*ck.glob("step_*"), *ck.glob("latest*")]:
            shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)


def check_run_dirs(cfg: Config, resume: bool, overwrite: bool, rank: int = 0, restarted: bool = False) -> str | None:
    """Refuse what would mix or lose runs; returns the line to print (rank 0) about what ``--resume`` finds."""
    if resume and overwrite:
        raise ConfigError("--resume and --overwrite contradict each other: continue the earlier run, or replace it")
    if resume and not cfg.checkpoint.dir:
        raise ConfigError("--resume needs checkpoint.dir: the directory of the checkpoints to continue from")
    check_writable(cfg.logging.dir, "logging.dir")
    if cfg.checkpoint.dir:
        check_writable(cfg.checkpoint.dir, "checkpoint.dir")
    if cfg.model.tiny and cfg.model.hf_dir and not (Path(cfg.model.hf_dir) / "config.json").is_file():
        check_writable(Path(cfg.model.hf_dir).parent, "model.hf_dir")  # model.tiny is built there
    if restarted:
        return None
    if resume:
        ck = Path(cfg.checkpoint.dir)
        if not (ck / "latest").is_file():
            why = "does not exist" if not ck.exists() else "holds no checkpoint (no latest)"
            return (f"gspo-megatron train: --resume: checkpoint.dir={cfg.checkpoint.dir} {why}: nothing to resume, "
                    f"starting at step 1")
        try:
            check_resumable(ck)
        except (ValueError, FileNotFoundError) as e:
            raise ConfigError(str(e)) from None
        return None
    used = used_by(cfg)
    if used and overwrite:
        if rank == 0:
            _remove_earlier_run(cfg)
        return f"gspo-megatron train: --overwrite: removed the earlier run's {'; '.join(used)}"
    if used:
        raise ConfigError("these directories already hold a run: " + "; ".join(used) + ". Continue it with --resume, "
                          "give another logging.dir / checkpoint.dir, or replace it with --overwrite")
    return None
