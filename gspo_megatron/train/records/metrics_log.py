"""Per-step metrics: JSONL always, TensorBoard when installed, Weights & Biases when configured.

Only rank 0 writes. Each record is one RL step: ``{"step": N, "time": unix seconds, <metric>: float, ...}``;
``read_metrics`` reads a file back for plots and comparisons.
"""

from __future__ import annotations

import json
import math
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
                 enabled: bool = True):
        self.enabled = enabled
        self.path = Path(directory) / "metrics.jsonl"
        self._tb = None
        self._wandb = None
        if not enabled:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                self._tb = SummaryWriter(str(Path(directory) / "tensorboard"))
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


def read_metrics(path: str | Path) -> list[dict]:
    """Records of a metrics.jsonl; a resumed run may repeat steps, the last record of a step wins."""
    by_step: dict[int, dict] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[record["step"]] = record
    return [by_step[s] for s in sorted(by_step)]
