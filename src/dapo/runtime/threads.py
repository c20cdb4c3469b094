"""How dapo's CPU threads share a machine: as many as the CPUs this process may use, waiting without spinning.

torch computes on CPU with OpenMP threads that, between two parallel regions, spin before they sleep: libgomp's
default is 300,000 rounds of a pause instruction (milliseconds). Alone on a machine that costs nothing; beside other
work it burns the cores the other jobs need, and a thread spins while the one it waits for has been put off its
core: the demo's step took 2.5x its CPU seconds beside two busy processes, the wall seconds 5x. ``wait_briefly``
caps the spin at 2,000 rounds (tens of microseconds: a thread that is woken at once still is) before the thread
sleeps, for torch's libgomp and for vLLM's CPU threads, which run on it in the trainer's process, and asks any other
OpenMP runtime for its passive policy. Measured on the demo (benchmarks/fair_share.py): about the same CPU seconds a
step beside two busy processes as alone, where sleeping at once (OMP_WAIT_POLICY=PASSIVE alone) cost the demo 60%
more wall time alone, its operations being small. It must run before torch is imported: ``import dapo`` does it;
settings of a user's own stay.

``usable_cpus`` is what the thread counts follow: the CPUs of the process's affinity mask, bounded by a cgroup's CPU
quota (a container given 2 CPUs of a 64-core host computes with 2 threads, not 64).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

SPIN_ROUNDS = 2000  # libgomp's rounds of spinning before a waiting thread sleeps (its default: 300,000)


def wait_briefly() -> None:
    """OpenMP threads spin briefly, then sleep, where they wait (GOMP_SPINCOUNT; OMP_WAIT_POLICY=PASSIVE for another
    runtime), unless the environment says otherwise; read once, when the OpenMP runtime is loaded (with torch)."""
    if "GOMP_SPINCOUNT" not in os.environ and "OMP_WAIT_POLICY" not in os.environ:
        os.environ["GOMP_SPINCOUNT"] = str(SPIN_ROUNDS)
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"  # libgomp: the spin count above wins; others: sleep at once


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
