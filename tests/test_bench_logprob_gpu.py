"""bench/logprob_gpu.py's harness, run on the CPU (``--device cpu``: tiny shapes, fp16, Triton's interpreter).

The GPU numbers come from bench/gpu_check.sh; here: every variant runs, the table and the JSON have each row's
ratios, and the log-probs are what they should be (the kernels' and the fp32 path's within 1e-5 of float64, naive
16-bit logits further off).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_cpu_smoke_run(tmp_path):
    out = tmp_path / "result.json"
    done = subprocess.run([sys.executable, "bench/logprob_gpu.py", "--device", "cpu", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert list(rows) == ["naive", "triton", "triton_loss", "torch_fp32"]
    assert result["gemm_peak_tflops"] > 0
    for name, row in rows.items():
        assert row["time_s"] > 0 and row["tflops"] > 0 and row["peak_bytes"] is None, name
    for name in ("triton", "triton_loss", "torch_fp32"):
        assert rows[name]["logp_err"] <= 1e-5, (name, rows[name]["logp_err"])
    assert rows["naive"]["logp_err"] > 10 * rows["triton"]["logp_err"]
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| variant | fwd+bwd ms | peak MiB | TFLOP/s | of GEMM peak | time/naive")
    assert [line.split(" | ")[0] for line in table[1:]] == ["| naive", "| triton", "| triton_loss", "| torch_fp32"]
    assert table[1].split(" | ")[5] == "1.000"  # naive against itself
