"""Kept servers (``ServerProcess(keep=True)``) and their watchdog, with stand-in processes instead of SGLang: a kept
process outlives its launcher and is adopted by a later one by pid and start time; the watchdog stops the
recorded servers (their whole process group) once the agent is gone, and leaves on its own when they are gone.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import psutil

from gspo_megatron.rollout import server_watchdog
from gspo_megatron.rollout.server import ServerProcess
from tests.processes import running

SLEEPER = [sys.executable, "-c", "import subprocess, sys, time; "
           "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"]


def _wait(condition, seconds: float = 30.0) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def _kept(tmp_path: Path, i: int) -> ServerProcess:
    return ServerProcess(SLEEPER, {}, f"http://127.0.0.1:{9000 + i}", tmp_path / f"s{i}.log", f"stand-in {i}",
                         keep=True)


def test_the_watchdog_stops_kept_servers_when_the_agent_is_gone(tmp_path):
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    servers = [_kept(tmp_path, i) for i in range(2)]
    record = tmp_path / "run.json"
    record.write_text(json.dumps({"servers": [s.record() for s in servers]}))
    assert _wait(lambda: all(psutil.Process(s.process.pid).children() for s in servers))
    groups = [[s.process.pid] + [c.pid for c in psutil.Process(s.process.pid).children()] for s in servers]
    watchdog = server_watchdog.start(agent.pid, record, tmp_path / "watchdog.log")
    try:
        # Another process adopts them from the record: the same pids, alive; a reused pid would not match.
        adopted = [ServerProcess.adopt(r) for r in json.loads(record.read_text())["servers"]]
        assert [a.process.pid for a in adopted] == [s.process.pid for s in servers] and all(a.alive() for a in adopted)
        assert ServerProcess.adopt(dict(servers[0].record(), started=1.0)) is None
        time.sleep(1.5)
        assert watchdog.poll() is None and all(s.alive() for s in servers)  # the agent runs: nothing stopped

        agent.kill()
        agent.wait()
        assert watchdog.wait(timeout=30) == 0
        assert not [pid for group in groups for pid in group if running(pid)], "a server or its child survived"
        assert "agent" in (tmp_path / "watchdog.log").read_text()
    finally:
        for s in servers:
            s.shutdown(grace_s=1)
        if watchdog.poll() is None:
            watchdog.kill()
        agent.kill()


def test_the_watchdog_leaves_when_its_servers_are_gone(tmp_path):
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    server = _kept(tmp_path, 0)
    record = tmp_path / "run.json"
    record.write_text(json.dumps({"servers": [server.record()]}))
    watchdog = server_watchdog.start(agent.pid, record, tmp_path / "watchdog.log")
    try:
        time.sleep(1.5)
        ServerProcess.adopt(server.record()).shutdown(grace_s=5)  # stopped by a process that did not start it
        assert not server.alive()
        assert watchdog.wait(timeout=30) == 0
        assert agent.poll() is None  # the agent is untouched
    finally:
        server.shutdown(grace_s=1)
        if watchdog.poll() is None:
            watchdog.kill()
        agent.kill()


def test_a_start_that_cannot_succeed_stops_at_its_fatal_line_and_a_wait_says_what_it_awaits(tmp_path, caplog):
    """A taken port (SGLang logs it, then lingers ~60 s): stopped at that line, named; a slow start says what is
    awaited every note_every_s. Stand-in processes: no SGLang start-up to pay."""
    import logging

    import pytest

    from gspo_megatron.parallel.groups import free_port
    from gspo_megatron.rollout.errors import ServerStartError

    taken = [sys.executable, "-c", "import time; print('ERROR: [Errno 98] error while attempting to bind on address "
             "(127.0.0.1, 3): address already in use', flush=True); time.sleep(600)"]
    server = ServerProcess(taken, {}, f"http://127.0.0.1:{free_port()}", tmp_path / "taken.log", name="server 0")
    start = time.monotonic()
    with pytest.raises(ServerStartError, match=r"server 0 at .* cannot start \(shut down\): 'ERROR: \[Errno 98\] "
                                               r"error while .*address already in use' in .*taken.log"):
        server.wait_ready(timeout=300)
    assert time.monotonic() - start < 30 and not server.alive()
    silent = ServerProcess(SLEEPER, {}, f"http://127.0.0.1:{free_port()}", tmp_path / "silent.log", name="server 1")
    try:
        with caplog.at_level(logging.WARNING, logger="gspo_megatron.rollout.server"):
            with pytest.raises(ServerStartError, match="was not healthy after 4 s"):
                silent.wait_ready(timeout=4, note_every_s=1)
        notes = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
        assert len(notes) >= 2 and "server 1: waiting for http://127.0.0.1:" in notes[0], notes
    finally:
        silent.shutdown()


# Binds --port as SGLang's HTTP server does (uvicorn's line if taken, then lingers), then answers every GET with 200.
BINDER = [sys.executable, "-c", """
import http.server, sys, time
port = int(sys.argv[sys.argv.index("--port") + 1])
try:
    server = http.server.HTTPServer(("127.0.0.1", port), http.server.BaseHTTPRequestHandler)
