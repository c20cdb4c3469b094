"""What screening costs and saves, priced under equal load: dynamic sampling alone against two-phase screening
(`algo.screen_samples`), on three settings.

    python benchmarks/screening.py                                    # every setting, 5 seeds a side (hours)
    python benchmarks/screening.py --settings multipass --seeds 2     # a subset
    python benchmarks/screening.py --settings demo600 --smoke         # 2 seeds, a few steps: the script itself

Settings (each side with the same seeds: seed k sets data, rollout and train seeds):
  demo600    the demo (configs/demo.yaml, G = 8) on 600 training problems for 100 steps, held-out every 10
  multipass  the demo on 128 training problems for 60 steps: each problem drawn 15 times or more
  smollm2    SmolLM2-135M-Instruct on its word problems (configs/smollm2_135m.yaml, vLLM, G = 8) for 4 steps,
             held-out (60 problems, 2 samples) every 2; needs `make smollm2`

A seed's sides run together, one core each on 2 cores shared by three (matched: they see the same load), in
processes of their own. Per run, from its metrics: generated tokens per trained token; wall and CPU seconds per
step (evaluation left out; CPU seconds are the trainer process's); the held-out curve against steps, generated
tokens and CPU seconds. Per side: means with 95% t-intervals over seeds, held-out accuracy at equal steps (the
last evaluation) and at equal generated tokens (each curve read at the fewest tokens any run of the setting
generated), generated tokens and CPU seconds until a run first reaches dynamic sampling's final accuracy, and the
ratios against dynamic sampling. A ratio of wall times is printed only where no run behind it shared the machine
with other work (benchmarks/runs.py says why otherwise). --json writes everything, every seed and the load each
batch saw; --markdown the tables (as in benchmarks/results/screening/). A seed whose sides all finished before (the same
commands; benchmark_summary.json in each run) is kept, so an interrupted benchmark resumes at its first unfinished
seed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from dapo.reporting.run_log import held_out_keys  # noqa: E402
from runs import generation, machine, mean_ci, run_together, time_ratio, withheld  # noqa: E402

SETTINGS = {
    "demo600": (
        "configs/demo.yaml",
        ["data.task_train_size=600", "train.total_steps=100", "eval.every_steps=10"],
    ),
    "multipass": (
        "configs/demo.yaml",
        ["data.task_train_size=128", "train.total_steps=60", "eval.every_steps=10"],
    ),
    "smollm2": (
        "configs/smollm2_135m.yaml",
        ["train.total_steps=4", "eval.every_steps=2", "eval.num_problems=60", "eval.n=2", "rollout.backend=vllm",
         "run.async_checkpoint=false"],
    ),
}  # fmt: skip
SIDES = {
    "ds": [],
    "screen": ["algo.screen_samples=4"],  # n = G/2
}
SMOKE = ["train.total_steps=4", "eval.every_steps=2", "eval.num_problems=20", "eval.n=2"]
# the bar a sampling rule must clear to be kept (beside dynamic sampling, on a setting)
FEWER = 1.3  # times fewer generated tokens and CPU seconds to dynamic sampling's final held-out accuracy
POINTS_BELOW = 1.0  # at most this many points below dynamic sampling's final accuracy at equal steps


def curve(rows: list[dict]) -> list[dict]:
    """The held-out accuracy at each evaluation, with the generated tokens and the step seconds (wall and CPU,
    evaluation left out) spent until then."""
    key = held_out_keys(rows)[0]
    tokens = wall = cpu = 0.0
    out = []
    for r in sorted(rows, key=lambda r: r.get("step", 0)):
        tokens += r.get("sampling/tokens_generated", 0.0)
        wall += r.get("perf/time_step_s", 0.0) - r.get("perf/time_eval_s", 0.0)
        cpu += r.get("perf/cpu_step_s", 0.0) - r.get("perf/cpu_eval_s", 0.0)
        if key in r:
            out.append({"step": r["step"], "tokens": tokens, "wall_s": wall, "cpu_s": cpu, "acc": r[key]})
    return out


def at_tokens(points: list[dict], budget: float) -> float:
    """The curve's accuracy at ``budget`` generated tokens, linear between evaluations."""
    for a, b in zip(points, points[1:]):
        if a["tokens"] <= budget <= b["tokens"]:
            w = (budget - a["tokens"]) / max(b["tokens"] - a["tokens"], 1e-9)
            return a["acc"] + w * (b["acc"] - a["acc"])
    return points[-1]["acc"]


