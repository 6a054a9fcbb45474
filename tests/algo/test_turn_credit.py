"""Multi-turn credit on hand-built trajectories: observation tokens (outside the response mask) contribute nothing to
the GSPO ratio, loss or gradient; per-turn advantages land on the right tokens, discounted by gamma."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.algo import gspo_loss, gspo_token_loss, segment_advantages
from gspo_megatron.rollout import Sample, samples_to_batch
from gspo_megatron.train.update.advantages import segment_tensors


def trajectory(prompt_len: int, pieces: list[tuple[str, int]], rewards: list[float], index: int) -> Sample:
    """pieces: ("m", k) k model tokens, ("o", k) k observation tokens; turns end after each model piece."""
    ids, mask, logprobs, turns = [], [], [], []
    for kind, k in pieces:
        ids += [10 + len(ids) + j for j in range(k)]
        mask += [kind == "m"] * k
        logprobs += [-0.1 * (j + 1) if kind == "m" else 0.0 for j in range(k)]
        if kind == "m":
            turns.append((len(ids), rewards[len(turns)]))
    return Sample(list(range(1, prompt_len + 1)), ids, logprobs, "stop", "0", index // 2, index % 2,
                  response_mask=mask, turns=turns)


@pytest.fixture
def batch_and_samples():
    samples = [trajectory(3, [("m", 2), ("o", 3), ("m", 4)], [0.0, 1.0], 0),
               trajectory(2, [("m", 3), ("o", 1), ("m", 1), ("o", 2), ("m", 2)], [1.0, 0.0, 2.0], 1)]
    return samples_to_batch(samples), samples


def test_loss_mask_covers_exactly_the_models_tokens(batch_and_samples):
    batch, samples = batch_and_samples
    for b, s in enumerate(samples):
        P = len(s.prompt_ids)
        expected = torch.zeros(batch["loss_mask"].shape[1], dtype=torch.bool)
        expected[P - 1:P - 1 + len(s.response_ids)] = torch.tensor(s.response_mask)
        assert torch.equal(batch["loss_mask"][b], expected)
        # labels at the masked positions are the observation tokens, in the sequence as sampled
        assert batch["labels"][b, P - 1:P - 1 + len(s.response_ids)].tolist() == s.response_ids
    assert int(batch["loss_mask"].sum()) == 6 + 6
    assert (batch["rollout_logprobs"][~batch["loss_mask"]] == 0).all()


@pytest.mark.parametrize("token_level", [False, True])
def test_observation_tokens_contribute_nothing(batch_and_samples, token_level):
    batch, _ = batch_and_samples
    mask = batch["loss_mask"]
    old = batch["rollout_logprobs"]
    g = torch.Generator().manual_seed(0)
    new = old + 0.3 * torch.randn(old.shape, generator=g) * mask  # pi_theta differs on the model's tokens only

    def run(logprobs):
        logprobs = logprobs.clone().requires_grad_(True)
        if token_level:
            adv = torch.tensor([[0.5], [-1.0]]).expand_as(mask).contiguous()
            loss, metrics = gspo_token_loss(logprobs, old, adv, mask, eps_low=0.2, eps_high=0.2)
        else:
            loss, metrics = gspo_loss(logprobs, old, torch.tensor([0.5, -1.0]), mask, eps_low=0.2, eps_high=0.2)
        loss.backward()
        return loss.detach(), metrics, logprobs.grad

    loss, metrics, grad = run(new)
    garbage = torch.where(mask, new, torch.full_like(new, -7.0) + torch.randn(new.shape, generator=g))
    loss2, metrics2, grad2 = run(garbage)
    assert torch.equal(loss, loss2) and metrics["seq_ratio_mean"] == metrics2["seq_ratio_mean"]
    assert (grad[~mask] == 0).all() and torch.equal(grad, grad2)
    # the sequence ratio is the mean log-ratio over the model's tokens only (formula, by hand)
    log_ratio = ((new - old) * mask).sum(1) / mask.sum(1)
    s = log_ratio.exp()
    A = torch.tensor([0.5, -1.0])
    expected = -(torch.minimum(s * A, s.clamp(0.8, 1.2) * A)).mean()
    torch.testing.assert_close(loss, expected, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("gamma", [1.0, 0.5])
def test_turn_advantages_land_on_their_turns(batch_and_samples, gamma):
    batch, samples = batch_and_samples
    mask = batch["loss_mask"]
    valid = torch.ones(2, dtype=torch.bool)
    rewards, ends = segment_tensors([s.turns for s in samples], batch["prompt_lengths"], tuple(mask.shape), valid)
    adv = segment_advantages(rewards, ends, mask, group_size=2, normalize_std=False, gamma=gamma)
    # group of 2: turn rewards [0, 1] and [1, 0, 2], mean 0.8 over the 5 turns
    r = {0: [0.0 - 0.8, 1.0 - 0.8], 1: [1.0 - 0.8, 0.0 - 0.8, 2.0 - 0.8]}
    for b, s in enumerate(samples):
        P, k, expected = len(s.prompt_ids), 0, torch.zeros(mask.shape[1])
        start = 0
        for end, _ in s.turns:
            to_go = sum(gamma ** (j - k) * r[b][j] for j in range(k, len(s.turns)))
            for t in range(start, end):
                if s.response_mask[t]:
                    expected[P - 1 + t] = to_go
            start, k = end, k + 1
        torch.testing.assert_close(adv[b], expected, rtol=1e-6, atol=1e-6)
    assert (adv[~mask] == 0).all()


def test_gamma_one_equals_the_undiscounted_path():
    g = torch.Generator().manual_seed(1)
    ends = torch.rand(4, 12, generator=g) < 0.3
    mask = torch.ones(4, 12, dtype=torch.bool)
    rewards = torch.randn(4, 12, generator=g)
    undiscounted = segment_advantages(rewards, ends, mask, 2)
    nearly = segment_advantages(rewards, ends, mask, 2, gamma=1 - 1e-7)
    torch.testing.assert_close(nearly, undiscounted, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="gamma"):
        segment_advantages(rewards, ends, mask, 2, gamma=0.0)
