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


def test_train_checks_the_config_before_starting():
    out = run("train", "examples/tiny_moe_cpu.yaml", "algo.name=ppo")
    assert out.returncode == 2 and "algo.name='ppo' is not one of" in out.stderr


def test_missing_config_is_named():
    out = run("train", "nope.yaml")
    assert out.returncode == 2 and "config file nope.yaml does not exist" in out.stderr


def test_stray_arguments_are_refused():
    out = run("plan", "examples/tiny_moe_cpu.yaml", "--bogus")
    assert out.returncode == 2 and "unrecognized arguments: --bogus" in out.stderr