def to_target(points: list[dict], target: float) -> dict | None:
    """The first evaluation at or above ``target`` (its tokens and seconds), or None."""
    return next((p for p in points if p["acc"] >= target), None)


def summarise(run) -> dict:
    steps = [r for r in run.rows if "sampling/tokens_generated" in r]
    g = generation(steps)
    return g | {
        "wall_s_per_step": g["step_s"] / max(g["steps"], 1),
        "cpu_s_per_step": g["step_cpu_s"] / max(g["steps"], 1),
        "run_wall_s": run.wall_s,
        "run_cpu_s": run.cpu_s,
        "load": run.load.summary(),
        "screened": sum(r.get("sampling/screened", 0) for r in steps),
        "curve": curve(run.rows),
    }  # fmt: skip


SUMMARY = "benchmark_summary.json"


def finished(spec: tuple[str, list[str], Path]) -> dict | None:
    """A run of the same command that finished earlier: its figures (with the load it saw), else None."""
    path = spec[2] / SUMMARY
    if not path.exists():
        return None
    r = json.loads(path.read_text())
    return r if r.pop("command") == [spec[0], spec[1]] else None


def run_setting(name: str, args) -> dict[str, list[dict]]:
    preset, base = SETTINGS[name]
    base = base + (SMOKE if args.smoke else []) + args.overrides
    sides = args.sides.split(",")
    out = Path(args.out) / name
    results: dict[str, list[dict]] = {side: [] for side in sides}
    print(f"== {name}: {preset} {' '.join(base)}", flush=True)
    for seed in range(args.seeds):
        seeded = [f"data.seed={seed}", f"rollout.seed={seed}", f"train.seed={seed}"]
        specs = [(preset, base + seeded + SIDES[side], out / side / f"seed{seed}") for side in sides]
        kept = [finished(spec) for spec in specs]
        if all(kept):  # an interrupted benchmark resumes at its first unfinished seed
            for side, r in zip(sides, kept):
                results[side].append(r)
                print(f"  seed {seed} {side:<7} kept from {out / side / f'seed{seed}'}", flush=True)
            continue
        for spec in specs:  # a seed cut short starts again from nothing
            shutil.rmtree(spec[2], ignore_errors=True)
        for side, run, spec in zip(sides, run_together(specs, threads=1), specs):
            r = summarise(run) | {"seed": seed}
            (spec[2] / SUMMARY).write_text(json.dumps(r | {"command": spec[:2]}))
            results[side].append(r)
            c = r["curve"]
            print(
                f"  seed {seed} {side:<7} tokens/trained {r['tokens_per_trained']:.2f}  wall {r['wall_s_per_step']:.2f}"
                f" s/step  CPU {r['cpu_s_per_step']:.2f} s/step  held-out {c[0]['acc']:.3f} -> {c[-1]['acc']:.3f}"
                f"  ({run.load.describe()})",
                flush=True,
            )
    return results


