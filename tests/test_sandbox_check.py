"""The sandbox starts wherever Python lives, and each reason it cannot start has its own line and fix."""

import os
import shutil
import subprocess
import sys
import venv
from pathlib import Path

import pytest

from dapo.tools import sandbox as sandbox_module
from dapo.tools.sandbox import Limits, Sandbox, SandboxUnavailable

SRC = Path(__file__).resolve().parents[1] / "src"

# run from the environment under test: the check, then what the code inside sees of the interpreter, of the host's
# /tmp (a file the test leaves beside the environment) and of its own environment (read-only)
PROBE = r"""
import sys
from dapo.tools.sandbox import Sandbox
box = Sandbox()
box.check()
print(box.run('''
import os, sys
print(sys.prefix)
print(os.path.exists(%r))
try:
    open(os.path.join(sys.prefix, "written"), "w")
except OSError as err:
    print(type(err).__name__, err.errno)
''').output, end="")
"""


def _environment(path: Path) -> Path:
    """A virtual environment at ``path`` (no pip: seconds), its interpreter linked to this one's base."""
    venv.create(path, with_pip=False, symlinks=True)
    return path / "bin" / "python"


@pytest.mark.sandbox
@pytest.mark.parametrize("layout", ["under /tmp", "path with spaces", "under the run directory", "through a symlink"])
def test_the_sandbox_starts_from_an_environment_wherever_it_lives(tmp_path, layout):
    assert str(tmp_path).startswith("/tmp/") or layout != "under /tmp"  # pytest's tmp_path: the CI clone's case
    home = {
        "under /tmp": tmp_path / "clone" / ".venv",
        "path with spaces": tmp_path / "my checkout" / "env 3.11",
        "under the run directory": tmp_path / "runs" / "demo" / ".venv",
        "through a symlink": tmp_path / "real" / ".venv",
    }[layout]
    python = _environment(home)
    if layout == "through a symlink":
        (tmp_path / "link").symlink_to(home.parent)
        python = tmp_path / "link" / ".venv" / "bin" / "python"
    host_file = tmp_path / "host_secret"
    host_file.write_text("not for the sandbox")
    out = subprocess.run(
        [str(python), "-c", PROBE % str(host_file)],
        env={"PATH": os.environ["PATH"], "PYTHONPATH": str(SRC)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    prefix, host_visible, write = out.stdout.splitlines()
    assert prefix == str(python.parent.parent)  # the environment's own interpreter ran inside
    assert host_visible == "False"  # the private /tmp hides the host's, the environment's neighbours included
    assert write == "OSError 30"  # EROFS: the environment is read-only inside


def test_no_bubblewrap_says_install_it(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable, match=r"not installed: `apt-get install bubblewrap`.*tools.sandbox=none"):
        Sandbox().check()


def test_root_without_setpriv_says_install_util_linux():
    box = Sandbox()
    box._bwrap, box._root, box._setpriv = "/usr/bin/bwrap", True, None
    with pytest.raises(SandboxUnavailable, match=r"as root need setpriv .* `apt-get install util-linux`"):
        box.check()


@pytest.mark.parametrize("root", [False, True])
def test_namespaces_refused_names_the_sysctl_or_the_container(tmp_path, root):
    """A bubblewrap that cannot create its namespaces (what it prints on a kernel with them off)."""
    fake = tmp_path / "bwrap"
    fake.write_text(
        "#!/bin/sh\necho 'bwrap: No permissions to creating new namespace, likely because the kernel does not allow "
        "non-privileged user namespaces.' >&2\nexit 1\n"
    )
    fake.chmod(0o755)
    box = Sandbox()
    box._bwrap, box._root, box._setpriv = str(fake), root, "/usr/bin/setpriv"
    with pytest.raises(SandboxUnavailable) as err:
        box.check()
    line = str(err.value)
    assert "\n" not in line and "No permissions to creating new namespace" in line
    if root:
        assert "could not create a sandbox as root" in line and "--cap-add SYS_ADMIN" in line
    else:
        assert "unprivileged user namespaces are off" in line and "kernel.unprivileged_userns_clone=1" in line


@pytest.mark.sandbox
def test_an_interpreter_not_visible_inside_is_named(monkeypatch):
    """The interpreter's directories left unbound (as the private /tmp once hid an environment under /tmp)."""
    if Path(sys.executable).resolve().is_relative_to("/usr"):
        pytest.skip("this interpreter lives under /usr, which the sandbox always binds")
    monkeypatch.setattr(sandbox_module, "_interpreter_paths", lambda: [])
    with pytest.raises(SandboxUnavailable) as err:
        Sandbox().check()
    line = str(err.value)
    assert f"the interpreter {sys.executable} is not visible inside it" in line
    assert "No such file or directory" in line and "tools.sandbox=none" in line


def test_an_interpreter_at_tmp_itself_is_refused(monkeypatch):
    box = Sandbox()
    box._bwrap = "/usr/bin/bwrap"
    box._setpriv = "/usr/bin/setpriv"
    monkeypatch.setattr(sandbox_module, "_interpreter_paths", lambda: [Path("/tmp")])
    with pytest.raises(SandboxUnavailable, match=r"lives at /tmp: binding it would show the host's /tmp"):
        box.check()


def test_the_none_sandbox_keeps_the_limits_but_not_the_isolation(tmp_path):
    box = Sandbox(Limits(wall_s=3.0), kind="none")
    box.check()
    assert box.run(f"print(open('{tmp_path}/x', 'w').write('ab'))").output == "2\n"  # the host is writable
    assert box.run("import time\ntime.sleep(60)").timed_out
