"""GSPO (and GSPO-token / GRPO) inside Megatron's pipeline schedules.

A rollout minibatch is a list of micro batches, each a dict of tensors:

    input_ids     [b, S] long   prompt + response tokens (the model input)
    labels        [b, S] long   the next token at each position (input_ids shifted left)
    loss_mask     [b, S] bool   True where labels[t] is a response token
    old_logprobs  [b, S] float  log pi_old(labels[t]), aligned with labels (ignored where not loss_mask)
    advantages    [b] float     (or [b, S] per-token advantages for gspo_token and grpo)
    ref_logprobs  [b, S] float  optional, for a KL penalty
    routing       [b, L, s_local, k] int  optional: experts the old policy chose (``logprob_pass`` with
                  ``record_routing=True``); when present the update pass replays them (GRPO + Routing Replay)
    old_routing   [b, L, s_local, k] int  optional, instead: the same record, compared with the experts the update
                  pass chooses (expert volatility: how many routing decisions one update changed)

Normalisation: megatron-core's per-token-loss mode is used with *sequences* as the unit (tokens for GRPO
token-mean). Each micro batch's loss function returns (sum of its sequences' losses, number of sequences);
the schedule does not divide by the micro batch count, DDP sums gradients over data-parallel ranks, and
``finalize_model_grads`` divides by the number of sequences summed over all micro batches and DP ranks.
So every sequence of the minibatch weighs the same in the gradient however the minibatch is split, exactly
as in the single-process ``gspo_loss``. Models must be built with ``calculate_per_token_loss=True``.

Micro batches arrive as CPU tensors of whole sequences; ``batch_for_model`` (in both forward steps) puts each
where the model needs it: on ``environment.device()`` and split over context-parallel ranks. Results come back
on the device; the trainer moves what it keeps to the CPU (``train.loop``).

Packed sequences (``pack=True``, ``parallel.pack_sequences``; micro batches then carry ``seq_lengths`` [b]): each
micro batch runs as one row of its sequences back to back (``parallel.packing``: TransformerEngine's THD
attention, or a block-diagonal causal mask with megatron's local attention). The model's per-token results are
unpacked to the padded [b, S] layout before the loss, so losses, sequence sums and metrics are those of the padded
path; routing records are kept per sequence ([b, L, S, k], gathered over TP under sequence parallelism) and packed
again for replay. Not with context parallelism (yet).

Context parallelism (GSPO): each CP rank holds megatron's load-balanced share of every sequence
(``parallel.context``); its per-sequence partial sums are all-reduced as scalars (``parallel.reductions``),
every CP rank computes the same loss, and only CP rank 0 counts the sequences (the count is summed over the
DP x CP group). The log-prob pass gathers its per-token results back over the CP group.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial
from typing import Iterable

import torch

from gspo_megatron import algo, environment
from gspo_megatron.model.hidden_output import hidden_states_instead_of_logits
from gspo_megatron.ops import vocab_parallel_logprobs, vocab_parallel_sequence_loss
from gspo_megatron.parallel import context, packing
from gspo_megatron.parallel.reductions import (all_gather_rows, all_reduce_sequence_stats, all_reduce_sequence_sums,
                                              broadcast_from_last_stage)
from gspo_megatron.train.resilience.faults import guarded_step

ALGORITHMS = ("gspo", "gspo_token", "grpo")


@dataclass(frozen=True)
class AlgoConfig:
    """The policy loss. Defaults are the GSPO paper's."""

    name: str = "gspo"
    eps_low: float = 3e-4
    eps_high: float = 4e-4
    max_log_ratio: float = 10.0
    grpo_aggregation: str = "token-mean"  # or "seq-mean-token-mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0  # an entropy bonus: loss - entropy_coef * mean entropy (aggregated like the loss)
    temperature: float = 1.0  # the rollout's sampling temperature: log-probs are of logits / temperature
    fused_loss: bool = True  # the loss inside the output layer's op (ops.sequence_loss); False: log-probs, then loss

    def __post_init__(self):
        if self.name not in ALGORITHMS:
            raise ValueError(f"algo.name={self.name!r} is not one of {ALGORITHMS}")
        if self.temperature <= 0:
            raise ValueError(f"algo.temperature={self.temperature} must be > 0")

    @property
    def unit(self) -> str:
        """What the loss clips: "sequence" (GSPO) or "token" (GRPO, GSPO-token); the unit of ``clip_frac``."""
        return "sequence" if self.name == "gspo" else "token"

    @classmethod
    def grpo(cls, **kwargs) -> "AlgoConfig":
        """The paper's GRPO baseline: token-level clip 0.2 / 0.27."""
        return cls(name="grpo", eps_low=0.2, eps_high=0.27, **kwargs)


