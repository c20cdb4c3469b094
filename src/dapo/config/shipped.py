"""The files the package ships: the presets (``configs/``), the demo's base models (``assets/``) and
the benchmark and training data (``data/``).

In the repository they live at its top, where the README's commands name them, and ``share/`` in the
package links to them; the wheel holds copies under ``dapo/share/``. A relative path that starts with
one of those folders (``assets/arith-base``, ``data/word_problems/train.jsonl``) is read from the
current directory when it exists there, and otherwise from the package's copy: the same presets and
commands work in a clone and after ``pip install`` from any directory.
"""

from __future__ import annotations

import os
from pathlib import Path

SHARE = Path(__file__).resolve().parents[1] / "share"
SHIPPED_DIRS = ("configs", "assets", "data")


def shipped(path: str | os.PathLike) -> Path:
    """``path`` itself when it exists (or is absolute); else the package's copy of a shipped file it
    names (``assets/...``, ``data/...``, ``configs/...``) when there is one; else ``path`` unchanged,
    for the caller to report as missing."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    if p.parts[:1] and p.parts[0] in SHIPPED_DIRS and (SHARE / p).exists():
        return SHARE / p
    return p
