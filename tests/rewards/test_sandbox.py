"""The code sandbox as a boundary (``rewards.sandbox``, ``rewards.code_tests``): what a model's program under RL
pressure would try, one test per escape. Each of these programs got out through the sandbox before it was confined
(the loopback listener excepted: the network namespace held). Also: legitimate programs still run, a host without
namespaces refuses by default, and ``unconfined`` (the old sandbox) is still there for such hosts."""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from pathlib import Path

import pytest

from gspo_megatron.rewards import sandbox
from gspo_megatron.rewards.code_tests import code_tests_reward
from gspo_megatron.rewards.sandbox import Limits, SandboxUnavailable, run_python

LIMITS = Limits(wall_s=20, cpu_s=5, memory_bytes=512 << 20, output_bytes=1 << 14)
ROOT = Path(__file__).resolve().parents[2]


def _attempt(action: str) -> str:
    """A program that tries ``action`` and prints "done" or "refused <error>"."""
    body = "\n".join("    " + line for line in action.strip().splitlines())
    return f"import os, sys\ntry:\n{body}\n    print('done')\nexcept OSError as e:\n    print('refused', e)\n"


def test_a_program_cannot_delete_or_plant_files_where_the_trainer_writes(tmp_path):
    victim = tmp_path / "checkpoint.pt"
    victim.write_text("weights")
    planted = [tmp_path / "planted.py", ROOT / "gspo_megatron" / "planted_by_sandbox_test.py"]
    try:
        result = run_python(_attempt(f"os.remove({str(victim)!r})"), limits=LIMITS)
        assert result.stdout.startswith("refused"), result
        for path in planted:
            result = run_python(_attempt(f"open({str(path)!r}, 'w').write('import os')"), limits=LIMITS)
            assert result.stdout.startswith("refused"), result
        assert victim.read_text() == "weights" and not any(path.exists() for path in planted)
    finally:
        for path in planted:
            path.unlink(missing_ok=True)


def test_a_program_cannot_read_the_users_home():
    secret = Path.home() / f".gspo_sandbox_test_secret_{os.getpid()}"
    secret.write_text("hf_token_1234")
    try:
        result = run_python(_attempt(f"print(open({str(secret)!r}).read())"), limits=LIMITS)
        assert "hf_token_1234" not in result.stdout and result.stdout.startswith("refused"), result
        listing = run_python(f"import os\nprint(os.listdir({str(Path.home())!r}))", limits=LIMITS).stdout
        assert secret.name not in listing, listing
    finally:
        secret.unlink()


def test_a_program_sees_the_interpreter_and_its_scratch_only():
    """The root is the sandbox's: system directories, the interpreter's installation (and the path down to it),
    /scratch and /tmp; no /home, /proc, /sys or /etc beyond the dynamic linker's cache (no /etc/passwd), and the
    interpreter's directories are read-only."""
    prefixes = {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}
    allowed = {"bin", "dev", "etc", "lib", "lib32", "lib64", "libx32", "sbin", "scratch", "tmp", "usr"}
    program = ("import json, os\n"
               "print(json.dumps([sorted(os.listdir('/')), sorted(os.listdir('/etc'))]))\n"
               f"for path in ['/etc/passwd', '/proc/self/status', '/sys/kernel', *{sorted(prefixes)!r}]:\n"
               "    try:\n"
               "        open(os.path.join(path, 'x'), 'w') if os.path.isdir(path) else open(path)\n"
               "        print(path, 'open')\n"
               "    except OSError as e:\n"
               "        print(path, type(e).__name__)\n")
    result = run_python(program, limits=LIMITS)
    root, etc = json.loads(result.stdout.splitlines()[0])
    assert set(root) <= allowed | {Path(p).parts[1] for p in prefixes} and "home" not in root, root
    assert set(etc) <= {"ld.so.cache", "localtime"}, etc
    assert [line.split()[1] for line in result.stdout.splitlines()[1:]] == (
        ["FileNotFoundError"] * 3 + ["OSError"] * len(prefixes)), result  # OSError: read-only file system


def test_a_program_cannot_reach_a_listener_on_loopback():
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        result = run_python(_attempt(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=3)"),
                            limits=LIMITS)
    assert result.stdout.startswith("refused") and "unreachable" in result.stdout, result


def _left_running(marker: str) -> list[int]:
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and marker.encode() in (proc / "cmdline").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            continue
    return pids


