"""The tiny GLM-4.5 model (``tests/model/hf_tiny.py``: sigmoid router with nonzero expert biases and a group limit,
shared expert, qkv bias, qk-norm, partial rotary) served by a real SGLang server on CPU (fp32): its per-token
log-probs equal the trainer-side model's (transformers, through the fused log-prob op) within ``TOLERANCE``, before
and after a distributed weight sync of a trained model whose expert bias was moved too (a sync that dropped the bias
would leave SGLang routing differently from the trainer: the stale check shows the moved bias alone is visible), and
after a bf16 sync (distributed, flattened or not, and disk), which must keep the expert bias fp32.
Rollout routing replay (R3) with its sigmoid, bias-corrected, group-limited router and a dense first layer: the
server's routes replayed in the Megatron policy (TP2 + SP) are used by every MoE router for every token, and the
log-probs equal SGLang's.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from gspo_megatron.rollout import SamplingParams, flatten, logprob_mismatch, samples_to_batch
from tests.model import hf_tiny

from tests.sglang_servers import own_engine, server_config
from .helpers import TOLERANCE, fused_logprobs, prompts, require_sglang
from .r3_ranks import GROUP, N_PROMPTS, r3_replay
from .test_weight_sync import _mismatch, _rollout, _train_step


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    require_sglang()
    model_dir = hf_tiny.save_variant("glm4_moe", tmp_path_factory.mktemp("glm"), seed=4)
    # context_length: its max positions; the routed experts for rollout routing replay's test
    config = server_config(model_dir, tmp_path_factory.mktemp("glm_logs"), context_length=64,
                           return_routed_experts=True)
    with own_engine(config) as engine:
        yield engine, model_dir


def test_sglang_serves_glm_with_the_trainers_logprobs(glm):
    from transformers import AutoModelForCausalLM

    engine, model_dir = glm
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    groups = engine.generate(prompts(6, seed=2), n=2, sampling=SamplingParams(max_new_tokens=8))
    batch = samples_to_batch(flatten(groups))
    with torch.no_grad():
        ours = fused_logprobs(model, batch)
    metrics = logprob_mismatch(ours, batch["rollout_logprobs"], batch["loss_mask"])
    assert metrics["mismatch/token_max_abs"] <= TOLERANCE, metrics
    print("GLM train/inference mismatch:", metrics)


@pytest.mark.megatron  # builds a Megatron model
def test_glm_routes_replayed_equal_the_servers_tp2(glm):
    """SGLang returns routes for every decoder layer ([P + R - 1, num_hidden_layers, top-k], the dense first layer's
    slot unused); the policy's routers (MoE layers only) take theirs by layer number. Replayed under TP2 + SP, every
    router uses the server's experts exactly, the log-probs equal SGLang's, and a misaligned replay is far off."""
    import json

    from gspo_megatron.parallel.groups import Layout
    from gspo_megatron.parallel.launch import run_on_ranks

    engine, model_dir = glm
    config = json.loads((model_dir / "config.json").read_text())
    layers, topk, dense = config["num_hidden_layers"], config["num_experts_per_tok"], config["first_k_dense_replace"]
    assert dense >= 1, "the tiny GLM has a dense first layer: the layer numbering is under test"
    layout = Layout(tensor=2, sequence_parallel=True)
    # Before the weight-sync test below (file order): the server still serves model_dir's weights.
    results = run_on_ranks(r3_replay, 2, layout, str(model_dir), engine.worker_urls[0], layout, timeout=300)
    shapes = results[0]["shapes"]
    assert len(shapes) == N_PROMPTS * GROUP
    assert all(shape == (p + r - 1, layers, topk) for p, r, shape in shapes), shapes
    for rank, r in enumerate(results):
        print(f"GLM R3 rank {rank}: " + "  ".join(f"{k}: {r[k]}" for k in ("r3", "shifted", "free")))
        r3, shifted = r["r3"], r["shifted"]
        assert r3["layers_seen"] == list(range(dense, layers))  # MoE layers only
        assert r3["routes_total"] > 0 and r3["routes_same"] == r3["routes_total"], r3
        assert r3["mismatch/token_max_abs"] <= TOLERANCE, r3
        assert shifted["mismatch/token_max_abs"] > 100 * TOLERANCE, shifted


def test_glm_weight_sync_carries_the_expert_bias(glm):
    """Distributed, then by disk: after each, SGLang's log-probs equal the trained model's, its expert bias moved."""
    from transformers import AutoModelForCausalLM

    from gspo_megatron.rollout import hf_weights

    engine, model_dir = glm
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    _, batch = _rollout(engine, seed=10)
    assert _mismatch(model, batch)["mismatch/token_max_abs"] <= TOLERANCE
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    for step, method in enumerate(("distributed", "disk"), start=1):
        with torch.no_grad():
            bias.add_(0.5 * torch.randn(bias.shape, generator=torch.Generator().manual_seed(step)))
        assert _mismatch(model, batch)["mismatch/token_max_abs"] > 10 * TOLERANCE, "the moved bias changes no route"
        _train_step(model, batch)
        stats = engine.update_weights(hf_weights.checkpoint_tensors(model), f"glm-step-{step}", method=method)
        assert stats.weight_version == f"glm-step-{step}"
        _, batch = _rollout(engine, seed=10 + step)
        after = _mismatch(model, batch)
        print(f"GLM mismatch after the {method} sync:", after)
        assert after["mismatch/token_max_abs"] <= TOLERANCE, (method, after)


@pytest.mark.parametrize("method, flattened", [("distributed", True), ("distributed", False), ("disk", None)])
def test_a_bf16_sync_routes_with_the_trainers_fp32_bias(glm, monkeypatch, method, flattened):
    """``weight_sync.dtype="bfloat16"`` into the fp32 server, in 4 KiB buckets (mixed: the bias among bf16 tensors):
    every weight arrives bf16-rounded but the expert bias, which SGLang's Glm4MoeGate keeps fp32 as megatron does
    (``mapping.KEPT_FP32``), so its log-probs equal a model holding exactly that. The biases sit at 100 with a spread
    of a few bf16 steps (0.5 there), as GLM-5's do: the same model with them rounded too routes far off."""
    from transformers import AutoModelForCausalLM

    from gspo_megatron.model.mapping import export_dtype
    from gspo_megatron.rollout import WeightSyncConfig, hf_weights

    engine, model_dir = glm
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in model.model.layers:
            gate = layer.mlp.gate if hasattr(layer.mlp, "gate") else None
            if gate is not None and hasattr(gate, "e_score_correction_bias"):
                gate.e_score_correction_bias.copy_(100 + torch.randn(gate.e_score_correction_bias.shape, generator=g))
    sent = [(n, t.to(export_dtype(n, t, torch.bfloat16)).float()) for n, t in hf_weights.checkpoint_tensors(model)]
    served = hf_weights.load_checkpoint_tensors(model, sent).eval()
    rounded = hf_weights.load_checkpoint_tensors(model, [(n, t.bfloat16().float()) for n, t in sent]).eval()
    sync = WeightSyncConfig(method=method, bucket_bytes=4096, flatten=flattened, dtype="bfloat16")
    monkeypatch.setattr(engine, "config", replace(engine.config, weight_sync=sync))
    version = f"glm-bf16-{method}-{flattened}"
    stats = engine.update_weights(hf_weights.checkpoint_tensors(model), version, method=method)
    assert stats.weight_version == version and stats.num_buckets > 10
    _, batch = _rollout(engine, seed=20)
    exact, off = _mismatch(served, batch), _mismatch(rounded, batch)
    print(f"GLM bf16 {method} sync (flattened {flattened}): vs fp32 bias {exact}; vs rounded bias {off}")
    assert exact["mismatch/token_max_abs"] <= TOLERANCE, exact
    assert off["mismatch/token_max_abs"] > 10 * TOLERANCE, off
