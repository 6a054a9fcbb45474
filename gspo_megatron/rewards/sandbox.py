"""Run untrusted Python (a model's program) in a subprocess with limits: the code-execution reward's sandbox, and
the multi-turn Python tool's (``rollout.env: python``, ``multiturn.PythonEnv``).

    result = run_python("print(input()[::-1])", stdin="abc", limits=Limits(wall_s=5))
    result.stdout == "cba\\n", result.ok, result.killed_by  # None, "wall", "cpu", "memory" or "output"

Limits, in both modes: ``wall_s`` (its process group killed; confined, counted from the program's start, not the
namespaces' setup), ``cpu_s`` (RLIMIT_CPU: SIGXCPU, SIGKILL a second later), ``memory_bytes`` (RLIMIT_AS:
MemoryError), ``output_bytes`` (RLIMIT_FSIZE on the files stdout and stderr go to, and on any file it writes),
``python -I``, an environment of PATH, HOME, TMPDIR, LANG and PYTHONIOENCODING only, and it dies with the process
that started it (PR_SET_PDEATHSIG), e.g. a reward worker killed for its time limit.

Two modes (``data.sandbox``; the trainer selects it with ``select`` and its reward workers inherit it):

``confined`` (the default): a boundary. The program runs in new user, mount, PID, network, IPC and UTS namespaces,
set up here with the kernel's calls (unshare, mount, pivot_root through ctypes) rather than a tool such as
bubblewrap, which is a system package, not a Python dependency, and often absent where the trainer runs:
- its filesystem is a fresh tmpfs (``disk_bytes``) holding read-only binds of the interpreter's installation and
  environment (``sys.base_prefix``, ``sys.prefix``: its standard library and site-packages, so numpy imports),
  ``/usr``, ``/lib*``, ``/bin``, the dynamic linker's cache and ``/dev/{null,zero,full,random,urandom}``, its
  scratch directory ``/scratch`` (cwd, HOME, TMPDIR) and a private ``/tmp``. Nothing else: not the user's home,
  not the run's directories or the project checkout, no ``/proc`` or ``/sys``;
- its processes are in their own PID namespace, whose init (``pid 1``, this module's launcher) waits for the
  program and exits with it, and the kernel then kills every process left in it (a ``setsid`` daemon included).
  It sees none of the host's processes, so it cannot signal, ptrace or read the memory of the reward worker;
- it has no capabilities and ``no_new_privs``, and ``processes`` bounds how many processes it runs at once
  (RLIMIT_NPROC, counted per user namespace since Linux 5.14, before it across all of the user's processes, so
  there a program of a busy non-root trainer may get no fork at all; as root, whose processes RLIMIT_NPROC never
  limits, it runs as ``nobody`` for that reason);
- no network: only a loopback that is down.
Where the kernel refuses the namespaces (some containers disable unprivileged user namespaces) ``run_python``
raises ``SandboxUnavailable`` saying why and naming the option that accepts the risk, rather than running it
unconfined.

``unconfined``: today's limits without the boundary, for hosts without namespaces: the program runs as the
trainer's user, can read (and write) what it can, and see and signal its processes; it gets new user and network
namespaces (``unshare --map-root-user --net``: no network) only where the kernel allows them
(``Result.network_isolated``). It bounds what a buggy or runaway program costs, not what a hostile one does.

What ``confined`` does not promise: the kernel is the boundary (a kernel bug is a way out); CPU time and memory are
limited per process, so a program that forks up to ``processes`` can use that many times them; the read-only
interpreter environment is visible (whatever sits in site-packages can be read).
"""

from __future__ import annotations

import functools
import json
import os
import platform
import select as io_select  # (``select`` here is the mode's)
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

MODES = ("confined", "unconfined")
SETUP_S = 60.0  # confined: the most its namespaces' setup may take before the program starts (then wall_s)
MODE_VARIABLE = "GSPO_SANDBOX"  # how the selected mode reaches the reward workers (they inherit the environment)


