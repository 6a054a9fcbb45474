"""The cluster examples pass `gspo-megatron plan` on their documented node counts (and 235B does not fit 8, nor
16 without recomputing its MoE layers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests import warm_cli

ROOT = Path(__file__).resolve().parents[1]


def plan(*args):
    return warm_cli.run([sys.executable, "-m", "gspo_megatron.cli", "plan", *args], capture_output=True, text=True,
                      cwd=ROOT, timeout=300)


@pytest.mark.parametrize("config, nodes, params", [
    ("examples/qwen3_30b_a3b/train.yaml", 2, "30.53B parameters (3.35B active)"),
    ("examples/qwen3_235b_a22b/train.yaml", 16, "235.09B parameters (22.19B active)"),
])
def test_cluster_examples_fit(config, nodes, params):
    out = plan(config, "--nodes", str(nodes), "--gpus-per-node", "8")
    assert out.returncode == 0, out.stderr[-2000:]
    assert params in out.stdout and ": fits" in out.stdout, out.stdout


def test_235b_needs_its_moe_recompute():
    # Keeping the routed experts' activations (2 micro batches of 9216 tokens in flight) does not fit an H100.
    out = plan("examples/qwen3_235b_a22b/train.yaml", "--nodes", "16", "--gpus-per-node", "8",
               "recompute.modules=[core_attn]")
    assert out.returncode == 0 and "DOES NOT FIT" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "recompute    selective, modules ['core_attn']" in out.stdout


def test_235b_on_8_nodes_does_not_fit():
    out = plan("examples/qwen3_235b_a22b/train.yaml", "--nodes", "8", "--gpus-per-node", "8", "parallel.expert=32")
    assert out.returncode == 0 and "DOES NOT FIT" in out.stdout, out.stdout + out.stderr[-2000:]


def test_bad_layout_names_the_field():
    out = plan("examples/qwen3_30b_a3b/train.yaml", "--nodes", "1", "--gpus-per-node", "6")
    assert out.returncode == 2 and "world size=6 is not divisible by parallel.expert*expert_tensor*pipeline=8" in out.stderr


def test_launch_script_is_valid_bash():
    assert subprocess.run(["bash", "-n", str(ROOT / "examples/launch_cluster.sh")]).returncode == 0
