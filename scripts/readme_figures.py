"""The figures the README quotes about `make demo`, printed from a finished demo run.

    make demo                                   # or: dapo demo
    python scripts/readme_figures.py [runs/demo]

Prints the held-out accuracy before and after (with its 95% bootstrap interval), the evaluations
along the way, the median step and its phases, and the run's wall time, in the README's words.
Seeded runs repeat these exactly on one machine; another CPU or library build sums floats in
another order, and the trained figures then move by a few points (the base model's do not).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dapo.reporting.run_log import held_out_keys, read_metrics  # noqa: E402


def main(run_dir: str = "runs/demo") -> None:
    rows = read_metrics(run_dir)
    if not rows:
        sys.exit(f"no metrics in {run_dir}: run `make demo` first")
    key = held_out_keys(rows)[0]
    evals = [r for r in rows if key in r]
    steps = [r for r in rows if r["step"] > 0]

    def pct(r):
        ci = f" [{100 * r[key + '_ci_low']:.1f}, {100 * r[key + '_ci_high']:.1f}]" if key + "_ci_low" in r else ""
        return f"{100 * r[key]:.1f}%{ci}"

    med = {
        p: statistics.median(r.get(f"perf/time_{p}_s", 0.0) for r in steps)
        for p in ("step", "generate", "old_logprob", "update", "eval", "checkpoint")
    }
    train_s = sum(r["perf/time_step_s"] for r in steps)
    print(f"{key}: {pct(evals[0])} at step {evals[0]['step']} -> {pct(evals[-1])} at step {evals[-1]['step']}")
    print("along the way: " + ", ".join(f"step {r['step']} {100 * r[key]:.1f}%" for r in evals[1:]))
    print(
        f"{len(steps)} steps, median {med['step']:.2f} s (generation {med['generate']:.2f} s, log-probs "
        f"{med['old_logprob']:.2f} s, update {med['update']:.2f} s); {train_s:.0f} s of steps with their evaluations "
        f"and checkpoints"
    )
    print(
        f"training accuracy (rollout/acc_mean) first and last step: {steps[0]['rollout/acc_mean']:.3f} -> "
        f"{steps[-1]['rollout/acc_mean']:.3f}"
    )


if __name__ == "__main__":
    main(*sys.argv[1:])
