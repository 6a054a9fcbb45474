"""The cluster examples pass `gspo-megatron plan` on their documented node counts (and 235B does not fit 8, nor
16 without recomputing its MoE layers: exit status 1, naming single changes that fit; 671B needs full recompute). In process: ``plan`` builds
nothing, and runs from any directory (a YAML's relative paths are relative to its folder)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from gspo_megatron.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def plan(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repository: the examples' paths resolve against their own folders

    def run(config, *args):
        code = main(["plan", str(ROOT / config), *args])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


@pytest.mark.parametrize("config, nodes, params", [
    ("examples/qwen3_30b_a3b/train.yaml", 2, "30.53B parameters (3.35B active)"),
    ("examples/qwen3_235b_a22b/train.yaml", 16, "235.09B parameters (22.19B active)"),
    ("examples/glm_4_5_355b/train.yaml", 16, "352.80B parameters (33.63B active)"),
    ("examples/deepseek_v3_671b/train.yaml", 32, "671.03B parameters (37.55B active)"),
    ("examples/glm_5_744b/train.yaml", 32, "743.91B parameters (41.78B active)"),  # slime's 256 H100
    ("examples/qwen3_5_35b_a3b/train.yaml", 2, "34.66B parameters (3.45B active)"),
    ("examples/qwen3_5_397b_a17b/train.yaml", 16, "396.35B parameters (17.35B active)"),
    ("examples/minimax_m2_230b/train.yaml", 8, "228.69B parameters (11.03B active)"),
    ("examples/gpt_oss_120b/train.yaml", 4, "116.83B parameters (5.71B active)"),
])
def test_cluster_examples_fit(plan, config, nodes, params):
    code, out, err = plan(config, "--nodes", str(nodes), "--gpus-per-node", "8")
    assert code == 0, err
    assert params in out and ": fits" in out, out


def test_671b_rollout_facts_and_its_uneven_stages(plan):
    """DeepSeek-V3's servers cache MLA's latent (68.6 KiB per token, not 4.8 MiB of per-head K and V); 1342 GB of
    bf16 into every server GPU at 45 GB/s is ~30 s of wire alone. Its 61 layers go over PP 4 only unevenly (an even
    split is refused by name), and at PP 1 recomputing only the MoE layers does not fit (full recompute does)."""
    example = ("examples/deepseek_v3_671b/train.yaml", "--nodes", "32", "--gpus-per-node", "8")
    code, out, err = plan(*example)
    assert "KV cache     68.6 KiB per token in bf16 (multi-latent: (kv_lora_rank 512 + qk_rope 64) x 61 layers" in out
    assert "weight sync  1342 GB (bf16) into every server GPU: ~45.7-47.1 s (29.8 s at 45 GB/s" in out, out
    assert "in flight (1F1B): 4 on the first stage, 3 on the middle stage, 1 on the last stage" in out, out
    code, out, err = plan(*example, "rollout.fp8=true")  # FP8 rollouts: half the servers' weights and the sync
    assert "weights      673 GB in FP8 (rollout.fp8) instead of 1342 GB in bf16 per server: 669 GB more" in out, out
    assert "weight sync  673 GB (FP8 + scales, bf16 rest) into every server GPU: ~23.4-24.8 s" in out, out
    code, out, err = plan(*example, "parallel.first_stage_layers=null")
    assert code == 2 and "num_hidden_layers=61 is not divisible by parallel.pipeline=4" in err, out + err
    pp1 = ("parallel.pipeline=1", "parallel.expert=256", "parallel.first_stage_layers=null")
    code, out, err = plan(*example, *pp1)
    assert code == 1 and "DOES NOT FIT" in out and "recompute.granularity=full" in err, out + err
    code, out, err = plan(*example, *pp1, "recompute.granularity=full")
    assert code == 0 and ": fits" in out, out + err


def test_235b_needs_its_moe_recompute(plan):
    # Keeping the routed experts' activations (2 micro batches of 9216 tokens in flight) does not fit an H100.
    code, out, err = plan("examples/qwen3_235b_a22b/train.yaml", "--nodes", "16", "--gpus-per-node", "8",
                          "recompute.modules=[core_attn]")
    assert code == 1 and "DOES NOT FIT" in out, out + err
    assert "recompute    selective, modules ['core_attn']" in out
    assert "this layout does not fit in 79.1 GiB per GPU; each of these would make it fit: " in err, err
    assert "recompute.modules=[core_attn, moe]" in err and "recompute.granularity=full" in err, err


def test_235b_on_8_nodes_does_not_fit_and_each_named_change_fits(plan):
    code, out, err = plan("examples/qwen3_235b_a22b/train.yaml", "--nodes", "8", "--gpus-per-node", "8",
                          "parallel.expert=32")
    assert code == 1 and "DOES NOT FIT" in out, out + err
    options = err.split("each of these would make it fit: ")[1].strip().split("; ")
    assert "--nodes 16" in options, options
    for option in options:  # what the message promises
        args = option.split() if option.startswith("--") else ["--nodes", "8", *option.split()]
        code, out, err = plan("examples/qwen3_235b_a22b/train.yaml", *args, "--gpus-per-node", "8",
                              "parallel.expert=32")
        assert code == 0 and ": fits" in out, (option, err)


@pytest.mark.parametrize("args, message", [
    (["--nodes", "1", "--gpus-per-node", "6"],
     "world size=6 is not divisible by parallel.expert*expert_tensor*pipeline=8"),
    (["--nodes", "2"], "--nodes 2 needs --gpus-per-node (the world is nodes x GPUs per node)"),
    (["--nodes", "0", "--gpus-per-node", "8"], "--nodes 0: the number of nodes must be at least 1"),
    (["--nodes", "-2", "--gpus-per-node", "8"], "--nodes -2: the number of nodes must be at least 1"),
    (["--gpus-per-node", "-8"], "--gpus-per-node -8: must be at least 1"),
    (["--gpus-per-node", "8", "--gpu-memory-gib", "0"], "--gpu-memory-gib 0 must be a positive number of GiB"),
    (["--gpus-per-node", "8", "--host-memory-gib", "-1"], "--host-memory-gib -1 must be a positive number of GiB"),
])
def test_bad_plan_arguments_are_sentences(plan, args, message):
    code, out, err = plan("examples/qwen3_30b_a3b/train.yaml", *args)
    assert code == 2 and message in err, err


def test_launch_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(ROOT / "examples/launch_cluster.sh")]).returncode == 0


def test_rollout_at_scale_tables_match_the_readme(capsys):
    """bench/rollout_at_scale.py prints the server and weight-sync rows the 671B example's README shows."""
    import importlib

    bench = importlib.import_module("bench.rollout_at_scale")
    bench.main([str(ROOT / "examples/deepseek_v3_671b/hf_config"), "--layouts", "32:4:32:2", "16:16:16:2"])
    out = capsys.readouterr().out
    readme = (ROOT / "examples/deepseek_v3_671b/README.md").read_text()
    rows = [line for line in out.splitlines() if line.startswith("| `")]
    assert len(rows) == 2 and all(row in readme for row in rows), out
    assert "| bf16, 256 MiB buckets | 1342 | 5000 | 29.8 s | 15.0 s | 0.9-2.3 s | **45.7-47.1 s** |" in out


