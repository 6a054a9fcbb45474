"""Generation against a real SGLang server on CPU: groups, order, log-probs equal to the trainer's fused op."""

from __future__ import annotations

import torch

from gspo_megatron.rollout import SamplingParams, flatten, logprob_mismatch, samples_to_batch

from .helpers import TOLERANCE, fused_logprobs, prompts


def test_groups_have_n_samples_in_prompt_order(engine):
    batch = prompts(6)
    groups = engine.generate(batch, n=3, sampling=SamplingParams(max_new_tokens=8))
    assert [g.prompt_index for g in groups] == list(range(6))
    for i, group in enumerate(groups):
        assert group.prompt_ids == batch[i]
        assert [s.sample_index for s in group.samples] == [0, 1, 2]
        for s in group.samples:
            assert s.prompt_ids == batch[i] and s.prompt_index == i
            assert 1 <= len(s.response_ids) <= 8 and len(s.logprobs) == len(s.response_ids)
            assert s.finish_reason in ("stop", "length")
            assert s.weight_version == engine.weight_version()
            assert all(lp <= 0.0 for lp in s.logprobs)
    # 6 prompts over requests of 4 prompts: the order is kept across requests too.
    assert len(flatten(groups)) == 18


def test_group_order_matches_each_prompt_alone(engine, trainer):
    """Near-greedy decoding: every sample of group i is the greedy continuation of prompt i (so SGLang's
    prompt-major answer is mapped to the right prompts), and equals the trainer model's greedy continuation."""
    batch = prompts(5, seed=1)
    sampling = SamplingParams(max_new_tokens=6, temperature=1e-4, ignore_eos=True)
    groups = engine.generate(batch, n=3, sampling=sampling)
    for i, group in enumerate(groups):
        ids = torch.tensor([batch[i]])
        with torch.no_grad():
            for _ in range(6):
                nxt = trainer.model(ids).logits[0, -1].argmax()
                ids = torch.cat([ids, nxt.view(1, 1)], dim=1)
        greedy = ids[0, len(batch[i]):].tolist()
        assert all(s.response_ids == greedy for s in group.samples), (i, greedy, [s.response_ids for s in group.samples])


def _check_logprobs(engine, trainer, temperature: float, record=None):
    samples = flatten(engine.generate(prompts(8, seed=2), n=4,
                                      sampling=SamplingParams(max_new_tokens=12, temperature=temperature)))
    batch = samples_to_batch(samples)
    with torch.no_grad():
        ours = fused_logprobs(trainer.model, batch, temperature=temperature)
    metrics = logprob_mismatch(ours, batch["rollout_logprobs"], batch["loss_mask"])
    if record is not None:
        record(f"mismatch_T{temperature}", metrics)
    assert metrics["mismatch/token_max_abs"] <= TOLERANCE, metrics
    return metrics


def test_sglang_logprobs_equal_fused_op(engine, trainer, record_property):
    metrics = _check_logprobs(engine, trainer, 1.0, record_property)
    print("train/inference mismatch at T=1:", metrics)


def test_sglang_logprobs_are_of_temperature_scaled_logits(engine, trainer, record_property):
    metrics = _check_logprobs(engine, trainer, 0.7, record_property)
    print("train/inference mismatch at T=0.7:", metrics)


def test_eos_ends_a_sample_and_is_included(engine):
    """With EOS made likely (stop_token_ids of every id below 64), samples end with "stop" and keep the stop
    token as their last response token (its log-prob is trained on like any other)."""
    stop = tuple(range(64))
    samples = flatten(engine.generate(prompts(4, seed=3), n=2,
                                      sampling=SamplingParams(max_new_tokens=32, stop_token_ids=stop)))
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert stopped, "no sample hit a stop token in 32 tokens"
    for s in stopped:
        assert s.response_ids[-1] in stop and len(s.logprobs) == len(s.response_ids)
    for s in samples:
        if s.finish_reason == "length":
            assert len(s.response_ids) == 32
