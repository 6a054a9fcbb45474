"""Trainer runs through the CLI under torchrun, for the tests that stop, signal or kill one of its ranks."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STEPS = 4  # of the runs of ``two_ranks``


def torchrun() -> str:
    return shutil.which("torchrun", path=str(Path(sys.executable).parent)) or "torchrun"


def env() -> dict:
    """This environment without a launcher's rank variables, one torch thread per rank (they share 2 cores)."""
    clean = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    return dict(clean, OMP_NUM_THREADS="1")


def logged_steps(run: Path) -> list[int]:
    """Steps logged so far (complete lines only: the trainer may be writing the next)."""
    path = run / "metrics.jsonl"
    return [json.loads(line)["step"] for line in path.read_text().split("\n")[:-1]] if path.is_file() else []


def two_ranks(run: Path, model: Path, *extra: str, max_restarts: int = 0) -> list[str]:
    """The CPU example for 4 steps on 2 gloo ranks with EP 2 (2 prompts x 8 responses a step), logging to ``run``
    and checkpointing to ``run/ck``; ``model``: where the tiny model is (built there by the first run)."""
    return [torchrun(), "--standalone", "--nproc-per-node", "2", "--max-restarts", str(max_restarts),
            "--monitor-interval", "0.5", "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
            f"train.steps={STEPS}", "train.eval_every=0", "model.warm_start_steps=2", f"model.hf_dir={model}",
            f"logging.dir={run}", f"checkpoint.dir={run / 'ck'}", "logging.plot_every=0", "rollout.prompts_per_step=2",
            "parallel.micro_batch_size=4", "parallel.expert=2", "data.reward_workers=0", *extra]

