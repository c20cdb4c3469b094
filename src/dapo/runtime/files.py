"""Files a run writes and reads back: the modes the user's umask asks for, and the one error for a checkpoint or
model file that cannot be loaded (or would run code to load)."""

from __future__ import annotations

import os
from pathlib import Path


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be loaded, or that would run code to load; the message names the file."""


def readable_as_umask(paths) -> None:
    """Give files and directories the modes the user's umask asks for (0644 and 0755 under umask 022).
    save_pretrained writes its weights 0600 and mkdtemp makes 0700: a model meant for sharing would be
    readable by its owner only."""
    mask = os.umask(0)
    os.umask(mask)  # (reading the umask means setting it)
    for p in paths:
        p = Path(p)
        if p.is_symlink():
            continue
        if p.is_dir():
            p.chmod(0o777 & ~mask)
        elif p.is_file():
            executable = p.stat().st_mode & 0o100
            p.chmod((0o777 if executable else 0o666) & ~mask)


def tree(path: Path) -> list[Path]:
    """``path`` and everything under it."""
    return [Path(path), *Path(path).rglob("*")]
