"""examples/paper/run.py, the paper's comparison, for 2 steps of its bf16 run with its real SGLang server: GSPO on
a bf16 server's log-probs as pi_old, with no old-policy pass. The command must train, measure what the README's
table reports, and write the plot and the table. (The comparison itself, five runs of 150 steps for 2 seeds, is
not a CI test: its numbers are in examples/paper/README.md; each run's algorithm is tested in tests/train.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.rollout.helpers import require_sglang

pytestmark = pytest.mark.megatron  # trains the Megatron policy through the CLI

ROOT = Path(__file__).resolve().parents[1]


def test_paper_command_runs_and_reports(tmp_path):
    require_sglang()
    readme = tmp_path / "README.md"
    readme.write_text("# results\n\n<!-- results: written by examples/paper/run.py -->\nstale table\n"
                      "<!-- end of results -->\nkept\n")
    out = subprocess.run([sys.executable, "examples/paper/run.py", "--seeds", "1", "--steps", "2", "--runs",
                          "gspo_bf16", "--out", str(tmp_path / "runs"), "--readme", str(readme)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "runs/gspo_bf16_seed1/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    # bf16 rollouts as pi_old: no old-policy pass, and a gap bf16 rounding makes, orders above fp32's (~1e-6).
    assert all("time/old_logprobs" not in r and r["logprob_diff_mean"] > 1e-4 for r in records), records
    assert all(0 <= r["clip_frac_tokens"] <= 1 and r["clip_frac"] == r["clip_frac_seqs"] for r in records)
    text = readme.read_text()
    assert "stale table" not in text and text.endswith("kept\n") and "| GSPO, bf16 rollouts as pi_old |" in text
    assert (tmp_path / "paper_comparison.png").read_bytes()[:4] == b"\x89PNG"