def _groups():
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_group(), ps.get_context_parallel_group(), ps


def token_logprobs(output_tensor: torch.Tensor, captured, labels: torch.Tensor, temperature: float,
                   with_entropy: bool = False):
    """[b, s_local, H] last-stage hidden states -> log pi(labels) [b, S] through the fused op (and the entropy of
    each position's distribution [b, S] with ``with_entropy``).

    ``captured``: the output layer's weight, sequence parallelism and real vocabulary size
    (``model.hidden_output.OutputLayer``); padding rows of the vocabulary take no part in the softmax.
    """
    tp_group, _, _ = _groups()
    hidden = output_tensor.transpose(0, 1)  # [s_local, b, H]: the op gathers the sequence dim under SP
    out = vocab_parallel_logprobs(
        hidden, captured.weight, labels.t(), tp_group=tp_group, temperature=temperature,
        sequence_parallel=captured.sequence_parallel, vocab_size=captured.vocab_size, return_entropy=with_entropy,
    )
    return (out[0].t(), out[1].t()) if with_entropy else out.t()


def _loss_terms(algo_config: AlgoConfig, batch: dict, logprobs: torch.Tensor):
    """(loss summed over this micro batch's units, number of units, per-sequence stats [b, len(SEQUENCE_STATS)])
    for one micro batch (or a chunk of its sequences)."""
    _, cp_group, ps = _groups()
    cfg = algo_config
    mask, old = batch["loss_mask"], batch["old_logprobs"]
    ref = batch.get("ref_logprobs")
    kl = dict(ref_logprobs=ref, kl_coef=cfg.kl_coef, kl_estimator=cfg.kl_estimator)
    clip = dict(eps_low=cfg.eps_low, eps_high=cfg.eps_high, max_log_ratio=cfg.max_log_ratio)
    cp = ps.get_context_parallel_world_size()
    if cp > 1 and (cfg.name != "gspo" or cfg.kl_coef or cfg.entropy_coef):
        raise NotImplementedError(
            f"algo.name={cfg.name!r} (kl_coef={cfg.kl_coef}, entropy_coef={cfg.entropy_coef}) under context "
            "parallelism: only gspo without KL or entropy terms reduces over CP ranks so far"
        )
    if cfg.name == "gspo":
        sums, counts = algo.masked_log_ratio_sums(logprobs, old, mask)
        sums, counts = all_reduce_sequence_sums(sums, counts, cp_group)
        terms = algo.gspo_loss_from_sums(sums, counts, batch["advantages"], num_sequences=1.0, **clip)
        loss = terms.loss
        if cfg.kl_coef:
            kl_term, _ = algo.kl.kl_loss_term(
                logprobs, ref, mask, cfg.kl_coef, cfg.kl_estimator, "seq-mean-token-mean", cfg.max_log_ratio,
                num_sequences=1.0,
            )
            loss = loss + kl_term
        # Only CP rank 0 counts the sequences (the count is summed over DP x CP).
        units = terms.valid.sum() if ps.get_context_parallel_rank() == 0 else torch.zeros_like(terms.valid.sum())
        clipped = (terms.clipped_low & terms.valid, terms.clipped_high & terms.valid)
    elif cfg.name == "gspo_token":
        terms = algo.gspo_token_terms(logprobs, old, _token_advantages(batch), mask, num_sequences=1.0,
                                      **clip, **kl)
        loss, units, clipped = terms.loss, mask.any(dim=-1).sum(), (terms.clipped_low, terms.clipped_high)
    else:
        per_token = cfg.grpo_aggregation == "token-mean"
        denominator = dict(num_tokens=1.0) if per_token else dict(num_sequences=1.0)
        terms = algo.grpo_terms(logprobs, old, batch["advantages"], mask, aggregation=cfg.grpo_aggregation,
                                **denominator, **clip, **kl)
        loss, clipped = terms.loss, (terms.clipped_low, terms.clipped_high)
        units = mask.sum() if per_token else mask.any(dim=-1).sum()
    stats = algo.sequence_stats(logprobs, old, mask, *clipped, max_log_ratio=cfg.max_log_ratio).float()
    if cp > 1:  # this rank's columns are partial sums over its slice of each sequence
        max_columns = tuple(algo.SEQUENCE_STATS.index(name) for name in algo.metrics.MAX_STATS)
        stats = all_reduce_sequence_stats(stats, max_columns, cp_group)
    return loss, units, stats


