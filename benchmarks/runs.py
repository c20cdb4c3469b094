"""The benchmarks' training runs: each one `python -m dapo.training PRESET` in its own process, its metrics read
back, and the mean with a 95% t-interval over seeds."""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from dapo.reporting.run_log import read_metrics  # noqa: E402

T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (0 for one value)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, T975.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))


def train(preset: str, overrides: list[str], run_dir: Path) -> list[dict]:
    """Train ``preset`` with ``overrides`` into ``run_dir`` (no checkpoints) in a process of its own; its metrics."""
    cmd = [sys.executable, "-m", "dapo.training", str(ROOT / preset), *overrides, f"run.dir={run_dir.parent}"]
    cmd += [f"run.name={run_dir.name}", "run.progress=false", "run.loggers=console", "run.save_every=null"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return read_metrics(run_dir)


def generation(steps: list[dict]) -> dict:
    """What the steps' generation cost, added up over them."""

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
        "step_s": total("perf/time_step_s"),
    }
