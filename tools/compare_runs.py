#!/usr/bin/env python
"""Plot several runs side by side, e.g. GSPO vs GRPO vs GRPO + Routing Replay.

    python tools/compare_runs.py runs/gspo runs/grpo runs/grpo_rr --out compare.png
    python tools/compare_runs.py gspo=runs/a/metrics.jsonl grpo=runs/b --out compare.png

Each argument is a run directory (holding metrics.jsonl) or a metrics.jsonl, optionally labelled LABEL=PATH.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gspo_megatron.train.records.plots import plot_runs


def _resolve(arg: str) -> tuple[str, Path]:
    label, _, path = arg.rpartition("=") if "=" in arg else ("", "", arg)
    path = Path(path)
    metrics = path / "metrics.jsonl" if path.is_dir() else path
    if not metrics.is_file():
        raise SystemExit(f"compare_runs: {arg}: no metrics.jsonl there")
    return label or (path.name if path.is_dir() else path.parent.name), metrics


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="run directories or metrics.jsonl files, optionally LABEL=PATH")
    parser.add_argument("--out", default="compare_runs.png", help="output PNG")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    runs = dict(_resolve(a) for a in args.runs)
    print(plot_runs(runs, args.out, args.title))
    return 0


if __name__ == "__main__":
    sys.exit(main())
