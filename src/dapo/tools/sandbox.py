"""Run untrusted Python (code a model wrote) in a fresh, isolated process per call.

Isolation is bubblewrap's, not a restricted interpreter: each call gets its own mount, PID, network, IPC and
UTS namespaces; a read-only view of the interpreter and its site-packages and nothing else of the host (not the
project, the run directory or the home directory); a private, size-capped /tmp; an empty environment; and it
dies with the process that started it. Resource limits (CPU seconds, address space, processes, file size) are
set on the sandboxed process, and a wall-clock limit kills the whole sandbox, so a call never outlives
``limits.wall_s`` by more than the time to reap it.

Started as root, the code runs under a user id of its own (``setpriv``), so the process limit holds and no
capability is kept; started as another user, bubblewrap maps that user into a user namespace of its own.

``sandbox="none"`` runs the same interpreter with the same limits but no namespaces: only for trusted setups.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
SANDBOXES = ("bwrap", "none")
_UIDS = itertools.count()  # calls started as root take uids 61000.. in turn: each call's process count is its own
_UID_BASE, _UID_SPAN = 61000, 1000
MOUNTED = (Path("/"), Path("/tmp"))  # the sandbox's own root and private /tmp: never re-made as bind parents


class SandboxUnavailable(RuntimeError):
    """No sandbox can start on this machine; the message says why and what to do."""


@dataclass(frozen=True)
class Limits:
    wall_s: float = 20.0  # wall-clock seconds per call, a backstop for code off the CPU; the sandbox is killed past it
    cpu_s: int = 5  # CPU seconds (RLIMIT_CPU): the limit a busy machine does not change
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    processes: int = 16  # processes and threads of the call (RLIMIT_NPROC)
    file_mb: int = 16  # largest file the code may write (RLIMIT_FSIZE), and the size of its /tmp
    output_chars: int = 1024  # what the model sees of stdout (its head) and of an error (the last line)

    @staticmethod
    def from_config(tools) -> Limits:
        """The limits of a run's ``tools`` settings (``dapo.config.ToolsConfig``)."""
        return Limits(tools.timeout_s, tools.cpu_s, tools.memory_mb, tools.processes, tools.file_mb, tools.output_chars)


@dataclass(frozen=True)
class ToolResult:
    output: str  # what the model sees: stdout cut to the limit, then the error line if the code failed
    exit_code: int | None  # None when the call was killed (time-out or output past the limit)
    timed_out: bool
    error: str  # the last line of stderr when the code failed (e.g. "ZeroDivisionError: division by zero")
    seconds: float

    @property
    def failed(self) -> bool:
        return self.timed_out or self.exit_code != 0


