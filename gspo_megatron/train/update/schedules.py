"""The two passes inside Megatron's pipeline schedules: ``update_step`` (one optimizer step on a minibatch)
and ``logprob_pass`` (log-probs with no gradient: the old and reference policies).

A rollout minibatch is a list of micro batches, each a dict of tensors:

    input_ids     [b, S] long   prompt + response tokens (the model input)
    labels        [b, S] long   the next token at each position (input_ids shifted left)
    loss_mask     [b, S] bool   True where labels[t] is a response token
    old_logprobs  [b, S] float  log pi_old(labels[t]), aligned with labels (ignored where not loss_mask)
    advantages    [b] float     (or [b, S] per-token advantages for gspo_token and grpo)
    ref_logprobs  [b, S] float  optional, for a KL penalty
    old_routing   [b, L, s_local, k] int  optional: experts the old policy chose (``logprob_pass`` with
                  ``record_old_routing=True``); ``update_step(replay_old_routing=True)`` replays them (GRPO +
                  Routing Replay), else they are compared with the experts the update pass chooses (expert
                  volatility: how many routing decisions one update changed)
    rollout_routing [b, S, L, k] int  optional: the engine's experts of every layer, replayed by both passes
                  (rollout routing replay, R3)

The loss of each micro batch, its normalisation and its context-parallel reduction: ``loss``.

Micro batches arrive as CPU tensors of whole sequences; ``batch_for_model`` (in both forward steps) puts each
where the model needs it: on ``environment.device()`` and split over context-parallel ranks. Results come back
on the device; the trainer moves what it keeps to the CPU (``train.loop``).

Packed sequences (``pack=True``, ``parallel.pack_sequences``; micro batches then carry ``seq_lengths`` [b]): each
micro batch runs as one row of its sequences back to back (``parallel.packing``: TransformerEngine's THD
attention, or a block-diagonal causal mask with megatron's local attention). The model's per-token results are
unpacked to the padded [b, S] layout before the loss, so losses, sequence sums and metrics are those of the padded
path; routing records are kept per sequence ([b, L, S, k], gathered over TP under sequence parallelism) and packed
again for replay. Not with context parallelism (yet).

Context parallelism: the log-prob pass gathers its per-token results back over the CP group.
"""


from __future__ import annotations

from functools import partial
from typing import Iterable

import torch

from gspo_megatron import algo, environment
from gspo_megatron.model.hidden_output import hidden_states_instead_of_logits
from gspo_megatron.parallel.reductions import all_gather_rows, broadcast_from_last_stage
from gspo_megatron.train.resilience.faults import guarded_step
from gspo_megatron.train.update.batch import (Packing, batch_for_model, computed_positions, megatron_groups,
                                              schedule_packing)
from gspo_megatron.train.update.loss import LossConfig, logprob_results, policy_loss
from gspo_megatron.train.update.routing import (end_routing_replay, packed_routing, rank_routing, replay,
                                                routing_changes, router_token_mask, sequence_routing,
                                                set_routing_action)


def _forward(model, batch: dict):
    """The last stage's hidden states (logits are never formed) and what the loss needs of the output layer."""
    with hidden_states_instead_of_logits(model) as captured:
        output = model(batch["input_ids"], batch["position_ids"], attention_mask=batch.get("attention_mask"),
                       packed_seq_params=batch.get("packed_seq_params"))
    return output, captured


