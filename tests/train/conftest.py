"""Fixtures shared by the trainer's tests."""

from __future__ import annotations

import subprocess

import pytest
import torch


@pytest.fixture(scope="session")
def moe_then_dense_dir(tmp_path_factory) -> str:
    """A tiny Qwen3-MoE saved locally: layer 0 routed experts (4, top-2), layer 1 a dense MLP, vocabulary 128."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                            num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                            tie_word_embeddings=False, max_position_embeddings=256, initializer_range=0.1)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("moe_then_dense")
    Qwen3MoeForCausalLM(config).to(torch.float32).save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def uninterrupted_two_ranks(tmp_path_factory):
    """(run, model): ``torchrun_runs.two_ranks`` with the local engine and a checkpoint every 2 steps, run once
    without interruption: the reference of the tests that stop, restart and resume it."""
    from tests.train.torchrun_runs import ROOT, env, two_ranks

    root = tmp_path_factory.mktemp("uninterrupted_two_ranks")
    run, model = root / "run", root / "model"
    out = subprocess.run(two_ranks(run, model, "rollout.engine=local", "checkpoint.every=2"), cwd=ROOT, env=env(),
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    # Two ranks print no third-party warnings (environment.KNOWN_NOISE reaches them) and our TransformerEngine note once
    noise = [line for line in out.stderr.splitlines() if "Warning" in line]
    assert not noise and out.stderr.count("TransformerEngine is not installed") <= 1, noise or out.stderr[-3000:]
    return run, model
