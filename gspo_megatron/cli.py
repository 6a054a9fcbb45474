"""The ``gspo-megatron`` command line."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NOT_YET = {
    "train": "the GSPO trainer (rollout -> rewards -> log-probs -> advantages -> update -> weight sync)",
    "plan": "the layout and memory planner",
    "score": "response log-likelihood scoring of HF or Megatron checkpoints",
}


def _read_config(path: str) -> dict:
    import yaml

    file = Path(path)
    if not file.is_file():
        raise SystemExit(f"gspo-megatron: config file {path} does not exist")
    with file.open() as f:
        config = yaml.safe_load(f) or {}
    if not isinstance(config, dict):
        raise SystemExit(f"gspo-megatron: {path} must hold a mapping of sections, got {type(config).__name__}")
    return config


def _not_implemented(command: str, args: argparse.Namespace) -> int:
    if getattr(args, "config", None):
        config = _read_config(args.config)
        print(f"gspo-megatron {command}: {args.config}")
        for section, values in config.items():
            print(f"  {section}: {values}")
    print(
        f"gspo-megatron {command}: {NOT_YET[command]} is not implemented in this version yet; "
        "the config above is what it will run.",
        file=sys.stderr,
    )
    return 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gspo-megatron",
        description="GSPO reinforcement learning for Mixture-of-Experts models on Megatron-Core, "
        "with rollouts from SGLang.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", help="run GSPO/GRPO training from a YAML config")
    train.add_argument("config", help="YAML config, e.g. examples/tiny_moe_cpu.yaml")
    train.add_argument("overrides", nargs="*", help="dotted.key=value overrides")
    train.add_argument("--resume", action="store_true", help="continue from the latest checkpoint")
    plan = sub.add_parser("plan", help="print the resolved parallel layout and per-GPU memory estimate")
    plan.add_argument("config")
    plan.add_argument("overrides", nargs="*")
    score = sub.add_parser("score", help="log-likelihood of responses under a model")
    score.add_argument("--model", required=True, help="HF directory or Megatron checkpoint")
    score.add_argument("--input", required=True, help="JSONL with prompt_ids and response_ids")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return _not_implemented(args.command, args)


if __name__ == "__main__":
    sys.exit(main())
