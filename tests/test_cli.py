"""The gspo-megatron command: help, and the README's main command until the trainer lands."""

from __future__ import annotations

import sys
from pathlib import Path

from tests import warm_cli

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    return warm_cli.run([sys.executable, "-m", "gspo_megatron.cli", *args], capture_output=True, text=True, cwd=ROOT)


def test_help_lists_subcommands():
    out = run("--help")
    assert out.returncode == 0
    for command in ("train", "plan", "score"):
        assert command in out.stdout


def test_train_checks_the_config_before_starting():
    out = run("train", "examples/tiny_moe_cpu.yaml", "algo.name=ppo")
    assert out.returncode == 2 and "algo.name='ppo' is not one of" in out.stderr


def test_missing_config_is_named():
    out = run("train", "nope.yaml")
    assert out.returncode == 2 and "config file nope.yaml does not exist" in out.stderr


def test_stray_arguments_are_refused():
    out = run("plan", "examples/tiny_moe_cpu.yaml", "--bogus")
    assert out.returncode == 2 and "unrecognized arguments: --bogus" in out.stderr


def test_train_checks_the_layout_against_the_model_before_starting(tmp_path):
    """The tiny model (2 key/value heads) cannot split over 4 TP ranks: refused from its config, before any process
    group starts (WORLD_SIZE=4 without torchrun would otherwise wait for ranks that never come)."""
    import os

    env = dict(os.environ, WORLD_SIZE="4")
    out = warm_cli.run([sys.executable, "-m", "gspo_megatron.cli", "train", "examples/tiny_moe_cpu.yaml",
                          "parallel.tensor=4", f"model.hf_dir={tmp_path / 'model'}"],
                       capture_output=True, text=True, cwd=ROOT, env=env, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    assert "num_key_value_heads=2 is not divisible by parallel.tensor=4" in out.stderr
    assert not (tmp_path / "model").exists()  # nothing was built


def test_commands_end_their_process_groups_before_exit(monkeypatch, tmp_path):
    """A command that started process groups destroys them before it returns, on success and on a refused input
    alike: gloo groups left to the interpreter's exit can abort a finished rank (SIGABRT, "terminate called without
    an active exception": one of four colocated ranks in CI). Here in-process, at world 1 on gloo."""
    import torch.distributed as dist

    from gspo_megatron import cli, score
    from gspo_megatron.model.errors import exit_status
    from gspo_megatron.parallel import groups

    monkeypatch.setenv("MASTER_PORT", str(groups.free_port()))
    for status in (0, 2):
        def run_scoring(args, status=status):
            groups.init_distributed(backend="gloo")
            assert dist.is_initialized()
            return status

        monkeypatch.setattr(score, "run", run_scoring)
        assert cli.main(["score", "--model", str(tmp_path), "--input", str(tmp_path / "r.jsonl")]) == status
        assert not dist.is_initialized()

    def refused_conversion():
        groups.init_distributed(backend="gloo")
        raise ValueError("model.layers.0.mlp.experts.0.up_proj.weight: shape (8, 4), expected (8, 16)")

    assert exit_status("convert_hf_to_megatron", refused_conversion) == 2
    assert not dist.is_initialized()
