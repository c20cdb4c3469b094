"""A run's checkpoint directories and their files: where they are and their manifest. The standard library only.

Each checkpoint ends with ``manifest.json`` (written last, inside the directory before its rename): every other
file's size and CRC-32. ``verify`` compares a checkpoint with it (a copy cut short, a full disk on the other side,
bit rot); which checkpoints are checked, and what is done with a damaged one, is ``dapo.checkpoint.load``'s
(``resume_point``, ``check_whole``).
"""

from __future__ import annotations

import json
import os
import re
import zlib
from pathlib import Path

MANIFEST = "manifest.json"  # every other file of a checkpoint: its size and CRC-32 (verify)
CHUNK = 8 << 20  # bytes read at a time while checksumming
STEP_DIR = re.compile(r"^step_(\d{6,})$")  # <run>/checkpoints/step_000020


DAMAGED_PREFIX = "damaged."  # a checkpoint that failed verification, moved aside: damaged.step_000020


class Unverified(Exception):
    """A checkpoint without a manifest: it cannot be checked, and is trusted as before."""


def _crc32(path: Path) -> str:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            crc = zlib.crc32(chunk, crc)
    return f"{crc:08x}"


def _files(path: Path) -> list[str]:
    """Every regular file under ``path`` but the manifest, as sorted relative POSIX paths."""
    return sorted(p.relative_to(path).as_posix() for p in Path(path).rglob("*") if p.is_file() and p.name != MANIFEST)


def write_manifest(path: Path) -> Path:
    """Record every file of the checkpoint directory ``path`` (size, CRC-32: a truncation, zeroed blocks,
    flipped bits) in its manifest.json, written whole under a temporary name and renamed."""
    path = Path(path)
    files = {name: {"bytes": (path / name).stat().st_size, "crc32": _crc32(path / name)} for name in _files(path)}
    tmp = path / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"format": 1, "checksum": "crc32", "files": files}, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path / MANIFEST)
    return path / MANIFEST


def verify(path: Path) -> str | None:
    """What differs between checkpoint ``path`` and its manifest, in a few words naming the file (the first
    difference found), or None when every file is as written. A checkpoint without a manifest (written before
    manifests existed) raises Unverified."""
    path = Path(path)
    if not (path / MANIFEST).exists():
        raise Unverified(f"checkpoint {path} has no {MANIFEST} (written before checkpoints had one)")
    try:
        listed = json.loads((path / MANIFEST).read_text())["files"]
        assert isinstance(listed, dict)
    except Exception as err:
        return f"{MANIFEST} is unreadable ({type(err).__name__})"
    for name, want in sorted(listed.items()):
        file = path / name
        if not file.is_file():
            return f"{name} is missing ({want['bytes']} bytes in the manifest)"
        size = file.stat().st_size
        if size != want["bytes"]:
            return f"{name} is {size} bytes, the manifest says {want['bytes']}"
        crc = _crc32(file)
        if crc != want["crc32"]:
            return f"{name} has CRC-32 {crc}, the manifest says {want['crc32']} (same size: its content changed)"
    extra = [name for name in _files(path) if name not in listed]
    if extra:
        return f"{extra[0]} is not in the manifest" + (f" (and {len(extra) - 1} more files)" if len(extra) > 1 else "")
    return None


def checkpoint_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [
        p
        for p in root.iterdir()
        if p.is_dir() and STEP_DIR.match(p.name) and ((p / "trainer_state.pt").exists() or (p / MANIFEST).exists())
    ]
    return sorted(found, key=step_of)


def step_of(path: Path) -> int:
    return int(STEP_DIR.match(Path(path).name).group(1))


def latest_checkpoint(run_dir: Path) -> Path | None:
    found = list_checkpoints(run_dir)
    return found[-1] if found else None


def unused_name(path: Path) -> Path:
    """``path``, or where it exists the first of path-1, path-2, ... that does not: a name to move something aside
    to (an earlier run, a damaged checkpoint) without replacing anything."""
    aside = path
    for k in range(1, 1000):
        if not aside.exists():
            break
        aside = path.with_name(f"{path.name}-{k}")
    return aside