class SandboxUnavailable(RuntimeError):
    """The confined sandbox cannot start on this host (and ``unconfined`` was not selected)."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 10.0
    cpu_s: int = 5
    memory_bytes: int = 1 << 30
    output_bytes: int = 1 << 16
    processes: int = 16  # confined only: processes at once, the program included
    disk_bytes: int = 64 << 20  # confined only: its tmpfs (scratch, /tmp and the program)


@dataclass
class Result:
    returncode: int | None
    stdout: str
    stderr: str
    killed_by: str | None  # None, "wall", "cpu", "memory", "output"
    network_isolated: bool
    confined: bool = False

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and self.killed_by is None


# Confined mode's launcher: ``python -I -S -c _CONFINED spec.json``. Four processes: this one (outside, in the
# trainer's namespaces; it writes the user namespace's id maps, which needs a process outside it, and the status
# file) forks ``setup``, which enters new namespaces, builds the root and forks ``init`` (pid 1 of the new PID
# namespace), which forks the program. init reports the program's exit through a pipe the program never holds
# (close-on-exec), then exits, and the kernel kills whatever the program left in the namespace.
_CONFINED = r"""
import ctypes, json, os, resource, signal, sys
libc = ctypes.CDLL(None, use_errno=True)
def call(result, what):
    if result != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
def mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()
    call(libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
         f"mount {source or ''} on {target}")
NEWNS, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET = 0x20000, 0x4000000, 0x8000000, 0x10000000, 0x20000000, 0x40000000
RDONLY, NOSUID, NODEV, NOEXEC, REMOUNT, BIND, REC, PRIVATE = 1, 2, 4, 8, 32, 4096, 16384, 1 << 18
NOATIME, NODIRATIME, RELATIME, STRICTATIME = 1024, 2048, 1 << 21, 1 << 24
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}[os.uname().machine]
spec = json.loads(sys.argv[1])
with open(spec["program"]) as f:
    code = f.read()
uid, gid = os.geteuid(), os.getegid()
libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: dies with the process that started it

def locked_flags(path):
    # A bind mount's remount in a user namespace must keep the flags the kernel locked from the original mount.
    f = os.statvfs(path).f_flag
    flags = (f & (NOSUID | NODEV | NOEXEC)) | (NODIRATIME if f & 2048 else 0)
    return flags | (NOATIME if f & 1024 else RELATIME if f & 4096 else STRICTATIME)

def build_root():
    root = spec["root"]
    mount(None, "/", None, REC | PRIVATE)
    mount("tmpfs", root, "tmpfs", NOSUID | NODEV, f"size={spec['disk']},mode=755")
    bound = []
    for path in spec["readonly"] + spec["devices"]:
        if any(path.startswith(b + "/") for b in bound) or not os.path.lexists(path):
            continue
        target = root + path
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if os.path.islink(path):  # e.g. /bin -> usr/bin
            os.symlink(os.readlink(path), target)
            continue
        if os.path.isdir(path):
            os.makedirs(target, exist_ok=True)
            bound.append(path)
        else:
            open(target, "w").close()
        mount(path, target, None, BIND)
        if path in spec["readonly"]:
            mount(None, target, None, BIND | REMOUNT | RDONLY | NOSUID | NODEV | locked_flags(path))
    for name, mode in (("/tmp", 0o1777), ("/dev/shm", 0o1777), ("/scratch", 0o755)):
        os.makedirs(root + name, exist_ok=True)
        os.chmod(root + name, mode)
        os.chown(root + name, spec["inside"], spec["inside"])
    with open(root + "/scratch/main.py", "w") as f:
        f.write(code)
    os.chown(root + "/scratch/main.py", spec["inside"], spec["inside"])
    os.chdir(root)
    call(libc.syscall(PIVOT_ROOT, b".", b"."), "pivot_root")
    call(libc.umount2(b".", 2), "umount the old root")  # MNT_DETACH: the host's filesystem is gone from here
    os.chdir("/")

