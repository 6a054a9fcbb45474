"""A progress bar for the RL loop (rank 0): step, reward, clip fraction and step time at a glance."""

from __future__ import annotations


class Progress:
    def __init__(self, total: int, start: int = 0, enabled: bool = True):
        self.bar = None
        if enabled:
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, desc="gspo", unit="step", dynamic_ncols=True)

    def update(self, step: int, metrics: dict, example: str | None = None) -> None:
        if self.bar is None:
            return
        shown = {"reward": metrics.get("reward_mean"), "eval": metrics.get("eval_reward_mean"),
                 "clip": metrics.get("clip_frac"), "lp_diff": metrics.get("logprob_diff_max"),
                 "s/step": metrics.get("time/step")}
        self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items() if v is not None}, refresh=False)
        self.bar.update(step - self.bar.n)
        if example and step % 10 == 0:
            self.bar.write(f"step {step}: {example}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
