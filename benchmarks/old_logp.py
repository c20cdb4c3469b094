"""What the old log-probs' settings save on a real-model step: a pass over every row (recompute, the reference)
against `algo.old_logp_from_update` (the first update's rows from its own forward) and `algo.old_logp_source=engine`.

    python benchmarks/old_logp.py [--runs 3] [--steps 2]      # make smollm2 first; about 25 minutes on 2 idle cores

Each run is `python -m dapo.training configs/smollm2_135m.yaml` in its own process (the same point
as benchmarks/scaling.py: 8 prompts x G=8, <= 96 tokens, 2 optimizer updates, dynamic sampling off,
vLLM rollout in float32, no evaluation), once per setting, the settings alternating run by run.
From the last step's metrics: the old-log-prob pass, the update and the whole step (wall), and the
child process's CPU time over the whole run (start-up included, so only differences between settings
mean something), and the step's CPU seconds (the trainer process's). Printed: medians over runs, and each
setting's saving against recompute, only where no run behind it saw more load than its own (benchmarks/runs.py's
Meter, the machine's cores its own jobs); otherwise a line says why.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runs import describe, withheld  # noqa: E402
from scaling import BASE, MODEL, run_point  # noqa: E402

# each setting's overrides of the preset (which turns algo.old_logp_from_update on)
SETTINGS = {
    "recompute": ("algo.old_logp_source=recompute", "algo.old_logp_from_update=false"),
    "from_update": ("algo.old_logp_source=recompute", "algo.old_logp_from_update=true"),
    "engine": ("algo.old_logp_source=engine", "algo.old_logp_from_update=false"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="steps per run; the last is reported")
    args = ap.parse_args()
    if not (MODEL / "config.json").exists():
        sys.exit(f"needs {MODEL}: run `make smollm2` once")
    res: dict[str, list[dict]] = {s: [] for s in SETTINGS}
    loads: list[dict] = []  # every run's: a saving compares them all
    for run in range(args.runs):
        for setting in list(SETTINGS) if run % 2 == 0 else list(SETTINGS)[::-1]:
            out = run_point(BASE, args.steps, extra=SETTINGS[setting])
            r = out["row"]
            res[setting].append(
                {
                    "old": r.get("perf/time_old_logprob_s", 0.0),
                    "update": r["perf/time_update_s"],
                    "step": r["perf/time_step_s"] - r.get("perf/time_checkpoint_s", 0.0),
                    "step_cpu": r.get("perf/cpu_step_s", float("nan")) - r.get("perf/cpu_checkpoint_s", 0.0),
                    "cpu": out["cpu_s"],
                    "entropy": r.get("actor/entropy", float("nan")),
                }
            )
            loads.append(out["load"])
            x = res[setting][-1]
            print(
                f"run {run + 1} {setting:12s} old log-probs {x['old']:5.1f} s  update {x['update']:5.1f} s  "
                f"step {x['step']:5.1f} s ({x['step_cpu']:.1f} CPU s)  process CPU {x['cpu']:6.1f} s  "
                f"({describe(out['load'])})",
                flush=True,
            )
    med = {s: {k: statistics.median(x[k] for x in rs) for k in rs[0]} for s, rs in res.items()}
    reason = withheld(loads, "saving")
    base = med["recompute"]
    print(f"\nmedian of {args.runs} runs (last of {args.steps} steps)")
    print(
        f"{'setting':12s} {'old logp s':>10s} {'update s':>9s} {'step s':>7s} {'CPU s/run':>9s}  "
        "saving per step vs recompute"
    )
    for s, m in med.items():
        print(
            f"{s:12s} {m['old']:10.1f} {m['update']:9.1f} {m['step']:7.1f} {m['cpu']:9.1f}  "
            + (
                "-"
                if reason
                else f"{base['step'] - m['step']:+.1f} s ({100 * (base['step'] - m['step']) / base['step']:+.0f}%), "
                f"CPU {base['cpu'] - m['cpu']:+.0f} s per run"
            )
        )
    if reason:
        print(reason)


if __name__ == "__main__":
    main()
