"""The GSPO training loop, top-down:

    rollout (G responses per prompt) -> rewards -> old-policy log-probs -> [reference log-probs] ->
    group advantages -> minibatch updates -> weight sync -> [eval] -> [checkpoint] -> metrics

Every rank runs this; global rank 0 also owns the rollout engine (``rollout_phase``).
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
import torch.distributed as dist

from gspo_megatron.algo import group_advantages, kl_penalty
from gspo_megatron.parallel import groups
from gspo_megatron.parallel.context import sequence_multiple
from gspo_megatron.rollout.mismatch import logprob_mismatch
from gspo_megatron.train import checkpoint, rollout_phase
from gspo_megatron.train.config import Config
from gspo_megatron.train.policy import build_policy, build_reference, layout_of
from gspo_megatron.train.policy_step import AlgoConfig, logprob_pass, update_step
from gspo_megatron.train.bootstrap import algo_config, load_prompts, prepare_model_dir, reward_function


def train(cfg: Config, resume: bool = False) -> dict:
    """Run ``cfg`` to ``train.steps``; returns the last step's metrics."""
    groups.init_distributed(timeout_s=cfg.distributed.timeout_s, control_timeout_s=cfg.distributed.control_timeout_s)
    rank0 = dist.get_rank() == 0
    hf_dir = prepare_model_dir(cfg)
    groups.init_model_parallel(layout_of(cfg), seed=cfg.train.seed, timeout_s=cfg.distributed.timeout_s)
    policy = build_policy(cfg, hf_dir)
    reference = build_reference(cfg, policy) if cfg.algo.kl_coef else None
    tokenizer, prompts, eval_prompts = load_prompts(cfg, hf_dir)
    reward_fn = reward_function(cfg)
    algo = algo_config(cfg)
    engine = rollout_phase.make_engine(cfg, hf_dir, tokenizer)  # rank 0's; None elsewhere
    from gspo_megatron.train.metrics_log import MetricsLogger
    from gspo_megatron.train.progress import Progress

    logger = MetricsLogger(cfg.logging.dir, cfg.logging.tensorboard, cfg.logging.wandb_project, enabled=rank0)
    step, version = 0, 0
    if resume and checkpoint.latest(cfg.checkpoint.dir):
        state = checkpoint.load(checkpoint.latest(cfg.checkpoint.dir), policy.model, policy.optimizer, policy.scheduler)
        step, version = state["step"], state["weight_version"]
        prompts.load_state_dict(state["data_position"])
        rollout_phase.sync_weights(policy, engine, f"{version}-resumed")
    progress = Progress(cfg.train.steps, start=step, enabled=rank0)
    seq_multiple = sequence_multiple(cfg.parallel.tensor, cfg.parallel.context, cfg.parallel.sequence_parallel)
    metrics: dict = {}
    try:
        while step < cfg.train.steps:
            step += 1
            start = time.perf_counter()
            rollout = rollout_phase.collect(engine, prompts.next(cfg.rollout.prompts_per_step), cfg, step, tokenizer,
                                            reward_fn, pad_multiple=seq_multiple)
            metrics = dict(rollout.metrics)
            batch = rollout.batch
            batch["loss_mask"] &= rollout.reward_valid.unsqueeze(1)  # a masked reward drops the sample

            rows = _row_plan(batch["input_ids"].shape[0], cfg)
            routing = _old_and_reference_logprobs(policy, reference, batch, rows, cfg, algo, metrics)
            batch["advantages"] = group_advantages(rollout.rewards, cfg.rollout.group_size,
                                                   normalize_std=cfg.algo.normalize_advantage_std)

            t = time.perf_counter()
            metrics.update(_update(policy, batch, rows, routing, cfg, algo))
            metrics["time/update"] = time.perf_counter() - t

            version += 1
            metrics.update(rollout_phase.sync_weights(policy, engine, version))
            if cfg.train.eval_every and step % cfg.train.eval_every == 0 and eval_prompts:
                metrics.update(rollout_phase.evaluate(engine, eval_prompts, cfg, step, tokenizer, reward_fn))
            if cfg.checkpoint.dir and ((cfg.checkpoint.every and step % cfg.checkpoint.every == 0)
                                       or step == cfg.train.steps):
                t = time.perf_counter()
                checkpoint.save(cfg.checkpoint.dir, step, policy.model, policy.optimizer, policy.scheduler,
                                {"weight_version": version, "data_position": prompts.state_dict()},
                                keep=cfg.checkpoint.keep, model_info=policy.write_model_info,
                                async_save=cfg.checkpoint.async_save)
                metrics["time/checkpoint"] = time.perf_counter() - t
            # An asynchronous save becomes `latest` once every rank has written it (the last one: before returning).
            checkpoint.finalize_saves(blocking=step == cfg.train.steps)
            metrics["time/step"] = time.perf_counter() - start
            tokens = int(batch["loss_mask"].sum()) + int(sum(len(s.prompt_ids) for s in rollout.samples))
            metrics["tokens_per_s"] = tokens / metrics["time/step"]
            metrics["lr"] = policy.optimizer.param_groups[0]["lr"]
            example = metrics.pop("example", None)
            logger.log(step, metrics)
            progress.update(step, metrics, example)
            if rank0 and cfg.logging.plot_every and (step % cfg.logging.plot_every == 0 or step == cfg.train.steps):
                from gspo_megatron.train.plots import plot_runs

                plot_runs({"run": logger.path}, Path(cfg.logging.dir) / "metrics.png", title=f"{cfg.algo.name}")
    finally:
        progress.close()
        logger.close()
        if engine is not None:
            engine.close()
    return metrics


