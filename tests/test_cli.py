"""The gspo-megatron command: help, and the README's main command until the trainer lands."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args):
    return subprocess.run([sys.executable, "-m", "gspo_megatron.cli", *args], capture_output=True, text=True, cwd=ROOT)


def test_help_lists_subcommands():
    out = run("--help")
    assert out.returncode == 0
    for command in ("train", "plan", "score"):
        assert command in out.stdout


def test_train_says_what_it_will_run_and_exits_nonzero():
    out = run("train", "examples/tiny_moe_cpu.yaml")
    assert out.returncode == 2
    assert "qwen3_moe" in out.stdout and "sglang" in out.stdout
    assert "not implemented" in out.stderr


def test_missing_config_is_named():
    out = run("train", "nope.yaml")
    assert out.returncode != 0 and "nope.yaml does not exist" in out.stderr
