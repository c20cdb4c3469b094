"""The run directory: made at the start, never written into when it holds an earlier run (unless that run is
moved aside first), and removed again when a start fails before anything of value was written."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from pathlib import Path

from dapo.checkpoint.files import checkpoint_dir, unused_name
from dapo.config import ConfigError
from dapo.runtime import parallel


def prepare_run_dir(run_dir: Path, *, resume: bool, overwrite: bool, dist: parallel.Dist | None = None) -> None:
    """Create the run directory. A fresh start (resume=false) never writes into an earlier run: its
    metrics.jsonl would be truncated and the checkpoint rotation would mix (and delete) steps of
    both. It stops instead, or with ``overwrite`` first moves the earlier run aside, whole."""
    d = dist or parallel.Dist()
    run_dir = Path(run_dir)
    earlier = not resume and _holds_results(run_dir)
    if earlier and not overwrite:
        raise ConfigError(
            f"run.resume=false but {run_dir} holds an earlier run (checkpoints or metrics.jsonl); "
            f"give a new run.name, or set run.overwrite=true to move it aside to "
            f"{run_dir.name}.<date-time> first, or drop run.resume=false to continue it"
        )
    parallel.barrier(d)  # every rank has looked before rank 0 moves anything
    if d.is_main:
        if earlier:
            aside = unused_name(run_dir.with_name(f"{run_dir.name}.{time.strftime('%Y%m%d-%H%M%S')}"))
            os.rename(run_dir, aside)  # not os.replace: never onto an existing directory
            print(f"run.overwrite=true: moved the earlier run {run_dir} to {aside}")
        run_dir.mkdir(parents=True, exist_ok=True)
    parallel.barrier(d)


def _holds_results(run_dir: Path) -> bool:
    """Whether a run directory holds anything of value: a checkpoint or a metrics row."""
    metrics = run_dir / "metrics.jsonl"
    return any(checkpoint_dir(run_dir).glob("step_*")) or (metrics.exists() and metrics.stat().st_size > 0)


@contextlib.contextmanager
def removed_if_start_fails(run_dir: Path):
    """Around a run's start: when it fails before anything of value was written (no checkpoint, no
    metrics row), remove the run directory, and the parents it made, if this run created them. An
    earlier run's directory is never touched."""
    run_dir = Path(run_dir)
    created = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # innermost first
    try:
        yield
    except BaseException:
        if created and run_dir.is_dir() and not _holds_results(run_dir):
            shutil.rmtree(run_dir, ignore_errors=True)
            for parent in created[1:]:
                with contextlib.suppress(OSError):
                    parent.rmdir()  # only while empty
        raise