def test_a_daemon_does_not_outlive_its_run():
    marker = f"gspo_sandbox_daemon_{os.getpid()}"
    program = ("import os, sys\n"
               "if os.fork() == 0:\n"
               "    os.setsid()\n"
               "    if os.fork() == 0:\n"
               f"        os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\n"
               "    os._exit(0)\n"
               "os.wait()\n"
               "print('detached')\n")
    result = run_python(program, limits=LIMITS)
    assert result.ok and result.stdout == "detached\n", result
    left = []
    for _ in range(20):  # the kernel kills the namespace's processes as its init exits: at most moments later
        left = _left_running(marker)
        if not left:
            break
        time.sleep(0.1)
    for pid in left:  # (so a failure leaves nothing behind)
        os.kill(pid, 9)
    assert not left, f"the daemon is still running: {left}"


def test_a_fork_bomb_stays_inside_its_process_limit():
    program = ("import os, time\n"
               "started = 0\n"
               "try:\n"
               "    for _ in range(100):\n"
               "        if os.fork() == 0:\n"
               "            time.sleep(3)\n"
               "            os._exit(0)\n"
               "        started += 1\n"
               "except OSError as e:\n"
               "    print('refused', e)\n"
               "print(started)\n")
    result = run_python(program, limits=Limits(wall_s=30, processes=8))
    lines = result.stdout.splitlines()
    assert lines[0].startswith("refused") and int(lines[-1]) < 8, result  # 8 at once, the program included


def test_a_program_has_no_privileges_to_gain():
    """no_new_privs, no capabilities (effective, permitted, inheritable) and an empty bounding set: nothing a
    setuid binary or a file capability could give back."""
    program = ("import ctypes\n"
               "libc = ctypes.CDLL(None, use_errno=True)\n"
               "data = (ctypes.c_uint32 * 6)()\n"
               "libc.capget((ctypes.c_uint32 * 2)(0x20080522, 0), data)\n"  # _LINUX_CAPABILITY_VERSION_3
               "bounding = sum(libc.prctl(23, cap, 0, 0, 0) == 1 for cap in range(64))\n"  # PR_CAPBSET_READ
               "print(libc.prctl(39, 0, 0, 0, 0), list(data), bounding)\n")  # PR_GET_NO_NEW_PRIVS
    result = run_python(program, limits=LIMITS)
    assert result.ok and result.stdout == "1 [0, 0, 0, 0, 0, 0] 0\n", result


def test_a_program_cannot_signal_or_read_the_reward_worker():
    me = os.getpid()  # this process stands for the reward worker that runs the program
    result = run_python(_attempt(f"os.kill({me}, 0)"), limits=LIMITS)
    assert result.stdout.startswith("refused") and "No such process" in result.stdout, result
    result = run_python(f"import ctypes\nlibc = ctypes.CDLL(None, use_errno=True)\n"
                        f"print(libc.ptrace(16, {me}, 0, 0), ctypes.get_errno())", limits=LIMITS)  # PTRACE_ATTACH
    assert result.stdout == "-1 3\n", result  # ESRCH: no such process in its namespace
    for file in ("environ", "mem", "cmdline"):
        result = run_python(_attempt(f"print(open('/proc/{me}/{file}', 'rb').read(64))"), limits=LIMITS)
        assert result.stdout.startswith("refused"), result
    result = run_python("import os\nprint(os.getppid(), len(os.listdir('/')))", limits=LIMITS)
    assert result.stdout.split()[0] == "1", result  # its parent is the namespace's init, not the worker


def test_a_host_without_namespaces_refuses_by_default(monkeypatch):
    """Where the kernel refuses user namespaces a program could read the reward worker's memory (/proc/<pid>/mem,
    same user): the sandbox then refuses to run it unless ``data.sandbox=unconfined`` accepts that risk."""
    monkeypatch.setattr(sandbox, "confinement_unavailable", lambda: "unshare (user namespaces): Operation not "
                                                                    "permitted")
    monkeypatch.setenv(sandbox.MODE_VARIABLE, "confined")  # (restored after: select sets it)
    with pytest.raises(SandboxUnavailable, match=r"cannot confine programs on this host \(unshare .*set "
                                                 r"data.sandbox=unconfined to accept that risk"):
        run_python("print(1)", limits=LIMITS)
    with pytest.raises(SandboxUnavailable, match="data.sandbox=unconfined"):
        code_tests_reward("", "def add(a, b):\n    return a + b", ["assert add(1, 2) == 3"], LIMITS)
    with pytest.raises(SandboxUnavailable, match="data.sandbox=unconfined"):
        sandbox.select("confined")
    sandbox.select("unconfined")  # the risk accepted: today's limits, unconfined
    result = run_python("import os\nprint(os.getcwd())", limits=LIMITS)
    assert result.ok and not result.confined and "gspo_sandbox_" in result.stdout, result
    with pytest.raises(ValueError, match=r"data.sandbox='off' must be one of \['confined', 'unconfined'\]"):
        sandbox.select("off")


ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]


