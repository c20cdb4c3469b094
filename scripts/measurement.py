"""A results file under benchmarks/results/: the figures of one measured run, with the command that measured
them, the date, the commit and the machine, so that a figure quoted in the manual can be checked against it
(tests/test_doc_figures.py) and says when and how it was measured."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import NoReturn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import runs  # noqa: E402  (the benchmarks' record of the CPU, shared)

# what a measured figure depends on: changes here that are not committed are recorded with the commit
MEASURED_CODE = ("src", "configs", "assets", "pyproject.toml")
# how busy the machine was when the measuring script started: times measured beside other work are longer
LOAD_AT_START = os.getloadavg()[0]


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""


def _session_nice() -> int | None:
    try:  # "/autogroup-42 nice 0": the scheduler weighs sessions against each other by this
        return int(Path("/proc/self/autogroup").read_text().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def machine() -> dict:
    """The machine a run was measured on: its CPU (model, AMX, AVX-512, cores: ``runs.machine()``), how loaded it
    was, the libraries that decide the arithmetic."""
    versions = {}
    for package in ("torch", "transformers"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            pass
    return {
        **runs.machine(),
        "load_average_1min": {"start": round(LOAD_AT_START, 2), "end": round(os.getloadavg()[0], 2)},
        # below 0: the run had priority over the machine's other work (Linux: per process, and per session)
        "nice": os.nice(0),
        "session_nice": _session_nice(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        **versions,
    }


def record(command: str, written_by: str, figures: dict, *, measured_at: datetime | None = None, **extra) -> dict:
    """The results file's content: ``command`` measured ``figures``; ``written_by`` wrote this file."""
    when = measured_at or datetime.now(timezone.utc)
    changed = [line[3:] for line in _git("status", "--porcelain", "--", *MEASURED_CODE).splitlines()]
    return {
        "command": command,
        "written_by": written_by,
        "date": when.astimezone(timezone.utc).strftime("%Y-%m-%d"),
        "measured_at": when.astimezone(timezone.utc).isoformat(timespec="seconds"),
        "commit": _git("rev-parse", "HEAD").strip() or "unknown",
        "uncommitted_changes": changed,
        "machine": machine(),
        **extra,
        "figures": figures,
    }


def fail(message: str) -> NoReturn:
    """One line on stderr and exit code 2, as the dapo command does for bad input."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def write(path: str | Path, content: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=2) + "\n")
    print(f"wrote {path}")