def _token_advantages(batch: dict) -> torch.Tensor:
    """GSPO-token's [b, S] advantages; a [b] sequence advantage is broadcast over the response (= GSPO)."""
    advantages = batch["advantages"]
    if advantages.dim() == 1:
        return advantages.unsqueeze(1).expand(batch["loss_mask"].shape)
    return advantages


def _entropy_sum(entropy: torch.Tensor, mask: torch.Tensor, cfg: AlgoConfig) -> torch.Tensor:
    """This micro batch's entropy, summed over the loss's units: response tokens for GRPO token-mean, else each
    sequence's mean over its response tokens (so the bonus is normalised exactly as the policy loss is)."""
    masked = entropy * mask
    if cfg.name == "grpo" and cfg.grpo_aggregation == "token-mean":
        return masked.sum()
    return (masked.sum(dim=-1) / mask.sum(dim=-1).clamp_min(1)).sum()


def _sequences_loss(cfg: AlgoConfig, batch: dict, sequences: slice, logprobs: torch.Tensor,
                    entropy: torch.Tensor | None):
    """The loss of the micro batch's ``sequences`` (a sum over them: the normaliser is applied after the schedule)
    from their log-probs [k, S] (and entropies), with the per-sequence statistics and the unit count."""
    part = {key: value[sequences] for key, value in batch.items() if torch.is_tensor(value)}
    loss, units, stats = _loss_terms(cfg, part, logprobs)
    extras = {"units": units, "stats": stats}
    if entropy is not None:
        entropy_sum = _entropy_sum(entropy, part["loss_mask"], cfg)
        loss = loss - cfg.entropy_coef * entropy_sum
        extras["entropy_sum"] = entropy_sum.detach()
    return loss, extras


def _padded(batch: dict, values: torch.Tensor | None) -> torch.Tensor | None:
    """Per-token results of the model's rows -> the micro batch's padded [b, S] layout (packed rows: unpacked)."""
    if values is None or "unpack_index" not in batch:
        return values
    return packing.unpack(values, batch["unpack_index"])


def _packed_sequences_loss(cfg: AlgoConfig, batch: dict, index: torch.Tensor, sequences: slice,
                           logprobs: torch.Tensor, entropy: torch.Tensor | None):
    """``_sequences_loss`` of every sequence of a packed row ([1, N] log-probs: the op's one "sequence"), unpacked
    to the padded layout by ``index`` [b, S]."""
    unpacked = {"unpack_index": index}
    return _sequences_loss(cfg, batch, slice(None), _padded(unpacked, logprobs), _padded(unpacked, entropy))