def program():
    os.chdir("/scratch")
    for limit, value in ((resource.RLIMIT_CPU, (spec["cpu"], spec["cpu"] + 1)),
                         (resource.RLIMIT_AS, (spec["memory"],) * 2), (resource.RLIMIT_FSIZE, (spec["output"],) * 2),
                         (resource.RLIMIT_CORE, (0, 0)), (resource.RLIMIT_NPROC, (spec["nproc"],) * 2)):
        resource.setrlimit(limit, value)
    call(libc.prctl(38, 1, 0, 0, 0), "PR_SET_NO_NEW_PRIVS")
    for cap in range(64):  # PR_CAPBSET_DROP: no capability can come back through exec
        if libc.prctl(24, cap, 0, 0, 0) != 0:
            break
    if spec["inside"]:  # root outside: run as nobody (RLIMIT_NPROC never limits root's processes)
        os.setgroups([])
        os.setresgid(spec["inside"], spec["inside"], spec["inside"])
        os.setresuid(spec["inside"], spec["inside"], spec["inside"])
    else:
        zeros = (ctypes.c_uint32 * 6)()
        call(libc.capset((ctypes.c_uint32 * 2)(0x20080522, 0), zeros), "capset")
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # init ignores them; exec would keep that
        signal.signal(sig, signal.SIG_DFL)
    os.write(spec["started"], b"s")  # the wall limit counts from here, not from the namespaces' setup
    os.close(spec["started"])
    os.execve(spec["python"], [spec["python"], "-I", "main.py"], dict(os.environ, HOME="/scratch",
                                                                       TMPDIR="/scratch"))

def init(status_w):
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    child = os.fork()
    if child == 0:
        try:
            program()
        except BaseException as e:
            os.write(2, f"sandbox: could not start the program: {e}\n".encode())
        os._exit(127)
    while True:  # reap orphans (init's job) until the program exits
        pid, status = os.waitpid(-1, 0)
        if pid == child:
            break
    code = os.waitstatus_to_exitcode(status)
    os.write(status_w, (f"signal {-code}" if code < 0 else f"exit {code}").encode())
    os._exit(0)

def setup(ready_w, go_r, status_w):
    try:
        libc.prctl(1, 9)
        call(libc.unshare(NEWUSER | NEWNS | NEWPID | NEWNET | NEWIPC | NEWUTS), "unshare (user namespaces)")
        os.write(ready_w, b"u")
        if os.read(go_r, 1) != b"g":
            os._exit(1)
        build_root()
        child = os.fork()
        if child == 0:
            libc.prctl(1, 9)
            init(status_w)
        os.close(status_w)
        os.waitpid(child, 0)
        os._exit(0)
    except BaseException as e:
        os.write(status_w, f"setup {e}".encode())
        os._exit(1)

ready_r, ready_w = os.pipe()
go_r, go_w = os.pipe()
status_r, status_w = os.pipe()
child = os.fork()
if child == 0:
    os.close(ready_r), os.close(go_w), os.close(status_r)
    setup(ready_w, go_r, status_w)
os.close(ready_w), os.close(go_r), os.close(status_w)
if os.read(ready_r, 1) == b"u":
    try:
        with open(f"/proc/{child}/setgroups", "w") as f:
            f.write("allow" if spec["inside"] else "deny")
        for name, own in (("uid_map", uid), ("gid_map", gid)):
            with open(f"/proc/{child}/{name}", "w") as f:
                f.write(f"0 {own} 1\n" + (f"{spec['inside']} 65534 1\n" if spec["inside"] else ""))
        os.write(go_w, b"g")
    except OSError as e:
        os.kill(child, 9)
        with open(spec["status"], "w") as f:
            f.write(f"setup writing the user namespace's id maps: {e}")
        sys.exit(0)
status = b""
while chunk := os.read(status_r, 4096):
    status += chunk
os.waitpid(child, 0)
with open(spec["status"], "wb") as f:
    f.write(status)
