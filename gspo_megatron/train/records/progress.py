"""The RL loop's progress (rank 0): step, reward, clip fraction, masked rewards, step time and throughput at a glance.

On a terminal, a tqdm bar on stderr. Anywhere else (a log file, Slurm's output, a pipe) one line per step on
stderr: a bar there is one line of carriage returns, unreadable in an editor and ungreppable.
"""

from __future__ import annotations

import math
import sys
from typing import TextIO


def number(value: float) -> str:
    """A metric as people read it: 3 significant digits (0.15, not 0.15000000596046448), nan as nan."""
    return "nan" if math.isnan(value) else f"{value:.3g}"


class Progress:
    def __init__(self, total: int, start: int = 0, enabled: bool = True, stream: TextIO | None = None):
        self.total, self.enabled = total, enabled
        self.stream = stream if stream is not None else sys.stderr
        self.bar = None
        if enabled and self.stream.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="gspo", unit="step", dynamic_ncols=True, file=self.stream)

    def update(self, step: int, metrics: dict, example: str | None = None) -> None:
        if not self.enabled:
            return
        masked = metrics.get("reward_masked")
        shown = {"reward": metrics.get("reward_mean"), "eval": metrics.get("eval_reward_mean"),
                 "clip": metrics.get("clip_frac"), "masked": masked or None,  # shown when there are any
                 "lp_diff": metrics.get("logprob_diff_max")}
        shown = {k: number(v) for k, v in shown.items() if v is not None}
        seconds, tokens = metrics.get("time/step"), metrics.get("tokens_per_s")
        if self.bar is not None:
            if seconds is not None:
                shown["s/step"] = number(seconds)
            self.bar.set_postfix(shown, refresh=False)
            self.bar.update(step - self.bar.n)
            if example and step % 10 == 0:
                self.bar.write(f"step {step}: {example}", file=self.stream)
            return
        # One line a step: `step 3/5: reward 0.15, clip 0.02, masked 2, lp_diff 3e-06, 1.2 s, 450 tokens/s`
        parts = [f"{k} {v}" for k, v in shown.items()]
        parts += [f"{number(seconds)} s"] if seconds is not None else []
        parts += [f"{tokens:.0f} tokens/s"] if tokens is not None else []
        print(f"gspo step {step}/{self.total}: {', '.join(parts)}", file=self.stream, flush=True)
        if example and step % 10 == 0:
            print(f"step {step}: {example}", file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
