"""The benchmarks' training runs, and times that no busy machine can bend.

A run is `python -m dapo.training PRESET [key=value ...]` in a process of its own. Beside its metrics it is
measured from outside: its wall seconds, its CPU seconds (user + system of the run's process and of the processes
it started and waited for: grading workers, a rollout process), and the load the machine was under meanwhile: the
1-minute load average sampled every few seconds, and the CPU seconds the machine spent on processes that were not
the benchmark's own ("foreign": from /proc/stat, less the runs' own).

Sides are compared under the same load. ``run_together`` starts a batch of runs at once (a seed's sides as matched
pairs, one core each) and ``run_alone`` one at a time; ``time_ratio`` gives a ratio of times only when every run
behind it saw no more load than its own jobs (the torch threads of its batch's runs), and otherwise says why and
gives none. CPU seconds are shown beside wall seconds either way, and a ratio of CPU seconds follows the same
rule: they move less than wall seconds when the machine is shared, but they move (cache and memory bandwidth are
shared too).

Work timed inside a benchmark's own process is measured the same way by a ``Meter``: ``with meter:`` around each
call of a side adds its wall seconds, its CPU seconds (this process's threads, its children and its live
descendants: a reward pool's workers, vLLM's engine core) and the load meanwhile; ``withheld`` says why a ratio
over some sides' loads is no figure (None when there is none to say).

``machine()`` is the CPU a benchmark ran on (model, AMX, AVX-512, cores), for the results file it writes: a time
measured on one CPU says little about another (an AMX Xeon's float32 matmuls ran 2x an older one's).
"""

from __future__ import annotations

import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from dapo.reporting.run_log import read_metrics  # noqa: E402

T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}
LOAD_SLACK = 0.5  # the load average a batch may show above its own jobs (a grading worker, the monitor itself)
FOREIGN_CPU_LIMIT = 0.05  # the share of the machine's CPU time other processes may take during a batch


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (0 for one value)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, T975.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))


def machine(cpuinfo: str | None = None) -> dict:
    """The CPU this runs on, for a results file: its model name, whether it has AMX tiles (``amx_tile``: bf16
    matmuls on tile units) and AVX-512 (``avx512f``), the machine's cores and the cores this process may use.
    ``cpuinfo``: /proc/cpuinfo's text (read when None); where it says nothing (not Linux), the model is
    platform's and AMX and AVX-512 are None (not known)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    first: dict[str, str] = {}  # the first processor's fields: the others repeat them on one machine
    for line in cpuinfo.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            first.setdefault(key.strip(), value.strip())
    flags = set(first["flags"].split()) if "flags" in first else None
    usable = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None  # not on macOS
    return {
        "cpu": first.get("model name") or platform.processor() or None,
        "amx": None if flags is None else "amx_tile" in flags,
        "avx512": None if flags is None else "avx512f" in flags,
        "cores": os.cpu_count(),
        "usable_cores": len(usable) if usable is not None else os.cpu_count(),
    }


@dataclass
class Load:
    """What the machine did while a batch of runs ran: the load average samples, and the CPU seconds spent by
    processes outside the batch."""

    own_jobs: int  # the cores the batch keeps busy: its runs x the torch threads each was given
    samples: list[float] = field(default_factory=list)  # the 1-minute load average, every few seconds
    machine_cpu_s: float = 0.0  # every process's CPU seconds during the batch (/proc/stat)
    own_cpu_s: float = 0.0  # the batch's runs' own
    capacity_s: float = 0.0  # wall seconds x cores
    tick_s: float = 0.0  # what the tick counters may be off by (a tick per core and block): short blocks

    @property
    def mean(self) -> float:
        return statistics.fmean(self.samples) if self.samples else 0.0

    @property
    def foreign_frac(self) -> float:
        """Other processes' share of the machine's CPU capacity during the batch."""
        return max(0.0, self.machine_cpu_s - self.own_cpu_s - self.tick_s) / max(self.capacity_s, 1e-9)

    def clean(self) -> bool:
        return self.mean <= self.own_jobs + LOAD_SLACK and self.foreign_frac <= FOREIGN_CPU_LIMIT

    def describe(self) -> str:
        return describe(self.summary())

    def summary(self) -> dict:
        """Plain data, for a results file and ``time_ratio``."""
        return {"mean": self.mean, "own_jobs": self.own_jobs, "foreign_frac": self.foreign_frac, "clean": self.clean()}


def describe(load: dict) -> str:
    jobs = load["own_jobs"]
    return (
        f"load average {load['mean']:.2f} for {jobs} own job{'s' * (jobs > 1)}, "
        f"{100 * load['foreign_frac']:.1f}% of the CPU to other processes"
    )


@dataclass
class Run:
    """One run: what it was, its metrics rows, and what it took."""

    name: str
    rows: list[dict]
    wall_s: float
    cpu_s: float  # the run's process and the processes it waited for
    load: Load


def _busy_cpu_s() -> float:
    """The machine's CPU seconds spent outside idle and iowait since boot (/proc/stat's first line)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def _process_tree() -> tuple[dict[int, list[int]], dict[int, float]]:
    """Every process's children, and the CPU seconds each spent with what it waited for (/proc/<pid>/stat: utime,
    stime, cutime, cstime)."""
    children: dict[int, list[int]] = {}
    spent: dict[int, float] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # it ended meanwhile
            continue
        pid = int(stat.parent.name)
        children.setdefault(int(fields[1]), []).append(pid)
        spent[pid] = sum(int(x) for x in fields[11:15]) / os.sysconf("SC_CLK_TCK")
    return children, spent