"""

# Unconfined mode's launcher: sets the limits, then replaces itself with the program (limits survive exec).
# argv: cpu_s memory output script.
_LAUNCHER = """
import ctypes, os, resource, sys
ctypes.CDLL(None).prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL: dies with the process that started it
cpu, memory, output = (int(x) for x in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
resource.setrlimit(resource.RLIMIT_FSIZE, (output, output))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
os.execv(sys.executable, [sys.executable, "-I", sys.argv[4]])
"""

_READONLY = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc/ld.so.cache", "/etc/localtime")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


def select(mode: str, option: str = "data.sandbox") -> None:
    """Use ``mode`` for ``run_python`` in this process and the processes it starts (the reward workers inherit it
    through the environment). Raises ``SandboxUnavailable`` for ``confined`` on a host that cannot confine."""
    if mode not in MODES:
        raise ValueError(f"{option}={mode!r} must be one of {list(MODES)}")
    if mode == "confined":
        _require_confinement(option)
    os.environ[MODE_VARIABLE] = mode


def selected_mode() -> str:
    mode = os.environ.get(MODE_VARIABLE, "confined")
    if mode not in MODES:
        raise ValueError(f"{MODE_VARIABLE}={mode!r} must be one of {list(MODES)}")
    return mode


def _require_confinement(option: str) -> None:
    reason = confinement_unavailable()
    if reason is not None:
        raise SandboxUnavailable(
            f"the code sandbox cannot confine programs on this host ({reason}): a model's program would run as this "
            f"user, able to read and delete its files and to signal its processes. Allow unprivileged user "
            f"namespaces (sysctl kernel.unprivileged_userns_clone=1 or user.max_user_namespaces > 0), or set "
            f"{option}=unconfined to accept that risk")


@functools.lru_cache(maxsize=1)
def confinement_unavailable() -> str | None:
    """Why the confined sandbox cannot start here (None: it can); checked once per process by running a program."""
    if platform.system() != "Linux":
        return f"it needs Linux namespaces, this is {platform.system()}"
    try:
        result = _run_confined("", "", Limits(wall_s=30))
    except SandboxUnavailable as e:
        return str(e)
    return None if result.ok else f"a trivial program failed: {result.stderr.strip()[-300:]}"


@functools.lru_cache(maxsize=1)
def network_isolation() -> bool:
    """Whether ``unshare --map-root-user --net`` works here (checked once per process): unconfined mode's network."""
    if shutil.which("unshare") is None:
        return False
    try:
        return subprocess.run(["unshare", "--map-root-user", "--net", "true"], capture_output=True,
                              timeout=10).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def run_python(code: str, stdin: str = "", limits: Limits = Limits(), mode: str | None = None) -> Result:
    """Run ``code`` as a script with ``stdin`` in ``mode`` (default: the selected one, ``confined`` unless
    ``select`` chose otherwise); never raises for anything the program does. Raises ``SandboxUnavailable`` in
    confined mode on a host that cannot confine."""
    mode = mode or selected_mode()
    if mode == "unconfined":
        return _run_unconfined(code, stdin, limits)
    _require_confinement("data.sandbox")
    return _run_confined(code, stdin, limits)


def _interpreter() -> str:
    """The interpreter to run inside: the environment's own (its pyvenv.cfg beside it), by a path with no symlinked
    directory in it (a worktree's ``.venv`` link is not in the sandbox's filesystem)."""
    candidate = Path(os.path.realpath(sys.prefix)) / "bin" / Path(sys.executable).name
    return str(candidate) if candidate.exists() else os.path.realpath(sys.executable)


def _run_confined(code: str, stdin: str, limits: Limits) -> Result:
    inside = 1000 if os.geteuid() == 0 else 0  # root outside: the program runs as a mapped nobody
    prefixes = sorted({os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix)})
    with tempfile.TemporaryDirectory(prefix="gspo_sandbox_") as scratch:
        work = Path(scratch)
        (work / "root").mkdir()
        (work / "main.py").write_text(code)  # (a file: a long program would overflow an argument)
        spec = {"root": str(work / "root"), "status": str(work / "status"), "program": str(work / "main.py"),
                "python": _interpreter(),
                "readonly": list(_READONLY) + prefixes, "devices": list(_DEVICES), "inside": inside,
                "cpu": limits.cpu_s, "memory": limits.memory_bytes, "output": limits.output_bytes,
                "disk": limits.disk_bytes,
                "nproc": limits.processes + (0 if inside else 2)}  # as its own user, setup's and init's count
        started_r, spec["started"] = os.pipe()
        command = [sys.executable, "-I", "-S", "-c", _CONFINED, json.dumps(spec)]  # -S: the stdlib is enough
        try:
            returncode, killed_by, stdout, stderr, full = _execute(command, work, stdin, limits, started=started_r,
                                                                   started_w=spec["started"])
        finally:
            os.close(started_r)
        status = (work / "status").read_text() if (work / "status").exists() else ""
    if status.startswith("setup "):
        raise SandboxUnavailable(status[len("setup "):])
    if killed_by is None:
        if status.startswith(("exit ", "signal ")):
            kind, number = status.split()
            returncode = int(number) if kind == "exit" else -int(number)
        killed_by = _killed_by(returncode, full, stderr)
    return Result(returncode, stdout, stderr, killed_by, network_isolated=True, confined=True)


