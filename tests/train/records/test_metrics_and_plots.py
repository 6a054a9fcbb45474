"""Metrics JSONL round trip (NaN as a gap, last record of a step wins, a resume cut back to its step), the PNG plots
and the progress lines."""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

from gspo_megatron.train.records.metrics_log import MetricsLogger, read_metrics
from gspo_megatron.train.records.plots import plot_runs
from gspo_megatron.train.records.progress import Progress
from tests import warm_cli

ROOT = Path(__file__).resolve().parents[3]


def fake_run(directory: Path, slope: float) -> Path:
    logger = MetricsLogger(directory, tensorboard=False)
    for step in range(1, 11):
        logger.log(step, {"reward_mean": slope * step, "clip_frac_tokens": 0.1, "clip_frac_seqs": 0.2, "expert_volatility": 0.1,
                          "seq_ratio_min": 0.999, "seq_ratio_mean": 1.0, "seq_ratio_max": 1.001,
                          "approx_kl": 1e-4 * step, "logprob_diff_mean": 1e-5, "logprob_diff_max": float("nan")})
    logger.log(10, {"reward_mean": 99.0})  # a resumed run re-logs step 10
    return directory / "metrics.jsonl"


def test_jsonl_round_trip(tmp_path):
    records = read_metrics(fake_run(tmp_path, 0.1))
    assert [r["step"] for r in records] == list(range(1, 11))
    assert math.isclose(records[0]["reward_mean"], 0.1) and records[-1]["reward_mean"] == 99.0
    assert records[0]["logprob_diff_max"] is None


def test_a_resumed_run_keeps_the_steps_up_to_its_checkpoint_once(tmp_path):
    """Steps 1-10 (10 twice), then a line cut short by a kill: a run resumed from step 6 keeps steps 1-6, each once,
    and logs on from 7."""
    path = fake_run(tmp_path, 0.1)
    with path.open("a") as f:
        f.write('{"step": 11, "reward_me')
    logger = MetricsLogger(tmp_path, tensorboard=False, start_step=6)
    assert [r["step"] for r in map(json.loads, path.read_text().splitlines())] == [1, 2, 3, 4, 5, 6]
    logger.log(7, {"reward_mean": 0.5})
    assert [json.loads(line)["step"] for line in path.read_text().splitlines()] == list(range(1, 8))
    assert not path.with_name("metrics.jsonl.tmp").exists()
    MetricsLogger(tmp_path / "fresh", tensorboard=False, start_step=0)  # nothing to cut: nothing written
    assert not (tmp_path / "fresh" / "metrics.jsonl").exists()


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000


def test_plot_and_compare(tmp_path):
    a, b = fake_run(tmp_path / "gspo", 0.1), fake_run(tmp_path / "grpo", 0.05)
    assert _is_png(plot_runs({"gspo": a}, tmp_path / "gspo.png"))
    out = warm_cli.run([sys.executable, str(ROOT / "tools/compare_runs.py"), str(tmp_path / "gspo"), f"grpo={b}",
                      "--out", str(tmp_path / "cmp.png")], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert _is_png(tmp_path / "cmp.png")
    bad = warm_cli.run([sys.executable, str(ROOT / "tools/compare_runs.py"), str(tmp_path / "nope")],
                     capture_output=True, text=True)
    assert bad.returncode != 0 and "no metrics.jsonl" in bad.stderr


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_one_line_a_step_off_a_terminal_and_a_bar_on_one():
    """A log file gets `gspo step N/T: ...` lines with rounded numbers, masked rewards when there are any and no
    carriage returns; a terminal gets the bar."""
    metrics = {"reward_mean": 0.15000000596046448, "clip_frac": 0.0213, "reward_masked": 0.0, "time/step": 1.23456,
               "tokens_per_s": 451.7, "logprob_diff_max": 3.1e-6}
    log = io.StringIO()
    progress = Progress(5, enabled=True, stream=log)
    progress.update(1, metrics)
    progress.update(2, {**metrics, "reward_masked": 2.0, "reward_mean": float("nan")})
    progress.close()
    assert log.getvalue().splitlines() == [
        "gspo step 1/5: reward 0.15, clip 0.0213, lp_diff 3.1e-06, 1.23 s, 452 tokens/s",
        "gspo step 2/5: reward nan, clip 0.0213, masked 2, lp_diff 3.1e-06, 1.23 s, 452 tokens/s"]
    terminal = _Terminal()
    bar = Progress(5, enabled=True, stream=terminal)
    bar.update(1, metrics)
    bar.close()
    assert "\r" in terminal.getvalue() and "1/5" in terminal.getvalue() and "reward=0.15" in terminal.getvalue()
    quiet = io.StringIO()
    Progress(5, enabled=False, stream=quiet).update(1, metrics)  # ranks other than 0
    assert quiet.getvalue() == ""