@pytest.mark.parametrize("name, program", [
    ("always-equal object", "class _Any:\n    def __eq__(self, other):\n        return True\n"
                            "def add(a, b):\n    return _Any()\n"),
    ("a subclass of int that is equal to everything",
     "class _Int(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
     "def add(a, b):\n    return _Int(7)\n"),
    ("frame inspection for the pass marker",
     "import sys\n"
     "def add(a, b):\n"
     "    frame = sys._getframe(1)\n"
     "    while frame is not None:  # the callers' constants and variables: the harness's among them\n"
     "        for value in [*frame.f_code.co_consts, *frame.f_globals.values(), *frame.f_locals.values()]:\n"
     "            if isinstance(value, str) and value.startswith('\\n') and len(value.strip()) == 32:\n"
     "                for i in range(3):\n"
     "                    print(f'\\n{value.strip()} {i}', flush=True)\n"
     "            if isinstance(value, (list, tuple)):\n"
     "                print('found', value)\n"
     "        frame = frame.f_back\n"
     "    return 7\n"),
    ("monkeypatched builtins", "import builtins\nbuiltins.exec = builtins.eval = lambda *a, **k: None\n"
                               "builtins.AssertionError = type('Never', (Exception,), {})\n"
                               "def add(a, b):\n    return 7\n"),
    ("sys.exit(0) before the tests", "import sys\nsys.exit(0)\n"),
    ("fake pass markers and reports",
     "import os\nfor i in range(3):\n"
     "    print('{\"test\": %d, \"values\": []}' % i)\n"
     "    for fd in range(3, 20):\n"
     "        try:\n"
     "            os.write(fd, b'{\"test\": %d, \"values\": [[true]]}\\n' % i)\n"
     "        except OSError:\n"
     "            pass\n"
     "def add(a, b):\n    return 7\n"),
    ("a report nested too deep to decode (a crashed grader would stop the run)",
     "import os\nline = b'{\"test\": 0, \"values\": [' + b'[' * 20000 + b']' * 20000 + b']}\\n'\n"
     "for fd in range(3, 20):\n"
     "    try:\n"
     "        os.write(fd, line)\n"
     "    except OSError:\n"
     "        pass\n"
     "def add(a, b):\n    return 7\n"),
])
def test_passes_cannot_be_faked(name, program):
    assert code_tests_reward("", f"```python\n{program}```", ADD_TESTS, LIMITS) == 0.0


def test_the_expected_value_inside_an_expression_is_not_the_programs_to_see():
    """``abs(half(3) - 1.5) < 1e-6``: were the expression evaluated in the sandbox, an object returned by ``half``
    would receive 1.5 (its ``__sub__``'s argument, or the caller's constants through its frame) and could answer
    0. Only ``half(3)`` is sent; the arithmetic and ``math.isclose`` run in the grader."""
    program = ("import sys\n"
               "class _Close:\n"
               "    def __sub__(self, other):\n        return 0.0\n"
               "    def __float__(self):\n"
               "        consts = sys._getframe(1).f_code.co_consts\n"
               "        return next(c for c in consts if isinstance(c, float))\n"
               "def half(x):\n    return _Close()\n")
    tests = ["assert abs(half(3) - 1.5) < 1e-6", "import math\nassert math.isclose(half(5), 2.5)"]
    assert code_tests_reward("", program, tests, LIMITS) == 0.0
    assert code_tests_reward("", "def half(x):\n    return x / 2", tests, LIMITS) == 1.0