def _run_unconfined(code: str, stdin: str, limits: Limits) -> Result:
    isolated = network_isolation()
    with tempfile.TemporaryDirectory(prefix="gspo_sandbox_") as scratch:
        work = Path(scratch)
        (work / "main.py").write_text(code)
        command = [sys.executable, "-I", "-c", _LAUNCHER, str(limits.cpu_s), str(limits.memory_bytes),
                   str(limits.output_bytes), "main.py"]
        if isolated:
            command = ["unshare", "--map-root-user", "--net"] + command
        returncode, killed_by, stdout, stderr, full = _execute(command, work, stdin, limits, home=scratch)
    if killed_by is None:
        killed_by = _killed_by(returncode, full, stderr)
    return Result(returncode, stdout, stderr, killed_by, isolated)


def _execute(command: list[str], work: Path, stdin: str, limits: Limits, home: str = "/scratch",
             started: int | None = None, started_w: int | None = None):
    """Runs ``command`` in ``work`` with stdin, stdout and stderr through files there (its output capped by
    RLIMIT_FSIZE on them) and the wall limit; returns (returncode, "wall" or None, stdout, stderr, output full).
    With ``started`` (a pipe's read end; the command writes a byte to ``started_w`` as the program starts) the wall
    limit counts from the program's start, and setting up before it gets ``SETUP_S`` (on a loaded host the
    confinement's setup can take a good part of a short limit)."""
    (work / "stdin").write_text(stdin)
    env = {"PATH": "/usr/bin:/bin", "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}
    with open(work / "stdin", "rb") as inp, open(work / "stdout", "wb") as out, open(work / "stderr", "wb") as err:
        try:
            process = subprocess.Popen(command, cwd=work, env=env, stdin=inp, stdout=out, stderr=err,
                                       start_new_session=True, pass_fds=() if started_w is None else (started_w,))
        finally:
            if started_w is not None:
                os.close(started_w)  # (so the read end sees EOF once the command's copies are gone)
        killed_by = None
        try:
            if started is not None:
                ready, _, _ = io_select.select([started], [], [], SETUP_S)
                if not ready:
                    raise subprocess.TimeoutExpired(command, SETUP_S)
            returncode = process.wait(timeout=limits.wall_s)
        except subprocess.TimeoutExpired:
            killed_by = "wall"
            _kill_group(process)
            returncode = process.wait()
    full = max((work / "stdout").stat().st_size, (work / "stderr").stat().st_size) >= limits.output_bytes
    stdout = (work / "stdout").read_bytes()[:limits.output_bytes].decode("utf-8", "replace")
    stderr = (work / "stderr").read_bytes()[:limits.output_bytes].decode("utf-8", "replace")
    return returncode, killed_by, stdout, stderr, full


def _killed_by(returncode: int, full: bool, stderr: str) -> str | None:
    if returncode in (-signal.SIGXCPU, -signal.SIGKILL):
        return "cpu"  # SIGKILL: the hard CPU limit (nothing else here sends it before the wall limit)
    if returncode == -signal.SIGXFSZ or (returncode != 0 and full):
        return "output"  # Python ignores SIGXFSZ: its write fails (EFBIG) and it exits with the error
    if returncode != 0 and "MemoryError" in stderr:
        return "memory"
    return None


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
