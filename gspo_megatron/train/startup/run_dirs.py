"""A run's output directories, checked before anything is built or written: never two runs mixed, none lost.

``logging.dir`` (metrics.jsonl) and ``checkpoint.dir`` (step_N/, latest) belong to one run. Without ``--resume`` a
directory that already holds a run is refused, naming it and the ways on; ``--overwrite`` deletes the earlier run's
metrics and checkpoints first. ``--resume`` says where it resumes from, or that there was nothing to resume (a fresh
start, so a job script can pass ``--resume`` on every submission). Every output directory must be creatable and
writable. Workers restarted by ``torchrun --max-restarts`` skip the used-dir check: they continue their own run.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from gspo_megatron.model.checkpoint import METADATA_FILE, layout_dict
from gspo_megatron.parallel.groups import Layout
from gspo_megatron.train.records.checkpoint import check_resumable, latest
from gspo_megatron.train.startup.config import Config, ConfigError

METRICS = "metrics.jsonl"
ENGINE_MODEL = "engine_model"  # the rollout engine's copy of model.hf_dir: FP8 rollouts' or an FP8 model's (bootstrap)
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


# The distributed optimizer's state is read back shard for shard: another data-parallel size is fine (its
# dp_reshardable format), another split of the model is not (megatron's load then fails with every key listed).
RESUMED_LAYOUT = ("tensor", "pipeline", "expert", "expert_tensor", "first_stage_layers", "last_stage_layers")


def check_resumed_layout(step_dir: Path, cfg: Config) -> None:
    """``--resume`` of ``step_dir`` under ``cfg.parallel``: the same model split as it was saved with, or a
    ``ConfigError`` naming the fields that changed and the way on (its weights under any layout)."""
    file = step_dir / METADATA_FILE
    saved = json.loads(file.read_text()).get("saved_layout") if file.is_file() else None
    if not saved:
        return
    now = layout_dict(Layout.of(cfg.parallel))
    for layout in (saved, now):  # None: the same as parallel.tensor
        layout["expert_tensor"] = layout.get("expert_tensor") or layout.get("tensor")
    changed = [f"parallel.{name}={now.get(name)} (saved with {saved.get(name)})" for name in RESUMED_LAYOUT
               if now.get(name) != saved.get(name)]
    if changed:
        raise ConfigError(f"--resume: {step_dir} was saved under another layout: {', '.join(changed)}. A resumed "
                          "run keeps the tensor, pipeline and expert split (the data-parallel size may change): "
                          "resume with the saved values, or start a new run from its weights under this layout with "
                          f"model.megatron_checkpoint={step_dir} (optimizer and data position afresh)")


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
        check_resumed_layout(latest(ck), cfg)
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
