"""What confining the code sandbox costs per run: ``confined`` against ``unconfined`` (the sandbox before it was a
boundary), the same programs, interleaved, in one process.

    .venv/bin/python bench/sandbox_overhead.py [--runs 30]

Programs: ``pass`` (start-up alone: what a run costs beyond the program), a stdin/stdout one, ``import numpy``, and
``code_tests``'s assert harness with three tests (one run through the grader). Prints the median and 90th
percentile wall time per run of each mode and the ratio of the medians. Run on a quiet machine: each run is a few
process starts, so a loaded CPU moves the numbers more than the modes do.
"""

from __future__ import annotations

import argparse
import statistics
import time

from gspo_megatron.rewards.code_tests import code_tests_reward
from gspo_megatron.rewards.sandbox import Limits, confinement_unavailable, run_python

LIMITS = Limits(wall_s=30)
PROGRAMS = {
    "pass": ("pass", ""),
    "stdin/stdout": ("a, b = map(int, input().split())\nprint(a + b)", "1 2\n"),
    "import numpy": ("import numpy\nprint(numpy.arange(3).sum())", ""),
}
ADD = "```python\ndef add(a, b):\n    return a + b\n```"
ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]


def _time(mode: str, name: str) -> float:
    start = time.perf_counter()
    if name == "code_tests (3 asserts)":
        import os

        os.environ["GSPO_SANDBOX"] = mode  # code_tests runs the selected mode
        assert code_tests_reward("", ADD, ADD_TESTS, LIMITS) == 1.0
    else:
        code, stdin = PROGRAMS[name]
        result = run_python(code, stdin, LIMITS, mode=mode)
        assert result.ok, result
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    reason = confinement_unavailable()
    if reason is not None:
        raise SystemExit(f"this host cannot confine ({reason}): nothing to compare")
    names = [*PROGRAMS, "code_tests (3 asserts)"]
    for name in names:  # warm: page cache, the probe
        _time("confined", name), _time("unconfined", name)
    print(f"{'program':24} {'unconfined ms (p50/p90)':>24} {'confined ms (p50/p90)':>22} {'ratio p50':>10}")
    for name in names:
        times = {"unconfined": [], "confined": []}
        for _ in range(args.runs):
            for mode in times:
                times[mode].append(_time(mode, name) * 1e3)
        cells = {mode: (statistics.median(t), statistics.quantiles(t, n=10)[-1]) for mode, t in times.items()}
        ratio = cells["confined"][0] / cells["unconfined"][0]
        print(f"{name:24} {cells['unconfined'][0]:>15.1f} / {cells['unconfined'][1]:<6.1f}"
              f" {cells['confined'][0]:>13.1f} / {cells['confined'][1]:<6.1f} {ratio:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
