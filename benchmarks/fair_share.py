"""A fair share on a shared machine: a training step's CPU and wall seconds alone, and beside busy processes.

    python benchmarks/fair_share.py                                   # the demo and SmolLM2, this checkout
    python benchmarks/fair_share.py --before-src /tmp/old/src         # ... and an older checkout's src/ beside it
    python benchmarks/fair_share.py --settings demo:3 --spins 2000,5000,300000   # libgomp's spin counts compared

Settings: ``demo`` (configs/demo.yaml, 10 steps, HF generate) and ``smollm2`` (configs/smollm2_135m.yaml, 1 step,
vLLM; needs `make smollm2`). Each run is a process of its own with no thread settings in its environment (what a user
gets), alone on the machine or beside ``--busy`` processes that spin on the CPU (other jobs on a shared machine).
Per run: the trainer process's CPU seconds and wall seconds per step from its metrics (perf/cpu_step_s,
perf/time_step_s; the first step, which warms caches up, left out where there are more), and the run's CPU seconds
in all (its process and those it started). The figure a shared machine should leave alone is the CPU seconds a step
costs: busy / alone is printed per code side. Runs alternate (a repeat runs every side once, alone then busy), on an
otherwise idle machine: the load each run saw is recorded, and a repeat whose alone runs shared the machine with
other work is marked.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from dapo.reporting.run_log import read_metrics  # noqa: E402
from runs import Load, _busy_cpu_s, machine  # noqa: E402

SMOLLM2 = Path.home() / ".cache/dapo/models/SmolLM2-135M-Instruct"
SETTINGS = {
    "demo": ("configs/demo.yaml", ["train.total_steps=10", "eval.benchmarks=[]"]),
    "smollm2": ("configs/smollm2_135m.yaml", [f"model.path={SMOLLM2}", "train.total_steps=1", "eval.benchmarks=[]"]),
}


def run(setting: str, src: Path, busy: int, out: Path, spin: str | None = None) -> dict:
    """One run of ``setting`` with the code in ``src``, beside ``busy`` spinning processes: per-step seconds.
    ``spin``: libgomp's rounds of spinning before a waiting thread sleeps (GOMP_SPINCOUNT), else the code's own."""
    preset, overrides = SETTINGS[setting]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "MKL_", "GOMP_", "KMP_"))}
    env["PYTHONPATH"] = str(src)
    if spin is not None:
        env["GOMP_SPINCOUNT"] = spin
    cmd = [sys.executable, "-m", "dapo.training", str(ROOT / preset), *overrides, f"run.dir={out.parent}"]
    cmd += [f"run.name={out.name}", "run.progress=false", "run.loggers=console", "run.save_every=null"]
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    load, t0, busy0 = Load(own_jobs=busy + 2), time.perf_counter(), _busy_cpu_s()
    done = threading.Event()

    def sample():
        while not done.wait(2.0):
            load.samples.append(os.getloadavg()[0])

    monitor = threading.Thread(target=sample, daemon=True)
    monitor.start()
    try:
        with open(out.parent / f"{out.name}.log", "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(proc.pid, 0)
    finally:
        done.set()
        for p in spinners:
            p.kill()
            p.wait()
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"{' '.join(cmd)} failed; its output: {out.parent / f'{out.name}.log'}")
    wall = time.perf_counter() - t0
    load.machine_cpu_s, load.capacity_s = _busy_cpu_s() - busy0, wall * (os.cpu_count() or 1)
    steps = [r for r in read_metrics(out) if "perf/cpu_step_s" in r]
    steps = steps[1:] if len(steps) > 1 else steps
    return {
        "cpu_s_per_step": statistics.fmean(r["perf/cpu_step_s"] for r in steps),
        "wall_s_per_step": statistics.fmean(r["perf/time_step_s"] for r in steps),
        "steps": len(steps),
        "run_cpu_s": usage.ru_utime + usage.ru_stime,  # the whole run: its process and those it started
        "run_wall_s": wall,
        "load_average": load.mean,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default="demo:2,smollm2:1", help="SETTING:REPEATS,...")
    p.add_argument("--busy", type=int, default=2, help="spinning processes beside a shared run")
    p.add_argument("--before-src", type=Path, help="an older checkout's src/, measured beside this one")
    p.add_argument(
        "--spins", default="", help="GOMP_SPINCOUNT values, each a side of this checkout (300000: libgomp's)"
    )
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    sides = {"after": (ROOT / "src", None), **({"before": (args.before_src, None)} if args.before_src else {})}
    sides |= {f"spin {n}": (ROOT / "src", n) for n in filter(None, args.spins.split(","))}
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        for setting, _, repeats in (s.partition(":") for s in args.settings.split(",")):
            for k in range(int(repeats or 1)):
                for side, (src, spin) in sides.items():
                    for busy in (0, args.busy):
                        name = f"{setting}-{side.replace(' ', '')}-{'busy' if busy else 'alone'}-{k}"
                        out = run(setting, src, busy, Path(tmp) / name, spin)
                        results.setdefault(setting, {}).setdefault(side, {}).setdefault(busy, []).append(out)
                        print(f"{name}: {out}", flush=True)
    figures = {}
    for setting, by_side in results.items():
        for side, by_busy in by_side.items():
            alone, shared = (statistics.fmean(r["cpu_s_per_step"] for r in by_busy[b]) for b in (0, args.busy))
            walls = [statistics.fmean(r["wall_s_per_step"] for r in by_busy[b]) for b in (0, args.busy)]
            row = f"{setting}, {side}: CPU s/step alone {alone:.2f}, beside {args.busy} busy {shared:.2f} "
            row += f"({shared / alone:.2f}x); wall s/step {walls[0]:.2f} / {walls[1]:.2f}"
            print(row)
            figures[f"{setting}, {side}"] = {
                "CPU s/step alone": round(alone, 2),
                f"CPU s/step beside {args.busy} busy": round(shared, 2),
                "CPU ratio": round(shared / alone, 2),
                "wall s/step alone": round(walls[0], 2),
                f"wall s/step beside {args.busy} busy": round(walls[1], 2),
            }
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        loads = [r["load_average"] for s in results.values() for b in s.values() for r in b[0]]
        record = {
            "title": "A fair share on a shared machine",
            "group": "A training step on the CPU",
            "measures": "CPU and wall seconds per training step, alone and beside busy processes that spin on the "
            "cores, each run with no thread settings in its environment.",
            "command": "python " + " ".join(sys.argv),
            "written_by": "python " + " ".join(sys.argv),
            "date": date.today().isoformat(),
            "commit": commit,
            "machine": machine(),
            "load": "one run at a time on an otherwise idle machine; the busy runs beside their own spinning processes "
            f"(the 1-minute load average, which lags, read up to {max(loads):.2f} in runs alone)",
            "figures": figures,
            "runs": results,
        }
        args.json.write_text(json.dumps(record, indent=2) + "\n")


if __name__ == "__main__":
    main()
