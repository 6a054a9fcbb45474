"""Fault tolerance of the trainer's update (``train.resilience.faults``): non-finite steps.

On 2 gloo ranks with EP 2 (dense parameters data-parallel over both ranks, experts expert-parallel: one rank's
expert gradients never reach the other), fp32 with megatron's FP32Optimizer, which itself never checks for inf/nan:

- rank 1 alone poisons one of its expert weights' gradients with NaN (a tensor hook): the update is skipped on both
  ranks (``skipped_updates`` == minibatches on each), the parameters, the optimizer state (Adam's moments and step)
  and the LR stay bit-identical, and the loop's guard saves the batch and raises ``NonFiniteError`` at the
  ``train.max_consecutive_nonfinite``-th such step in a row;
- rank 1 alone gets inf advantages (an inf loss there): skipped on both ranks the same way;
- with the poison gone the next step updates normally.
"""

from __future__ import annotations

import copy

import pytest
import torch

from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import run_on_ranks
from gspo_megatron.train.startup.config import load_config

pytestmark = pytest.mark.megatron  # builds a Megatron model

SEQ = 32
LIMIT = 3
BASE = ["data.task=reverse", "model.dtype=float32", "rollout.prompts_per_step=2", "rollout.group_size=4",
        "algo.minibatches=2", "parallel.micro_batch_size=2", "parallel.expert=2", "optimizer.lr=1e-3",
        "parallel.distributed_optimizer=false", "algo.eps_low=0.2", "algo.eps_high=0.2",
        f"train.max_consecutive_nonfinite={LIMIT}"]


def _state(policy) -> tuple:
    params = [p.detach().clone() for p in policy.model.parameters()]
    return params, copy.deepcopy(policy.optimizer.state_dict()), policy.optimizer.param_groups[0]["lr"]


def _identical(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_identical(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_identical(x, y) for x, y in zip(a, b))
    return a == b


def nonfinite_steps(hf_dir: str, log_dir: str) -> dict:
    import torch.distributed as dist

    from gspo_megatron.train.update import passes
    from gspo_megatron.train.update.rows import row_plan
    from gspo_megatron.train.startup.bootstrap import loss_config
    from gspo_megatron.train.resilience.faults import NonFiniteError, NonFiniteGuard
    from gspo_megatron.plan.probe import synthetic_rollout
    from gspo_megatron.train.startup.policy import build_policy

    rank = dist.get_rank()
    cfg = load_config(None, BASE + [f"model.hf_dir={hf_dir}", f"logging.dir={log_dir}"])
    algo = loss_config(cfg)
    policy = build_policy(cfg, hf_dir)
    batch = synthetic_rollout(cfg, 128, SEQ)
    batch["old_logprobs"] = batch["rollout_logprobs"]
    rows = row_plan(batch["input_ids"].shape[0], cfg)
    guard = NonFiniteGuard(cfg.train.max_consecutive_nonfinite, log_dir, rank == 0)

    def update(step, rollout):
        metrics = passes.update(policy, rollout, rows, None, cfg, algo)
        guard.check(step, rollout, metrics)
        return metrics

    out = {"good": update(1, batch)}  # Adam's state exists from here on
    before = _state(policy)
    expert = next(p for name, p in policy.model.named_parameters() if "experts" in name)
    hook = expert.register_hook(lambda grad: grad * float("nan")) if rank == 1 else None
    out["poisoned_grad"] = []
    try:
        for step in range(2, 2 + LIMIT):
            out["poisoned_grad"].append((update(step, batch), _identical(_state(policy), before)))
    except NonFiniteError as e:
        out["error"] = (step, str(e))
    if hook is not None:
        hook.remove()
    guard.in_a_row = []
    poisoned = {k: v.clone() for k, v in batch.items()}
    if rank == 1:  # rank 1's rows only: an inf loss on rank 1 alone
        poisoned["advantages"][torch.cat(rows)] = float("inf")
    out["poisoned_loss"] = (update(10, poisoned), _identical(_state(policy), before))
    out["recovered"] = (update(11, batch), _identical(_state(policy), before))
    return out


def test_a_nonfinite_step_is_skipped_on_every_rank_and_too_many_stop_the_run(moe_then_dense_dir, tmp_path):
    per_rank = run_on_ranks(nonfinite_steps, 2, Layout(expert=2), moe_then_dense_dir, str(tmp_path))
    for rank, out in enumerate(per_rank):
        assert out["good"]["skipped_updates"] == 0 and torch.isfinite(torch.tensor(out["good"]["grad_norm"]))
        # The limit-th poisoned step raises: the ones before it returned, each skipped and leaving everything as it was.
        assert len(out["poisoned_grad"]) == LIMIT - 1, rank
        for metrics, unchanged in out["poisoned_grad"]:
            assert metrics["skipped_updates"] == 2 and unchanged, (rank, metrics["skipped_updates"])
        step, message = out["error"]
        assert step == 1 + LIMIT and "train.max_consecutive_nonfinite=3" in message and "[2, 3, 4]" in message
        metrics, unchanged = out["poisoned_loss"]
        assert metrics["skipped_updates"] == 2 and unchanged, rank
        metrics, unchanged = out["recovered"]
        assert metrics["skipped_updates"] == 0 and not unchanged, rank
    saved = sorted(p.name for p in (tmp_path / "nonfinite").iterdir())
    assert saved == ["step_000002.pt", "step_000003.pt", "step_000004.pt", "step_000010.pt"]
    replay = torch.load(tmp_path / "nonfinite" / "step_000010.pt", weights_only=False)
    assert replay["step"] == 10 and replay["metrics"]["skipped_updates"] == 2 and "advantages" in replay["batch"]