def _loss_func(algo_config: AlgoConfig, batch: dict, captured, output_tensor: torch.Tensor):
    cfg = algo_config
    bonus = bool(cfg.entropy_coef)
    packed = "unpack_index" in batch
    # The loss sees the padded per-sequence tensors (the model's packed row is not sliced by sequence).
    loss_batch = {k: v for k, v in batch.items() if k not in packing.MODEL_KEYS} if packed else batch
    if cfg.fused_loss:
        # Each chunk of whole sequences gets its loss and logits gradient at once: no recomputation in backward.
        tp_group, _, _ = _groups()
        loss_fn = (partial(_packed_sequences_loss, cfg, loss_batch, batch["unpack_index"]) if packed
                   else partial(_sequences_loss, cfg, batch))
        loss, _, _, stats = vocab_parallel_sequence_loss(
            output_tensor.transpose(0, 1), captured.weight, batch["labels"].t(), loss_fn,
            tp_group=tp_group, temperature=cfg.temperature, with_entropy=bonus,
            sequence_parallel=captured.sequence_parallel, vocab_size=captured.vocab_size,
        )
    else:
        out = token_logprobs(output_tensor, captured, batch["labels"], cfg.temperature, with_entropy=bonus)
        logprobs, entropy = out if bonus else (out, None)
        loss, stats = _sequences_loss(cfg, loss_batch, slice(None), _padded(batch, logprobs), _padded(batch, entropy))
    units = stats.pop("units").to(torch.int)
    # Every CP rank holds the whole loss; like the units, it is reported by CP rank 0 alone (summed over DP x CP).
    _, _, ps = _groups()
    reported = loss.detach().clone() if ps.get_context_parallel_rank() == 0 else torch.zeros_like(loss.detach())
    return loss, units, {"loss_sum": reported, "units": units.clone(), **stats}


# ---- routing record / replay (megatron-core's RouterReplay; the model needs moe_enable_routing_replay=True) ----


def _router_replay():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    return RouterReplay, RouterReplayAction


def _recorded_routing(batch_size: int) -> torch.Tensor:
    """This rank's routers' recorded top-k after one forward: [b, L_local, s_local, k] int16.

    Each router saw its tokens flattened s-major ([s_local * b, k]); regrouping them per sequence lets the
    update pass split the rollout into different micro batches than the old-policy pass did. int16 (expert ids
    < 32768) keeps a rollout's routing at a quarter of int64's memory; ``_replay`` widens it again.
    """
    RouterReplay, _ = _router_replay()
    layers = [t.detach().reshape(-1, batch_size, t.shape[-1]).transpose(0, 1) for t in RouterReplay.get_recorded_data()
              if t is not None]
    if not layers:  # a pipeline stage without MoE layers
        return torch.zeros(batch_size, 0, 0, 0, dtype=torch.int16)
    return torch.stack(layers, dim=1).to(torch.int16)


def _sequence_routing(batch: dict) -> torch.Tensor:
    """This rank's routing record of one forward, per sequence of the micro batch. Padded rows: as recorded,
    [b, L_local, s_local, k]. A packed row: [b, L_local, S, k] in the padded layout, gathered over the TP group
    under sequence parallelism (every TP rank then holds the whole record)."""
    record = _recorded_routing(batch["input_ids"].shape[0])
    if "unpack_index" not in batch:
        return record
    index = batch["unpack_index"]
    if record.shape[1] == 0:  # a pipeline stage without MoE layers
        return torch.zeros(index.shape[0], 0, 0, 0, dtype=record.dtype, device=record.device)
    tp_group, _, ps = _groups()
    tp = ps.get_tensor_model_parallel_world_size()
    if batch["sequence_parallel"]:  # this rank's routers saw 1/tp of the row
        parts = [torch.empty(record.shape, dtype=torch.int32, device=record.device) for _ in range(tp)]
        torch.distributed.all_gather(parts, record.to(torch.int32).contiguous(), group=tp_group)
        record = torch.cat(parts, dim=2).to(record.dtype)
    return packing.unpack(record.transpose(1, 2), index).transpose(1, 2)


