"""Which rollout rows each data-parallel rank trains on, and in which micro batches.

Minibatch m is rows [m*M, (m+1)*M) of the rollout batch; DP rank r trains on the r-th contiguous share of each
(``row_plan``), in micro batches of ``parallel.micro_batch_size`` rows or, with ``parallel.max_tokens_per_micro_batch``,
of balanced token counts (``micro_batch_rows``). ``all_rows`` gathers per-row results back into the batch's order.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from gspo_megatron import environment
from gspo_megatron.parallel import packing
from gspo_megatron.train.startup.config import Config, correction


def row_plan(total: int, cfg: Config) -> list[torch.Tensor]:
    """The rollout rows this data-parallel rank trains on, one index tensor per minibatch."""
    from megatron.core import parallel_state as ps

    return rank_rows(total, cfg.algo.minibatches, ps.get_data_parallel_world_size(), ps.get_data_parallel_rank())


def rank_rows(total: int, minibatches: int, dp: int, dp_rank: int) -> list[torch.Tensor]:
    """Data-parallel rank ``dp_rank``'s share of each minibatch of ``total`` rows: consecutive, in rank order."""
    per_minibatch = total // minibatches
    share = per_minibatch // dp
    return [torch.arange(m * per_minibatch + dp_rank * share, m * per_minibatch + (dp_rank + 1) * share)
            for m in range(minibatches)]


def micro_batch_rows(batch: dict, rows: torch.Tensor, cfg: Config) -> list[torch.Tensor]:
    """Each micro batch's positions in ``rows``: consecutive runs of ``parallel.micro_batch_size``, or with
    ``parallel.max_tokens_per_micro_batch`` the fewest token-balanced micro batches within the budget
    (``parallel.packing.balance``; a longer sequence is its own micro batch), as many on every data-parallel rank
    (pipeline schedules run in step; one all-reduce per round over the DP group)."""
    budget = cfg.parallel.max_tokens_per_micro_batch
    if not budget:
        size = cfg.parallel.micro_batch_size
        return [torch.arange(i, min(i + size, rows.numel())) for i in range(0, rows.numel(), size)]
    from megatron.core import parallel_state as ps

    lengths = sequence_lengths(batch)[rows]
    count = 1
    while True:  # ends: every round raises ``count``, and each rank fits with one micro batch per sequence
        agreed = torch.tensor([packing.smallest_count(lengths, budget, count)], device=environment.device())
        dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=ps.get_data_parallel_group())
        if int(agreed) == count:
            return packing.balance(lengths, count)[0]
        count = int(agreed)


def micro_batches(batch: dict, rows: torch.Tensor, cfg: Config, old_routing: torch.Tensor | None = None,
                  parts: list[torch.Tensor] | None = None, with_rollout_routing: bool = True) -> list[dict]:
    """``rows`` of the batch as micro batches (``micro_batch_rows``, or ``parts`` already planned); ``old_routing``
    (this rank's old-policy record for exactly these rows, in their order) goes in as ``old_routing`` (replayed or
    compared: ``update_step``'s ``replay_old_routing``), and with a correction the engine's ``rollout_logprobs``. Each
    carries ``seq_lengths`` (packed rows hold those
    tokens). With rollout routing replay (and ``with_rollout_routing``) the batch's ``rollout_routing`` goes in too:
    the engine's experts."""
    keys = [k for k in ("input_ids", "labels", "loss_mask", "old_logprobs", "ref_logprobs", "advantages")
            if k in batch]
    if correction(cfg).enabled:  # the loss's behaviour weights need the engine's log-probs
        keys.append("rollout_logprobs")
    if with_rollout_routing and cfg.algo.replays_rollout_routing:
        if "rollout_routing" not in batch:
            raise ValueError("algo.routing_replay=rollout but the rollout batch has no rollout_routing: the "
                             "engine returned no routed experts")
        keys.append("rollout_routing")
    out = []
    for part in micro_batch_rows(batch, rows, cfg) if parts is None else parts:
        micro = {k: batch[k][rows[part]] for k in keys}
        micro["seq_lengths"] = sequence_lengths(batch)[rows[part]]  # what a packed row holds of each row
        if old_routing is not None:
            micro["old_routing"] = old_routing[part.to(old_routing.device)]
        out.append(micro)
    return out


def sequence_lengths(batch: dict) -> torch.Tensor:
    """[B] tokens of each rollout row (prompt + response; at least 1)."""
    return (batch["prompt_lengths"] + batch["response_lengths"]).clamp_min(1)


def all_rows(local: torch.Tensor, total: int, cfg: Config) -> torch.Tensor:
    """Per-row results of this DP rank's ``row_plan`` rows (on the device) -> [total, ...] on every rank's CPU."""
    from megatron.core import parallel_state as ps

    group = ps.get_data_parallel_group()
    parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, local.contiguous(), group=group)  # on the model's device (NCCL)
    out = torch.empty((total,) + tuple(local.shape[1:]), dtype=local.dtype)  # the rollout batch's side: CPU
    for r, part in enumerate(parts):
        out[torch.cat(rank_rows(total, cfg.algo.minibatches, len(parts), r))] = part.cpu()
    return out