def test_legitimate_programs_still_run():
    program = ("import collections, json, os, tempfile\n"
               "name = input()\n"
               "with open('notes.txt', 'w') as f:\n"
               "    f.write(name * 2)\n"
               "with tempfile.NamedTemporaryFile('w', delete=False) as f:\n"
               "    f.write('t')\n"
               "with open('/tmp/private', 'w') as g:\n"
               "    g.write('p')\n"
               "print(open('notes.txt').read(), open(f.name).read(), open('/tmp/private').read(),\n"
               "      json.dumps(collections.Counter('aab')), os.environ['HOME'] == os.getcwd())\n")
    result = run_python(program, stdin="ab\n", limits=LIMITS)
    assert result.ok and result.confined and result.stdout == 'abab t p {"a": 2, "b": 1} True\n', result
    numpy = pytest.importorskip("numpy")
    result = run_python("import numpy as np\nprint(int(np.arange(10).sum()))", limits=LIMITS)
    assert result.ok and result.stdout == "45\n", result
    # Values come back as plain values, numpy's included, and compare here the way the assert would.
    program = ("import numpy as np\n"
               "def add(a, b):\n    return np.int64(a + b)\n"
               "def pair(x):\n    return (x, [x / 2, {'k': {x}}], None, b'x')\n")
    tests = ["assert add(1, 2) == 3", "assert add(2, 2) != 5", "assert 0 < add(1, 1) < 3",
             "x = add(1, 1)\nassert x == 2", "assert pair(2) == (2, [1.0, {'k': {2}}], None, b'x')",
             "assert pair(1)[2] is None", "assert not add(0, 0)", "assert add(1, 2) in [3, 4]", "add(1, 2)",
             "assert add(1, 2) == 4"]
    assert code_tests_reward("", program, tests, LIMITS) == pytest.approx(9 / 10)
    assert numpy.__name__ == "numpy"


def test_expected_values_in_a_tests_variables_stay_in_the_grader():
    """``expected = [1, 2]`` then ``assert f(1) == expected``: the grader evaluates the assignment too, so a program
    that takes over the harness (every value it reports is 7) cannot report ``expected`` as its answer."""
    tests = ["expected = 3\nassert add(1, 2) == expected", "e = [1, 2]\nassert add(1, 1) == e[1]",
             "x = sorted([3, 1])\nx = x + [5]\nassert add(x[0], x[1]) == sum(x) - 5"]
    takeover = ("import sys\nsys.modules['__main__'].__dict__['_plain'] = lambda value: 7\n"
                "def add(a, b):\n    return 0\n")
    assert code_tests_reward("", takeover, tests, LIMITS) == 0.0
    assert code_tests_reward("", "def add(a, b):\n    return a + b", tests, LIMITS) == 1.0


def test_the_common_shapes_of_a_test_grade_outside_the_program():
    """Methods of plain values, a lambda key, a generator, a filtered comprehension, an object's methods and
    numpy's isclose-like checks: the right program passes them all, one that returns always-equal objects none."""
    tests = ["assert ', '.join(words(2)) == 'w0, w1'", "assert [3].count(add(1, 2)) == 1",
             "assert sorted(add(i, 1) for i in range(3)) == [1, 2, 3]",
             "assert sorted(pairs(3), key=lambda p: -p[0]) == [(2, 0), (1, 1), (0, 2)]",
             "assert [add(i, i) for i in range(5) if i % 2 == 0] == [0, 4, 8]",
             "s = Stack()\ns.push(1)\ns.push(2)\nassert s.pop() == 2 and len(s.items) == 1",
             "import math\nassert math.isclose(add(0.1, 0.2), 0.3) and add(2, 1) > math.e"]
    right = ("def add(a, b):\n    return a + b\n"
             "def words(n):\n    return [f'w{i}' for i in range(n)]\n"
             "def pairs(n):\n    return [(i, n - 1 - i) for i in range(n)]\n"
             "class Stack:\n    def __init__(self):\n        self.items = []\n"
             "    def push(self, x):\n        self.items.append(x)\n"
             "    def pop(self):\n        return self.items.pop()\n")
    assert code_tests_reward("", right, tests, LIMITS) == 1.0
    cheat = ("class _Any(str):\n    __eq__ = __lt__ = __gt__ = lambda self, other: True\n    __hash__ = str.__hash__\n"
             "    def __len__(self):\n        return 1\n"
             "def add(a, b):\n    return _Any()\n"
             "def words(n):\n    return _Any()\n"
             "def pairs(n):\n    return _Any()\n"
             "class Stack:\n    items = _Any()\n    def push(self, x):\n        pass\n"
             "    def pop(self):\n        return _Any()\n")
    assert code_tests_reward("", cheat, tests, LIMITS) == 0.0