def policy_forward_step(loss_config: LossConfig, packed: Packing | None = None, replay_old_routing: bool = False):
    """A ``forward_step_func`` for ``get_forward_backward_func`` computing the policy loss; a micro batch's
    ``old_routing`` is replayed with ``replay_old_routing``, else compared (expert volatility)."""

    def forward_step(data_iterator, model):
        batch = batch_for_model(next(data_iterator), packed)
        if replay_old_routing and "old_routing" in batch:
            replay(packed_routing(batch, batch["old_routing"]))
        elif "rollout_routing" in batch:
            replay(rank_routing(model, batch["rollout_routing"]))
        output, captured = _forward(model, batch)
        if not replay_old_routing and "old_routing" in batch:  # recorded by this forward (update_step set RECORD)
            new = sequence_routing(batch)
            changes = routing_changes(batch["old_routing"].to(new.device), new,
                                      router_token_mask(batch["loss_mask"], new.shape[2]))
            tp_rank = megatron_groups()[2].get_tensor_model_parallel_rank()
            if packed is not None and packed.sequence_parallel and tp_rank:
                changes = torch.zeros_like(changes)  # every TP rank holds the gathered record: count it once
            volatility.append(changes)
        return output, partial(policy_loss, loss_config, batch, captured)

    volatility: list[torch.Tensor] = []
    forward_step.volatility = volatility
    return forward_step


def _run_schedule(model, forward_step, micro_batches: list[dict], forward_only: bool, packed: Packing | None = None):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    b, seq = micro_batches[0]["input_ids"].shape
    if packed is not None:  # one row per micro batch; its length matters to pipeline sends only (packed.length)
        b, seq = 1, packed.length or packed.row_length(micro_batches[0]["seq_lengths"])
    return get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(micro_batches),
        model=[model],
        num_microbatches=len(micro_batches),
        seq_length=seq,
        micro_batch_size=b,
        forward_only=forward_only,
    )


def update_step(model, optimizer, micro_batches: list[dict], loss_config: LossConfig, pack: bool = False,
                replay_old_routing: bool = False) -> dict:
    """One optimizer step on one minibatch (its share on this data-parallel rank, as micro batches); with
    ``pack``, each micro batch runs as one packed row (micro batches carry ``seq_lengths``).

    Micro batches may carry ``old_routing`` [b, L_local, s_local, k] (the old policy's experts: with
    ``replay_old_routing`` replayed, GRPO + Routing Replay; else compared with the experts this forward chooses,
    expert volatility) or ``rollout_routing`` [b, S, L, k] (the engine's experts of every layer, replayed: rollout
    routing replay).

    Returns, on every rank (CPU tensors): ``loss`` (the minibatch's mean loss per unit, over all DP ranks),
    ``stats`` [N, len(algo.metrics.LOSS_STATS)] for every sequence of the minibatch (gathered over DP ranks in
    rank order: ``algo.update_metrics`` turns them into the logged metrics), ``seq_log_ratio`` and ``valid`` [N]
    from them, ``grad_norm``, ``update_successful``, ``token_positions`` (this rank's ``computed_positions``), and
    with ``old_routing`` compared, ``routing_changes`` [changed, decisions] summed over all ranks. If any rank's loss or
    gradient is non-finite the step is skipped on every rank (``train.resilience.faults.guarded_step``): weights and
    optimizer state are left as they were.
    """
    _, _, ps = megatron_groups()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    packed = schedule_packing(model, micro_batches, pack)
    forward_step = policy_forward_step(loss_config, packed, replay_old_routing)
    replays_old = replay_old_routing and "old_routing" in micro_batches[0]
    volatility = not replay_old_routing and "old_routing" in micro_batches[0]
    if volatility:
        set_routing_action("RECORD")
    try:
        results = _run_schedule(model, forward_step, micro_batches, forward_only=False, packed=packed)
    finally:
        if replays_old or "rollout_routing" in micro_batches[0] or volatility:
            end_routing_replay()
    # Skipped on every rank when any loss or gradient is NaN/inf (resilience.faults: megatron's fp32/bf16 step would
    # apply it).
    update_successful, grad_norm = guarded_step(
        model, optimizer, [r["loss_sum"] for r in results] if ps.is_pipeline_last_stage() else [])
    summary = None
    if ps.is_pipeline_last_stage():
        totals = torch.stack([sum(r["loss_sum"] for r in results).float(), sum(r["units"] for r in results).float()])
        torch.distributed.all_reduce(totals, group=ps.get_data_parallel_group(with_context_parallel=True))
        # Every CP rank holds whole-sequence stats of the same sequences: gathered over DP ranks only.
        stats = all_gather_rows(torch.cat([r["stats"] for r in results]), ps.get_data_parallel_group())
        summary = {"loss": totals[0] / totals[1].clamp_min(1), "stats": stats}
    # A handful of numbers a step: back on the CPU for the trainer's metrics.
    out = {k: v.cpu() for k, v in broadcast_from_last_stage(summary, ps.get_pipeline_model_parallel_group()).items()}
    columns = algo.SEQUENCE_STATS
    tokens, sums = out["stats"][:, columns.index("tokens")], out["stats"][:, columns.index("log_ratio_sum")]
    out["valid"] = tokens > 0
    out["seq_log_ratio"] = torch.where(out["valid"], sums / tokens.clamp_min(1), torch.zeros_like(sums))
    if volatility:
        # Each rank's routers saw distinct (token, layer) pairs (TP/SP, CP and DP split tokens, PP splits layers).
        counts = torch.stack(forward_step.volatility).sum(dim=0).to(environment.device())
        torch.distributed.all_reduce(counts)
        out["routing_changes"] = counts.cpu()
    out["grad_norm"] = grad_norm
    out["token_positions"] = computed_positions(micro_batches, packed)
    out["update_successful"] = update_successful
    return out