def _packed_routing(batch: dict, routing: torch.Tensor) -> torch.Tensor:
    """The inverse of ``_sequence_routing`` on a packed row: [b, L, S, k] -> this rank's [1, L, s_local, k]."""
    if "unpack_index" not in batch or routing.shape[1] == 0:
        return routing
    length = batch["input_ids"].shape[1]
    # Padding has no record: any k distinct experts (a repeated expert would miscount the dispatch).
    distinct = torch.arange(routing.shape[-1], dtype=routing.dtype, device=routing.device)
    row = packing.pack_rows(routing.transpose(1, 2), batch["unpack_index"], length, fill=distinct).transpose(1, 2)
    if batch["sequence_parallel"]:
        _, _, ps = _groups()
        s_local = length // ps.get_tensor_model_parallel_world_size()
        rank = ps.get_tensor_model_parallel_rank()
        row = row[:, :, rank * s_local:(rank + 1) * s_local]
    return row


def _set_routing_action(action_name: str) -> None:
    RouterReplay, Action = _router_replay()
    RouterReplay.set_global_router_replay_action(getattr(Action, action_name))


def _replay(routing: torch.Tensor) -> None:
    """Make this rank's routers use ``routing`` [b, L_local, s_local, k] in the next forward."""
    RouterReplay, _ = _router_replay()
    per_layer = [routing[:, layer].transpose(0, 1).reshape(-1, routing.shape[-1]).long()
                 for layer in range(routing.shape[1])]
    RouterReplay.set_replay_data(per_layer)
    _set_routing_action("REPLAY_FORWARD")


def _router_layers(model) -> tuple[list[int], bool]:
    """The global (0-based) layer index of each of this rank's routers, in RouterReplay's order (construction
    order: layer order), so a pipeline stage picks its layers out of a whole model's routes; and whether they see
    a sequence-parallel share of the tokens."""
    found = getattr(model, "_gspo_router_layers", None)
    if found is None:
        from megatron.core.transformer.moe.router import TopKRouter

        routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
        found = ([r.layer_number - 1 for r in routers], bool(routers) and routers[0].config.sequence_parallel)
        model._gspo_router_layers = found
    return found


def rank_routing(model, routing: torch.Tensor) -> torch.Tensor:
    """Routes of every layer of the whole sequence (rollout routing replay) -> what this rank's routers see.

    ``routing`` [b, s_cp, L, k] is the micro batch's ``rollout_routing`` after the context-parallel split
    (``batch_for_model``); the result [b, L_local, s_local, k] is what ``_recorded_routing`` would have recorded:
    this pipeline stage's MoE layers, and under sequence parallelism this TP rank's contiguous 1/tp of the tokens.
    """
    layers, sequence_parallel = _router_layers(model)
    if layers and max(layers) >= routing.shape[2]:
        raise ValueError(f"rollout routing has {routing.shape[2]} layers but the model routes at layer "
                         f"{max(layers)}: the engine serves a different model than the trainer's")
    local = routing[:, :, layers]  # [b, s_cp, L_local, k]
    _, _, ps = _groups()
    tp = ps.get_tensor_model_parallel_world_size()
    if tp > 1 and sequence_parallel:
        s_local = local.shape[1] // tp
        rank = ps.get_tensor_model_parallel_rank()
        local = local[:, rank * s_local:(rank + 1) * s_local]
    return local.transpose(1, 2)


def _end_routing_replay() -> None:
    RouterReplay, _ = _router_replay()
    RouterReplay.clear_global_router_replay_action()
    RouterReplay.clear_global_indices()


def _router_token_mask(loss_mask: torch.Tensor, s_local: int) -> torch.Tensor:
    """The tokens of this rank's routers [b, s_local] from the micro batch's (CP-local) [b, S] token mask: under
    sequence parallelism each TP rank's routers see its contiguous 1/tp of the sequence."""
    if s_local == loss_mask.shape[1]:
        return loss_mask
    tp_rank = _groups()[2].get_tensor_model_parallel_rank()
    return loss_mask[:, tp_rank * s_local:(tp_rank + 1) * s_local]


