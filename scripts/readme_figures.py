"""The figures the manual quotes about `make demo`, printed from a finished demo run, or written to its results file.

    make demo                                   # or: dapo demo
    python scripts/readme_figures.py [runs/demo]
    python scripts/readme_figures.py runs/demo --train --write benchmarks/results/demo.json

Prints the held-out accuracy before and after (with its 95% bootstrap interval), the evaluations
along the way, the median step and its phases, and the run's wall time, in the README's words.
Seeded runs repeat these exactly on one machine; another CPU or library build sums floats in
another order, and the trained figures then move by a few points (the base model's do not).

--train runs `dapo demo` into the run directory first (which must not exist yet), so that the wall time
the demo prints is measured too; --write writes the figures as JSON with the command, the date and the
commit they were measured at (tests/test_doc_figures.py checks the manual's figures against that file).
"""

from __future__ import annotations

import argparse
import re
import shlex
import statistics
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from dapo.reporting.run_log import held_out_keys, read_metrics  # noqa: E402
from measurement import fail, record, write  # noqa: E402

# its section of benchmarks/RESULTS.md (scripts/results_page.py renders the page from the results file)
PAGE = {
    "title": "The demo: `dapo demo` on 2 CPU cores",
    "group": "The demo and the Python API example",
    "measures": "The demo as a user runs it after installation: the 0.9M-parameter arithmetic model, 60 steps of 32 "
    "prompts x 8 samples; held-out avg@4 before, along the way and after (95% bootstrap intervals), the median step "
    "and its phases in seconds, and the wall time the demo prints.",
}
PHASES = ("step", "generate", "old_logprob", "update", "eval", "checkpoint")


def figures(run_dir: Path) -> dict:
    """The run's held-out evaluations, its steps' median times, its training accuracy first and last."""
    rows = read_metrics(run_dir)
    if not rows:
        fail(f"no metrics in {run_dir}: run `make demo` first (or add --train)")
    key = held_out_keys(rows)[0]
    evals = [r for r in rows if key in r]
    steps = [r for r in rows if r["step"] > 0]

    def held_out(r):
        ci = [r[key + "_ci_low"], r[key + "_ci_high"]] if key + "_ci_low" in r else None
        return {"step": r["step"], "avg": r[key], "ci": ci}

    return {
        "metric": key,
        "before": held_out(evals[0]),
        "after": held_out(evals[-1]),
        "evaluations": [held_out(r) for r in evals],
        "steps": len(steps),
        "median_s": {p: statistics.median(r.get(f"perf/time_{p}_s", 0.0) for r in steps) for p in PHASES},
        "steps_s": sum(r["perf/time_step_s"] for r in steps),
        "train_acc_first": steps[0]["rollout/acc_mean"],
        "train_acc_last": steps[-1]["rollout/acc_mean"],
    }


def show(fig: dict) -> None:
    def pct(e):
        ci = f" [{100 * e['ci'][0]:.1f}, {100 * e['ci'][1]:.1f}]" if e["ci"] else ""
        return f"{100 * e['avg']:.1f}%{ci}"

    before, after, med = fig["before"], fig["after"], fig["median_s"]
    print(f"{fig['metric']}: {pct(before)} at step {before['step']} -> {pct(after)} at step {after['step']}")
    print("along the way: " + ", ".join(f"step {e['step']} {100 * e['avg']:.1f}%" for e in fig["evaluations"][1:]))
    print(
        f"{fig['steps']} steps, median {med['step']:.2f} s (generation {med['generate']:.2f} s, log-probs "
        f"{med['old_logprob']:.2f} s, update {med['update']:.2f} s); {fig['steps_s']:.0f} s of steps with their "
        "evaluations and checkpoints"
    )
    print(
        f"training accuracy (rollout/acc_mean) first and last step: {fig['train_acc_first']:.3f} -> "
        f"{fig['train_acc_last']:.3f}"
    )
    if "wall_s" in fig:
        print(f"wall time: {fig['wall_s']:.0f} s")


def train_demo(run_dir: Path) -> tuple[list[str], float]:
    """Run `dapo demo` into ``run_dir``, its console passed through; the command and the wall time it printed."""
    if run_dir.exists():
        fail(f"{run_dir} exists: delete it, or name another run directory, to measure a fresh run")
    command = ["dapo", "demo"]
    if run_dir != Path("runs/demo"):
        command += [f"run.dir={run_dir.parent}", f"run.name={run_dir.name}"]
    proc = subprocess.Popen([sys.executable, "-m", "dapo.cli", *command[1:]], stdout=subprocess.PIPE, text=True)
    printed = []
    for line in proc.stdout:
        print(line, end="", flush=True)
        printed.append(line.rstrip("\n"))
    if proc.wait() != 0:
        fail(f"`{shlex.join(command)}` failed with exit code {proc.returncode}")
    walls = [float(m[1]) for line in printed if (m := re.fullmatch(r"wall time: (\d+) s", line))]
    if not walls:
        fail(f"`{shlex.join(command)}` printed no 'wall time: N s' line")
    return command, walls[-1]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dir", nargs="?", default="runs/demo", type=Path)
    ap.add_argument("--train", action="store_true", help="run `dapo demo` into RUN_DIR first (it must not exist)")
    ap.add_argument("--write", type=Path, help="write the figures, command, date and commit to this JSON file")
    args = ap.parse_args(argv)
    command, wall_s = train_demo(args.run_dir) if args.train else (None, None)
    fig = figures(args.run_dir)
    if wall_s is not None:
        fig["wall_s"] = wall_s
    show(fig)
    if args.write:
        if command is None:  # a run measured earlier: its date is its metrics' last write
            command = ["dapo", "demo"] if args.run_dir == Path("runs/demo") else None
        run = shlex.join(command) if command else f"the run in {args.run_dir} (its settings: config.yaml there)"
        metrics = args.run_dir / "metrics.jsonl"
        written_by = shlex.join(["python", "scripts/readme_figures.py", *(argv or sys.argv[1:])])
        when = datetime.fromtimestamp(metrics.stat().st_mtime, timezone.utc)
        write(args.write, record(run, written_by, fig, measured_at=when, **PAGE))


if __name__ == "__main__":
    main()
