"""Plots and the results table of examples/paper/run.py's runs (``report``), from their metrics.jsonl."""

from __future__ import annotations

import json
import math
from pathlib import Path

from gspo_megatron.train.metrics_log import read_metrics

START, END = "<!-- results: written by examples/paper/run.py -->", "<!-- end of results -->"
# (title, metric, y scale); each panel shows every algorithm, the mean over seeds with the seeds' range.
PANELS = [
    ("reward (train, 10-step mean)", "reward_mean", "linear"),
    ("held-out reward (64 prompts)", "eval_reward_mean", "linear"),
    ("clip fraction of response tokens", "clip_frac_tokens", "log"),
    ("expert volatility (after one step)", "expert_volatility", "linear"),
    ("rollout vs trainer |log-prob diff| per token", "logprob_diff_mean", "log"),
]
SMOOTH = 10


def _series(records: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in records if r.get(key) is not None}


def _smooth(points: dict[int, float], window: int) -> dict[int, float]:
    steps = sorted(points)
    return {s: sum(points[t] for t in steps[max(0, i - window + 1):i + 1]) / len(steps[max(0, i - window + 1):i + 1])
            for i, s in enumerate(steps)}


def _mean(values: list[float]) -> float:
    values = [v for v in values if v is not None and math.isfinite(v)]
    return sum(values) / len(values) if values else float("nan")


def load(out: Path, names: list[str], seeds: int) -> dict[str, list[list[dict]]]:
    """name -> the records of each seed's run (runs without metrics are left out)."""
    runs = {}
    for name in names:
        found = [read_metrics(out / f"{name}_seed{s}" / "metrics.jsonl") for s in range(1, seeds + 1)
                 if (out / f"{name}_seed{s}" / "metrics.jsonl").is_file()]
        if found:
            runs[name] = found
    return runs


def plot(runs: dict, labels: dict[str, str], path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.4 * len(PANELS), 3.6))
    for ax, (title, key, scale) in zip(axes, PANELS):
        for name, seeds in runs.items():
            per_seed = [_series(r, key) for r in seeds]
            if key not in ("eval_reward_mean",):
                per_seed = [_smooth(p, SMOOTH) for p in per_seed]
            steps = sorted(set.intersection(*(set(p) for p in per_seed))) if per_seed else []
            if scale == "log":
                steps = [s for s in steps if all(p[s] > 0 for p in per_seed)]
            if not steps:
                continue
            values = [[p[s] for p in per_seed] for s in steps]
            line, = ax.plot(steps, [sum(v) / len(v) for v in values], label=labels[name], linewidth=1.5,
                            marker="o" if key == "eval_reward_mean" else None, markersize=3)
            if len(per_seed) > 1:
                ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=line.get_color(),
                                alpha=0.15, linewidth=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if scale == "log" and ax.lines:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _over(records: list[dict], key: str, first: int | None = None, last: int | None = None) -> float:
    values = [r[key] for r in records if r.get(key) is not None]
    if first is not None:
        values = values[:first]
    if last is not None:
        values = values[-last:]
    return _mean(values)


def _cell(values: list[float], digits: int = 2, scientific: bool = False) -> str:
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return "-"
    fmt = (lambda v: f"{v:.1e}") if scientific else (lambda v: f"{v:.{digits}f}")
    mean = sum(values) / len(values)
    if len(values) == 1:
        return fmt(mean)
    return f"{fmt(mean)} ({fmt(min(values))}-{fmt(max(values))})"


def table(runs: dict, labels: dict[str, str]) -> str:
    """One row per algorithm: mean over seeds (the seeds' range in brackets)."""
    rows = [
        "| run | reward, first 10 steps | reward, last 20 steps | held-out reward, end | clip fraction: tokens | "
        "clip fraction: loss's unit | expert volatility | log-prob diff per token | s / step |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, seeds in runs.items():
        cols = [
            _cell([_over(r, "reward_mean", first=10) for r in seeds]),
            _cell([_over(r, "reward_mean", last=20) for r in seeds]),
            _cell([_over(r, "eval_reward_mean", last=1) for r in seeds]),
            _cell([_over(r, "clip_frac_tokens") for r in seeds], scientific=True),
            _cell([_over(r, "clip_frac") for r in seeds], scientific=True),
            _cell([_over(r, "expert_volatility") for r in seeds], 3),
            _cell([_over(r, "logprob_diff_mean") for r in seeds], scientific=True),
            _cell([_over(r, "time/step", last=len(r) - 1) for r in seeds]),  # the first step warms up
        ]
        rows.append(f"| {labels[name]} | " + " | ".join(cols) + " |")
    return "\n".join(rows)


def report(out: Path, names: list[str], seeds: int, steps: int, readme: Path) -> None:
    from run import RUNS

    labels = {name: label for name, (label, _) in RUNS.items()}
    runs = load(out, names, seeds)
    if not runs:
        raise SystemExit(f"examples/paper: no finished runs under {out}")
    figure = plot(runs, labels, readme.parent / "paper_comparison.png")
    wall = out / "wall_time.json"
    took = json.loads(wall.read_text()) if wall.is_file() else None
    counts = ", ".join(f"{len(s)} seed{'s' if len(s) > 1 else ''}" for s in runs.values())
    lines = [START, "", f"![comparison]({figure.name})", "",
             f"{steps} steps per run, seeds: {counts.split(', ')[0] if len(set(counts.split(', '))) == 1 else counts}"
             + (f"; the whole command took {took['seconds'] / 60:.0f} min" if took else "") + ".", "",
             table(runs, labels), "", END]
    text = readme.read_text() if readme.is_file() else f"{START}\n{END}\n"
    if START not in text or END not in text:
        text = text.rstrip() + f"\n\n{START}\n{END}\n"
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(head + "\n".join(lines) + tail)
    print(f"examples/paper: {figure} and the table in {readme}")