except OSError as e:
    print(f"ERROR:    [Errno {e.errno}] error while attempting to bind on address ('127.0.0.1', {port}): "
          f"{e.strerror.lower()}", flush=True)
    time.sleep(600)
class Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("Content-Length", "0"); self.end_headers()
server.RequestHandlerClass = Ok
server.serve_forever()
"""]


def test_a_launched_server_whose_port_was_taken_meanwhile_restarts_on_a_new_port(tmp_path):
    """The port is picked free at launch but SGLang binds it only after loading the model: another process may take
    it meanwhile (CI on 94f1c1c: 'address already in use' failed a module's servers). A launched server moves to a
    new port, at most ``port_retries`` times; a kept one (its URL already recorded for the next attempt) does not."""
    import socket

    import pytest

    from gspo_megatron.rollout.errors import ServerStartError

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        moved = ServerProcess(BINDER + ["--port", str(port)], {}, f"http://127.0.0.1:{port}", tmp_path / "moved.log",
                              name="server 0", port_retries=1)
        kept = ServerProcess(BINDER + ["--port", str(port)], {}, f"http://127.0.0.1:{port}", tmp_path / "kept.log",
                             name="server 1", keep=True)
        try:
            moved.wait_ready(timeout=60)
            assert moved.url != f"http://127.0.0.1:{port}" and moved.url == f"http://127.0.0.1:{moved.cmd[-1]}"
            assert moved.port_retries == 0 and "address already in use" in moved.log_path.read_text()
            with pytest.raises(ServerStartError, match=r"server 1 at http://127.0.0.1:%d cannot start" % port):
                kept.wait_ready(timeout=60)
            moved.shutdown()
            # Its log keeps the taken port's line: a relaunch on the new port reads only its own start's lines.
            again = moved.relaunch()
            again.wait_ready(timeout=60)
            assert again.url == moved.url
            again.shutdown()
        finally:
            moved.shutdown()
            kept.shutdown()


def _stop_after(seconds: float):
    """A stand-in for train.preemption.requested: SIGTERM once ``seconds`` have passed."""
    import signal

    at = time.monotonic() + seconds
    return lambda: signal.SIGTERM if time.monotonic() >= at else None


def test_a_stop_signal_interrupts_the_wait_for_a_launched_server(tmp_path):
    """A scheduler's SIGTERM while a launched server starts (train.preemption caught it): the wait ends within a
    poll, the server is shut down, and StartInterrupted names the signal; without it the wait would run its 300 s."""
    import pytest

    from gspo_megatron.parallel.launch import free_port
    from gspo_megatron.rollout.errors import StartInterrupted
    from gspo_megatron.rollout.server import wait_all_ready

    servers = [ServerProcess(SLEEPER, {}, f"http://127.0.0.1:{free_port()}", tmp_path / f"s{i}.log", name=f"server {i}")
               for i in range(2)]
    start = time.monotonic()
    with pytest.raises(StartInterrupted, match=r"SIGTERM while waiting for server 0 at http://127.0.0.1:\d+ to "
                                               r"start \(shut down\)") as caught:
        wait_all_ready(servers, timeout=300, stop=_stop_after(2.0))
    assert caught.value.signum == 15 and 2.0 <= time.monotonic() - start < 20
    assert not any(s.alive() for s in servers), "every server is stopped, not only the one awaited"


def test_an_attached_server_that_never_answers_is_reported_and_a_stop_signal_ends_the_wait(caplog, monkeypatch):
    """rollout.urls naming a server that accepts connections but never answers (hung, or still loading): short
    probes instead of one request of startup_timeout_s, so the wait says what it awaits, ends at its time-out with
    the URL named, and a stop signal ends it at once."""
    import logging
    import socket

    import pytest

    from gspo_megatron.rollout import SGLangConfig, SGLangEngine, sglang_engine
    from gspo_megatron.rollout.errors import ServerStartError, StartInterrupted

    monkeypatch.setattr(sglang_engine, "NOTE_EVERY_S", 1.0)

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)  # accepts (the kernel's backlog), never answers
    url = f"http://127.0.0.1:{listener.getsockname()[1]}"
    try:
        config = SGLangConfig(model_path="unused", urls=(url,), startup_timeout_s=4.0)
        start = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="gspo_megatron.rollout.sglang_engine"):
            with pytest.raises(ServerStartError, match=rf"{url} not healthy after 4 s"):
                SGLangEngine(config)
        assert time.monotonic() - start < 20
        notes = [r.getMessage() for r in caplog.records if "waiting for" in r.getMessage()]
        assert notes and f"waiting for {url}/health_generate to answer" in notes[0], notes
        config = SGLangConfig(model_path="unused", urls=(url,), startup_timeout_s=300.0)
        start = time.monotonic()
        with pytest.raises(StartInterrupted, match=rf"SIGTERM while waiting for {url} to answer"):
            SGLangEngine(config, stop=_stop_after(1.0))
        assert time.monotonic() - start < 20
    finally:
        listener.close()
