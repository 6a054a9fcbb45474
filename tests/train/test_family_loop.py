"""The training loop on the other MoE families, through the command line as a user runs it (world 1; the local
engine, and for the gated-DeltaNet hybrid a launched CPU SGLang server):
``model.tiny.family`` builds a tiny random GLM-4.5 or DeepSeek-V3 (dense first layer, shared expert, sigmoid
group-limited router with its score-correction bias; MLA for DeepSeek), gpt-oss (sliding windows, sinks, biases,
the clamped GLU, stacked experts) or MiniMax-M2 (q/k norms over the whole projection, sigmoid router with its bias),
the warm start trains it with transformers,
and three GSPO steps run with a weight sync after each (8 experts in two groups, the top 2 from the better one). The engine's log-probs of every step's samples equal the
trainer's (fp32: ``LOGPROB_TOL``; measured ~2e-6), so each sync carried every tensor the engine routes and attends
with, the frozen expert bias included. Whether the loop learns on them over hundreds of steps: bench/RESULTS.md
(``family_learning``).
"""

from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from tests import warm_cli
from tests.rollout.helpers import require_sglang

ROOT = Path(__file__).resolve().parents[2]
STEPS = 3
LOGPROB_TOL = 1e-4  # per token, trainer vs engine, fp32


def _every_step_synced(run: Path, names: list[str]) -> list[dict]:
    """The run's metrics, after checking each step: the engine's log-probs equal the trainer's (so the sync before
    it carried every tensor the model computes with), a finite loss and gradient, and every checkpoint tensor sent."""
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == list(range(1, STEPS + 1))
    for s in steps:
        assert s["logprob_diff_max"] <= LOGPROB_TOL, (s["step"], s["logprob_diff_max"])
        assert math.isfinite(s["loss"]) and math.isfinite(s["grad_norm"]) and s["grad_norm"] > 0
        assert s["weight_sync/tensors"] == len(names), "the sync sends every tensor of the checkpoint"
    return steps


@pytest.mark.megatron  # trains the Megatron policy through the CLI
@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3", "gpt_oss", "minimax_m2"])
def test_the_loop_runs_each_family_with_the_engine_in_step(family, tmp_path):
    run = tmp_path / "run"
    command = [sys.executable, "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
               f"model.tiny.family={family}", "model.tiny.num_experts=8", "rollout.engine=local", f"train.steps={STEPS}", "train.eval_every=0",
               "model.warm_start_steps=2", f"model.hf_dir={tmp_path / 'model'}", f"logging.dir={run}",
               f"checkpoint.dir={run / 'ck'}", "logging.plot_every=0", "rollout.prompts_per_step=4",
               "parallel.micro_batch_size=8", "data.reward_workers=0",
               "optimizer.lr=3e-3"]  # 10x the example's: an optimizer step then moves some routes (volatility)
    out = warm_cli.run(command, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, WORLD_SIZE="1"),
                       timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["model_type"] == family
    with safe_open(tmp_path / "model" / "model.safetensors", "pt") as f:
        names = list(f.keys())
    if family == "gpt_oss":  # windows shorter than a prompt and its answer, sinks, the experts stacked in the files
        assert config["sliding_window"] < 16 and "sliding_attention" in config["layer_types"]
        assert any(n.endswith("self_attn.sinks") for n in names) and any(n.endswith("gate_up_proj") for n in names)
    elif family == "minimax_m2":  # q/k norms over the whole projection, the routing bias beside the router
        assert config["use_qk_norm"] and config["qk_norm_type"] == "per_layer"
        assert config["rotary_dim"] == config["head_dim"] // 2
        assert any(n.endswith("self_attn.q_norm.weight") for n in names)
        assert any(n.endswith("block_sparse_moe.e_score_correction_bias") for n in names)
    else:
        assert config["first_k_dense_replace"] == 1
        assert (config["n_group"], config["topk_group"], config["n_routed_experts"]) == (2, 1, 8)  # a group limit
        assert any(n.endswith("e_score_correction_bias") for n in names)
    steps = _every_step_synced(run, names)
    # The second minibatch routes some tokens otherwise than the old-policy pass (the volatility measure works).
    assert sum(s["expert_volatility"] for s in steps) > 0


