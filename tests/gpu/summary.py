"""One line per check of bench/gpu_check.sh, from pytest's JUnit XML and bench/logprob_gpu.py's JSON.

    python -m tests.gpu.summary --junit JUNIT.xml [--log PYTEST.log] [--bench logprob_gpu.json] [--out SUMMARY.txt]

A line: status (PASS, FAIL, SKIP, ERROR, or MISSING for a result file that was never written), the check's name,
its seconds, then its figure (``record_property("figure", ...)`` in the test) or the first line of why it failed
or was skipped. pytest writes its JUnit XML only when it ends: when it was stopped at its time limit, the tests it
finished come from its ``-v`` log instead (no seconds or figures), after a MISSING line. Exit status 0 when no
check failed, else 1.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def junit_lines(path: Path) -> list[tuple[str, str]]:
    """(status, line) for every test case of a JUnit XML file; one MISSING line when it is absent or unreadable."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as e:
        return [("MISSING", f"MISSING pytest results ({path}: {type(e).__name__})")]
    lines = []
    for case in root.iter("testcase"):
        name = f"{Path(case.get('file') or case.get('classname', '').replace('.', '/')).stem}::{case.get('name')}"
        seconds = float(case.get("time") or 0)
        status, detail = "PASS", ""
        for tag, word in (("failure", "FAIL"), ("error", "ERROR"), ("skipped", "SKIP")):
            found = case.find(tag)
            if found is not None:
                status = word
                text = (found.get("message") or found.text or "").strip()
                detail = text.splitlines()[0][:200] if text else ""
                break
        figures = [p.get("value") for p in case.iter("property") if p.get("name") == "figure"]
        if figures and status in ("PASS", "FAIL"):
            detail = f"{figures[0]}" + (f" | {detail}" if detail else "")
        lines.append((status, f"{status:5} {name} ({seconds:.1f} s)" + (f": {detail}" if detail else "")))
    return lines


VERBOSE = re.compile(r"^(?:\S+/)?(\w+)\.py::(\S+) (PASSED|FAILED|SKIPPED|ERROR)\b")
WORDS = {"PASSED": "PASS", "FAILED": "FAIL", "SKIPPED": "SKIP", "ERROR": "ERROR"}


def log_lines(path: Path) -> list[tuple[str, str]]:
    """(status, line) for every test a ``pytest -v`` log reports as finished."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return []
    out = []
    for line in text.splitlines():
        match = VERBOSE.match(line)
        if match:
            status = WORDS[match.group(3)]
            out.append((status, f"{status:5} {match.group(1)}::{match.group(2)} (from the log)"))
    return out


def bench_line(path: Path) -> tuple[str, str]:
    """bench/logprob_gpu.py's result: the Triton backend's time and peak memory against naive bf16's."""
    try:
        result = json.loads(path.read_text())
        rows = result["rows"]
        naive, triton = rows["naive"], rows["triton"]
    except (OSError, ValueError, KeyError) as e:
        return "MISSING", f"MISSING bench/logprob_gpu.py ({path}: {type(e).__name__})"
    memory = (f", peak memory x{triton['peak_bytes'] / naive['peak_bytes']:.3f}"
              if triton.get("peak_bytes") and naive.get("peak_bytes") else "")
    return "PASS", (f"PASS  bench/logprob_gpu.py: triton {triton['time_s'] * 1e3:.2f} ms = x"
                    f"{triton['time_s'] / naive['time_s']:.3f} naive bf16{memory}, {triton['of_peak']:.2f} of the "
                    f"GEMM peak ({result['gemm_peak_tflops']:.0f} TFLOP/s), max |logp - fp64| {triton['logp_err']:.1e}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--junit", type=Path, required=True)
    parser.add_argument("--log", type=Path, default=None, help="pytest -v output, read when the XML is missing")
    parser.add_argument("--bench", type=Path, default=None)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    lines = junit_lines(args.junit)
    if lines and lines[0][0] == "MISSING" and args.log is not None:
        lines += log_lines(args.log)
    if args.bench is not None:
        lines.append(bench_line(args.bench))
    text = "\n".join(line for _, line in lines) + "\n"
    sys.stdout.write(text)
    if args.out is not None:
        args.out.write_text(text)
    return 1 if any(status in ("FAIL", "ERROR", "MISSING") for status, _ in lines) else 0


if __name__ == "__main__":
    sys.exit(main())
