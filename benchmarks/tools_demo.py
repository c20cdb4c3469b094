"""The demo with the Python tool against the text-only demo, at the same steps: held-out accuracy and tool use.

    python benchmarks/tools_demo.py                    # 5 seeds a side, 60 steps: about 45 minutes on 2 cores
    python benchmarks/tools_demo.py --seeds 2 --steps 20
    python benchmarks/tools_demo.py --control          # also the tool demo's base model with tools.python=false

Each run is `python -m dapo.training <preset>` in its own process, the sides alternating seed by seed (seed k sets
data.seed, rollout.seed and train.seed). Held-out: the demo's 200 arithmetic problems, avg@4, before training and
every --eval-every steps. Per run: held-out accuracy before and after, and for the tool side the share of held-out
responses that ran code and the share that ran code and ended right (eval/arith/tool_call_frac, tool_helped_frac),
before and after. Printed: every run (with its wall and process CPU seconds and the load it saw, measured from
outside by benchmarks/runs.py), then each side's mean with a 95% t-interval over seeds, and the difference of the
final accuracies (tool - text) and of the gains over each side's own base model, with paired 95% t-intervals.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent))
from runs import describe, machine, mean_ci, run_alone  # noqa: E402

SIDES = {"text-only demo": ("configs/demo.yaml", []), "with the tool": ("configs/demo_tools.yaml", [])}
CONTROL = {"tool base, no tool": ("configs/demo_tools.yaml", ["tools.python=false"])}
KEYS = ("avg@4", "tool_call_frac", "tool_helped_frac", "acc_with_tool_call")


def summarise(rows: list[dict]) -> dict:
    evals = [r for r in rows if "eval/arith/avg@4" in r]
    first, last = evals[0], evals[-1]
    out = {"first_step": first["step"], "last_step": last["step"]}
    for k in KEYS:
        if f"eval/arith/{k}" in last:
            out[f"{k}_before"], out[f"{k}_after"] = first.get(f"eval/arith/{k}", 0.0), last[f"eval/arith/{k}"]
    steps = [r for r in rows if "perf/time_step_s" in r]
    out["step_s"] = sum(r["perf/time_step_s"] - r.get("perf/time_eval_s", 0.0) for r in steps)
    if any("tools/calls_per_response" in r for r in steps):
        out["train_calls_per_response"] = statistics.fmean(r.get("tools/calls_per_response", 0.0) for r in steps)
    return out


def line(r: dict) -> str:
    s = f"held-out {r['avg@4_before']:.3f} -> {r['avg@4_after']:.3f}"
    if "tool_call_frac_after" in r:
        s += (
            f"  called the tool {r['tool_call_frac_before']:.3f} -> {r['tool_call_frac_after']:.3f}"
            f"  called and right {r['tool_helped_frac_before']:.3f} -> {r['tool_helped_frac_after']:.3f}"
            f"  right when called {r.get('acc_with_tool_call_before', 0):.3f}"
            f" -> {r.get('acc_with_tool_call_after', 0):.3f}"
        )
    return s + f"  steps {r['step_s']:.0f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--control", action="store_true", help="also the tool base model without the tool")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench_tools_demo"))
    ap.add_argument("--json", default=None, help="also write every figure here")
    args = ap.parse_args()
    sides = SIDES | (CONTROL if args.control else {})
    base = [f"train.total_steps={args.steps}", f"eval.every_steps={args.eval_every}", "eval.before_train=true"]
    print(f"{' '.join(base)}; sides: {', '.join(sides)}", flush=True)
    results: dict[str, list[dict]] = {side: [] for side in sides}
    for seed in range(args.seeds):
        order = list(sides) if seed % 2 == 0 else list(sides)[::-1]
        for side in order:
            preset, extra = sides[side]
            seeds = [f"data.seed={seed}", f"rollout.seed={seed}", f"train.seed={seed}"]
            run_dir = Path(args.out) / side.replace(" ", "_").replace(",", "") / f"seed{seed}"
            run = run_alone(preset, base + seeds + extra, run_dir)
            r = summarise(run.rows) | {"seed": seed, "wall_s": run.wall_s, "cpu_s": run.cpu_s}
            r["load"] = run.load.summary()
            results[side].append(r)
            print(
                f"  seed {seed} {side:<18} {line(r)}  ({r['wall_s']:.0f} s, {r['cpu_s']:.0f} CPU s; "
                f"{describe(r['load'])})",
                flush=True,
            )
    print("\nmean [95% CI] over seeds")
    for side, runs in results.items():
        cells = []
        for k in [f"{k}_{when}" for k in KEYS for when in ("before", "after")] + ["step_s"]:
            xs = [r[k] for r in runs if k in r]
            if xs:
                m, h = mean_ci(xs)
                cells.append(f"{k} {m:.3f} [{m - h:.3f}, {m + h:.3f}]")
        print(f"  {side:<18} " + "  ".join(cells))
    a, b = results["text-only demo"], results["with the tool"]
    diff = [y["avg@4_after"] - x["avg@4_after"] for x, y in zip(a, b)]
    m, h = mean_ci(diff)
    print(f"  final held-out, tool - text (paired by seed): {m:+.3f} [{m - h:+.3f}, {m + h:+.3f}]")
    gain = [(y["avg@4_after"] - y["avg@4_before"]) - (x["avg@4_after"] - x["avg@4_before"]) for x, y in zip(a, b)]
    m, h = mean_ci(gain)  # the two sides start from different base models: what each added, compared
    print(f"  gain over its own base, tool - text (paired by seed): {m:+.3f} [{m - h:+.3f}, {m + h:+.3f}]")
    if args.json:
        Path(args.json).write_text(json.dumps(results | {"machine": machine()}, indent=1))


if __name__ == "__main__":
    main()
