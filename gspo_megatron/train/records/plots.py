"""PNG plots of a run's metrics (and several runs side by side, for tools/compare_runs.py).

Panels: reward (mean, and eval when present; with rollout.env the fraction of trajectories that got an
observation, i.e. called a tool), clip fraction (of response tokens and of sequences, log axis: GSPO
and GRPO differ by orders of magnitude), sequence-ratio range (min/mean/max), KL (old vs new policy per update, and
policy vs reference when algo.kl_coef > 0), expert volatility (MoE routing decisions one step changed), the
policy's entropy, the rollout-vs-trainer log-prob difference (and KL(engine || trainer), the share of sequences
whose mean gap lies beyond the clip range), and what the rollout correction did (the shares of tokens masked,
truncated and rejected; the weights' mean and max).
"""

from __future__ import annotations

from pathlib import Path

from gspo_megatron.train.records.metrics_log import read_metrics

# (title, [(metric, label)], y scale)
PANELS = [
    ("reward", [("reward_mean", "train"), ("eval_reward_mean", "eval"),
                ("observed_frac", "with an observation (tool called)")], "linear"),
    ("clip fraction", [("clip_frac_tokens", "tokens"), ("clip_frac_seqs", "sequences")], "log"),
    ("sequence ratio", [("seq_ratio_min", "min"), ("seq_ratio_mean", "mean"), ("seq_ratio_max", "max")], "linear"),
    ("KL", [("approx_kl", "old || new (per update)"), ("kl_ref", "policy || reference")], "linear"),
    ("expert volatility (one step)", [("expert_volatility", "routing decisions changed")], "linear"),
    ("entropy per response token", [("entropy", "policy")], "linear"),
    ("rollout vs trainer log-prob |diff|", [("logprob_diff_mean", "mean per token"), ("logprob_diff_max", "max"),
                                            ("logprob_diff_kl", "KL(engine || trainer) k3"),
                                            ("logprob_diff_kl_k1", "KL k1"),
                                            ("logprob_diff_beyond_clip", "sequences beyond the clip range")], "log"),
    ("rollout correction (tokens)", [("correction_masked_tokens", "masked"),
                                     ("correction_truncated_tokens", "truncated"),
                                     ("correction_rejected_tokens", "rejected")], "linear"),
    ("correction weight", [("correction_weight_mean", "mean"), ("correction_weight_max", "max")], "linear"),
]


def _series(records: list[dict], key: str):
    points = [(r["step"], r[key]) for r in records if r.get(key) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot_runs(runs: dict[str, str | Path], out: str | Path, title: str = "") -> Path:
    """``runs``: label -> metrics.jsonl path. One figure, one panel per PANELS entry; returns the PNG path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = {label: read_metrics(path) for label, path in runs.items()}
    fig, axes = plt.subplots(1, len(PANELS), figsize=(4.2 * len(PANELS), 3.4))
    single = len(runs) == 1
    for ax, (panel, metrics, scale) in zip(axes, PANELS):
        drawn = False
        for run, recs in records.items():
            for key, label in metrics:
                steps, values = _series(recs, key)
                if not steps:
                    continue
                positive = [v for v in values if v > 0]
                if scale == "log" and not positive:
                    continue
                ax.plot(steps, values, label=label if single else f"{run}: {label}", linewidth=1.4)
                drawn = True
        ax.set_title(panel)
        ax.set_xlabel("step")
        if drawn:
            if scale == "log":
                ax.set_yscale("log")
            ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