def test_gpt_oss_120b_does_not_fit_one_h100_node(plan):
    """gpt-oss-120b's full-parameter state (bf16 weights, fp32 gradients, Adam: 18 B x 116.8B = 2.1 TB) is over three
    times one node's 640 GB: refused on one node with no single change that fits, and at 2 nodes; 4 fit (above)."""
    code, out, err = plan("examples/gpt_oss_120b/train.yaml", "--nodes", "1", "--gpus-per-node", "8",
                          "parallel.tensor=1", "parallel.expert=8")
    assert code == 1 and "DOES NOT FIT" in out and "no single change" in err, out + err
    code, out, err = plan("examples/gpt_oss_120b/train.yaml", "--nodes", "2", "--gpus-per-node", "8",
                          "parallel.expert=16")
    assert code == 1 and "DOES NOT FIT" in out, out + err


def test_gpt_oss_120b_fits_one_h100_node_with_the_optimizer_in_host_memory(plan):
    """train_one_node.yaml: the optimizer state in host memory and bf16 gradients leave 4 B per parameter on the GPUs
    (65.0 GiB per GPU at TP 4 x EP 8) and need 1805 GiB of a DGX H100's 2048 GiB per node; a node with 1 TiB is
    refused by its host memory, naming it. Without them the same layout needs 265.5 GiB per GPU, and the refusal
    names them."""
    one_node = ("examples/gpt_oss_120b/train_one_node.yaml", "--nodes", "1", "--gpus-per-node", "8")
    code, out, err = plan(*one_node)
    assert code == 0, err
    assert "gradients       27.72 GiB  (bf16 buffer)" in out, out
    assert "optimizer        0.00 GiB  (distributed: dense over DP x CP 2, experts over expert-DP 1; 100% of it in " \
           "host memory)" in out, out
    assert "total           64.95 GiB of 79.1 GiB: fits" in out, out
    assert "optimizer      217.69 GiB per rank" in out and "total         1805.50 GiB of 2048 GiB" in out, out
    code, out, err = plan(*one_node, "--host-memory-gib", "1024")
    assert code == 1 and "1805.50 GiB of 1024 GiB (--host-memory-gib): DOES NOT FIT" in out, out
    assert "does not fit in 79.1 GiB per GPU and 1024 GiB of host memory per node" in err, err
    code, out, err = plan(*one_node, "optimizer.offload_fraction=0", "optimizer.grad_reduce_in_fp32=true")
    assert code == 1 and "total          265.48 GiB of 79.1 GiB: DOES NOT FIT" in out, out
    # Named as the change that fits: both fields together.
    assert "optimizer.offload_fraction=1 optimizer.grad_reduce_in_fp32=false" in err, err


def test_qwen3_5_sizes_one_node_and_recompute(plan):
    """Qwen3.5-35B-A3B does not fit one H100 node (the experts' weights, fp32 gradients and Adam state are 18 B x 32.2B
    over 8 GPUs) and the refusal names 2 nodes; one H200 node fits. Qwen3.5-397B-A17B on 16 nodes needs every layer
    recomputed: recomputing only the MoE layers keeps the DeltaNet and attention activations of 4 micro batches."""
    code, out, err = plan("examples/qwen3_5_35b_a3b/train.yaml", "--nodes", "1", "--gpus-per-node", "8",
                          "parallel.expert=8")
    assert code == 1 and "DOES NOT FIT" in out and "--nodes 2" in err, out + err
    code, out, err = plan("examples/qwen3_5_35b_a3b/train.yaml", "--nodes", "1", "--gpus-per-node", "8",
                          "--gpu-memory-gib", "139", "parallel.expert=8")
    assert code == 0 and ": fits" in out, out + err
    assert "gated DeltaNet" in out and "10 full-attention layers" in out and "DeltaNet     61.4 MiB" in out, out
    code, out, err = plan("examples/qwen3_5_397b_a17b/train.yaml", "--nodes", "16", "--gpus-per-node", "8",
                          "recompute.granularity=selective")
    assert code == 1 and "recompute.granularity=full" in err, out + err
