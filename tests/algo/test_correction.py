"""The rollout correction (algo/correction.py) against the objective written out token by token in float64: the
behaviour weight pi_old / pi_engine at token, sequence and geometric level, truncated or masked, rejection by a
sequence statistic (k1 / k3; max, mean, sum) and the per-token veto, for GSPO, GSPO-token and GRPO, in loss and
gradient. Samples from older weights (algo.decoupled_clip) use the same weight: the geometric one is AReaL's
decoupled objective in GSPO's length-normalised form."""

import math

import pytest
import torch

from gspo_megatron.algo import (Correction, correction_metrics, correction_stats, grpo_loss, gspo_loss,
                                gspo_token_loss, rollout_correction, sequence_stats)
from gspo_megatron.algo.correction import log_weights, weight_sums, correction_weights

from .batches import grad_of, random_batch

LENGTHS = [3, 5, 1, 4, 0, 6, 2]
T = 8
GSPO_CLIP = (3e-4, 4e-4)
GRPO_CLIP = (0.2, 0.27)


def _batch(seed: int = 0, gap: float = 0.3):
    """(logprobs leaf, pi_old, engine log-probs, mask, advantages): the update moved ~1e-3 from pi_old, which is
    ``gap`` per token from the engine (large, so weights spread over both bounds)."""
    new, old, mask = random_batch(LENGTHS, T, log_ratio_scale=1e-3, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    engine = old + gap * torch.randn(old.shape, generator=gen, dtype=torch.float64)
    advantages = torch.randn(len(LENGTHS), generator=gen, dtype=torch.float64)
    return new, old, engine, mask, advantages


def _tokens(i):
    return range(1, 1 + LENGTHS[i])


def _weights(old, engine, c: Correction):
    """Written out: {(i, t): weight} of kept sequences' tokens, the rejected rows, and masked / truncated counts."""
    weights, rejected, masked, truncated = {}, set(), 0, 0
    for i, n in enumerate(LENGTHS):
        if n == 0:
            continue
        logs = [float(old[i, t] - engine[i, t]) for t in _tokens(i)]
        k = logs if c.rejection_estimator == "k1" else [math.exp(x) - 1 - x for x in logs]
        if c.rejection is not None:
            stat = {"sum": sum(k), "mean": sum(k) / n,
                    "max": max(abs(x) for x in k)}[c.rejection]
            if ((c.rejection_low is not None and stat < c.rejection_low)
                    or (c.rejection_high is not None and stat > c.rejection_high)):
                rejected.add(i)
        if c.veto is not None and min(math.exp(x) for x in logs) < c.veto:
            rejected.add(i)
        for j, t in enumerate(_tokens(i)):
            raw = {"token": math.exp(logs[j]), "sequence": math.exp(sum(logs)),
                   "geometric": math.exp(sum(logs) / n), None: 1.0}[c.level]
            w = raw
            if c.level is not None and c.mode == "truncate":
                w = min(raw, c.high)
                truncated += raw > c.high and i not in rejected
            elif c.level is not None:
                w = raw if c.low <= raw <= c.high else 0.0
                masked += w == 0.0 and i not in rejected
            weights[i, t] = w
    return weights, rejected, masked, truncated


def _expected(name, new, old, engine, advantages, c, eps):
    weights, rejected, _, _ = _weights(old, engine, c)
    kept = [i for i, n in enumerate(LENGTHS) if n and i not in rejected]
    terms = []
    for i in kept:
        n, a = LENGTHS[i], float(advantages[i])
        if name == "gspo":
            s = torch.exp(sum(new[i, t] - old[i, t] for t in _tokens(i)) / n)
            w = sum(weights[i, t] for t in _tokens(i)) / n
            terms.append(w * torch.minimum(s * a, s.clamp(1 - eps[0], 1 + eps[1]) * a))
            continue
        for t in _tokens(i):
            if name == "gspo_token":  # sg[s_i] * pi(y_t) / sg[pi(y_t)]
                s = torch.exp(sum(new[i, u] - old[i, u] for u in _tokens(i)).detach() / n + new[i, t]
                              - new[i, t].detach())
                terms.append(weights[i, t] * torch.minimum(s * a, s.clamp(1 - eps[0], 1 + eps[1]) * a) / n)
            else:
                r = torch.exp(new[i, t] - old[i, t])
                terms.append(weights[i, t] * torch.minimum(r * a, r.clamp(1 - eps[0], 1 + eps[1]) * a))
    if name == "grpo":  # token-mean over the kept sequences' tokens
        return -torch.stack(terms).sum() / sum(LENGTHS[i] for i in kept)
    return -torch.stack(terms).sum() / len(kept)


CORRECTIONS = {
    "token_truncate": Correction(level="token", high=1.2),
    "sequence_truncate": Correction(level="sequence", high=1.5),
    "geometric_truncate": Correction(level="geometric", high=1.05),
    "token_mask": Correction(level="token", mode="mask", low=0.8, high=1.25),
    "sequence_mask": Correction(level="sequence", mode="mask", low=0.7, high=1.4),
    "geometric_mask_k1_max": Correction(level="geometric", mode="mask", low=0.9, high=1.1, rejection="max",
                                        rejection_high=0.6),
    "k1_mean": Correction(rejection="mean", rejection_low=-0.1, rejection_high=0.1),
    "k1_sum": Correction(level="token", rejection="sum", rejection_low=-0.5, rejection_high=0.5),
    "k3_mean_veto": Correction(level="geometric", rejection="mean", rejection_estimator="k3", rejection_high=0.05,
                               veto=0.6),
    "k3_max": Correction(level="token", rejection="max", rejection_estimator="k3", rejection_high=0.1),
}
LOSSES = {"gspo": (gspo_loss, GSPO_CLIP, True), "gspo_token": (gspo_token_loss, GSPO_CLIP, False),
          "grpo": (grpo_loss, GRPO_CLIP, False)}


@pytest.mark.parametrize("case", sorted(CORRECTIONS))
def test_corrected_losses_equal_the_written_out_objective_and_gradient(case):
    c = CORRECTIONS[case]
    new, old, engine, mask, advantages = _batch(seed=len(case))
    weights, rejected, masked, truncated = _weights(old, engine, c)
    # Each case does something: it rejects, masks or truncates some sequences but keeps others.
    assert 0 < len(rejected) + masked + truncated and len(rejected) < sum(n > 0 for n in LENGTHS), case
    for name, (loss_fn, eps, per_sequence) in LOSSES.items():
        given = advantages.unsqueeze(1).expand(mask.shape) if name == "gspo_token" else advantages
        corrected, kept_mask, _ = rollout_correction(old, engine, mask, given, c, per_sequence)
        loss, _ = loss_fn(new, old, corrected, kept_mask, *eps)
        expected = _expected(name, new, old, engine, advantages, c, eps)
        torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-15, msg=f"{case}/{name}")
        torch.testing.assert_close(grad_of(loss, new), grad_of(expected, new), rtol=1e-10, atol=1e-15,
                                   msg=f"{case}/{name} gradient")


