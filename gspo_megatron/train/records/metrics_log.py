"""Per-step metrics: JSONL always, TensorBoard when installed, Weights & Biases when configured.

Only rank 0 writes. Each record is one RL step: ``{"step": N, "time": unix seconds, <metric>: float, ...}``;
``read_metrics`` reads a file back for plots and comparisons. A resumed run first cuts the file back to its
checkpoint's step, so each step appears once.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any


def _plain(value: Any):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return None  # JSON has no NaN/inf; a missing value plots as a gap
    return value


class MetricsLogger:
    def __init__(self, directory: str | Path, tensorboard: bool = True, wandb_project: str = "", config: dict | None = None,
                 enabled: bool = True, start_step: int | None = None):
        """``start_step``: the step the run starts after (a resumed run's checkpoint's, else 0): steps logged past
        it by a run that stopped are dropped, so each step is logged once (``keep_steps_up_to``; TensorBoard's
        purged). None: append to what is there."""
        self.enabled = enabled
        self.path = Path(directory) / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if start_step is not None:
            keep_steps_up_to(self.path, start_step)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: TensorBoard hides the events of the steps from there on that an earlier run wrote
                self._tb = SummaryWriter(str(Path(directory) / "tensorboard"),
                                         purge_step=None if start_step is None else start_step + 1)
            except ImportError:  # tensorboard is optional
                self._tb = None
        if wandb_project:
            import wandb  # configured explicitly: a missing package is an error, not a silent no-op

            self._wandb = wandb.init(project=wandb_project, config=config or {}, dir=str(directory))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "time": time.time(), **{k: _plain(v) for k, v in metrics.items()}}
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        numeric = {k: v for k, v in record.items() if isinstance(v, (int, float)) and k not in ("step", "time")}
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def keep_steps_up_to(path: Path, step: int) -> None:
    """Rewrite ``path`` (atomically: a new file renamed over it) to its records of steps 1..``step``, each once (the
    last written of a step) and in order; a line cut short by a killed run is dropped."""
    if not path.is_file():
        return
    by_step: dict[int, str] = {}
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            by_step[record["step"]] = line
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("".join(by_step[s] + "\n" for s in sorted(by_step)))
    os.replace(tmp, path)


def read_metrics(path: str | Path) -> list[dict]:
    """Records of a metrics.jsonl; a resumed run may repeat steps, the last record of a step wins."""
    by_step: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]
