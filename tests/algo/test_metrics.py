"""The trainer's metrics from per-sequence stats: one definition each, equal to the losses' own metrics, and
additive over pieces of a minibatch (micro batches, data-parallel ranks)."""

import math

import pytest
import torch

from gspo_megatron.algo import (SEQUENCE_STATS, grpo_loss, grpo_terms, gspo_loss, gspo_loss_from_sums,
                                gspo_token_terms, masked_log_ratio_sums, mismatch_metrics, sequence_stats,
                                update_metrics)

from .batches import random_batch

LENGTHS = [3, 5, 1, 0, 7, 4, 2, 6]


def test_approx_kl_is_kl_old_to_new_per_token():
    """k3 of KL(pi_old || pi_theta) from tokens sampled by pi_old: exp(new - old) - 1 - (new - old), averaged over
    response tokens (not the reverse direction, exp(old - new) - 1 + (new - old), nor per sequence)."""
    new = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, 0.0, 0.0]], dtype=torch.float64)
    old = torch.tensor([[-1.5, -2.0, 0.0], [-0.3, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    stats = sequence_stats(new, old, mask)
    expected = sum(math.exp(d) - 1 - d for d in (0.5, 0.0, -0.2)) / 3
    assert update_metrics(stats, "sequence")["approx_kl"] == pytest.approx(expected, rel=1e-12)


def _gspo_stats(logprobs, old, adv, mask):
    terms = gspo_loss_from_sums(*masked_log_ratio_sums(logprobs, old, mask), adv)
    return sequence_stats(logprobs, old, mask, terms.clipped_low & terms.valid, terms.clipped_high & terms.valid)


@pytest.mark.parametrize("seed", [0, 1])
def test_equal_to_the_losses_metrics_and_additive_over_pieces(seed):
    logprobs, old, mask = random_batch(LENGTHS, T=9, log_ratio_scale=1e-3, seed=seed)
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0, -0.7, 1.3, -1.2, 0.9], dtype=torch.float64)
    stats = _gspo_stats(logprobs, old, adv, mask)
    assert stats.shape == (8, len(SEQUENCE_STATS))
    got, (_, want) = update_metrics(stats, "sequence"), gspo_loss(logprobs, old, adv, mask)
    assert 0 < got["clip_frac"] < 1
    for name in ("clip_frac", "clip_frac_low", "clip_frac_high", "seq_ratio_min", "seq_ratio_mean", "seq_ratio_max",
                 "approx_kl"):
        assert got[name] == pytest.approx(want[name], rel=1e-9, abs=1e-15), name
    # GSPO's token clip fraction: the tokens of the clipped sequences.
    clipped = stats[:, SEQUENCE_STATS.index("clipped_low")] + stats[:, SEQUENCE_STATS.index("clipped_high")]
    assert got["clip_frac_tokens"] == pytest.approx(float((clipped * stats[:, 0]).sum() / sum(LENGTHS)), rel=1e-12)
    # Stats of pieces (micro batches, DP ranks) concatenate to the whole minibatch's metrics.
    pieces = torch.cat([_gspo_stats(logprobs[i:i + 3], old[i:i + 3], adv[i:i + 3], mask[i:i + 3]) for i in (0, 3, 6)])
    assert update_metrics(pieces, "sequence") == pytest.approx(got, rel=1e-12, abs=1e-15)

    # Token-level losses: clip_frac is per token, as grpo_loss counts it; the sequence fraction counts sequences
    # holding a clipped token.
    _, grpo_metrics = grpo_loss(logprobs, old, adv, mask, eps_low=1e-3, eps_high=1e-3)
    terms = grpo_terms(logprobs, old, adv, mask, eps_low=1e-3, eps_high=1e-3)
    got = update_metrics(sequence_stats(logprobs, old, mask, terms.clipped_low, terms.clipped_high), "token")
    for name in ("clip_frac", "clip_frac_low", "clip_frac_high", "approx_kl"):
        assert got[name] == pytest.approx(grpo_metrics[name], rel=1e-9, abs=1e-15), name
    holding = (terms.clipped_low | terms.clipped_high).any(dim=-1).sum().item() / 7  # 7 non-empty sequences
    assert got["clip_frac_seqs"] == pytest.approx(holding, rel=1e-12) and 0 < got["clip_frac"] < 1
    token_adv = adv.unsqueeze(1).expand_as(mask)
    terms = gspo_token_terms(logprobs, old, token_adv, mask)
    got_token = update_metrics(sequence_stats(logprobs, old, mask, terms.clipped_low, terms.clipped_high), "token")
    assert got_token["clip_frac"] == pytest.approx(update_metrics(stats, "sequence")["clip_frac_tokens"], rel=1e-12)


def test_mismatch_hand_values():
    trainer = torch.tensor([[-1.0, -2.0, 0.0], [-0.5, -0.1, 0.0]], dtype=torch.float64)
    rollout = torch.tensor([[-1.1, -2.0, 9.0], [-0.5, -0.4, 0.0]], dtype=torch.float64)  # garbage under the mask
    mask = torch.tensor([[True, True, False], [True, True, False]])
    m = mismatch_metrics(sequence_stats(trainer, rollout, mask))
    assert m["logprob_diff_max"] == pytest.approx(0.3)
    assert m["logprob_diff_mean"] == pytest.approx(0.4 / 4)
    assert m["logprob_diff_seq_log_ratio"] == pytest.approx(0.15)
    assert m["logprob_diff_kl"] == pytest.approx(sum(math.exp(d) - 1 - d for d in (0.1, 0.0, 0.0, 0.3)) / 4)
    # k1 of KL(engine || trainer): log pi_engine - log pi_trainer per token; the sequences' mean gaps are 0.05 and
    # 0.15, ratios 1.051 (inside [0.8, 1.1]) and 1.162 (beyond it).
    m = mismatch_metrics(sequence_stats(trainer, rollout, mask), clip_range=(0.2, 0.1))
    assert m["logprob_diff_kl_k1"] == pytest.approx(-0.4 / 4) and m["logprob_diff_beyond_clip"] == 0.5


def test_stats_shape_is_checked():
    with pytest.raises(ValueError, match=r"stats must be \[N, 9\]"):
        update_metrics(torch.zeros(3, 4), "sequence")
    with pytest.raises(ValueError, match="unit must be"):
        update_metrics(torch.zeros(3, len(SEQUENCE_STATS)), "tokens")
