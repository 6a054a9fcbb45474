"""examples/paper/run.py, the paper's comparison, for 2 steps of two of its runs with their real SGLang servers:
GSPO-token on per-character rewards, and GSPO on a bf16 server's log-probs (no old-policy pass). The command
must train, measure what the README's table reports, and write the plot and the table. (The comparison itself,
all runs for 150 steps and 2 seeds, is not a CI test: its numbers are in examples/paper/README.md.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.rollout.helpers import require_sglang

ROOT = Path(__file__).resolve().parents[1]


def test_paper_command_runs_and_reports(tmp_path):
    require_sglang()
    readme = tmp_path / "README.md"
    readme.write_text("# results\n\n<!-- results: written by examples/paper/run.py -->\nstale table\n<!-- end of results -->\n"
                      "kept\n")
    out = subprocess.run([sys.executable, "examples/paper/run.py", "--seeds", "1", "--steps", "2", "--runs",
                          "gspo_token,gspo_bf16", "--out", str(tmp_path / "runs"), "--readme", str(readme)],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    token, bf16 = ([json.loads(line) for line in (tmp_path / "runs" / f"{name}_seed1" / "metrics.jsonl").read_text()
                    .splitlines()] for name in ("gspo_token", "gspo_bf16"))
    assert [r["step"] for r in token] == [1, 2] and [r["step"] for r in bf16] == [1, 2]
    # GSPO-token clips tokens; the fp32 pass measures the fp32 server's gap, one step changes some routing.
    assert all(r["clip_frac"] == r["clip_frac_tokens"] and r["logprob_diff_max"] < 1e-4 for r in token)
    assert all(0 <= r["expert_volatility"] <= 1 for r in token)
    # bf16 rollouts as pi_old: no old-policy pass, and a gap bf16 rounding makes, orders above fp32's.
    assert all("time/old_logprobs" not in r and r["logprob_diff_mean"] > 1e-4 for r in bf16), bf16
    text = readme.read_text()
    assert "stale table" not in text and text.endswith("kept\n") and "| GSPO-token" in text and "| GSPO, bf16" in text
    assert (tmp_path / "paper_comparison.png").read_bytes()[:4] == b"\x89PNG"