def routing_changes(old: torch.Tensor, new: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """[changed, decisions]: how many (token, layer) routing decisions of the tokens in ``token_mask`` [b, s]
    chose a different top-k *set* in ``new`` than in ``old`` (both [b, L, s, k]), out of how many. float64 [2]."""
    if new.numel() == 0:
        return torch.zeros(2, dtype=torch.float64, device=token_mask.device)
    differs = (old.sort(dim=-1).values != new.sort(dim=-1).values).any(dim=-1)  # [b, L, s]
    keep = token_mask.bool().unsqueeze(1).expand_as(differs)
    return torch.stack([(differs & keep).sum(), keep.sum()]).double()


@dataclass(frozen=True)
class Packing:
    """How one schedule's micro batches are packed (``parallel.packing``): through TransformerEngine's THD
    attention (``thd``) or a block-diagonal mask, each row ``length`` tokens (pipeline parallelism needs one
    shape for every micro batch) or, with None, its own sequences' tokens rounded up to ``multiple``. Under
    context parallelism each sequence's segment is padded to ``segment_multiple`` = 2 * cp (its 2 * cp chunks)."""

    thd: bool
    multiple: int
    sequence_parallel: bool
    length: int | None = None
    segment_multiple: int = 1

    def row_length(self, seq_lengths: torch.Tensor) -> int:
        return self.length or packing.packed_length(seq_lengths, self.multiple, self.segment_multiple)


def _unwrapped(model):
    while hasattr(model, "module"):
        model = model.module
    return model


def schedule_packing(model, micro_batches: list[dict], pack: bool) -> Packing | None:
    """The ``Packing`` of a schedule over ``micro_batches`` (each with ``seq_lengths``), or None without ``pack``."""
    if not pack:
        return None
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    _, _, ps = _groups()
    if any("seq_lengths" not in mb for mb in micro_batches):
        raise ValueError("packed micro batches need seq_lengths [b] (prompt + response tokens of each row)")
    tp, cp = ps.get_tensor_model_parallel_world_size(), ps.get_context_parallel_world_size()
    sp = bool(_unwrapped(model).config.sequence_parallel) and tp > 1
    layers = list(_unwrapped(model).decoder.layers)
    local = not layers or isinstance(layers[0].self_attention.core_attention, DotProductAttention)
    if local and cp > 1:
        raise NotImplementedError("packed rows under context parallelism need THD attention (TransformerEngine's): "
                                  "megatron's local attention has neither")
    # A row splits into cp shares of whole chunks of every segment (the trailing padding one too), each share
    # into tp under sequence parallelism.
    segment_multiple = 2 * cp if cp > 1 else 1
    multiple = context.sequence_multiple(tp, cp, sp)
    length = None
    if ps.get_pipeline_model_parallel_world_size() > 1:  # stages exchange [length / (cp * tp), 1, H] tensors
        length = max(packing.packed_length(mb["seq_lengths"], multiple, segment_multiple) for mb in micro_batches)
    return Packing(thd=not local, multiple=multiple, sequence_parallel=sp, length=length,
                   segment_multiple=segment_multiple)


def batch_for_model(batch: dict, packed: Packing | None = None) -> dict:
    """This rank's share of a micro batch, where the model needs it (Megatron-LM's ``get_batch``): on
    ``environment.device()``, with ``position_ids``, split over the context-parallel group; with ``packed``, its
    sequences as one row with their packing metadata (THD ``packed_seq_params`` or a block-diagonal
    ``attention_mask``) and the ``unpack_index`` back to the padded layout."""
    _, cp_group, _ = _groups()
    batch = environment.to_device(batch, environment.device())
    if packed is not None:
        batch = packing.pack(batch, packed.row_length(batch["seq_lengths"]), packed.segment_multiple)
        if packed.thd:
            batch["packed_seq_params"] = packing.packed_seq_params(batch["cu_seqlens"], batch["max_seqlen"],
                                                                   batch.get("cu_seqlens_unpadded"))
        else:
            batch["attention_mask"] = packing.block_causal_mask(batch["cu_seqlens"], batch["input_ids"].shape[1])
        batch["sequence_parallel"] = packed.sequence_parallel
        return context.split_packed(batch, cp_group)  # under CP: every segment's chunks r and 2*cp-1-r
    ids = batch["input_ids"]
    batch["position_ids"] = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
    return context.split_batch(batch, cp_group)


def _forward(model, batch: dict):
    """The last stage's hidden states (logits are never formed) and what the loss needs of the output layer."""
    with hidden_states_instead_of_logits(model) as captured:
        output = model(batch["input_ids"], batch["position_ids"], attention_mask=batch.get("attention_mask"),
                       packed_seq_params=batch.get("packed_seq_params"))
    return output, captured


def policy_forward_step(algo_config: AlgoConfig, packed: Packing | None = None):
    """A ``forward_step_func`` for ``get_forward_backward_func`` computing the policy loss."""

    def forward_step(data_iterator, model):
        batch = batch_for_model(next(data_iterator), packed)
        if "routing" in batch:
            _replay(_packed_routing(batch, batch["routing"]))
        elif "rollout_routing" in batch:
            _replay(rank_routing(model, batch["rollout_routing"]))
        output, captured = _forward(model, batch)
        if "old_routing" in batch:  # recorded by this forward (update_step set RECORD): expert volatility
            new = _sequence_routing(batch)
            changes = routing_changes(batch["old_routing"].to(new.device), new,
                                      _router_token_mask(batch["loss_mask"], new.shape[2]))
            if packed is not None and packed.sequence_parallel and _groups()[2].get_tensor_model_parallel_rank():
                changes = torch.zeros_like(changes)  # every TP rank holds the gathered record: count it once
            volatility.append(changes)
        return output, partial(_loss_func, algo_config, batch, captured)

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


def computed_positions(micro_batches: list[dict], packed: Packing | None) -> tuple[int, int]:
    """(tokens of the micro batches' sequences, token positions the model computes for them): padded rows cost
    their width each, packed rows their length. Without ``seq_lengths`` a padded row counts as all real."""
    real = computed = 0
    for mb in micro_batches:
        b, width = mb["input_ids"].shape[:2]
        lengths = mb.get("seq_lengths")
        real += int(lengths.sum()) if lengths is not None else b * width
        computed += packed.row_length(lengths) if packed is not None else b * width
    return real, computed


def update_step(model, optimizer, micro_batches: list[dict], algo_config: AlgoConfig, pack: bool = False) -> dict:
    """One optimizer step on one minibatch (its share on this data-parallel rank, as micro batches); with
    ``pack``, each micro batch runs as one packed row (micro batches carry ``seq_lengths``).

    Micro batches may carry ``routing`` (replayed: GRPO + Routing Replay), ``rollout_routing`` [b, S, L, k] (the
    engine's experts of every layer, replayed: rollout routing replay) or ``old_routing`` [b, L_local, s_local, k]
    (the old policy's experts, compared with the experts this forward chooses: expert volatility).

    Returns, on every rank (CPU tensors): ``loss`` (the minibatch's mean loss per unit, over all DP ranks),
    ``stats`` [N, len(algo.SEQUENCE_STATS)] for every sequence of the minibatch (gathered over DP ranks in
    rank order: ``algo.update_metrics`` turns them into the logged metrics), ``seq_log_ratio`` and ``valid`` [N]
    from them, ``grad_norm``, ``update_successful``, ``token_positions`` (this rank's ``computed_positions``), and
    with ``old_routing`` ``routing_changes`` [changed, decisions] summed over all ranks. If any rank's loss or
    gradient is non-finite the step is skipped on every rank (``train.resilience.faults.guarded_step``): weights and optimizer
    state are left as they were.
    """
    _, _, ps = _groups()
    model.zero_grad_buffer()
    optimizer.zero_grad()
    packed = schedule_packing(model, micro_batches, pack)
    forward_step = policy_forward_step(algo_config, packed)
    volatility = "old_routing" in micro_batches[0] and "routing" not in micro_batches[0]
    if volatility:
        _set_routing_action("RECORD")
    try:
        results = _run_schedule(model, forward_step, micro_batches, forward_only=False, packed=packed)
    finally:
        if "routing" in micro_batches[0] or "rollout_routing" in micro_batches[0] or volatility:
            _end_routing_replay()
    # Skipped on every rank when any loss or gradient is NaN/inf (train.faults: megatron's fp32/bf16 step would
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


def _logprob_loss_func(batch: dict, captured, temperature: float, with_entropy: bool, output_tensor: torch.Tensor):
    _, cp_group, _ = _groups()
    out = token_logprobs(output_tensor, captured, batch["labels"], temperature, with_entropy)
    logprobs, entropy = out if with_entropy else (out, None)
    logprobs, entropy = _padded(batch, logprobs), _padded(batch, entropy)
    mask = batch["loss_mask"]
    zero = torch.zeros((), dtype=torch.float32, device=logprobs.device)
    sums, counts = all_reduce_sequence_sums(*algo.masked_log_ratio_sums(logprobs, torch.zeros_like(logprobs), mask),
                                            cp_group)
    # Whole sequences again (every CP rank): the trainer keeps per-token log-probs as pi_old.
    segments = batch.get("cp_segments")  # packed under CP: each row split by its own segment
    results = {"logprobs": context.gather_sequence(logprobs.detach(), cp_group, segments),
               "seq_logprob": sums.detach(), "num_tokens": counts.detach()}
    if with_entropy:
        results["entropy"] = context.gather_sequence(entropy.detach(), cp_group, segments)
    return zero, torch.zeros((), dtype=torch.int, device=logprobs.device), results


@torch.no_grad()
def logprob_pass(model, micro_batches: Iterable[dict], temperature: float = 1.0, record_routing: bool = False,
                 with_entropy: bool = False, pack: bool = False) -> dict:
    """Log-likelihoods of each micro batch's labels, with no gradient: the old- and reference-policy pass.

    Returns on every pipeline rank, on the model's device: ``logprobs`` [n, S] per token (meaningful where
    loss_mask is set), ``seq_logprob`` [n] (sum over response tokens) and ``num_tokens`` [n]; with
    ``with_entropy``, ``entropy`` [n, S] of each position's (tempered) distribution. With ``record_routing``, also
    ``routing`` [n, L_local, s_local, k]: the experts this rank's routers chose, to put in the update pass's
    micro batches for Routing Replay (it stays on this rank: the same rank runs those layers in the update).
    Micro batches with ``rollout_routing`` (the engine's experts) are computed under that routing instead. With
    ``pack``, micro batches run as packed rows and the record is [n, L_local, S, k] (whole sequences, every TP rank).
    """
    _, _, ps = _groups()
    micro_batches = list(micro_batches)
    packed = schedule_packing(model, micro_batches, pack)
    routing = []
    replays = bool(micro_batches) and "rollout_routing" in micro_batches[0]
    if record_routing and replays:
        raise ValueError("logprob_pass: record_routing with rollout_routing in the micro batches (the routers "
                         "replay the engine's experts: there is nothing of their own to record)")
    if record_routing:
        RouterReplay, Action = _router_replay()
        RouterReplay.set_global_router_replay_action(Action.RECORD)

    def forward_step(data_iterator, model):
        batch = batch_for_model(next(data_iterator), packed)
        if replays:
            _replay(rank_routing(model, batch["rollout_routing"]))
        output, captured = _forward(model, batch)
        if record_routing:
            routing.append(_sequence_routing(batch))
        return output, partial(_logprob_loss_func, batch, captured, temperature, with_entropy)

    try:
        results = _run_schedule(model, forward_step, micro_batches, forward_only=True, packed=packed)
    finally:
        if record_routing or replays:
            _end_routing_replay()
    out = None
    if ps.is_pipeline_last_stage():
        keys = ("logprobs", "seq_logprob", "num_tokens") + (("entropy",) if with_entropy else ())
        out = {key: torch.cat([r[key] for r in results]) for key in keys}
    out = broadcast_from_last_stage(out, ps.get_pipeline_model_parallel_group())
    if record_routing:
        out["routing"] = torch.cat(routing)
    return out
