"""The code-execution reward (``data.reward=code_tests``): the response's program against the prompt's tests, in the
sandbox (``rewards.sandbox``). Reward = the fraction of tests passed.

The program is the last fenced code block of the response (```python ... ``` or ``` ... ```), else the whole
response. The prompt record carries the tests as its label (``"tests"``, or ``"answer"``/``"label"``), a list of
either
    "assert add(1, 2) == 3"                   statements run after the program, in its namespace (one sandbox run
                                              for all of them; each passes if it raises nothing), or
    {"input": "1 2\\n", "output": "3"}       stdin for one run of the program and its expected stdout (compared
                                              with surrounding whitespace stripped; one sandbox run per pair).
A program killed by a limit (time, CPU, memory, output) passes no test of that run (statements that passed before
the kill count).
"""

from __future__ import annotations

import json
import re
import secrets

from .sandbox import Limits, run_python

_FENCE = re.compile(r"```[^\n`]*\n(.*?)```", re.DOTALL)

# Runs the program, then each test, reporting each pass as it happens (so a test that hangs keeps the earlier
# ones). The nonce keeps the program's own output from counting as passes (not hardened: a program that inspects
# its caller's frame can find it).
_HARNESS = """
import os, sys
os.remove(__file__)  # the program cannot read the nonce from this file
_ns = {{"__name__": "__main__"}}
try:
    exec(compile({program!r}, "solution.py", "exec"), _ns)
except BaseException:
    sys.exit(0)
for _i, _test in enumerate({tests!r}):
    try:
        exec(compile(_test, "test", "exec"), _ns)
    except BaseException:
        continue
    print("\\n{nonce}", _i, flush=True)
"""


def extract_program(response: str) -> str:
    blocks = _FENCE.findall(response)
    return blocks[-1] if blocks else response


def parse_tests(label) -> list:
    tests = json.loads(label) if isinstance(label, str) else label
    if isinstance(tests, dict) and "tests" in tests:
        tests = tests["tests"]
    if not isinstance(tests, list) or not tests:
        raise ValueError(f"code_tests needs a non-empty list of tests as the prompt's label, got {str(label)[:80]!r}")
    for test in tests:
        if not (isinstance(test, str) or (isinstance(test, dict) and {"input", "output"} <= set(test))):
            raise ValueError(f"a code test is an assert statement or {{input, output}}, got {str(test)[:80]!r}")
    return tests


def passed_tests(program: str, tests: list, limits: Limits = Limits()) -> int:
    """How many of ``tests`` ``program`` passes."""
    statements = [t for t in tests if isinstance(t, str)]
    passed = 0
    if statements:
        nonce = secrets.token_hex(16)
        result = run_python(_HARNESS.format(program=program, tests=statements, nonce=nonce), limits=limits)
        passed += len({line.split()[1] for line in result.stdout.splitlines() if line.startswith(nonce + " ")})
    for test in (t for t in tests if isinstance(t, dict)):
        result = run_python(program, stdin=str(test["input"]), limits=limits)
        passed += result.ok and result.stdout.strip() == str(test["output"]).strip()
    return passed


def code_tests_reward(prompt: str, response: str, label, limits: Limits = Limits()) -> float:
    tests = parse_tests(label)
    return passed_tests(extract_program(response), tests, limits) / len(tests)
