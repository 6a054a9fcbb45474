"""Checkpoints: a resumed run ends with exactly the weights of an uninterrupted one; saves are atomic.

Two optimizer steps uninterrupted vs step 1, save, rebuild everything from scratch (as a new process
would), load, step 2: the weights must be bit-identical (torch.equal), at world=1 and at EP=2 with the
distributed optimizer. The same with an asynchronous save that training runs past (step 2 changes the weights
while the background writer writes step 1's), finalized afterwards. A process SIGKILLed in the middle of a save
leaves the previous checkpoint as ``latest`` and loadable.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch

from gspo_megatron.parallel.groups import Layout
from gspo_megatron.parallel.launch import RankFailed, run_on_ranks
from gspo_megatron.train.records import checkpoint
from gspo_megatron.train.update.loss import LossConfig
from gspo_megatron.train.update.schedules import update_step
from tests import megatron_tiny as tiny
from tests.train.update.test_schedules import NUM_SEQUENCES, make_rollout, micro_batches

pytestmark = pytest.mark.megatron  # builds a Megatron model


def _build(distributed_optimizer: bool):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    model = tiny.wrap_ddp(tiny.build_model(seed=0, per_sequence_loss=True), distributed_optimizer)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-3, min_lr=1e-4, clip_grad=1.0, use_distributed_optimizer=distributed_optimizer),
        [model],
    )
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0, max_lr=1e-3, min_lr=1e-4, lr_warmup_steps=1, lr_decay_steps=4,
        lr_decay_style="cosine", start_wd=0.0, end_wd=0.0, wd_incr_steps=4, wd_incr_style="constant",
    )
    return model, optimizer, scheduler


def _step(model, optimizer, scheduler, step: int):
    from megatron.core import parallel_state as ps

    rollout = make_rollout()
    g = torch.Generator().manual_seed(100 + step)
    rollout["old_logprobs"] = -torch.rand(rollout["labels"].shape, generator=g) * 5
    per_dp = NUM_SEQUENCES // ps.get_data_parallel_world_size()
    first = ps.get_data_parallel_rank() * per_dp
    # Something random inside the step, so RNG state is part of what resume must restore.
    rollout["advantages"] = rollout["advantages"] + 0.01 * torch.randn(rollout["advantages"].shape)
    update_step(model, optimizer, micro_batches(rollout, first, per_dp, 2), LossConfig(eps_low=0.2, eps_high=0.2))
    scheduler.step(increment=1)


def _weights(model):
    return {k: v.detach().clone() for k, v in tiny.flat(tiny.tensors_only(model.module.sharded_state_dict())).items()}


def _resume_equals_uninterrupted(ckpt_dir: str, distributed_optimizer: bool):
    torch.manual_seed(5)
    model, optimizer, scheduler = _build(distributed_optimizer)
    _step(model, optimizer, scheduler, 1)
    _step(model, optimizer, scheduler, 2)
    uninterrupted = _weights(model)

    torch.manual_seed(5)
    model, optimizer, scheduler = _build(distributed_optimizer)
    _step(model, optimizer, scheduler, 1)
    checkpoint.save(ckpt_dir, 1, model, optimizer, scheduler, {"data_position": 8, "weight_version": 1})
    after_save = torch.get_rng_state()

    torch.manual_seed(999)  # a new process starts from other RNG states and other weights
    model, optimizer, scheduler = _build(distributed_optimizer)
    state = checkpoint.load(checkpoint.latest(ckpt_dir), model, optimizer, scheduler)
    after_load = torch.get_rng_state()
    _step(model, optimizer, scheduler, 2)
    resumed = _weights(model)
    return {
        "state": state,
        "rng_restored": torch.equal(after_save, after_load),
        "lr": optimizer.param_groups[0]["lr"],
        "identical": all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted),
        "moved": any(not torch.equal(resumed[k], v) for k, v in _weights(_build(distributed_optimizer)[0]).items()),
    }


def _async_save_then_resume(ckpt_dir: str, distributed_optimizer: bool):
    """Step 1, an asynchronous save, step 2 while it is written; then a new process loads step 1 and redoes step 2."""
    from pathlib import Path

    torch.manual_seed(5)
    model, optimizer, scheduler = _build(distributed_optimizer)
    _step(model, optimizer, scheduler, 1)
    checkpoint.save(ckpt_dir, 1, model, optimizer, scheduler, {"data_position": 8, "weight_version": 1},
                    async_save=True)
    pending = {"latest": checkpoint.latest(ckpt_dir), "tmp": (Path(ckpt_dir) / "step_000001.tmp").is_dir()}
    _step(model, optimizer, scheduler, 2)  # training goes on while the writer writes step 1's state
    uninterrupted = _weights(model)
    checkpoint.finalize_saves(blocking=True)

    torch.manual_seed(999)
    model, optimizer, scheduler = _build(distributed_optimizer)
    state = checkpoint.load(checkpoint.latest(ckpt_dir), model, optimizer, scheduler)
    _step(model, optimizer, scheduler, 2)
    resumed = _weights(model)
    return {"pending": pending, "state": state,
            "identical": all(torch.equal(resumed[k], uninterrupted[k]) for k in uninterrupted)}


@pytest.mark.parametrize("world, layout, distributed_optimizer", [(1, Layout(), False), (2, Layout(expert=2), True)])
def test_async_save_resumes_exactly(tmp_path, world, layout, distributed_optimizer):
    results = run_on_ranks(_async_save_then_resume, world, layout, str(tmp_path), distributed_optimizer)
    for r in results:
        assert r["pending"] == {"latest": None, "tmp": True}, r  # not `latest` before every rank has written it
        assert r["identical"], r
        assert r["state"] == {"data_position": 8, "weight_version": 1, "step": 1, "has_optimizer_state": True}
    assert (tmp_path / "latest").read_text() == "step_000001" and not (tmp_path / "step_000001.tmp").exists()


def test_resume_is_exact_world1(tmp_path):
    (r,) = run_on_ranks(_resume_equals_uninterrupted, 1, Layout(), str(tmp_path), False)
    assert r["identical"], r
    assert r["moved"] and r["rng_restored"], r
    assert r["state"] == {"data_position": 8, "weight_version": 1, "step": 1, "has_optimizer_state": True}
    assert (tmp_path / "latest").read_text() == "step_000001"


def test_resume_is_exact_ep2_distributed_optimizer(tmp_path):
    results = run_on_ranks(_resume_equals_uninterrupted, 2, Layout(expert=2), str(tmp_path), True)
    assert all(r["identical"] and r["rng_restored"] for r in results), results


def _killed_while_saving(ckpt_dir: str):
    from megatron.core import dist_checkpointing

    model, optimizer, scheduler = _build(False)
    checkpoint.save(ckpt_dir, 1, model, optimizer, scheduler, {"weight_version": 1})
    real_save = dist_checkpointing.save

    def save_then_die(state, path, *args, **kwargs):
        real_save(state, path, *args, **kwargs)  # the data is written, the rename has not happened
        os.kill(os.getpid(), signal.SIGKILL)

    dist_checkpointing.save = save_then_die
    checkpoint.save(ckpt_dir, 2, model, optimizer, scheduler, {"weight_version": 2})


def _load_latest(ckpt_dir: str):
    model, optimizer, scheduler = _build(False)
    state = checkpoint.load(checkpoint.latest(ckpt_dir), model, optimizer, scheduler)
    # The next save clears the half-written one.
    checkpoint.save(ckpt_dir, 2, model, optimizer, scheduler, dict(state, weight_version=2))
    return state


def test_kill_during_save_leaves_previous_checkpoint(tmp_path):
    with pytest.raises(RankFailed, match="exited with code -9"):
        run_on_ranks(_killed_while_saving, 1, Layout(), str(tmp_path))
    assert (tmp_path / "latest").read_text() == "step_000001"
    assert (tmp_path / "step_000002.tmp").is_dir() and not (tmp_path / "step_000002").exists()
    (state,) = run_on_ranks(_load_latest, 1, Layout(), str(tmp_path))
    assert state["step"] == 1 and state["weight_version"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step_000001", "step_000002"]