def _interpreter_paths() -> list[Path]:
    """What the sandboxed interpreter needs to read: its installation and the environment's site-packages."""
    paths = {Path(sys.base_prefix), Path(sys.prefix)}
    paths |= {Path(sysconfig.get_paths()[key]) for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    paths.add(Path(sys.executable).parent)
    resolved = {p.resolve() for p in paths if p.exists()} | {p for p in paths if p.exists()}
    # bind the outermost of nested paths only
    return sorted(p for p in resolved if not any(q != p and q in p.parents for q in resolved))


def _system_binds() -> list[str]:
    """/usr read-only, and the top-level links into it (/lib -> usr/lib on merged-/usr systems) as links."""
    args = ["--ro-bind", "/usr", "/usr"]
    for name in ("bin", "sbin", "lib", "lib32", "lib64"):
        path = Path("/") / name
        if path.is_symlink():
            args += ["--symlink", os.readlink(path), str(path)]
        elif path.is_dir():
            args += ["--ro-bind", str(path), str(path)]
    return args


class Sandbox:
    """``run(code)`` executes ``code`` with ``python -I -`` under ``limits`` and returns what it printed."""

    def __init__(self, limits: Limits | None = None, kind: str = "bwrap"):
        if kind not in SANDBOXES:
            raise ValueError(f"tools.sandbox={kind!r}: must be one of {', '.join(SANDBOXES)}")
        self.limits, self.kind = limits or Limits(), kind
        self._bwrap = shutil.which("bwrap")
        self._root = os.geteuid() == 0
        self._setpriv = shutil.which("setpriv")
        self._prlimit = shutil.which("prlimit")

    def check(self) -> None:
        """Start one sandbox, or raise SandboxUnavailable with one line saying what failed and how to fix it: no
        bubblewrap, setpriv missing (as root), namespaces refused, or the interpreter not runnable inside."""
        if self.kind == "none":
            log.warning(
                "tools.sandbox=none: the model's code runs unisolated, with the trainer's user, files and network "
                "(limits only); use it on a trusted machine only"
            )
            return
        if self._bwrap is None:
            raise SandboxUnavailable(
                "tools need bubblewrap (bwrap) and it is not installed: `apt-get install bubblewrap` (or your "
                "system's package), or tools.sandbox=none on a trusted machine"
            )
        if self._root and self._setpriv is None:
            raise SandboxUnavailable(
                "tools run as root need setpriv to drop to a user of their own and it is not installed: "
                "`apt-get install util-linux` (or your system's package), or run the trainer as another user"
            )
        exposed = [p for p in _interpreter_paths() if p in (Path("/"), Path("/tmp"))]
        if exposed:
            raise SandboxUnavailable(
                f"the interpreter lives at {exposed[0]}: binding it would show the host's {exposed[0]} inside the "
                "sandbox; put the Python environment in a directory of its own (e.g. python -m venv /opt/dapo-env)"
            )
        started = self._run(self.command(program=["/bin/sh", "-c", "exit 0"]), b"")
        if started.exit_code != 0:
            raise SandboxUnavailable(_namespaces_refused(started.error, self._root))
        result = self.run("print(6 * 7)")
        if result.output.strip() == "42":
            return
        if "No such file or directory" in result.error or result.exit_code == 127:
            raise SandboxUnavailable(
                f"a sandbox starts but the interpreter {sys.executable} is not visible inside it ({result.error}); "
                f"it binds read-only {', '.join(map(str, _interpreter_paths()))} and /usr: a Python that needs "
                "files elsewhere cannot run there, so use one installed under a single prefix (a venv of it works "
                "anywhere), or tools.sandbox=none on a trusted machine"
            )
        raise SandboxUnavailable(
            f"a sandbox starts but Python fails inside it ({result.error or result.output.strip()!r}); "
            "`dapo tool-run FILE` shows the same call, or set tools.sandbox=none on a trusted machine"
        )

    def command(self, program: list[str] | None = None) -> list[str]:
        """The command line of one call, running ``program`` (the interpreter reading its code on stdin)."""
        program = program or [sys.executable, "-I", "-"]
        if self.kind == "none":
            return program
        mb = self.limits.file_mb << 20
        cmd = [self._bwrap, "--die-with-parent", "--new-session", "--unshare-pid", "--unshare-net"]
        cmd += ["--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try", "--hostname", "sandbox"]
        cmd += _system_binds()
        # the private /tmp first, the interpreter after: bubblewrap mounts in order, so an environment that lives
        # under /tmp (a CI checkout's .venv) is bound over the empty tmpfs and stays visible, the host's /tmp not
        cmd += ["--proc", "/proc", "--dev", "/dev", "--perms", "1777", "--size", str(mb), "--tmpfs", "/tmp"]
        for path in _interpreter_paths():
            for parent in reversed(path.parents[:-1]):  # bubblewrap would make them root-only (0700)
                if parent not in MOUNTED:
                    cmd += ["--perms", "0755", "--dir", str(parent)]
            cmd += ["--ro-bind", str(path), str(path)]
        cmd += ["--chdir", "/tmp", "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin"]
        cmd += ["--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8", "--setenv", "PYTHONDONTWRITEBYTECODE", "1"]
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            cmd += ["--setenv", var, "1"]  # one thread each: a thread pool would use up the process limit
        if self._root:
            uid = str(_UID_BASE + next(_UIDS) % _UID_SPAN)
            # setpriv needs CAP_SETUID to switch; the switch to a non-root user then clears every capability
            cmd += ["--", self._setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]
            cmd += ["--inh-caps=-all", "--bounding-set=-all", "--no-new-privs"]
        else:
            cmd += ["--unshare-user", "--"]
        return cmd + program

    def _rlimits(self) -> dict[int, tuple[int, int]]:
        lim = self.limits
        nproc = lim.processes
        if not self._root:  # counted per user: what this user already runs, plus the call's own
            nproc += _processes_of(os.getuid())
        return {
            resource.RLIMIT_CPU: (lim.cpu_s, lim.cpu_s + 1),
            resource.RLIMIT_AS: (lim.memory_mb << 20,) * 2,
            resource.RLIMIT_FSIZE: (lim.file_mb << 20,) * 2,
            resource.RLIMIT_CORE: (0, 0),
            resource.RLIMIT_NPROC: (nproc, nproc),
        }

    def _limited(self, cmd: list[str]) -> tuple[list[str], object]:
        """``cmd`` under the limits: through util-linux's prlimit, which sets them on itself and execs ``cmd``, so
        the call starts with vfork; without prlimit, set in the forked child. A fork copies the trainer's page
        tables (with torch and a model loaded, tens of ms a call; a CUDA process's far more) where vfork does not."""
        limits = self._rlimits()
        if self._prlimit is None:
            return cmd, lambda: [resource.setrlimit(r, v) for r, v in limits.items()]
        flags = {resource.RLIMIT_CPU: "cpu", resource.RLIMIT_AS: "as", resource.RLIMIT_FSIZE: "fsize",
                 resource.RLIMIT_CORE: "core", resource.RLIMIT_NPROC: "nproc"}  # fmt: skip
        return [self._prlimit, *(f"--{flags[r]}={soft}:{hard}" for r, (soft, hard) in limits.items()), "--", *cmd], None

    def _died(self, returncode: int) -> str:
        """What to tell the model when the code ended without a traceback."""
        # bubblewrap exits 128 + N when the code was killed by signal N
        signum = -returncode if returncode < 0 else returncode - 128 if self.kind != "none" and returncode > 128 else 0
        if signum == signal.SIGXCPU:
            return f"TimeoutError: the code used more than its {self.limits.cpu_s} s of CPU time"
        if signum in signal.Signals._value2member_map_:
            return f"Killed: {signal.Signals(signum).name}"
        return f"exit code {returncode}"

    def run(self, code: str) -> ToolResult:
        return self._run(self.command(), code.encode())

    def _run(self, command: list[str], stdin: bytes) -> ToolResult:
        lim = self.limits
        cap = 4 * lim.output_chars + 4096  # bytes read from each stream; more kills the call
        start = time.monotonic()
        env = {"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8", "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        cmd, preexec = self._limited(command)
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env if self.kind == "none" else {},
            cwd="/tmp",
            start_new_session=True,  # its own process group: a time-out kills everything it started
            preexec_fn=preexec,
        )
        out, err, killed = _communicate(proc, stdin, start + lim.wall_s, cap)
        seconds = time.monotonic() - start
        stdout = out.decode("utf-8", "replace")
        error = ""
        if killed == "time":
            error = f"TimeoutError: the code ran past the {lim.wall_s:g} s limit"
        elif killed == "output":
            error = f"OutputLimit: the code printed more than {cap} bytes"
        elif proc.returncode != 0:
            lines = err.decode("utf-8", "replace").strip().splitlines()
            error = lines[-1] if lines else self._died(proc.returncode)
        output = _cut(stdout, lim.output_chars)
        if error:
            output = (output.rstrip("\n") + "\n" if output.strip() else "") + error[-lim.output_chars :]
        return ToolResult(output, None if killed else proc.returncode, killed == "time", error, seconds)


def _communicate(proc: subprocess.Popen, data: bytes, deadline: float, cap: int) -> tuple[bytes, bytes, str]:
    """Feed stdin and read both streams until the process ends, the deadline passes or a stream passes
    ``cap`` bytes; then kill its process group. Returns (stdout, stderr, why it was killed or "")."""
    out_fd, err_fd = proc.stdout.fileno(), proc.stderr.fileno()
    chunks: dict[int, list[bytes]] = {out_fd: [], err_fd: []}
    sizes = dict.fromkeys(chunks, 0)
    killed = ""
    # (a pipe error: it exited, or closed stdin, before reading its program; its stderr says why)
    with contextlib.suppress(BrokenPipeError, OSError):
        proc.stdin.write(data)
        proc.stdin.close()
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                killed = "time"
                break
            for key, _ in sel.select(timeout=left):
                block = os.read(key.fd, 65536)
                if not block:
                    sel.unregister(key.fileobj)
                    continue
                chunks[key.fd].append(block)
                sizes[key.fd] += len(block)
                if sizes[key.fd] > cap:
                    killed = "output"
            if killed:
                break
    if killed:
        _kill_group(proc)
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()) + 1.0)
    except subprocess.TimeoutExpired:  # closed its streams but lives on (a daemonised child)
        killed = killed or "time"
        _kill_group(proc)
        proc.wait()
    proc.stdout.close()
    proc.stderr.close()
    return b"".join(chunks[out_fd])[:cap], b"".join(chunks[err_fd])[:cap], killed


def _namespaces_refused(error: str, root: bool) -> str:
    """The line for a bubblewrap that could not set up its namespaces, from what it printed."""
    said = f"bwrap said {error!r}" if error else "bwrap gave no reason"
    if root:
        return (
            f"bubblewrap is installed but could not create a sandbox as root ({said}); a container must allow new "
            "namespaces (e.g. docker run --security-opt seccomp=unconfined --cap-add SYS_ADMIN), or set "
            "tools.sandbox=none on a trusted machine"
        )
    return (
        f"bubblewrap is installed but could not create a sandbox ({said}): unprivileged user namespaces are off; "
        "enable them (sysctl -w kernel.unprivileged_userns_clone=1, or on Ubuntu 24.04+ "
        "kernel.apparmor_restrict_unprivileged_userns=0), or set tools.sandbox=none on a trusted machine"
    )


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the call's process group: bubblewrap, and with it (PID namespace) everything inside."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def _cut(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n... ({len(text) - limit} more characters)\n"


def _processes_of(uid: int) -> int:
    """Tasks (processes and threads) this user runs now: RLIMIT_NPROC counts all of them."""
    count = 0
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    count += len(os.listdir(f"/proc/{entry.name}/task"))
            except OSError:
                continue
    return count
