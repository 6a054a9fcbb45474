"""bench/gpu_check.sh's summary (``tests/gpu/summary.py``): one line per check, from JUnit XML and the bench's JSON.
Runs everywhere (no GPU, no megatron)."""

from __future__ import annotations

import json

from tests.gpu import summary

JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" tests="3">
<testcase classname="tests.gpu.test_gpu_checks" name="test_weight_export" time="1.25">
  <properties><property name="figure" value="409.0 MB in 163 tensors: 41.20 GB/s" /></properties></testcase>
<testcase classname="tests.gpu.test_gpu_checks" name="test_memory" time="0.5">
  <properties><property name="figure" value="peak 1.0 GiB, plan 0.9 GiB (x1.300)" /></properties>
  <failure message="AssertionError: ratio&#10;assert 1.3 &lt;= 1.25">long traceback</failure></testcase>
<testcase classname="tests.gpu.test_gpu_paths" name="test_grouped" time="0.0">
  <skipped type="pytest.skip" message="TransformerEngine is not installed here">skip</skipped></testcase>
</testsuite></testsuites>"""


def test_one_line_per_check_with_its_figure_and_a_failing_exit(tmp_path, capsys):
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    bench = tmp_path / "logprob_gpu.json"
    bench.write_text(json.dumps({"gemm_peak_tflops": 700.0, "rows": {
        "naive": {"time_s": 0.010, "peak_bytes": 8 << 30, "of_peak": 0.5, "logp_err": 2e-3},
        "triton": {"time_s": 0.012, "peak_bytes": 1 << 30, "of_peak": 0.4, "logp_err": 1e-6}}}))
    out = tmp_path / "summary.txt"
    assert summary.main(["--junit", str(junit), "--bench", str(bench), "--out", str(out)]) == 1  # one failed
    lines = out.read_text().splitlines()
    assert capsys.readouterr().out.splitlines() == lines
    assert lines == [
        "PASS  test_gpu_checks::test_weight_export (1.2 s): 409.0 MB in 163 tensors: 41.20 GB/s",
        "FAIL  test_gpu_checks::test_memory (0.5 s): peak 1.0 GiB, plan 0.9 GiB (x1.300) | AssertionError: ratio",
        "SKIP  test_gpu_paths::test_grouped (0.0 s): TransformerEngine is not installed here",
        "PASS  bench/logprob_gpu.py: triton 12.00 ms = x1.200 naive bf16, peak memory x0.125, 0.40 of the GEMM peak "
        "(700 TFLOP/s), max |logp - fp64| 1.0e-06",
    ]


def test_missing_results_are_named_and_fail(tmp_path):
    out = tmp_path / "summary.txt"
    assert summary.main(["--junit", str(tmp_path / "none.xml"), "--bench", str(tmp_path / "none.json"),
                         "--out", str(out)]) == 1
    assert [line.split()[0] for line in out.read_text().splitlines()] == ["MISSING", "MISSING"]
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT.replace("<failure", "<ignored").replace("</failure>", "</ignored>"))
    assert summary.main(["--junit", str(junit)]) == 0


def test_a_stopped_pytest_is_read_from_its_verbose_log(tmp_path):
    log = tmp_path / "pytest.log"
    log.write_text("collected 3 items\n\n"
                   "tests/gpu/test_gpu_checks.py::test_weight_export PASSED                      [ 33%]\n"
                   "tests/gpu/test_gpu_paths.py::test_fp32_passes_and_step_equal_the_cpu FAILED  [ 66%]\n"
                   "tests/gpu/test_gpu_paths.py::test_trainer_runs_two_steps_on_the_gpu \n")
    out = tmp_path / "summary.txt"
    assert summary.main(["--junit", str(tmp_path / "junit.xml"), "--log", str(log), "--out", str(out)]) == 1
    lines = out.read_text().splitlines()
    assert lines[0].startswith("MISSING pytest results")
    assert lines[1:] == ["PASS  test_gpu_checks::test_weight_export (from the log)",
                         "FAIL  test_gpu_paths::test_fp32_passes_and_step_equal_the_cpu (from the log)"]
