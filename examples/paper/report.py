"""Plots and the results table of examples/paper/run.py's runs (``report``), from their metrics.jsonl."""

from __future__ import annotations

import math
from pathlib import Path

from gspo_megatron.train.records.metrics_log import read_metrics

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

    fig, grid = plt.subplots(2, 3, figsize=(14, 7.6))
    axes = grid.ravel()
    colors = {name: f"C{i}" for i, name in enumerate(labels)}  # one color per run in every panel
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
            ax.plot(steps, [sum(v) / len(v) for v in values], label=labels[name], linewidth=1.5, color=colors[name],
                    marker="o" if key == "eval_reward_mean" else None, markersize=3)
            if len(per_seed) > 1:
                ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values], color=colors[name],
                                alpha=0.12, linewidth=0)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step")
        if scale == "log" and ax.lines:
            ax.set_yscale("log")
        ax.grid(alpha=0.3)
    handles, names = axes[0].get_legend_handles_labels()
    axes[-1].axis("off")  # the sixth cell holds the legend
    axes[-1].legend(handles, names, loc="center", fontsize=10, frameon=False)
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


def _cell(values: list[float], fmt) -> str:
    values = [v for v in values if math.isfinite(v)]
    if not values:
        return "-"
    mean = sum(values) / len(values)
    return fmt(mean) if len(values) == 1 else f"{fmt(mean)} ({fmt(min(values))} to {fmt(max(values))})"


def table(runs: dict, labels: dict[str, str]) -> str:
    """One row per algorithm: mean over seeds (the seeds' range in brackets)."""
    number, percent, small = (lambda v: f"{v:.2f}"), (lambda v: f"{100 * v:.1f}%"), (lambda v: f"{v:.1e}")
    rows = [
        "| run | reward, first 10 steps | reward, last 20 steps | held-out reward, end | clipped tokens | "
        "clipped, loss's unit | expert volatility | log-prob gap per token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, seeds in runs.items():
        cols = [
            _cell([_over(r, "reward_mean", first=10) for r in seeds], number),
            _cell([_over(r, "reward_mean", last=20) for r in seeds], number),
            _cell([_over(r, "eval_reward_mean", last=1) for r in seeds], number),
            _cell([_over(r, "clip_frac_tokens") for r in seeds], percent),
            _cell([_over(r, "clip_frac") for r in seeds], percent),
            _cell([_over(r, "expert_volatility") for r in seeds], lambda v: f"{100 * v:.2f}%"),
            _cell([_over(r, "logprob_diff_mean") for r in seeds], small),
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
    walls = [out / f"{name}_seed{s}" / "wall_seconds" for name in runs for s in range(1, seeds + 1)]
    seconds = sum(float(w.read_text()) for w in walls if w.is_file())
    done = sorted({len(s) for s in runs.values()})
    lines = [START, "", f"![comparison]({figure.name})", "",
             f"{steps} steps per run, {' or '.join(map(str, done))} seed(s) per run; the runs took "
             f"{seconds / 60:.0f} min in all (start-up included). Each cell: mean over seeds (the seeds' range).", "",
             table(runs, labels), "", END]
    text = readme.read_text() if readme.is_file() else f"{START}\n{END}\n"
    if START not in text or END not in text:
        text = text.rstrip() + f"\n\n{START}\n{END}\n"
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    readme.write_text(head + "\n".join(lines) + tail)
    print(f"examples/paper: {figure} and the table in {readme}")
