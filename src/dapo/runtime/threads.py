"""How dapo's CPU threads share a machine: as many as the CPUs this process may use, waiting without spinning.

torch computes on CPU with OpenMP threads that, between two parallel regions, spin for a while before they sleep
(libgomp's default). Alone on a machine that costs nothing; beside other work it burns the cores the other jobs
need, and a thread spins while the one it waits for has been put off its core, so a step costs several times its
CPU seconds. ``wait_passively`` sets OpenMP's passive wait policy (threads sleep as soon as they wait) before any
OpenMP runtime is loaded: torch's libgomp, and vLLM's CPU threads, which run on torch's runtime in the trainer's
process. It must run before torch is imported: ``import dapo`` does it (a user's own OMP_WAIT_POLICY stays).

``usable_cpus`` is what the thread counts follow: the CPUs of the process's affinity mask, bounded by a cgroup's CPU
quota (a container given 2 CPUs of a 64-core host computes with 2 threads, not 64).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

WAIT_POLICY = "PASSIVE"


def wait_passively() -> None:
    """OpenMP threads sleep as soon as they wait (OMP_WAIT_POLICY=PASSIVE) unless the environment says otherwise;
    read once, when the OpenMP runtime is loaded (with torch)."""
    os.environ.setdefault("OMP_WAIT_POLICY", WAIT_POLICY)


def usable_cpus() -> int:
    """The CPUs this process may compute on: its affinity mask, bounded by its cgroup's CPU quota; at least 1."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    quota = _cgroup_quota()
    return max(1, min(cpus, math.ceil(quota)) if quota else cpus)


def _cgroup_quota(root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """CPUs' worth of time the cgroup may use (cgroup v2 cpu.max "quota period", or v1's cfs files); None: no quota."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return quota / period if quota > 0 and period > 0 else None
    except (OSError, ValueError):
        return None


def fit_torch_threads() -> int:
    """torch's intra-op threads set to the usable CPUs where it would use more (it counts the affinity mask, not a
    cgroup's quota) and OMP_NUM_THREADS does not say; the count."""
    import torch

    usable = usable_cpus()
    if "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > usable:
        torch.set_num_threads(usable)
    return torch.get_num_threads()