def _old_and_reference_logprobs(policy, reference, batch: dict, rows: list[torch.Tensor], cfg: Config,
                                algo: AlgoConfig, metrics: dict):
    """Score the rollout with the current (old) policy, and the reference when there is a KL term: fills
    ``batch["old_logprobs"]`` (and ``ref_logprobs``) and ``metrics``; returns the recorded routing (this rank's
    rows, in the order of ``rows``) for Routing Replay, else None."""
    total = batch["input_ids"].shape[0]
    t = time.perf_counter()
    trainer = logprob_pass(policy.model, _micro_batches(batch, torch.cat(rows), cfg), algo.temperature,
                           record_routing=cfg.algo.routing_replay, with_entropy=True)
    trainer_logprobs = _all_rows(trainer["logprobs"], total, cfg)
    metrics["time/old_logprobs"] = time.perf_counter() - t
    mask = batch["loss_mask"]
    # The policy's entropy per response token: a collapsing policy stops exploring (and learning).
    metrics["entropy"] = float(_all_rows(trainer["entropy"], total, cfg)[mask].mean()) if mask.any() else 0.0
    metrics.update(_mismatch(trainer_logprobs, batch))
    batch["old_logprobs"] = batch["rollout_logprobs"] if cfg.rollout.reuse_rollout_logprobs else trainer_logprobs
    if reference is not None:
        t = time.perf_counter()
        ref = logprob_pass(reference, _micro_batches(batch, torch.cat(rows), cfg), algo.temperature)
        batch["ref_logprobs"] = _all_rows(ref["logprobs"], total, cfg)
        metrics["time/ref_logprobs"] = time.perf_counter() - t
        # KL(policy || reference) before this step's updates, as the loss estimates it.
        metrics["kl_ref"] = float(kl_penalty(trainer_logprobs, batch["ref_logprobs"], mask, algo.kl_estimator,
                                             max_log_ratio=algo.max_log_ratio))
    return trainer.get("routing")


def _row_plan(total: int, cfg: Config) -> list[torch.Tensor]:
    """The rollout rows this data-parallel rank trains on, one index tensor per minibatch.

    Minibatch m is rows [m*M, (m+1)*M); DP rank r takes the r-th contiguous share of it. The old-policy pass
    visits the same rows in the same order, so recorded routing lines up with the update's micro batches.
    """
    from megatron.core import parallel_state as ps

    dp, dp_rank = ps.get_data_parallel_world_size(), ps.get_data_parallel_rank()
    per_minibatch = total // cfg.algo.minibatches
    share = per_minibatch // dp
    return [torch.arange(m * per_minibatch + dp_rank * share, m * per_minibatch + (dp_rank + 1) * share)
            for m in range(cfg.algo.minibatches)]


