"""Non-finite steps: a NaN/inf loss or gradient skips the update on every rank, and too many in a row stop the run.

Megatron's optimizers do not guard this for us: ``FP32Optimizer.step`` and the bf16 ``MixedPrecisionOptimizer``
(no grad scaler) never look for inf/nan; only fp16's grad scaler sets ``found_inf``. A NaN gradient would go
through Adam into the weights and both moments. So before ``optimizer.step()`` every rank checks its loss sums and
its whole gradient buffer (its own contributions and what the data-parallel reduction brought it) and the flag is
max-reduced over the world: a non-finite value on any rank skips the step on all of them, weights, optimizer state
and LR schedule untouched (``guarded_step``). The loop's ``NonFiniteGuard`` saves each such step's rollout batch for
replay and stops the run after ``train.max_consecutive_nonfinite`` such steps in a row, before that step's
checkpoint, so ``latest`` stays the last good one.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron import environment


class NonFiniteError(RuntimeError):
    """Too many consecutive steps had a non-finite loss or gradient; the message names them and the saved batches."""


def nonfinite_anywhere(model, loss_sums: list[torch.Tensor]) -> bool:
    """True on every rank if any rank's ``loss_sums`` or gradient buffer (``param.main_grad``) holds a NaN or inf
    (collective over the world group)."""
    checks = [torch.isfinite(g).all() for p in model.parameters() if (g := getattr(p, "main_grad", None)) is not None]
    checks += [torch.isfinite(s).all() for s in loss_sums]
    flag = torch.zeros(1, dtype=torch.float32, device=environment.device())
    if checks:
        flag += (~torch.stack(checks)).any().float()
    if dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def guarded_step(model, optimizer, loss_sums: list[torch.Tensor]) -> tuple[bool, float]:
    """``optimizer.step()`` unless a loss or gradient is non-finite on any rank -> (update_successful, grad_norm)."""
    if nonfinite_anywhere(model, loss_sums):
        return False, float("nan")
    update_successful, grad_norm, _ = optimizer.step()
    return bool(update_successful), float(grad_norm) if grad_norm is not None else float("nan")


class NonFiniteGuard:
    """Counts steps whose updates were skipped (``skipped_updates`` > 0) in a row; every rank holds the same count.

    ``check`` after each step's update: a skipped step's batch goes to ``<logging.dir>/nonfinite/step_N.pt``
    (rank 0; ``torch.load`` gives {"step", "batch", "metrics"}), and the ``limit``-th in a row raises
    ``NonFiniteError``. A step with every update applied resets the count. ``limit`` 0: never stop."""

    def __init__(self, limit: int, log_dir: str | Path, rank0: bool):
        self.limit, self.dir, self.rank0 = limit, Path(log_dir) / "nonfinite", rank0
        self.in_a_row: list[int] = []

    def check(self, step: int, batch: dict, metrics: dict) -> None:
        if not metrics.get("skipped_updates"):
            self.in_a_row = []
            return
        self.in_a_row.append(step)
        path = self.dir / f"step_{step:06d}.pt"
        if self.rank0:
            self.dir.mkdir(parents=True, exist_ok=True)
            torch.save({"step": step, "batch": batch, "metrics": dict(metrics)}, path)
        if self.limit and len(self.in_a_row) >= self.limit:
            raise NonFiniteError(
                f"steps {self.in_a_row} had a non-finite loss or gradient norm ({len(self.in_a_row)} in a row, "
                f"train.max_consecutive_nonfinite={self.limit}); their updates were skipped and the run stops before "
                f"saving. Their batches are in {self.dir} for replay; the last good checkpoint is checkpoint.dir's "
                "latest (resume with --resume after fixing the cause, e.g. a lower optimizer.lr)")


class MaskedRewardGuard:
    """A reward that fails on (nearly) every sample never trains to the end: with ``data.on_reward_error=mask`` a
    failed reward is masked, and a step whose rewards are all masked has no signal at all (reward NaN, gradient 0).

    Rank 0's rounds ``check`` each step's reward validity: a step with every reward masked, or more than
    ``max_share`` of the rewards of the last ``window`` steps masked (timeouts and crashes included), raises the
    reward's own error (``RewardError``, the first masked sample's message). ``max_share`` 1: only an all-masked step
    stops the run."""

    def __init__(self, max_share: float, window: int):
        self.max_share, self.window = max_share, window
        self.steps: list[tuple[int, int, int]] = []  # (step, masked, rewards) of the last ``window`` steps
        self.last_error = "masked"  # the latest masked sample's message

    def check(self, step: int, valid: torch.Tensor, errors: list[str]) -> None:
        from gspo_megatron.rollout.errors import RewardError

        masked, total = int((~valid).sum()), valid.numel()
        earlier = [s for s in self.steps if s[0] != step]  # a step sampled again (a resync) counts once
        self.steps = (earlier + [(step, masked, total)])[-self.window:]
        self.last_error = errors[-1] if errors else self.last_error
        share = sum(s[1] for s in self.steps) / max(1, sum(s[2] for s in self.steps))
        if total and masked == total:
            raise RewardError(f"step {step}: every reward ({total} of {total}) failed and was masked, so the step "
                              f"has nothing to learn from; the last: {self.last_error}")
        if len(self.steps) == self.window and share > self.max_share:
            raise RewardError(f"steps {step - self.window + 1}-{step}: {share:.0%} of the rewards failed and were "
                              f"masked, more than data.max_masked_reward_share={self.max_share:g} over "
                              f"data.masked_reward_window={self.window} steps; the last: {self.last_error}")