def test_an_assert_the_grader_cannot_split_is_a_bad_label():
    with pytest.raises(ValueError, match="has an assert inside a block: write its asserts as top-level"):
        code_tests_reward("", "x = 1", ["for i in range(2):\n    assert i < 2"], LIMITS)
    # Comparisons that would run in the program's process, where an always-equal object makes them hold.
    for test, comparison in (("assert all(add(i, i) == 2 * i for i in range(3))", "add(i, i) == 2 * i"),
                             ("ok = add(1, 2) == 3\nassert ok", "add(1, 2) == 3"),
                             ("def check(x):\n    return x == 3\nassert check(add(1, 2))", "x == 3")):
        with pytest.raises(ValueError, match=rf"compares {re.escape(repr(comparison))} inside .* runs in the "
                                             r"program's process, where a comparison can be forged"):
            code_tests_reward("", "x = 1", [test], LIMITS)
    with pytest.raises(ValueError, match=r"the code test 'assert add\(1,' does not parse"):
        code_tests_reward("", "x = 1", ["assert add(1,"], LIMITS)


def test_the_wall_limit_counts_from_the_programs_start(monkeypatch):
    """The namespaces' setup (a good part of a short limit on a loaded host) is not the program's time: a program
    that prints at once and then sleeps shows its line before a 0.3 s limit stops it. Setup has ``SETUP_S``."""
    result = run_python("import time\nprint('hi', flush=True)\ntime.sleep(60)", limits=Limits(wall_s=0.3))
    assert result.killed_by == "wall" and result.stdout == "hi\n", result
    monkeypatch.setattr(sandbox, "SETUP_S", 1e-4)  # no setup finishes this fast: stopped as over its time
    start = time.monotonic()
    result = run_python("print('hi')", limits=LIMITS)
    assert result.killed_by == "wall" and result.stdout == "" and time.monotonic() - start < 5, result


def test_unconfined_is_the_old_sandbox():
    result = run_python("import os\nprint(os.getcwd())", limits=LIMITS, mode="unconfined")
    assert result.ok and not result.confined and "gspo_sandbox_" in result.stdout, result
    assert sys.executable  # (the interpreter both modes run)


def _train(tmp_path: Path, overrides: list[str]) -> list[dict]:
    """One step of the tiny example through the command line (local engine, world 1) -> its metrics."""
    from tests import warm_cli

    run = tmp_path / "run"
    command = [sys.executable, "-m", "gspo_megatron.cli", "train", str(ROOT / "examples/tiny_moe_cpu.yaml"),
               "rollout.engine=local", "train.steps=1", "train.eval_every=0", "model.warm_start_steps=0",
               f"model.hf_dir={tmp_path / 'model'}", f"logging.dir={run}", "checkpoint.dir=", "logging.plot_every=0",
               "rollout.prompts_per_step=2", "rollout.group_size=2", "parallel.micro_batch_size=2",
               "rollout.max_new_tokens=6", *overrides]
    out = warm_cli.run(command, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, WORLD_SIZE="1"),
                       timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.megatron  # trains the Megatron policy through the CLI (the sandbox is not megatron-core's)
@pytest.mark.megatron_covered_by("tests/train/test_loop.py::test_train_logs_plots_and_resumes_exactly")
def test_the_code_reward_and_the_python_tool_run_through_the_cli(tmp_path):
    """The confined sandbox from the trainer: the code_tests reward in its reward workers (the tiny model's programs
    are not Python: 0, and no reward error, which would stop the run under on_reward_error=raise), and the Python
    tool in the rollout (a fixed call, answered from the sandbox's /scratch)."""
    prompts = tmp_path / "code.jsonl"
    tests = ["assert add(1, 2) == 3", {"input": "", "output": "3"}]
    prompts.write_text("".join(json.dumps({"prompt": p, "tests": tests}) + "\n" for p in ("rev abc=", "rev bad=")))
    (tmp_path / "a").mkdir()
    records = _train(tmp_path / "a", ["data.task=", f"data.prompts={prompts}", "data.reward=code_tests"])
    assert records[0]["reward_mean"] == 0.0 and records[0]["reward_crashes"] == 0, records
    assert records[0]["reward_timeouts"] == 0, records
    (tmp_path / "b").mkdir()
    records = _train(tmp_path / "b", ["rollout.env=tests.rewards.user_envs:ScriptedPython", "rollout.max_turns=3",
                                      "algo.name=gspo_token", "algo.token_advantages=turns"])
    assert records[0]["reward_mean"] == 1.0 and records[0]["turns_mean"] == 2.0, records