def _micro_batches(batch: dict, rows: torch.Tensor, cfg: Config, routing: torch.Tensor | None = None) -> list[dict]:
    keys = [k for k in ("input_ids", "labels", "loss_mask", "old_logprobs", "ref_logprobs", "advantages")
            if k in batch]
    size = cfg.parallel.micro_batch_size
    out = []
    for i in range(0, rows.numel(), size):
        micro = {k: batch[k][rows[i:i + size]] for k in keys}
        if routing is not None:
            micro["routing"] = routing[i:i + size]
        out.append(micro)
    return out


def _all_rows(local: torch.Tensor, total: int, cfg: Config) -> torch.Tensor:
    """Per-row results of this DP rank's ``_row_plan`` rows (on the device) -> [total, ...] on every rank's CPU."""
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)  # on the model's device (NCCL)
    per_minibatch = total // cfg.algo.minibatches
    share = per_minibatch // len(parts)
    out = torch.empty((total,) + tuple(local.shape[1:]), dtype=local.dtype)  # the rollout batch's side: CPU
    for r, part in enumerate(parts):
        rows = torch.cat([torch.arange(m * per_minibatch + r * share, m * per_minibatch + (r + 1) * share)
                          for m in range(cfg.algo.minibatches)])
        out[rows] = part.cpu()
    return out


def _mismatch(trainer: torch.Tensor, batch: dict) -> dict:
    """Rollout-vs-trainer log-prob gap over the whole batch."""
    m = logprob_mismatch(trainer, batch["rollout_logprobs"], batch["loss_mask"])
    return {"logprob_diff_max": m["mismatch/token_max_abs"], "logprob_diff_mean": m["mismatch/token_mean_abs"],
            "logprob_diff_seq_log_ratio": m["mismatch/seq_log_ratio_max_abs"]}


def _update(policy, batch: dict, rows: list[torch.Tensor], routing, cfg: Config, algo: AlgoConfig) -> dict:
    """``algo.minibatches`` optimizer steps over the rollout batch; metrics averaged over them."""
    sums: dict[str, float] = {}
    ratios = []
    offset = 0
    for minibatch_rows in rows:
        replay = None if routing is None else routing[offset:offset + minibatch_rows.numel()]
        offset += minibatch_rows.numel()
        out = update_step(policy.model, policy.optimizer, _micro_batches(batch, minibatch_rows, cfg, replay), algo)
        policy.scheduler.step(increment=1)
        valid = out["valid"]
        ratios.append(torch.exp(out["seq_log_ratio"][valid].clamp(-algo.max_log_ratio, algo.max_log_ratio)))
        for key in ("loss", "clip_frac_low", "clip_frac_high", "grad_norm"):
            if key in out:
                sums[key] = sums.get(key, 0.0) + float(out[key])
        sums["skipped_updates"] = sums.get("skipped_updates", 0.0) + (not out["update_successful"])
    metrics = {k: v / cfg.algo.minibatches for k, v in sums.items() if k != "skipped_updates"}
    metrics["skipped_updates"] = sums["skipped_updates"]
    if "clip_frac_low" in metrics:
        metrics["clip_frac"] = metrics["clip_frac_low"] + metrics["clip_frac_high"]
    ratio = torch.cat(ratios)
    if ratio.numel():
        metrics.update(seq_ratio_min=float(ratio.min()), seq_ratio_mean=float(ratio.mean()), seq_ratio_max=float(ratio.max()))
        # KL(old || new) from the sequence ratios the update saw (k3 on the per-token mean log-ratio).
        log_r = torch.log(ratio)
        metrics["approx_kl"] = float((torch.exp(-log_r) - 1 + log_r).mean())
    return metrics
