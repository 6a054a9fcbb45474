"""Decoupled clipping (algo/decoupled.py) against the objective written out sequence by sequence: clipped around
the proximal policy, weighted by min(pi_prox / pi_behaviour, cap) on the stale rows only."""

import math

import pytest
import torch

from gspo_megatron.algo import behaviour_weights, decoupled_advantages, grpo_loss, gspo_loss

from .batches import grad_of, random_batch

LENGTHS = [3, 5, 1, 4, 0, 6]
T = 8


def _batch(seed: int = 0):
    """(logprobs leaf, pi_prox, pi_behaviour, mask, advantages, stale rows): the update has moved ~1e-3 from
    pi_prox, which is ~2e-2 from the behaviour policy per token (one weight version)."""
    new, prox, mask = random_batch(LENGTHS, T, log_ratio_scale=1e-3, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    behaviour = prox + 2e-2 * torch.randn(prox.shape, generator=gen, dtype=torch.float64)
    advantages = torch.randn(len(LENGTHS), generator=gen, dtype=torch.float64)
    stale = torch.tensor([True, False, True, True, True, False])
    return new, prox, behaviour, mask, advantages, stale


def test_sequence_weights_are_the_length_normalised_ratio_capped():
    _, prox, behaviour, mask, _, _ = _batch()
    behaviour[3, 1:5] = prox[3, 1:5] - 2.0  # pi_prox / pi_behaviour = e^2 per token: capped
    weights = behaviour_weights(prox, behaviour, mask, cap=2.0)
    for i, n in enumerate(LENGTHS):
        expected = 1.0 if n == 0 else min(math.exp(sum(prox[i, t] - behaviour[i, t] for t in range(1, 1 + n)) / n), 2.0)
        assert abs(float(weights[i]) - expected) < 1e-12, (i, float(weights[i]), expected)
    assert float(weights[3]) == 2.0
    per_token = behaviour_weights(prox, behaviour, mask, per_token=True, cap=1.01)
    expected = torch.where(mask, (prox - behaviour).exp().clamp(max=1.01), torch.ones_like(prox))
    torch.testing.assert_close(per_token, expected, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="cap must be > 0"):
        behaviour_weights(prox, behaviour, mask, cap=0.0)


def test_decoupled_gspo_equals_the_written_out_objective_and_its_gradient():
    new, prox, behaviour, mask, advantages, stale = _batch()
    weights = behaviour_weights(prox, behaviour, mask, cap=2.0)
    loss, _ = gspo_loss(new, prox, decoupled_advantages(advantages, weights, stale), mask)
    objective = []
    for i, n in enumerate(LENGTHS):
        if n == 0:
            continue
        s = torch.exp((new[i, 1:1 + n] - prox[i, 1:1 + n]).sum() / n)
        w = math.exp(float((prox[i, 1:1 + n] - behaviour[i, 1:1 + n]).sum()) / n) if stale[i] else 1.0
        a = float(advantages[i])
        objective.append(w * torch.minimum(s * a, s.clamp(1 - 3e-4, 1 + 4e-4) * a))
    expected = -torch.stack(objective).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad_of(loss, new), grad_of(expected, new), rtol=1e-10, atol=1e-15)
    # The fresh rows are untouched; without the stale rows' weights the loss differs (the weights do something).
    plain, _ = gspo_loss(new, prox, advantages, mask)
    assert abs(float(plain) - float(loss)) > 1e-6


def test_decoupled_grpo_weights_each_token():
    new, prox, behaviour, mask, advantages, stale = _batch(seed=3)
    weights = behaviour_weights(prox, behaviour, mask, per_token=True, cap=1.02)
    token_advantages = decoupled_advantages(advantages, weights, stale)
    assert token_advantages.shape == mask.shape
    loss, _ = grpo_loss(new, prox, token_advantages, mask)
    terms = []
    for i, n in enumerate(LENGTHS):
        for t in range(1, 1 + n):
            r = torch.exp(new[i, t] - prox[i, t])
            w = min(math.exp(float(prox[i, t] - behaviour[i, t])), 1.02) if stale[i] else 1.0
            a = w * float(advantages[i])
            terms.append(torch.minimum(r * a, r.clamp(1 - 0.2, 1 + 0.27) * a))
    expected = -torch.stack(terms).mean()  # token-mean over every response token of the batch
    torch.testing.assert_close(loss, expected, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grad_of(loss, new), grad_of(expected, new), rtol=1e-10, atol=1e-15)


def test_gspo_token_takes_the_sequence_weight_on_every_token():
    _, prox, behaviour, mask, advantages, stale = _batch(seed=5)
    token_advantages = advantages.unsqueeze(1) * torch.linspace(0.5, 1.5, T, dtype=torch.float64)  # [B, T]
    weights = behaviour_weights(prox, behaviour, mask)
    out = decoupled_advantages(token_advantages, weights, stale)
    for i in range(len(LENGTHS)):
        factor = float(weights[i]) if stale[i] else 1.0
        torch.testing.assert_close(out[i], token_advantages[i] * factor, rtol=1e-15, atol=0)