def report(name: str, results: dict[str, list[dict]]) -> list[str]:
    """The setting's table (Markdown) and the verdict on each rule against dynamic sampling."""
    ds = results["ds"]
    target = statistics.fmean(r["curve"][-1]["acc"] for r in ds)
    budget = min(r["curve"][-1]["tokens"] for rs in results.values() for r in rs)

    def ci(xs, scale=1.0, spec=".2f"):
        m, h = mean_ci([x * scale for x in xs])
        return f"{m:{spec}} ± {h:{spec}}"

    lines = [
        f"**{name}**: target (dynamic sampling's final held-out accuracy) {100 * target:.1f}%; equal-token budget "
        f"{budget:,.0f} generated tokens",
        "",
        "| side | tokens per trained token | wall s / step | CPU s / step | held-out at equal steps (%) | "
        "held-out at equal tokens (%) | reached target | tokens to target | CPU s to target |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    verdicts = []
    for side, rs in results.items():
        reached = [p for p in (to_target(r["curve"], target) for r in rs) if p]
        row = [
            side,
            ci([r["tokens_per_trained"] for r in rs]),
            ci([r["wall_s_per_step"] for r in rs]),
            ci([r["cpu_s_per_step"] for r in rs]),
            ci([r["curve"][-1]["acc"] for r in rs], 100, ".1f"),
            ci([at_tokens(r["curve"], budget) for r in rs], 100, ".1f"),
            f"{len(reached)}/{len(rs)}",
            f"{statistics.fmean(p['tokens'] for p in reached):,.0f}" if reached else "-",
            f"{statistics.fmean(p['cpu_s'] for p in reached):,.0f}" if reached else "-",
        ]
        lines.append("| " + " | ".join(row) + " |")
        lines.append(per_seed(rs, budget))
        if side != "ds":
            verdicts.append(verdict(side, rs, ds, target))
    return lines + [""] + verdicts


def per_seed(rs: list[dict], budget: float) -> str:
    """The table's row of every seed's figures, in seed order."""

    def each(f):
        return ", ".join(f(r) for r in rs)

    cells = [
        each(lambda r: f"{r['tokens_per_trained']:.2f}"),
        each(lambda r: f"{r['wall_s_per_step']:.2f}"),
        each(lambda r: f"{r['cpu_s_per_step']:.2f}"),
        each(lambda r: f"{100 * r['curve'][-1]['acc']:.1f}"),
        each(lambda r: f"{100 * at_tokens(r['curve'], budget):.1f}"),
    ]
    return "| per seed | " + " | ".join(cells) + " | | | |"


def verdict(side: str, rs: list[dict], ds: list[dict], target: float) -> str:
    """The side against dynamic sampling: ratios, and whether it clears the bar (FEWER, POINTS_BELOW)."""
    mean = statistics.fmean
    ds_reach = [p for p in (to_target(r["curve"], target) for r in ds) if p]
    reach = [p for p in (to_target(r["curve"], target) for r in rs) if p]
    below = 100 * (target - mean(r["curve"][-1]["acc"] for r in rs))
    loads = [r["load"] for r in ds + rs]
    busy = withheld(loads, "ratio of seconds")  # a busy machine bends wall seconds, and CPU seconds too
    tokens_x = cpu_x = None
    if reach and ds_reach:
        tokens_x = mean(p["tokens"] for p in ds_reach) / mean(p["tokens"] for p in reach)
        cpu_x = mean(p["cpu_s"] for p in ds_reach) / mean(p["cpu_s"] for p in reach)
    per_trained = mean(r["tokens_per_trained"] for r in ds) / mean(r["tokens_per_trained"] for r in rs)
    cpu = time_ratio([r["cpu_s_per_step"] for r in ds], [r["cpu_s_per_step"] for r in rs], loads, what="CPU")
    wall = time_ratio([r["wall_s_per_step"] for r in ds], [r["wall_s_per_step"] for r in rs], loads)
    to_reach = "not reached"
    if tokens_x is not None:
        to_reach = f"{tokens_x:.2f}x fewer tokens and " + (busy or f"{cpu_x:.2f}x fewer CPU seconds")
    passes = tokens_x is not None and not busy and tokens_x >= FEWER and cpu_x >= FEWER and below <= POINTS_BELOW
    return (
        f"- {side} against ds: generated tokens per trained token {per_trained:.2f}x fewer; CPU s per step {cpu} "
        f"less; wall s per step {wall} less; to ds's final accuracy {to_reach} ({len(reach)}/{len(rs)} seeds); "
        f"final held-out {-below:+.1f} points against ds's; "
        + ("clears" if passes else "does not clear" + (" (no clean seconds to judge by)" if busy else ""))
        + f" the bar ({FEWER}x fewer tokens and CPU seconds, at most {POINTS_BELOW:g} point below)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--settings", default=",".join(SETTINGS))
    ap.add_argument("--sides", default=",".join(SIDES), help=f"a subset of {', '.join(SIDES)} (ds first)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="a few steps, fewer held-out problems: the script itself")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench_screening"))
    ap.add_argument("--json", default=None, help="write every seed's figures and the load each batch saw")
    ap.add_argument("--markdown", default=None, help="write the tables as Markdown")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.smoke:
        args.seeds = min(args.seeds, 2)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    everything = {"command": "python " + " ".join(sys.argv), "date": date.today().isoformat(), "commit": commit}
    everything["machine"] = machine()  # the load is each batch's, beside its seeds
    tables = []
    for name in args.settings.split(","):
        results = run_setting(name, args)
        everything[name] = results
        table = report(name, results)
        print("\n".join(table), flush=True)
        tables += table + [""]
        if args.json:
            Path(args.json).write_text(json.dumps(everything, indent=1))
    if args.markdown:
        Path(args.markdown).write_text("\n".join(tables))


if __name__ == "__main__":
    main()
