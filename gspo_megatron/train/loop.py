"""The GSPO training loop, top-down:

    rollout (G responses per prompt) -> rewards -> old-policy log-probs (or the rollout's) -> [reference
    log-probs] -> group advantages -> minibatch updates -> weight sync -> [eval] -> [checkpoint] -> metrics

The rollouts come from a ``RolloutSource``: sampled when asked (``rollout.mode=sync``) or ahead, while the trainer
updates (one_step_off, async); the same loop runs all three. With ``rollout.partial_chunk_tokens`` the samples still
running when a batch is full are carried into the next step and continued under the new weights (partial rollouts).

A non-finite loss or gradient skips its update on every rank (``faults``); a SIGTERM/SIGUSR1 on any rank stops every
rank after the same step, saved (``preemption``); under ``torchrun --max-restarts`` a failed rank's restarted workers
resume on their own, rank 0's servers kept (``elastic``).

Every rank runs this; global rank 0 also owns the rollout engine (``sampling``); the trainer's passes and
updates, and their metrics over all ranks, are ``update``; the weights reach the engine by ``weight_sync``.
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron.parallel import groups
from gspo_megatron.parallel.context import sequence_multiple
from gspo_megatron.train.startup.bootstrap import load_prompts, loss_config, prepare_model_dir, reward_function
from gspo_megatron.train.startup.config import Config
from gspo_megatron.train.startup.policy import build_policy, build_reference, layout_of
from gspo_megatron.train.sampling import colocate
from gspo_megatron.train.sampling.engine import make_engine
from gspo_megatron.train.sampling.source import RolloutSource
from gspo_megatron.train.update import passes
from gspo_megatron.train.update.advantages import advantages
from gspo_megatron.train.update.rows import row_plan
from gspo_megatron.train.weight_sync.sync import sync_weights
from gspo_megatron.train.resilience import elastic, preemption
from gspo_megatron.train.resilience.faults import NonFiniteGuard
from gspo_megatron.train.records import checkpoint
from gspo_megatron.train.records.metrics_log import MetricsLogger
from gspo_megatron.train.records.plots import plot_runs  # matplotlib is imported when a plot is drawn
from gspo_megatron.train.records.progress import Progress

def train(cfg: Config, resume: bool = False) -> dict:
    """Run ``cfg`` to ``train.steps``; returns the last step's metrics."""
    groups.init_distributed(timeout_s=cfg.distributed.timeout_s, control_timeout_s=cfg.distributed.control_timeout_s)
    rank0 = dist.get_rank() == 0
    if cfg.train.cpu_threads:
        torch.set_num_threads(cfg.train.cpu_threads)
    hf_dir = prepare_model_dir(cfg)
    groups.init_model_parallel(layout_of(cfg), seed=cfg.train.seed, timeout_s=cfg.distributed.timeout_s)
    policy = build_policy(cfg, hf_dir)
    reference = build_reference(cfg, policy) if cfg.algo.kl_coef else None
    tokenizer, prompts, eval_prompts = load_prompts(cfg, hf_dir)
    reward_fn = reward_function(cfg)
    loss_cfg = loss_config(cfg)
    engine = make_engine(cfg, hf_dir, tokenizer)  # rank 0's; None elsewhere
    step, version, state = 0, 0, None
    resume_from = elastic.checkpoint_to_resume(cfg, resume)  # --resume, or a torchrun restart: this run's latest
    if resume_from:
        state = checkpoint.load(resume_from, policy.model, policy.optimizer, policy.scheduler)
        step, version = state["step"], state["weight_version"]
        if rank0:
            print(f"gspo-megatron train: resumed from {resume_from} at step {step} of {cfg.train.steps}", flush=True)
    # metrics.jsonl keeps the steps up to the one resumed from (a stopped run's later ones go): each step once
    logger = MetricsLogger(cfg.logging.dir, cfg.logging.tensorboard, cfg.logging.wandb_project, enabled=rank0,
                           start_step=step)
    # The engine started from model.hf_dir's weights: a resumed run or model.megatron_checkpoint needs its own; servers
    # kept through a restart serve the failed attempt's weights
    if resume_from or elastic.restarted() or cfg.model.megatron_checkpoint:
        sync_weights(policy, engine, elastic.resumed_version(version))
    progress = Progress(cfg.train.steps, start=step, enabled=rank0)
    seq_multiple = sequence_multiple(cfg.parallel.tensor, cfg.parallel.context, cfg.parallel.sequence_parallel)
    # rollout.mode: sync (sampled when asked), one_step_off / async (sampled ahead while the trainer updates); a
    # rollout server restarted after a distributed sync lacks the weights: the source syncs them again (resync)
    source = RolloutSource(engine, prompts, cfg, tokenizer, reward_fn, seq_multiple, version, policy)
    if state is not None:
        source.load_state_dict(state)  # the data position (and partial rollouts' groups in flight)
    metrics: dict = {}
    nonfinite = NonFiniteGuard(cfg.train.max_consecutive_nonfinite, cfg.logging.dir, rank0)
    trainer_state = colocate.trainer_state(policy, cfg)  # rollout.colocate_offload: off the GPU between updates
    save_clock = checkpoint.SaveClock(cfg.checkpoint.every_minutes)  # a save at least every N minutes
    try:
        while step < cfg.train.steps:
            step += 1
            start = time.perf_counter()
            # (with rollout.filter_zero_variance_groups: groups without reward variance dropped, more prompts drawn)
            rollout = source.next(step, version)  # staleness: version minus each sample's weight version
            metrics = dict(rollout.metrics)
            metrics.update(colocate.release(engine, cfg))  # rollout.colocate: the servers' memory to training
            batch = rollout.batch
            batch["stale"] = rollout.versions != version  # sampled by older weights: pi_old is the engine's
            if cfg.rollout.partial_mask == "old_tokens":  # partial rollouts: only this version's tokens train
                batch["loss_mask"] &= batch["token_versions"] == version
            batch["advantages"] = advantages(rollout, cfg)  # a masked reward leaves its group's statistics
            batch["loss_mask"] &= rollout.reward_valid.unsqueeze(1)  # and the loss

            rows = row_plan(batch["input_ids"].shape[0], cfg)
            # pi_old: recomputed (recording old_routing for Routing Replay / expert volatility, replaying the engine's
            # experts under rollout routing replay), or the rollout's (and always the rollout's for stale samples)
            old_routing = passes.old_logprobs(policy, batch, rows, cfg, loss_cfg, metrics)
            if reference is not None:
                passes.reference_logprobs(reference, batch, rows, cfg, loss_cfg, metrics)

            metrics.update(trainer_state.reload())  # rollout.colocate_offload: optimizer state back for the update
            t = time.perf_counter()
            metrics.update(passes.update(policy, batch, rows, old_routing, cfg, loss_cfg))  # NaN/inf: skipped
            metrics["time/update"] = time.perf_counter() - t
            nonfinite.check(step, batch, metrics)  # saves a skipped step's batch; N in a row stop the run
            metrics.update(trainer_state.offload())  # and to host memory again, before the servers resume

            version += 1
            metrics.update(source.sync_weights(policy, version))  # generation ahead: finished first, or paused
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and eval_prompts:
                metrics.update(source.evaluate(eval_prompts, step))
            stop = preemption.stop_agreed()  # SIGTERM/SIGUSR1/Ctrl-C on any rank: every rank saves this step, stops
            timed = save_clock.due()  # checkpoint.every_minutes since the last save (rank 0's clock)
            if cfg.checkpoint.dir and (stop or timed or step == cfg.train.steps
                                       or (cfg.checkpoint.every and step % cfg.checkpoint.every == 0)):
                save_clock.saved()
                t = time.perf_counter()
                checkpoint.save(cfg.checkpoint.dir, step, policy.model, policy.optimizer, policy.scheduler,
                                {"weight_version": version, **source.state_dict()},
                                keep=cfg.checkpoint.keep, model_info=policy.write_model_info,
                                async_save=cfg.checkpoint.async_save)
                metrics["time/checkpoint"] = time.perf_counter() - t
            # An asynchronous save becomes `latest` once every rank has written it (the last one: before returning).
            checkpoint.finalize_saves(blocking=stop or step == cfg.train.steps)
            metrics["time/step"] = time.perf_counter() - start
            tokens = int(batch["loss_mask"].sum()) + int(sum(len(s.prompt_ids) for s in rollout.samples))
            metrics["tokens_per_s"] = tokens / metrics["time/step"]
            metrics["lr"] = policy.optimizer.param_groups[0]["lr"]
            example = metrics.pop("example", None)
            logger.log(step, metrics)
            progress.update(step, metrics, example)
            if rank0 and cfg.logging.plot_every and (step % cfg.logging.plot_every == 0 or step == cfg.train.steps):
                plot_runs({"run": logger.path}, Path(cfg.logging.dir) / "metrics.png", title=f"{cfg.algo.name}")
            if stop:
                metrics["preempted_at_step"] = step
                break
    except BaseException:
        elastic.leave_servers(engine)  # torchrun restarts left: the next attempt adopts rank 0's servers
        raise
    finally:
        source.close()
        progress.close()
        logger.close()
        if engine is not None:
            engine.close()
    return metrics
