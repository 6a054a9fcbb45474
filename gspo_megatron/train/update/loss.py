"""The policy loss of one micro batch inside Megatron's schedules: GSPO (sequence-level clip), GSPO-token, GRPO
(token-level clip; token-mean or seq-mean-token-mean), with an optional KL penalty and entropy bonus.

Normalisation: megatron-core's per-token-loss mode is used with *sequences* as the unit (tokens for GRPO
token-mean). Each micro batch's loss function returns (sum of its sequences' losses, number of sequences); the
schedule does not divide by the micro batch count, DDP sums gradients over data-parallel ranks, and
``finalize_model_grads`` divides by the number of sequences summed over all micro batches and DP ranks. So every
sequence of the minibatch weighs the same in the gradient however the minibatch is split, exactly as in the
single-process ``gspo_loss``. Models must be built with ``calculate_per_token_loss=True``.

Context parallelism (GSPO): each CP rank holds megatron's load-balanced share of every sequence; its per-sequence
partial sums are all-reduced as scalars (``parallel.reductions``), every CP rank computes the same loss, and only CP
rank 0 counts the sequences (the count is summed over the DP x CP group).

Corrections (``algo.correction``, the config's ``correction`` section): each micro batch's behaviour weights come
from its ``rollout_logprobs`` (the engine's) and ``old_logprobs`` (or, with ``reuse_rollout_logprobs``, the policy's
own log-probs, detached) before the loss; a sequence-level weight or rejection reduces its sums over CP ranks as
the GSPO ratio does, so the fused and unfused loss and every layout see the same whole-sequence weights.

``LossConfig`` is the loss's configuration; its defaults are the algorithm layer's (``algo.defaults``: the papers'
clip ranges ``CLIP_RANGES`` and the other constants live there).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial

import torch

from gspo_megatron import algo
from gspo_megatron.algo.defaults import ALGORITHMS, CLIP_RANGES, GRPO_AGGREGATION, KL_ESTIMATOR, MAX_LOG_RATIO
from gspo_megatron.ops import vocab_parallel_logprobs, vocab_parallel_sequence_loss
from gspo_megatron.parallel import context, packing
from gspo_megatron.parallel.reductions import all_reduce_sequence_stats, all_reduce_sequence_sums
from gspo_megatron.train.update.batch import megatron_groups, padded




@dataclass(frozen=True)
class LossConfig:
    """The policy loss. Defaults are the GSPO paper's; an unset clip bound is the algorithm's (``CLIP_RANGES``)."""

    name: str = "gspo"
    eps_low: float | None = None
    eps_high: float | None = None
    max_log_ratio: float = MAX_LOG_RATIO
    grpo_aggregation: str = GRPO_AGGREGATION  # or "seq-mean-token-mean"
    kl_coef: float = 0.0
    kl_estimator: str = KL_ESTIMATOR
    entropy_coef: float = 0.0  # an entropy bonus: loss - entropy_coef * mean entropy (aggregated like the loss)
    temperature: float = 1.0  # the rollout's sampling temperature: log-probs are of logits / temperature
    fused_loss: bool = True  # the loss inside the output layer's op (ops.sequence_loss); False: log-probs, then loss
    correction: algo.Correction = field(default_factory=algo.Correction)  # the behaviour weight (off by default)
    # pi_old is the engine's (rollout.reuse_rollout_logprobs): the correction weighs the current policy against it
    reuse_rollout_logprobs: bool = False

    def __post_init__(self):
        if self.name not in ALGORITHMS:
            raise ValueError(f"algo.name={self.name!r} is not one of {ALGORITHMS}")
        if self.temperature <= 0:
            raise ValueError(f"algo.temperature={self.temperature} must be > 0")
        low, high = CLIP_RANGES[self.name]
        if self.eps_low is None:
            object.__setattr__(self, "eps_low", low)
        if self.eps_high is None:
            object.__setattr__(self, "eps_high", high)

    @property
    def unit(self) -> str:
        """What the loss clips: "sequence" (GSPO) or "token" (GRPO, GSPO-token); the unit of ``clip_frac``."""
        return "sequence" if self.name == "gspo" else "token"

    @classmethod
    def grpo(cls, **kwargs) -> "LossConfig":
        """The paper's GRPO baseline (token-level clip: ``CLIP_RANGES["grpo"]`` unless given)."""
        return cls(name="grpo", **kwargs)


def token_logprobs(output_tensor: torch.Tensor, captured, labels: torch.Tensor, temperature: float,
                   with_entropy: bool = False):
    """[b, s_local, H] last-stage hidden states -> log pi(labels) [b, S] through the fused op (and the entropy of
    each position's distribution [b, S] with ``with_entropy``).

    ``captured``: the output layer's weight, sequence parallelism and real vocabulary size
    (``model.hidden_output.OutputLayer``); padding rows of the vocabulary take no part in the softmax.
    """
    tp_group, _, _ = megatron_groups()
    hidden = output_tensor.transpose(0, 1)  # [s_local, b, H]: the op gathers the sequence dim under SP
    out = vocab_parallel_logprobs(
        hidden, captured.weight, labels.t(), tp_group=tp_group, temperature=temperature,
        sequence_parallel=captured.sequence_parallel, vocab_size=captured.vocab_size, return_entropy=with_entropy,
    )
    return (out[0].t(), out[1].t()) if with_entropy else out.t()


