"""The tool sandbox: what the model sees of its code's run, the limits, and the hostile corpus contained."""

import dataclasses
import os
import socket
import time
from pathlib import Path

import pytest

from dapo.tools.sandbox import Limits, Sandbox
from sandbox_corpus import CORPUS

pytestmark = pytest.mark.sandbox

LIMITS = Limits(wall_s=3.0, cpu_s=2, memory_mb=768, processes=16, file_mb=8, output_chars=512)
SLACK_S = 2.0  # past the wall-clock limit: the kill, reaping the namespace, the pipes closing
# for calls that must finish: a wall-clock limit no loaded machine reaches (with both cores busy, sympy's import in a
# fresh sandbox ran past 3 s), so that their verdicts do not hang on the machine's speed
ROOMY = dataclasses.replace(LIMITS, wall_s=60.0)


@pytest.fixture(scope="module")
def sandbox():
    box = Sandbox(LIMITS)
    box.check()
    return box


def _sandbox_processes() -> list[str]:
    """Processes left from a call: sandbox users (started as root) or a bubblewrap child of this process."""
    left = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            uid = entry.stat().st_uid
            stat = Path(f"/proc/{entry.name}/stat").read_text()
        except OSError:
            continue
        comm, ppid = stat[stat.index("(") + 1 : stat.rindex(")")], int(stat[stat.rindex(")") + 2 :].split()[1])
        if 61000 <= uid < 62000 or (comm == "bwrap" and ppid == os.getpid()):
            left.append(f"{entry.name} {comm} uid={uid}")
    return left


def test_what_the_model_sees(sandbox):
    sandbox = Sandbox(ROOMY)
    assert sandbox.run("print(6 * 7)").output == "42\n"
    r = sandbox.run("x = 1\nprint('before')\nprint(x / 0)")
    assert r.output == "before\nZeroDivisionError: division by zero"  # stdout, then the traceback's last line
    assert r.exit_code == 1 and not r.timed_out and r.error == "ZeroDivisionError: division by zero"
    r = sandbox.run("print('y' * 2000)")
    assert r.output.startswith("y" * 512) and r.output.endswith("(1489 more characters)\n")  # 2000 + newline
    assert sandbox.run("import sympy\nprint(sympy.factorint(360))").output == "{2: 3, 3: 2, 5: 1}\n"


def test_a_fresh_process_each_call(sandbox):
    sandbox = Sandbox(ROOMY)
    sandbox.run("open('/tmp/state', 'w').write('1')")
    assert "FileNotFoundError" in sandbox.run("print(open('/tmp/state').read())").output


def test_time_limit_holds_and_names_itself(sandbox):
    r = sandbox.run("import time\nprint('started', flush=True)\ntime.sleep(60)")
    assert r.timed_out and r.exit_code is None
    assert r.output == "started\nTimeoutError: the code ran past the 3 s limit"
    assert LIMITS.wall_s <= r.seconds < LIMITS.wall_s + SLACK_S


def test_the_cpu_limit_names_itself_whatever_the_load():
    """An endless loop meets the CPU-time limit, named as such. The wall-clock limit here is far beyond it: with
    the corpus's 3 s a loaded machine gives the loop under 2 CPU seconds in 3 wall seconds, and the wall limit
    would strike first."""
    r = Sandbox(Limits(wall_s=120.0, cpu_s=2, memory_mb=768, processes=16, file_mb=8, output_chars=512)).run(
        "while True:\n    pass"
    )
    assert r.failed and not r.timed_out  # killed by the kernel's SIGXCPU, not by the wall-clock watch
    assert r.output == "TimeoutError: the code used more than its 2 s of CPU time"


@pytest.mark.parametrize("through", ["prlimit", "preexec"])
def test_the_limits_reach_the_code_with_or_without_prlimit(sandbox, through):
    """With prlimit the call starts by vfork (the trainer is never forked); without it, the limits are set in a
    forked child. Either way the code runs under the same limits."""
    box = Sandbox(LIMITS)
    if through == "preexec":
        box._prlimit = None
    elif box._prlimit is None:
        pytest.skip("no prlimit (util-linux) here")
    assert (box._limited(["true"])[1] is None) == (through == "prlimit")
    names = ("CPU", "AS", "FSIZE", "CORE")
    r = box.run("import resource\n" + "".join(f"print(resource.getrlimit(resource.RLIMIT_{n}))\n" for n in names))
    mb = 1 << 20
    assert r.output.splitlines() == ["(2, 3)", f"({768 * mb}, {768 * mb})", f"({8 * mb}, {8 * mb})", "(0, 0)"]
    assert box.run("x = bytearray(1024 << 20)").error == "MemoryError"


def test_the_hostile_corpus_is_contained(sandbox, tmp_path, monkeypatch):
    assert len(CORPUS) >= 30
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text("the secret")
    secret = "s3cr3t-token-4711"
    monkeypatch.setenv("DAPO_TEST_SECRET", secret)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    listener.setblocking(False)
    fill = {"outside": outside, "port": listener.getsockname()[1], "pid": os.getpid(), "secret": secret}
    slowest, failures = (0.0, ""), []
    for name, code, expect in CORPUS:
        t0 = time.monotonic()
        r = sandbox.run(code.format(**fill))
        wall = time.monotonic() - t0
        slowest = max(slowest, (wall, name))
        kind, _, text = expect.partition(":")
        text = text.format(**fill)
        ok = {
            "fails": r.failed,
            "timeout": r.timed_out,
            "no": text not in r.output,
            "has": text in r.output,
        }[kind]
        if not ok:
            failures.append(f"{name}: expected {expect!r}, the model saw {r.output!r}")
        if wall > LIMITS.wall_s + SLACK_S:
            failures.append(f"{name}: took {wall:.1f} s")
        if sorted(p.name for p in outside.iterdir()) != ["secret.txt"] or (outside / "secret.txt").read_text() != (
            "the secret"
        ):
            failures.append(f"{name}: changed {outside}")
        with pytest.raises(BlockingIOError):
            listener.accept()
        for _ in range(20):  # the namespace's last processes may take a moment to be reaped
            if not (left := _sandbox_processes()):
                break
            time.sleep(0.1)
        if left:
            failures.append(f"{name}: left {left}")
    listener.close()
    print(f"\nhostile corpus: {len(CORPUS)} programs, slowest call {slowest[0]:.2f} s ({slowest[1]})")
    assert os.environ["DAPO_TEST_SECRET"] == secret
    assert not failures, "\n".join(failures)


def test_tool_run_prints_what_the_model_would_see(tmp_path, capsys):
    from dapo import cli

    program = tmp_path / "model_wrote.py"
    program.write_text("import math\nprint(math.comb(10, 3))\n")
    assert cli.main(["tool-run", str(program)]) == 0
    out, err = capsys.readouterr()
    assert out == "```output\n120\n```\n" and "exit 0" in err and "sandbox bwrap" in err
    program.write_text("while True:\n    pass\n")
    assert cli.main(["tool-run", str(program), "tools.cpu_s=1", "tools.timeout_s=10"]) == 1
    out, _ = capsys.readouterr()
    assert out == "```output\nTimeoutError: the code used more than its 1 s of CPU time\n```\n"
    assert cli.main(["tool-run", str(program), "tools.sandbox=docker"]) == 2
    assert "error: tools.sandbox='docker': choose bwrap or none" in capsys.readouterr().err
