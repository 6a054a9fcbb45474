"""End-to-end tests that run in a second pytest session beside the main one: ``@pytest.mark.beside``.

A test whose whole work is child processes of its own (a CLI run under torchrun, the SGLang servers that run
launches, a cluster script's nodes) shares nothing with the main session's SGLang server or warm rank workers, and
spends much of its time waiting on its children. Such tests run, in their collected order, in one more pytest
session (``python -m pytest -p tests.beside <their node ids>``), started with the background runs of
``tests/background.py`` once the tests are collected, at a lower CPU priority (``NICE``). In the main session each
is replaced by a ``BesideItem`` of the same node id, ordered last, which waits for that session and reports the
test's own outcome there: passed, skipped with its reason, or failed with its traceback and captured output.

Mark a test ``beside`` only if it uses none of the session fixtures of ``tests/sglang_servers.py`` (the side
session would start its own server) and its children pick free ports. ``GSPO_BACKGROUND=inline`` runs marked
tests in the main session as ordinary tests; so does the side session itself.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests import background
from tests.background import BackgroundRun

MARKER = "beside"
NICE = 10  # below the main run (its tests time servers and collectives; a niced process per rank and server
# still adds up: at nice 5 these slowed the main run by ~40%), above the megatron-core 0.19 run
TIMEOUT_S = 40 * 60  # from its start
REPORT = "GSPO_BESIDE_REPORT"  # in the side session: the file each test's outcome is appended to (JSON lines)
IN_SIDE_SESSION = "GSPO_BESIDE_SESSION"
SHARED_FIXTURES = "tests.sglang_servers"  # the main session's servers: a beside test may not use them


class _Side:
    """The main session's side session: its tests' node ids, and its run once started."""

    node_ids: list[str] = []
    run: BackgroundRun | None = None
    outcomes: dict[str, dict] | None = None
    pending: int = 0  # BesideItems still to report: the last one removes the run's directory


def replace_marked(items: list) -> list:
    """tests/conftest.py, after collection and selection: the marked tests as ``BesideItem`` s registered to run
    in the side session (a no-op inside the side session and under ``GSPO_BACKGROUND=inline``)."""
    if background.inline() or os.environ.get(IN_SIDE_SESSION):
        return items
    replaced = []
    for item in items:
        if item.get_closest_marker(MARKER) is None:
            replaced.append(item)
            continue
        shared = [name for name, defs in item._fixtureinfo.name2fixturedefs.items()
                  if defs and defs[-1].func.__module__ == SHARED_FIXTURES]
        if shared:
            raise pytest.UsageError(f"{item.nodeid} is marked {MARKER} but uses the session's {', '.join(shared)} "
                                    f"({SHARED_FIXTURES}): the side session would start servers of its own")
        side = BesideItem.from_parent(item.parent, name=item.name)
        side.line = item.location[1]  # the test's own line, where its failure or skip is reported
        side.keywords.update(item.keywords)
        side.own_markers.extend(item.own_markers)
        _Side.node_ids.append(side.nodeid)
        background.register(side.nodeid, _start, NICE)
        replaced.append(side)
    _Side.pending = len(_Side.node_ids)
    return replaced


def _start(nice: int) -> BackgroundRun:
    """The side session (once for all its tests: every node id's start returns the same run)."""
    if _Side.run is None:
        command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.beside",
                   "--basetemp={work}/run", "-q", "-rs", *_Side.node_ids]
        if os.environ.get("GSPO_DURATIONS"):
            command.append(f"--durations={os.environ['GSPO_DURATIONS']}")
        env = dict(os.environ, GSPO_BACKGROUND="inline", **{IN_SIDE_SESSION: "1", REPORT: "{work}/report.jsonl"})
        _Side.run = BackgroundRun("side session", command, env, nice, TIMEOUT_S)
    return _Side.run


class BesideItem(pytest.Item):
    """A marked test in the main session: waits for the side session and reports the test's outcome there."""

    def runtest(self) -> None:
        run = background.take(self.nodeid) or _start(nice=0)
        status, output = run.wait(say=self._say)
        outcome = self._outcome(run, status, output)
        if outcome.get("stdout"):
            sys.stdout.write(outcome["stdout"])  # its prints, shown as a test's are (-rP, -s, or on failure)
        if outcome["outcome"] == "failed":
            pytest.fail(f"{outcome['crash']}\n(its {outcome['when']} in the side session, tests/beside.py; output: "
                        f"{run.log})\n{outcome['longrepr']}", pytrace=False)
        if outcome["outcome"] == "skipped":
            raise pytest.skip.Exception(outcome["longrepr"], _use_item_location=True)

    def _say(self, line: str) -> None:
        """What it waits for, on the terminal (not into the test's captured output)."""
        capture = self.config.pluginmanager.get_plugin("capturemanager")
        terminal = self.config.pluginmanager.get_plugin("terminalreporter")
        if capture and terminal:
            with capture.global_and_fixture_disabled():
                terminal.write_line("\n" + line)

    def _outcome(self, run: BackgroundRun, status: int | None, output: str) -> dict:
        """This test's outcome in the side session's report (its worst phase), or a failure naming why none is
        there (the session timed out or died before reaching the test)."""
        if _Side.outcomes is None:
            report = Path(run.env[REPORT])
            lines = report.read_text().splitlines() if report.exists() else []
            _Side.outcomes = {}
            for record in map(json.loads, lines):
                seen = _Side.outcomes.get(record["nodeid"])
                if seen is None or seen["outcome"] == "passed" or record["outcome"] == "failed":
                    _Side.outcomes[record["nodeid"]] = dict(record, stdout=(seen or {}).get("stdout", "") +
                                                            record["stdout"])
        _Side.pending -= 1
        if _Side.pending == 0:  # the last of them: the session's summary (and slowest tests), then its files go
            summary = output.strip().splitlines()[-1] if output.strip() else "(no output)"
            self._say(f"[side session, started {run.elapsed():.0f} s before this line] {summary}")
            if os.environ.get("GSPO_DURATIONS") and "slowest" in output:
                self._say(output[output.find("slowest"):][:4000])
            run.remove()
        found = _Side.outcomes.get(self.nodeid)
        if found is not None:
            return found
        why = f"ran past {TIMEOUT_S} s" if status is None else f"exited with {status}"
        return {"outcome": "failed", "when": "run", "crash": f"the side session {why} without reporting this test",
                "longrepr": f"`{' '.join(run.command)}`; its output ends:\n{output[-6000:]}"}

    def reportinfo(self):
        return self.path, self.line, self.name


# ---- in the side session (loaded with -p tests.beside) ------------------------------------------------------


def pytest_runtest_logreport(report) -> None:
    """Each phase's outcome of each test, appended to the file the main session reads."""
    path = os.environ.get(REPORT)
    if not path or (report.when != "call" and report.outcome == "passed"):
        return
    crash = ""
    if report.outcome == "skipped" and isinstance(report.longrepr, tuple):
        longrepr = report.longrepr[2].removeprefix("Skipped: ")  # (file, line, reason)
    else:
        longrepr = "" if report.outcome == "passed" else str(report.longrepr)
        reprcrash, lines = getattr(report.longrepr, "reprcrash", None), longrepr.strip().splitlines()
        crash = reprcrash.message if reprcrash is not None else (lines[-1] if lines else "")
    with open(path, "a") as out:
        out.write(json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                              "crash": crash, "longrepr": longrepr,
                              "stdout": report.capstdout if report.when == "call" else "",
                              "duration": report.duration}) + "\n")