def _corrected(cfg: LossConfig, batch: dict, logprobs: torch.Tensor, cp_group) -> tuple[dict, torch.Tensor]:
    """The micro batch with the correction's weights folded into its advantages and its rejected sequences out of
    its loss mask (``algo.correction``), and the correction's per-sequence stats [b, len(CORRECTION_STATS)] (zeros
    without one); whole-sequence sums are reduced over ``cp_group``."""
    mask = batch["loss_mask"]
    if not cfg.correction.enabled:
        return batch, logprobs.new_zeros(mask.shape[0], len(algo.CORRECTION_STATS), dtype=torch.float32)
    target = logprobs.detach() if cfg.reuse_rollout_logprobs else batch["old_logprobs"]
    log_weight = algo.log_weights(target, batch["rollout_logprobs"], mask)
    sums = algo.weight_sums(log_weight, mask, cfg.max_log_ratio)
    sums = all_reduce_sequence_stats(sums, _indices(algo.correction.WEIGHT_SUMS, algo.correction.WEIGHT_MAX_SUMS),
                                     cp_group)
    terms = algo.correction_weights(log_weight, sums, mask, cfg.correction, cfg.max_log_ratio)
    sequence_weight = None
    if cfg.name == "gspo":  # the sequence term takes the token mean of the weights over the whole sequence
        weight_sum = all_reduce_sequence_stats(terms.weights.sum(dim=-1, keepdim=True), (), cp_group)[:, 0]
        sequence_weight = weight_sum / sums[:, 0].clamp(min=1)
    advantages = _token_advantages(batch) if cfg.name == "gspo_token" else batch["advantages"]
    corrected = dict(batch, advantages=algo.corrected_advantages(advantages, terms.weights, sequence_weight),
                     loss_mask=mask & terms.keep.unsqueeze(-1))
    return corrected, algo.correction_stats(terms, mask).float()


def _indices(names: tuple[str, ...], chosen: tuple[str, ...]) -> tuple[int, ...]:
    return tuple(names.index(name) for name in chosen)


def _loss_terms(loss_config: LossConfig, batch: dict, logprobs: torch.Tensor):
    """(loss summed over this micro batch's units, number of units, per-sequence stats [b, len(LOSS_STATS)])
    for one micro batch (or a chunk of its sequences)."""
    _, cp_group, ps = megatron_groups()
    cfg = loss_config
    batch, correction_stats = _corrected(cfg, batch, logprobs, cp_group)
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
    stats = torch.cat([stats, correction_stats.to(stats.device)], dim=-1)
    if cp > 1:  # this rank's columns are partial sums over its slice of each sequence
        max_columns = _indices(algo.metrics.LOSS_STATS, algo.metrics.MAX_STATS + algo.correction.CORRECTION_MAX_STATS)
        stats = all_reduce_sequence_stats(stats, max_columns, cp_group)
    return loss, units, stats


def _token_advantages(batch: dict) -> torch.Tensor:
    """GSPO-token's [b, S] advantages; a [b] sequence advantage is broadcast over the response (= GSPO)."""
    advantages = batch["advantages"]
    if advantages.dim() == 1:
        return advantages.unsqueeze(1).expand(batch["loss_mask"].shape)
    return advantages


def _entropy_sum(entropy: torch.Tensor, mask: torch.Tensor, cfg: LossConfig) -> torch.Tensor:
    """This micro batch's entropy, summed over the loss's units: response tokens for GRPO token-mean, else each
    sequence's mean over its response tokens (so the bonus is normalised exactly as the policy loss is)."""
    masked = entropy * mask
    if cfg.name == "grpo" and cfg.grpo_aggregation == "token-mean":
        return masked.sum()
    return (masked.sum(dim=-1) / mask.sum(dim=-1).clamp_min(1)).sum()


def _sequences_loss(cfg: LossConfig, batch: dict, sequences: slice, logprobs: torch.Tensor,
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


def _packed_sequences_loss(cfg: LossConfig, batch: dict, index: torch.Tensor, sequences: slice,
                           logprobs: torch.Tensor, entropy: torch.Tensor | None):
    """``_sequences_loss`` of every sequence of a packed row ([1, N] log-probs: the op's one "sequence"), unpacked
    to the padded layout by ``index`` [b, S]."""
    unpacked = {"unpack_index": index}
    return _sequences_loss(cfg, batch, slice(None), padded(unpacked, logprobs), padded(unpacked, entropy))


def policy_loss(loss_config: LossConfig, batch: dict, captured, output_tensor: torch.Tensor):
    cfg = loss_config
    bonus = bool(cfg.entropy_coef)
    packed = "unpack_index" in batch
    # The loss sees the padded per-sequence tensors (the model's packed row is not sliced by sequence).
    loss_batch = {k: v for k, v in batch.items() if k not in packing.MODEL_KEYS} if packed else batch
    if cfg.fused_loss:
        # Each chunk of whole sequences gets its loss and logits gradient at once: no recomputation in backward.
        tp_group, _, _ = megatron_groups()
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
        loss, stats = _sequences_loss(cfg, loss_batch, slice(None), padded(batch, logprobs), padded(batch, entropy))
    units = stats.pop("units").to(torch.int)
    # Every CP rank holds the whole loss; like the units, it is reported by CP rank 0 alone (summed over DP x CP).
    _, _, ps = megatron_groups()
    reported = loss.detach().clone() if ps.get_context_parallel_rank() == 0 else torch.zeros_like(loss.detach())
    return loss, units, {"loss_sum": reported, "units": units.clone(), **stats}


def logprob_results(batch: dict, captured, temperature: float, with_entropy: bool, output_tensor: torch.Tensor):
    _, cp_group, _ = megatron_groups()
    out = token_logprobs(output_tensor, captured, batch["labels"], temperature, with_entropy)
    logprobs, entropy = out if with_entropy else (out, None)
    logprobs, entropy = padded(batch, logprobs), padded(batch, entropy)
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