def _own_cpu_s() -> float:
    """CPU seconds of this process (every thread), of the children it waited for, and of its live descendants with
    what they waited for."""
    children, spent = _process_tree()
    live, todo = 0.0, list(children.get(os.getpid(), []))
    while todo:
        pid = todo.pop()
        live += spent[pid]
        todo += children.get(pid, [])
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + waited.ru_utime + waited.ru_stime + live


def _children() -> set[int]:
    """The live (or not yet waited) processes whose parent is this one."""
    return set(_process_tree()[0].get(os.getpid(), []))


def adopt_orphans() -> bool:
    """Make this process the reaper of its descendants' orphans (Linux's PR_SET_CHILD_SUBREAPER): a process that
    outlives its parent (a reward pool's forkserver and its workers, once the run that started them exits) then
    comes back to this one, to be waited for and its CPU seconds counted, instead of to init. True where it took."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0) == 0  # 36: PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):  # not Linux
        return False


def reap_orphans(before: set[int], timeout_s: float = 10.0) -> None:
    """Wait (up to ``timeout_s``) for this process's children that were not its children at ``before``'s time and
    that nothing else waits for: orphans it adopted (``adopt_orphans``). Their CPU seconds then count in
    RUSAGE_CHILDREN; one still running at the deadline counts as a live descendant instead."""
    deadline = time.monotonic() + timeout_s
    left = _children() - before
    while left and time.monotonic() < deadline:
        for pid in list(left):
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:  # waited for elsewhere
                done = pid
            if done:
                left.discard(pid)
        if left:
            time.sleep(0.05)


class Meter:
    """Wall and CPU seconds of the blocks run under it (``with meter:``, as often as a side is called: they add up)
    and a ``Load`` over all of them: the load average at each block's start and end and every 5 s within it, and
    the CPU seconds other processes spent meanwhile. ``own_jobs``: the cores the blocks keep busy (their torch
    threads, a pool's workers). ``orphans``: the block runs a subprocess to its end; what that left running (a
    reward pool's forkserver and workers) is adopted and waited for at the block's end, so its CPU seconds are the
    block's own, not other processes'."""

    def __init__(self, own_jobs: int = 1, *, orphans: bool = False):
        self.load = Load(own_jobs=own_jobs)
        self.wall_s = 0.0
        self.cpu_s = 0.0  # this process's threads, its children and its live descendants
        self.orphans = orphans and adopt_orphans()

    def __enter__(self) -> Meter:
        self._stop = threading.Event()
        self._monitor = threading.Thread(target=self._sample, daemon=True)
        self.load.samples.append(os.getloadavg()[0])
        self._monitor.start()
        self._children_before = _children() if self.orphans else set()
        self._start = (time.perf_counter(), _own_cpu_s(), _busy_cpu_s())
        return self

    def __exit__(self, *exc) -> None:
        if self.orphans:
            reap_orphans(self._children_before)
        t0, cpu0, busy0 = self._start
        wall, cpu, busy = time.perf_counter() - t0, _own_cpu_s() - cpu0, _busy_cpu_s() - busy0
        self._stop.set()
        self._monitor.join()
        self.load.samples.append(os.getloadavg()[0])
        self.wall_s += wall
        self.cpu_s += cpu
        self.load.own_cpu_s += cpu
        self.load.machine_cpu_s += busy
        self.load.capacity_s += wall * (os.cpu_count() or 1)
        self.load.tick_s += ((os.cpu_count() or 1) + 1) / os.sysconf("SC_CLK_TCK")

    def _sample(self) -> None:
        while not self._stop.wait(5.0):
            self.load.samples.append(os.getloadavg()[0])

    def record(self) -> dict:
        """Plain data, for a results file: the seconds and the load (``Load.summary()``)."""
        return {"wall_s": self.wall_s, "cpu_s": self.cpu_s, "load": self.load.summary()}


def _command(preset: str, overrides: list[str], run_dir: Path) -> list[str]:
    cmd = [sys.executable, "-m", "dapo.training", str(ROOT / preset), *overrides, f"run.dir={run_dir.parent}"]
    return cmd + [f"run.name={run_dir.name}", "run.progress=false", "run.loggers=console", "run.save_every=null"]


def run_together(specs: list[tuple[str, list[str], Path]], *, threads: int | None = None) -> list[Run]:
    """Start every (preset, overrides, run directory) of ``specs`` at once and wait for all; ``threads``: torch
    threads per run (default: the cores shared out among the runs). Each run's wall and CPU seconds, and the load
    the batch saw."""
    cores = os.cpu_count() or 1
    threads = threads or max(1, cores // len(specs))
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": str(threads)}
    load = Load(own_jobs=len(specs) * threads)  # a run alone has the machine's cores
    stop = threading.Event()

    def sample():
        while not stop.wait(5.0):
            load.samples.append(os.getloadavg()[0])

    monitor = threading.Thread(target=sample, daemon=True)
    busy0, t0 = _busy_cpu_s(), time.perf_counter()
    procs = []
    for preset, overrides, run_dir in specs:
        run_dir.parent.mkdir(parents=True, exist_ok=True)
        log = open(run_dir.parent / f"{run_dir.name}.log", "w")  # noqa: SIM115 (closed below)
        cmd = _command(preset, overrides, run_dir)
        procs.append((subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT), log, cmd))
    monitor.start()
    finished = {}
    for proc, log, cmd in procs:
        _, status, usage = os.wait4(proc.pid, 0)
        finished[proc.pid] = (time.perf_counter() - t0, usage.ru_utime + usage.ru_stime)
        proc.returncode = os.waitstatus_to_exitcode(status)
        log.close()
        if proc.returncode:
            sys.exit(f"{' '.join(cmd)} failed (exit {proc.returncode}); its output: {log.name}")
    stop.set()
    monitor.join()
    load.machine_cpu_s, load.capacity_s = _busy_cpu_s() - busy0, (time.perf_counter() - t0) * cores
    load.own_cpu_s = sum(cpu for _, cpu in finished.values())
    return [
        Run(run_dir.name, read_metrics(run_dir), *finished[proc.pid], load)
        for (proc, _, _), (_, _, run_dir) in zip(procs, specs)
    ]


def run_alone(preset: str, overrides: list[str], run_dir: Path, *, threads: int | None = None) -> Run:
    """One run with the machine to itself (all its cores unless ``threads``)."""
    return run_together([(preset, overrides, run_dir)], threads=threads)[0]


def train(preset: str, overrides: list[str], run_dir: Path) -> list[dict]:
    """Train ``preset`` with ``overrides`` into ``run_dir`` (no checkpoints) in a process of its own; its metrics."""
    return run_alone(preset, overrides, run_dir).rows


def time_ratio(a: list[float], b: list[float], loads: list[dict], *, what: str = "wall") -> str:
    """``mean(a) / mean(b)`` as "1.23x", when every run behind the two sides saw no more load than its own jobs
    (``loads``: each run's ``Load.summary()``); else the reason there is no ratio."""
    return withheld(loads, f"{what} ratio") or f"{statistics.fmean(a) / max(statistics.fmean(b), 1e-12):.2f}x"


def withheld(loads: list[dict | None], what: str, *, unit: str = "runs") -> str | None:
    """Why ``what`` (a ratio of times) over the runs or sides that saw ``loads`` (each a ``Load.summary()``, None
    where it was not recorded) is no figure: one of them saw more load than its own jobs; None when every one saw
    no more."""
    busy = [load for load in loads if load is not None and not load["clean"]]
    if busy:
        worst = max(busy, key=lambda load: load["foreign_frac"])
        if len(loads) == 1:
            return f"(no {what}: it shared the machine with other work: {describe(worst)})"
        shared = f"{len(busy)} of {len(loads)} {unit} shared the machine with other work"
        return f"(no {what}: {shared}, e.g. {describe(worst)})"
    unknown = sum(load is None for load in loads)
    if unknown:
        return f"(no {what}: the load of {unknown} of {len(loads)} {unit} was not recorded)"
    return None


def generation(steps: list[dict]) -> dict:
    """What the steps' generation cost, added up over them, with their wall and CPU seconds (evaluation left out)."""

    def total(k):
        return sum(r.get(k, 0.0) for r in steps)

    return {
        "steps": len(steps),
        "tokens": total("sampling/tokens_generated"),
        "tokens_per_trained": total("sampling/tokens_generated") / max(total("sampling/tokens_trained"), 1),
        "gen_s": total("perf/time_generate_s"),
        "dropped_gen_s": total("sampling/dropped_gen_s"),
        "drawn": total("sampling/prompts_generated"),
        "informative": statistics.fmean(r["sampling/informative_frac"] for r in steps),
        "step_s": total("perf/time_step_s") - total("perf/time_eval_s"),
        "step_cpu_s": total("perf/cpu_step_s") - total("perf/cpu_eval_s"),
    }
