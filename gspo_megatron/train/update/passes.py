"""The trainer's passes over a step's rollout: the old-policy (and reference) log-prob passes and the minibatch
updates, and the metrics of all of it over every rank. The passes return per-row results (routing records too) in
row order (``rows``), so the update's micro batches may group rows differently.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from gspo_megatron import algo, environment
from gspo_megatron.algo import kl_penalty
from gspo_megatron.train.startup.config import Config, measures_volatility, runs_old_pass
from gspo_megatron.train.update.loss import LossConfig
from gspo_megatron.train.update.rows import all_rows, micro_batch_rows, micro_batches
from gspo_megatron.train.update.schedules import logprob_pass, update_step


def _pass(model, batch: dict, rows: torch.Tensor, cfg: Config, with_rollout_routing: bool = True, **kwargs) -> dict:
    """``logprob_pass`` over ``rows``, its per-row results back in the order of ``rows`` (micro batches may
    regroup them); ``with_rollout_routing``: as ``micro_batches`` (the frozen reference routes freely)."""
    parts = micro_batch_rows(batch, rows, cfg)
    micro = micro_batches(batch, rows, cfg, parts=parts, with_rollout_routing=with_rollout_routing)
    out = logprob_pass(model, micro, pack=cfg.parallel.pack_sequences, **kwargs)
    order = torch.cat(parts)
    if torch.equal(order, torch.arange(rows.numel())):
        return out
    inverse = torch.argsort(order)
    return {k: v[inverse.to(v.device)] if torch.is_tensor(v) and v.dim() and v.shape[0] == rows.numel() else v
            for k, v in out.items()}


def old_logprobs(policy, batch: dict, rows: list[torch.Tensor], cfg: Config, loss_config: LossConfig,
                 metrics: dict):
    """pi_old into ``batch["old_logprobs"]``: the trainer's pass over this rank's rows, or the engine's log-probs
    with rollout.reuse_rollout_logprobs (no pass). The pass also gives the policy's entropy and the
    rollout-vs-trainer mismatch over the whole batch (under rollout routing replay, with the engine's experts
    replayed). Rows of ``batch["stale"]`` (sampled by older weights than the policy's: ``rollout.mode`` one_step_off
    or async, partial rollouts) take the engine's log-probs, their behaviour policy's, or with algo.decoupled_clip
    keep this pass's (the loss's correction weighs them: ``algo.correction``). Returns this rank's ``old_routing``
    record when Routing Replay (all its rows, in the order of ``rows``) or expert volatility (the second
    minibatch's rows) needs it, else None."""
    if not runs_old_pass(cfg):
        batch["old_logprobs"] = batch["rollout_logprobs"]  # the mismatch is measured by the first update instead
        return None
    total = batch["input_ids"].shape[0]
    record = cfg.algo.replays_old_routing or measures_volatility(cfg, policy.spec)
    t = time.perf_counter()
    trainer = _pass(policy.model, batch, torch.cat(rows), cfg, temperature=loss_config.temperature,
                    record_old_routing=record, with_entropy=True)
    trainer_logprobs = all_rows(trainer["logprobs"], total, cfg)
    metrics["time/old_logprobs"] = time.perf_counter() - t
    mask = batch["loss_mask"]
    # The policy's entropy per response token: a collapsing policy stops exploring (and learning).
    metrics["entropy"] = float(all_rows(trainer["entropy"], total, cfg)[mask].mean()) if mask.any() else 0.0
    metrics.update(algo.mismatch_metrics(algo.sequence_stats(trainer_logprobs, batch["rollout_logprobs"], mask),
                                         (loss_config.eps_low, loss_config.eps_high)))
    batch["old_logprobs"] = batch["rollout_logprobs"] if cfg.rollout.reuse_rollout_logprobs else trainer_logprobs
    stale = batch.get("stale")
    if stale is not None and stale.any() and not cfg.algo.decoupled_clip:
        # With decoupled_clip they keep this pass (the proximal policy) and the correction weighs them.
        batch["old_logprobs"] = torch.where(stale.unsqueeze(1), batch["rollout_logprobs"], batch["old_logprobs"])
    if record and not cfg.algo.replays_old_routing:  # volatility compares the second minibatch's rows only
        first = rows[0].numel()
        return trainer["old_routing"][first:first + rows[1].numel()].clone()
    return trainer.get("old_routing")


def reference_logprobs(reference, batch: dict, rows: list[torch.Tensor], cfg: Config, loss_config: LossConfig,
                       metrics: dict) -> None:
    """The frozen reference's log-probs into ``batch["ref_logprobs"]`` and ``kl_ref``: KL(policy || reference)
    before this step's updates, as the loss estimates it."""
    t = time.perf_counter()
    ref = _pass(reference, batch, torch.cat(rows), cfg, with_rollout_routing=False,
                temperature=loss_config.temperature)
    batch["ref_logprobs"] = all_rows(ref["logprobs"], batch["input_ids"].shape[0], cfg)
    metrics["time/ref_logprobs"] = time.perf_counter() - t
    metrics["kl_ref"] = float(kl_penalty(batch["old_logprobs"], batch["ref_logprobs"], batch["loss_mask"],
                                         loss_config.kl_estimator, max_log_ratio=loss_config.max_log_ratio))


def _padding_fraction(positions: torch.Tensor) -> float:
    """The share of the update's computed token positions, over every data-parallel rank, that are padding
    (padded rows: all but each sequence's tokens; packed rows: the row's rounding, and each sequence's rounding to
    2 * cp chunks under context parallelism)."""
    from megatron.core import parallel_state as ps

    totals = positions.to(environment.device())
    dist.all_reduce(totals, group=ps.get_data_parallel_group())
    real, computed = totals.tolist()
    return 1.0 - real / computed if computed else 0.0


def update(policy, batch: dict, rows: list[torch.Tensor], old_routing, cfg: Config, loss_config: LossConfig) -> dict:
    """``algo.minibatches`` optimizer steps over the rollout batch, and their metrics over every sequence of every
    rank (``algo.update_metrics``). ``old_routing``: this rank's old-policy record (``old_logprobs``), replayed with
    Routing Replay, else the second minibatch's, compared with its own routing (expert_volatility: after one step).
    Under rollout routing replay every micro batch carries the engine's experts instead (``micro_batches``)."""
    losses, norms, stats = [], [], []
    skipped, offset, metrics = 0, 0, {}
    positions = torch.zeros(2, dtype=torch.float64)  # (sequence tokens, computed positions) of this rank's rows
    for m, minibatch_rows in enumerate(rows):
        if cfg.algo.replays_old_routing:
            record = old_routing[offset:offset + minibatch_rows.numel()]
        else:  # compared: the second minibatch's forward runs on weights one step past the old policy's
            record = old_routing if m == 1 else None
        micro = micro_batches(batch, minibatch_rows, cfg, record)
        offset += minibatch_rows.numel()
        out = update_step(policy.model, policy.optimizer, micro, loss_config, pack=cfg.parallel.pack_sequences,
                          replay_old_routing=cfg.algo.replays_old_routing)
        if out["update_successful"]:  # a skipped (non-finite) update leaves the LR schedule too, as megatron does
            policy.scheduler.step(increment=1)
        positions += torch.tensor(out["token_positions"], dtype=torch.float64)
        losses.append(float(out["loss"]))
        if out["update_successful"]:  # a skipped update's norm is NaN/inf: the metric averages the applied ones
            norms.append(out["grad_norm"])
        stats.append(out["stats"])
        skipped += not out["update_successful"]
        if "routing_changes" in out:
            changed, decisions = out["routing_changes"].tolist()
            metrics["expert_volatility"] = changed / max(decisions, 1.0)
        if m == 0 and not runs_old_pass(cfg):
            # pi_old is the engine's and the weights are still the rollout's: the first minibatch's ratios are the
            # rollout-vs-trainer mismatch (over its sequences), measured without an old-policy pass.
            metrics.update(algo.mismatch_metrics(out["stats"][:, :len(algo.SEQUENCE_STATS)],
                                                 (loss_config.eps_low, loss_config.eps_high)))
    metrics.update(algo.update_metrics(torch.cat(stats), loss_config.unit, loss_config.max_log_ratio))
    if loss_config.correction.enabled:
        metrics.update(algo.correction_metrics(torch.cat(stats)))
    metrics.update(loss=sum(losses) / len(losses), grad_norm=sum(norms) / len(norms) if norms else float("nan"),
                   skipped_updates=float(skipped), padding_frac=_padding_fraction(positions))
    return metrics
