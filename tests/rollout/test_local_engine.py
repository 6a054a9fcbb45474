"""The in-process engine: same interface, log-probs of the temperature-scaled distribution, weight updates."""

from __future__ import annotations

import pytest
import torch

from gspo_megatron.rewards import synthetic
from gspo_megatron.rollout import LocalEngine, SamplingParams, flatten, logprob_mismatch, samples_to_batch
from gspo_megatron.rollout import hf_weights
from gspo_megatron.rollout.local_engine import _filter

from .helpers import fused_logprobs, prompts


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    from transformers import Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(synthetic.tiny_qwen3_moe_config()).eval()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_groups_and_logprobs(model, temperature):
    engine = LocalEngine(model, tokenizer=synthetic.char_tokenizer(), seed=0)
    groups = engine.generate(prompts(3), n=4, sampling=SamplingParams(max_new_tokens=10, temperature=temperature))
    assert [len(g.samples) for g in groups] == [4, 4, 4]
    samples = flatten(groups)
    assert all(isinstance(s.text, str) and s.weight_version == "default" for s in samples)
    batch = samples_to_batch(samples)
    with torch.no_grad():
        metrics = logprob_mismatch(fused_logprobs(model, batch, temperature), batch["rollout_logprobs"],
                                   batch["loss_mask"])
    assert metrics["mismatch/token_max_abs"] < 1e-4, metrics  # incremental KV-cache decoding vs one forward


def test_same_seed_same_samples(model):
    sampling = SamplingParams(max_new_tokens=8, seed=7)
    a = flatten(LocalEngine(model).generate(prompts(2), 3, sampling))
    b = flatten(LocalEngine(model).generate(prompts(2), 3, sampling))
    assert [s.response_ids for s in a] == [s.response_ids for s in b]


def test_update_weights_changes_the_policy(model):
    engine = LocalEngine(model, version="v0")
    perturbed = [(n, t + 0.05 * torch.randn_like(t)) for n, t in hf_weights.checkpoint_tensors(model)]
    stats = engine.update_weights(iter(perturbed), "v1")
    assert engine.weight_version() == "v1" and stats.num_tensors == len(perturbed)
    assert dict(hf_weights.checkpoint_tensors(engine.model)).keys() == dict(perturbed).keys()
    for name, tensor in hf_weights.checkpoint_tensors(engine.model):
        torch.testing.assert_close(tensor, dict(perturbed)[name], rtol=0, atol=0)
    samples = flatten(engine.generate(prompts(2), 2, SamplingParams(max_new_tokens=6)))
    assert {s.weight_version for s in samples} == {"v1"}


def test_missing_weight_is_refused(model):
    tensors = list(hf_weights.checkpoint_tensors(model))[1:]
    with pytest.raises(ValueError, match="missing"):
        LocalEngine(model).update_weights(iter(tensors), "v1")


def test_filters():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    assert torch.isinf(_filter(logits, SamplingParams(top_k=2))).tolist() == [[False, False, True, True]]
    p = logits.softmax(-1)[0]  # 0.644, 0.237, 0.087, 0.032
    kept = ~torch.isinf(_filter(logits, SamplingParams(top_p=0.8)))
    assert kept.tolist() == [[True, True, False, False]] and p[0] < 0.8 <= p[0] + p[1]
    kept = ~torch.isinf(_filter(logits, SamplingParams(min_p=0.3)))  # keep p >= 0.3 * 0.644
    assert kept.tolist() == [[True, True, False, False]]


def test_checkpoint_tensors_match_saved_files(tmp_path, model):
    """The in-memory -> checkpoint conversion is what save_pretrained writes (and SGLang loads)."""
    from safetensors.torch import load_file

    model.save_pretrained(tmp_path)
    saved = load_file(str(tmp_path / "model.safetensors"))
    ours = dict(hf_weights.checkpoint_tensors(model))
    assert ours.keys() == saved.keys()
    assert any(".experts.3.gate_proj.weight" in n for n in ours)
    for name in saved:
        torch.testing.assert_close(ours[name], saved[name], rtol=0, atol=0)


def test_rollout_routing_equals_one_forwards(model):
    """With rollout_routing, each sample's routes ([P + R - 1, layers, top-k], like SGLang's) are the experts
    one forward over prompt + response routes each token to: the incremental decode's hooks line up."""
    engine = LocalEngine(model, seed=0, rollout_routing=True, eos_token_ids=[5])  # some samples stop early
    samples = flatten(engine.generate(prompts(3), n=4, sampling=SamplingParams(max_new_tokens=10)))
    assert len({len(s.response_ids) for s in samples}) > 1
    captured = {}
    routers = [(name, m) for name, m in model.named_modules() if type(m).__name__.endswith("TopKRouter")]
    handles = [m.register_forward_hook(lambda _m, _i, out, name=name: captured.__setitem__(name, out[2]))
               for name, m in routers]
    try:
        for s in samples:
            with torch.no_grad():
                model(torch.tensor([s.prompt_ids + s.response_ids]))
            full = torch.stack([captured[name] for name, _ in routers], dim=1)[:-1]  # every token but the last
            assert s.rollout_routing.shape == (len(s.prompt_ids) + len(s.response_ids) - 1, len(routers), 2), s.name
            assert torch.equal(s.rollout_routing.long().sort(-1).values, full.sort(-1).values), s.name
    finally:
        for handle in handles:
            handle.remove()


def test_stop_token_ids_end_responses(model):
    """rollout.stop_token_ids reach the engine with the end token: a response ends at its first stop token,
    which it keeps (finish_reason stop), and none ends earlier."""
    from gspo_megatron.train.sampling import rounds
    from gspo_megatron.train.startup.config import load_config

    stops = list(range(20, 60))  # a third of the tiny vocabulary: most responses stop early
    cfg = load_config(None, ["data.task=count", "rollout.max_new_tokens=12", f"rollout.stop_token_ids={stops}"])
    sampling = rounds.sampling_params(cfg, step=0, eos_ids=[1])
    assert sampling.stop_token_ids == (1, *stops)
    samples = flatten(LocalEngine(model, eos_token_ids=[]).generate(prompts(4), 4, sampling))
    stopped = [s for s in samples if s.finish_reason == "stop"]
    assert len(stopped) >= len(samples) // 2
    for s in samples:
        hits = [j for j, t in enumerate(s.response_ids) if t in sampling.stop_token_ids]
        assert hits == ([len(s.response_ids) - 1] if s.finish_reason == "stop" else []), s.response_ids