@torch.no_grad()
def logprob_pass(model, micro_batches: Iterable[dict], temperature: float = 1.0, record_old_routing: bool = False,
                 with_entropy: bool = False, pack: bool = False) -> dict:
    """Log-likelihoods of each micro batch's labels, with no gradient: the old- and reference-policy pass.

    Returns on every pipeline rank, on the model's device: ``logprobs`` [n, S] per token (meaningful where
    loss_mask is set), ``seq_logprob`` [n] (sum over response tokens) and ``num_tokens`` [n]; with
    ``with_entropy``, ``entropy`` [n, S] of each position's (tempered) distribution. With ``record_old_routing``,
    also ``old_routing`` [n, L_local, s_local, k]: the experts this rank's routers chose, to put in the update
    pass's micro batches for Routing Replay or expert volatility (it stays on this rank: the same rank runs those
    layers in the update).
    Micro batches with ``rollout_routing`` (the engine's experts) are computed under that routing instead. With
    ``pack``, micro batches run as packed rows and the record is [n, L_local, S, k] (whole sequences, every TP rank).
    """
    _, _, ps = megatron_groups()
    micro_batches = list(micro_batches)
    packed = schedule_packing(model, micro_batches, pack)
    old_routing = []
    replays = bool(micro_batches) and "rollout_routing" in micro_batches[0]
    if record_old_routing and replays:
        raise ValueError("logprob_pass: record_old_routing with rollout_routing in the micro batches (the routers "
                         "replay the engine's experts: there is nothing of their own to record)")
    if record_old_routing:
        set_routing_action("RECORD")

    def forward_step(data_iterator, model):
        batch = batch_for_model(next(data_iterator), packed)
        if replays:
            replay(rank_routing(model, batch["rollout_routing"]))
        output, captured = _forward(model, batch)
        if record_old_routing:
            old_routing.append(sequence_routing(batch))
        return output, partial(logprob_results, batch, captured, temperature, with_entropy)

    try:
        results = _run_schedule(model, forward_step, micro_batches, forward_only=True, packed=packed)
    finally:
        if record_old_routing or replays:
            end_routing_replay()
    out = None
    if ps.is_pipeline_last_stage():
        keys = ("logprobs", "seq_logprob", "num_tokens") + (("entropy",) if with_entropy else ())
        out = {key: torch.cat([r[key] for r in results]) for key in keys}
    out = broadcast_from_last_stage(out, ps.get_pipeline_model_parallel_group())
    if record_old_routing:
        out["old_routing"] = torch.cat(old_routing)
    return out
