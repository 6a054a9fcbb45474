"""bench/mismatch.py (issue 38's tolerance table): its statistics by hand, and a short run of its harness on the CPU
with transformers' bf16 decoding as the engine (``--engine transformers``, as bench/gpu_check.sh runs it on CUDA;
the SGLang engine's numbers are in bench/RESULTS.md)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import mismatch  # noqa: E402  bench/mismatch.py


def test_row_by_hand():
    # Three sequences of two tokens: mean gaps 0, +1e-3 (ratio 1.001 > 1 + 4e-4), -2e-4 (inside 1 - 3e-4).
    gap = torch.tensor([[1e-3, -1e-3], [2e-3, 0.0], [-4e-4, 0.0]])
    r = mismatch.row(gap)
    assert math.isclose(r["token_mean_abs"], (1e-3 + 1e-3 + 2e-3 + 4e-4) / 6, rel_tol=1e-6)
    assert math.isclose(r["seq_mean_abs"], (0 + 1e-3 + 2e-4) / 3, rel_tol=1e-6)
    assert math.isclose(r["seq_max_abs"], 1e-3, rel_tol=1e-6)
    assert r["beyond_clip"] == 1 / 3


def test_cpu_run_prints_a_row_per_length_and_trainer():
    done = subprocess.run([sys.executable, "bench/mismatch.py", "--engine", "transformers", "--lengths", "4", "16",
                           "--sequences", "4"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    rows = [line.split(" | ") for line in done.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [(r[0], r[1]) for r in rows] == [("| 4", "fp32"), ("| 4", "bf16"), ("| 16", "fp32"), ("| 16", "bf16")]
    for r in rows:
        token_gap, seq_mean, seq_max = (float(x) for x in r[2:5])
        # max over 4 sequences of |mean gap| <= the sum of their mean |gap| = 4 x the token mean |gap| (tables round
        # to 3 digits)
        assert seq_mean <= seq_max * 1.01 and seq_max <= 4 * token_gap * 1.01, r
        assert 0 <= float(r[5].rstrip("% |")) <= 100, r
    # bf16 sampling against an fp32 recompute: a real gap (bf16's ~3e-3 relative rounding), far from a wrong token.
    fp32 = [float(r[2]) for r in rows if r[1] == "fp32"]
    assert all(1e-4 < g < 0.1 for g in fp32), fp32