def test_metrics_count_what_the_correction_did():
    new, old, engine, mask, advantages = _batch(seed=7)
    for case in ("token_mask", "geometric_truncate", "k3_mean_veto"):
        c = CORRECTIONS[case]
        weights, rejected, masked, truncated = _weights(old, engine, c)
        log_weight = log_weights(old, engine, mask)
        terms = correction_weights(log_weight, weight_sums(log_weight, mask), mask, c)
        stats = torch.cat([sequence_stats(new, old, mask), correction_stats(terms, mask)], dim=-1)
        m = correction_metrics(stats)
        tokens = sum(LENGTHS)
        rejected_tokens = sum(LENGTHS[i] for i in rejected)
        kept = [w for (i, _), w in weights.items() if i not in rejected]
        assert m["correction_rejected_tokens"] == pytest.approx(rejected_tokens / tokens, abs=1e-15), case
        assert m["correction_rejected_seqs"] == pytest.approx(len(rejected) / 6, abs=1e-15), case
        assert m["correction_masked_tokens"] == pytest.approx(masked / tokens, abs=1e-15), case
        assert m["correction_truncated_tokens"] == pytest.approx(truncated / tokens, abs=1e-15), case
        assert m["correction_weight_mean"] == pytest.approx(sum(kept) / len(kept), rel=1e-12), case
        assert m["correction_weight_max"] == pytest.approx(max(kept), rel=1e-12), case


def test_no_correction_changes_nothing_and_large_gaps_stay_finite():
    new, old, engine, mask, advantages = _batch(gap=50.0)  # sequence weights of e^(+-100s): clamped before exp
    corrected, kept, terms = rollout_correction(old, engine, mask, advantages, Correction(), True)
    assert torch.equal(corrected, advantages * (mask.any(-1)).double()) and torch.equal(kept, mask)
    corrected, _, terms = rollout_correction(old, engine, mask, advantages, Correction(level="sequence"), True)
    assert torch.isfinite(corrected).all() and float(terms.weights.max()) == 2.0


@pytest.mark.parametrize("fields, message", [
    (dict(level="tokens"), r"correction.level='tokens' is not one of"),
    (dict(level="token", low=2.0, high=1.0), r"correction.low=2.0 and correction.high=1.0"),
    (dict(rejection="mean"), r"correction.rejection='mean' needs correction.rejection_low"),
    (dict(veto=1.5), r"correction.veto=1.5 must lie in \(0, 1\)"),
    (dict(rejection="max", rejection_estimator="k2", rejection_high=1.0), r"rejection_estimator='k2'"),
])
def test_bad_corrections_name_their_field(fields, message):
    with pytest.raises(ValueError, match=message):
        Correction(**fields)
