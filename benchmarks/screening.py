"""What two-phase screening (`algo.screen_samples`) saves: dynamic sampling alone against screening
on the demo's task with 600 training problems, 100 steps.

    python benchmarks/screening.py                                   # every side, 5 seeds, 100 steps (hours on 2 cores)
    python benchmarks/screening.py --sides ds,screen_G/2 --seeds 2   # a subset
    python benchmarks/screening.py --seeds 1 --steps 4 --eval-every 2 --sides ds,screen_G/4   # a smoke run

Each run is `python -m dapo.training configs/demo.yaml` in its own process (benchmarks/runs.py), the
sides alternating seed by seed (seed k sets data, rollout and train seeds). Per run, from metrics.jsonl: generated
tokens per trained token; the held-out curve (avg@n every --eval-every steps) against the tokens generated and the
step seconds (evaluation excluded) spent until each evaluation. The target is dynamic sampling's final held-out
accuracy (the mean over its seeds): per side, the generated tokens and the step seconds until a run first reaches
it, the final held-out accuracy with its 95% CI, and the ratios against dynamic sampling. With --plot, held-out
accuracy against generated tokens, one curve per side (the mean over seeds at each evaluation).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from runs import generation, mean_ci, train  # noqa: E402

from dapo.reporting.run_log import held_out_keys, read_metrics  # noqa: E402

SIDES = {  # the demo's G is 8
    "ds": [],
    "screen_G/2": ["algo.screen_samples=4"],
    "screen_G/4": ["algo.screen_samples=2"],
    "ds_G16": ["rollout.group_size=16"],
    "screen_G16/4": ["rollout.group_size=16", "algo.screen_samples=4"],
}
# what screening's drops cost in signal: a quarter of the prompts screened out are completed anyway (never trained
# on) to see whether the whole group would have been informative; their tokens are extra, so these runs say why,
# not what screening costs (--sides audit_G/2,audit_G/4)
AUDIT_SIDES = {
    "audit_G/2": ["algo.screen_samples=4", "algo.screen_audit=0.25"],
    "audit_G/4": ["algo.screen_samples=2", "algo.screen_audit=0.25"],
}


def curve(rows: list[dict]) -> list[tuple[int, float, float, float]]:
    """(step, generated tokens, step seconds without evaluation, held-out accuracy) at each evaluation."""
    key = held_out_keys(rows)[0]
    tokens = seconds = 0.0
    out = []
    for r in sorted(rows, key=lambda r: r.get("step", 0)):
        tokens += r.get("sampling/tokens_generated", 0.0)
        seconds += r.get("perf/time_step_s", 0.0) - r.get("perf/time_eval_s", 0.0)
        if key in r:
            out.append((r["step"], tokens, seconds, r[key]))
    return out


def screening(steps: list[dict]) -> dict:
    """Prompts screened and screened out over the run (0 without screening)."""

    def total(k):
        return sum(r.get(k, 0.0) for r in steps)

    return {
        "screened": total("sampling/screened"),
        "out_correct": total("sampling/screened_out_all_correct"),
        "out_wrong": total("sampling/screened_out_all_wrong"),
        "screened_out_tokens": total("sampling/screened_out_tokens"),
        "audited": total("sampling/screen_audited"),
        "audit_informative": total("sampling/screen_audit_informative"),
    }


def to_target(points: list, target: float) -> tuple[float, float] | None:
    """Tokens and seconds until the curve first reaches ``target``; None if it never does."""
    return next(((tok, sec) for _, tok, sec, acc in points if acc >= target), None)


def report(results: dict[str, list[dict]]) -> None:
    base = results.get("ds")
    target = statistics.fmean(r["curve"][-1][3] for r in base) if base else None
    print(
        f"\ntarget: dynamic sampling's final held-out accuracy {target:.3f}" if target else "\n(no ds side: no target)"
    )
    means = {}
    for side, runs in results.items():
        finals = [r["curve"][-1][3] for r in runs]
        m, h = mean_ci(finals)
        reached = [x for x in (to_target(r["curve"], target) for r in runs) if x] if target else []
        cells = {
            "tokens/trained": statistics.fmean(r["tokens_per_trained"] for r in runs),
            "tokens to target": statistics.fmean(t for t, _ in reached) if reached else None,
            "seconds to target": statistics.fmean(s for _, s in reached) if reached else None,
        }
        means[side] = cells
        shown = "  ".join(f"{k} {v:,.3g}" if v is not None else f"{k} -" for k, v in cells.items())
        print(f"  {side:<22} {shown}  reached {len(reached)}/{len(runs)}  final {m:.3f} [{m - h:.3f}, {m + h:.3f}]")
        print("    per seed final " + ", ".join(f"{x:.3f}" for x in finals))
    if "ds" in means:
        for side, cells in means.items():
            if side == "ds":
                continue
            ratios = [
                f"{k} {means['ds'][k] / v:.2f}x fewer" for k, v in cells.items() if v and means["ds"][k] is not None
            ]
            print(f"  {side} against ds: " + ", ".join(ratios))


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for side, runs in results.items():
        n = min(len(r["curve"]) for r in runs)
        tokens = [statistics.fmean(r["curve"][i][1] for r in runs) for i in range(n)]
        acc = [statistics.fmean(r["curve"][i][3] for r in runs) for i in range(n)]
        ax.plot(tokens, acc, marker="o", ms=3, label=side)
    ax.set_xlabel("generated tokens")
    ax.set_ylabel("held-out accuracy (mean over seeds)")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"plot: {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--train-size", type=int, default=600)
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--jobs", type=int, default=1, help="runs at a time (each its own process)")
    ap.add_argument("--sides", default=",".join(SIDES), help=f"a subset of {', '.join(SIDES | AUDIT_SIDES)}")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench_screening"))
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="a .png: held-out accuracy against generated tokens per side")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    sides = args.sides.split(",")
    base = [f"train.total_steps={args.steps}", f"data.task_train_size={args.train_size}"]
    base += [f"eval.every_steps={args.eval_every}", "eval.before_train=true"]
    print(f"configs/demo.yaml {' '.join(base + args.overrides)}", flush=True)
    order = [(seed, side) for seed in range(args.seeds) for side in (sides if seed % 2 == 0 else sides[::-1])]
    run_dirs = {key: Path(args.out) / key[1].replace("/", "_") / f"seed{key[0]}" for key in order}

    def run(key: tuple[int, str]) -> list[dict]:
        seed, side = key
        run_dir = run_dirs[key]
        seeded = [f"data.seed={seed}", f"rollout.seed={seed}", f"train.seed={seed}"]
        rows = read_metrics(run_dir) if (run_dir / "metrics.jsonl").exists() else []
        if max((r.get("step", 0) for r in rows), default=0) < args.steps:  # a finished run is read back
            rows = train("configs/demo.yaml", base + seeded + (SIDES | AUDIT_SIDES)[side] + args.overrides, run_dir)
        return rows

    results: dict[str, list[dict]] = {side: [] for side in sides}
    with ThreadPoolExecutor(args.jobs) as pool:  # each run is its own process; --jobs of them share the machine
        for (seed, side), rows in zip(order, pool.map(run, order)):
            steps = [r for r in rows if "sampling/tokens_generated" in r]
            r = generation(steps) | screening(steps) | {"seed": seed, "curve": curve(rows)}
            r.pop("record", None)
            results[side].append(r)
            print(
                f"  seed {seed} {side:<22} tokens/trained {r['tokens_per_trained']:.2f}  tokens {r['tokens']:,.0f}  "
                f"held-out {r['curve'][0][3]:.3f} -> {r['curve'][-1][3]:.3f}  step s {r['step_s']:.0f}"
                + (
                    f"  screened {r['screened']:.0f}: out {r['out_correct']:.0f} correct, {r['out_wrong']:.0f} wrong"
                    if r["screened"]
                    else ""
                )
                + (
                    f"  audited {r['audited']:.0f}, informative as a group of G: {r['audit_informative']:.0f} "
                    f"({r['audit_informative'] / r['audited']:.1%})"
                    if r["audited"]
                    else ""
                ),
                flush=True,
            )
    report(results)
    if args.plot:
        plot(results, Path(args.plot))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