@pytest.mark.megatron  # trains the Megatron policy through the CLI
def test_the_loop_runs_the_gated_deltanet_hybrid_with_the_engine_in_step(tmp_path):
    """``model.tiny.family=qwen3_5_moe``: Qwen3.5-MoE's text model (a DeltaNet layer, then a gated full-attention
    layer; gated shared expert, zero-centred norms), served by a launched CPU SGLang server (SGLang's own
    Qwen3.5 model on the pure-torch stand-ins of patches/sglang_cpu for its Triton kernels; the directory
    transformers saved served through a copy with ``full_attention_interval``, without the radix cache, fp32
    convolution states), with packed sequences in token-budget micro batches (``parallel.pack_sequences``,
    ``parallel.max_tokens_per_micro_batch``: several samples per row, no padding). The engine's log-probs of every
    step's samples (its prefill, then its recurrent decode over each response's tokens) equal the trainer's packed
    ones (measured <= 1e-5), so each sync carried every tensor the DeltaNet, the gated attention and the shared
    expert's gate compute with, and each packed sample's DeltaNet state started fresh
    (tests/model/test_gated_deltanet.py checks packed against padded directly). Where SGLang is not installed (the
    megatron-core 0.19 run's environment) it is skipped; the hybrid's layers on 0.19 are test_gated_deltanet's."""
    require_sglang()
    run = tmp_path / "run"
    command = [sys.executable, "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
               "model.tiny.family=qwen3_5_moe", "rollout.engine=sglang", f"train.steps={STEPS}", "train.eval_every=0",
               "model.warm_start_steps=2", f"model.hf_dir={tmp_path / 'model'}", f"logging.dir={run}",
               f"checkpoint.dir={run / 'ck'}", "logging.plot_every=0", "rollout.prompts_per_step=4",
               "parallel.micro_batch_size=8", "data.reward_workers=0", "optimizer.lr=3e-3",
               "parallel.pack_sequences=true", "parallel.max_tokens_per_micro_batch=96"]
    out = warm_cli.run(command, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, WORLD_SIZE="1"),
                       timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["model_type"] == "qwen3_5_moe_text"
    assert config["layer_types"] == ["linear_attention", "full_attention"]
    with safe_open(tmp_path / "model" / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert any(".linear_attn.in_proj_qkv." in n for n in names) and any("shared_expert_gate" in n for n in names)
    steps = _every_step_synced(run, names)
    assert all(s["padding_frac"] == 0.0 for s in steps), "packed rows of whole samples"
    assert all(s["response_length_mean"] > 2 for s in steps), "responses of several tokens: the decode path ran"


@pytest.mark.megatron  # trains the Megatron policy through the CLI, or is refused it (megatron-core 0.16.1)
def test_the_loop_runs_glm5_sparse_attention_with_the_engine_in_step(tmp_path):
    """``model.tiny.family=glm_moe_dsa``: GLM-5's DeepSeek sparse attention (MLA plus an indexer keeping 8 keys per
    query, fewer than a prompt and its answer) with the local engine. On megatron-core 0.19.2 three GSPO steps run and
    the engine's log-probs of every step's samples equal the trainer's, so each sync carried every tensor the indexer
    chooses with (it is frozen: the weight sync still sends it). On 0.16.1 the command refuses it by name before the
    warm start."""
    from gspo_megatron.model.dsa import megatron_has_dsa

    run = tmp_path / "run"
    command = [sys.executable, "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
               "model.tiny.family=glm_moe_dsa", "model.tiny.num_experts=8", "rollout.engine=local",
               f"train.steps={STEPS}", "train.eval_every=0", "model.warm_start_steps=2",
               f"model.hf_dir={tmp_path / 'model'}", f"logging.dir={run}", f"checkpoint.dir={run / 'ck'}",
               "logging.plot_every=0", "rollout.prompts_per_step=4", "parallel.micro_batch_size=8",
               "data.reward_workers=0", "optimizer.lr=3e-3"]
    out = warm_cli.run(command, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, WORLD_SIZE="1"),
                       timeout=600)
    if not megatron_has_dsa():
        assert out.returncode != 0 and "model_type=glm_moe_dsa needs DeepSeek sparse attention" in out.stderr, \
            out.stderr[-3000:]
        assert not (run / "metrics.jsonl").exists()
        return
    assert out.returncode == 0, out.stderr[-3000:]
    config = json.loads((tmp_path / "model" / "config.json").read_text())
    assert config["model_type"] == "glm_moe_dsa" and config["index_topk"] == 8
    with safe_open(tmp_path / "model" / "model.safetensors", "pt") as f:
        names = list(f.keys())
    assert sum(".self_attn.indexer." in n for n in names) == 2 * 5
    _every_step_synced(run, names)
