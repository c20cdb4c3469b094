"""What `algo.prefilter` saves: dynamic sampling alone against dynamic sampling with the prompt pre-filter.

    python benchmarks/prefilter.py                       # the demo, 5 seeds per side, about 25 minutes on 2 cores
    python benchmarks/prefilter.py --seeds 2 --steps 20  # shorter
    python benchmarks/prefilter.py --smollm2 --steps 6   # the SmolLM2 preset on its word problems (make smollm2)
    python benchmarks/prefilter.py --record --steps 100 --eval-every 10 --target 0.7  # and how the record predicts

Each run is `python -m dapo.training <preset>` in its own process, the sides alternating seed by seed (seed k sets
data.seed, rollout.seed and train.seed). The demo trains on a finite set of --train-size problems, so a run draws
each prompt several times (the prefilter can only skip a prompt it has seen); held-out accuracy is measured every
--eval-every steps on the demo's 200 held-out problems. Per run, from metrics.jsonl: generated tokens and
generation seconds until held-out avg@n first reaches --target, the step time (collect + update, evaluation
excluded) until then, generated tokens per trained token over the run, the generation time spent on groups
dynamic sampling dropped, prompts skipped, and the final held-out accuracy. Printed: every run, then each side's
mean with a 95% t-interval over seeds, and the ratios dynamic sampling / prefilter; then, per side, the share of
groups that came back informative by the state of their prompt's record when drawn, and what skipping whole states
would have saved and lost (with --record the dynamic-sampling side keeps the record too, skipping nothing).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from dapo.log import held_out_keys, read_metrics, record_totals  # noqa: E402
from dapo.prefilter import STATES  # noqa: E402

SIDES = {"dynamic sampling": [], "+ prefilter": ["algo.prefilter=true"]}
RECORD = ["algo.prefilter=true", "algo.prefilter_floor=1.0"]  # keeps the record, skips nothing
T975 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262}


def mean_ci(xs: list[float]) -> tuple[float, float]:
    """Mean and the half-width of its 95% t-interval (0 for one value)."""
    m = statistics.fmean(xs)
    if len(xs) < 2:
        return m, 0.0
    return m, T975.get(len(xs) - 1, 1.96) * statistics.stdev(xs) / math.sqrt(len(xs))


def train(preset: str, overrides: list[str], run_dir: Path) -> list[dict]:
    cmd = [sys.executable, "-m", "dapo.training", str(ROOT / preset), *overrides, f"run.dir={run_dir.parent}"]
    cmd += [f"run.name={run_dir.name}", "run.progress=false", "run.loggers=console", "run.save_every=null"]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return read_metrics(run_dir)


def generation(steps: list[dict]) -> dict:
    """What the steps' generation cost, added up over them (both sides, demo and SmolLM2)."""

    def total(k):
        return sum(r.get(k, 0.0) for r in steps)

    skipped = total("sampling/skipped_all_correct") + total("sampling/skipped_all_wrong")
    return {
        "steps": len(steps),
        "tokens": total("sampling/tokens_generated"),
        "tokens_per_trained": total("sampling/tokens_generated") / max(total("sampling/tokens_trained"), 1),
        "gen_s": total("perf/time_generate_s"),
        "dropped_gen_s": total("sampling/dropped_gen_s"),
        "skipped": skipped,
        "drawn": total("sampling/prompts_generated") + skipped,
        "informative": statistics.fmean(r["sampling/informative_frac"] for r in steps),
        "step_s": total("perf/time_step_s"),
        # what the prompt's record knew when each group was drawn, and how many of those groups were informative
        "record": record_totals(steps),
    }


def summarise(rows: list[dict], target: float) -> dict:
    steps = [r for r in rows if "sampling/tokens_generated" in r]
    key = held_out_keys(rows)[0]
    evals = [(r["step"], r[key]) for r in rows if key in r]
    reached = next((step for step, acc in evals if acc >= target), None)
    upto = generation([r for r in steps if r["step"] <= reached]) if reached is not None else None
    return generation(steps) | {
        "reached_step": reached,
        "tokens_to_target": upto and upto["tokens"],
        "gen_s_to_target": upto and upto["gen_s"],
        "step_s_to_target": upto and upto["step_s"],
        "first_acc": evals[0][1],
        "final_acc": evals[-1][1],
        "metric": key,
    }


def fmt(x, spec):
    return "-" if x is None else format(x, spec)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--train-size", type=int, default=None, help="problems trained on (the demo's: 600; --smollm2: 24)")
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--target", type=float, default=0.6, help="held-out avg@n to reach")
    ap.add_argument("--smollm2", action="store_true", help="the SmolLM2 preset instead of the demo (one seed a side)")
    ap.add_argument("--backend", default="vllm", help="rollout.backend for --smollm2")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench_prefilter"))
    ap.add_argument("--json", default=None, help="also write every figure here")
    ap.add_argument(
        "--pf",
        nargs="*",
        default=[],
        help="dotted overrides for the prefilter side only (e.g. algo.prefilter_floor=0.25); its runs get a folder "
        "of their own, and the dynamic-sampling runs already in --out are read back, not trained again",
    )
    ap.add_argument(
        "--record",
        action="store_true",
        help="the dynamic-sampling side keeps the prefilter's record without skipping (algo.prefilter_floor=1: the "
        "same draws, samples and weights as the switch off), to print how well the record predicts on it",
    )
    ap.add_argument("overrides", nargs="*", help="extra dotted overrides for every run")
    args = ap.parse_args()
    out = Path(args.out) / ("smollm2" if args.smollm2 else "demo")
    if args.smollm2:  # the first --train-size word problems (24 by default), so that 6 steps draw each several times
        preset = "configs/smollm2_135m.yaml"
        subset = out / "train_subset.jsonl"
        subset.parent.mkdir(parents=True, exist_ok=True)
        rows = (ROOT / "data/word_problems/train.jsonl").read_text().splitlines()
        subset.write_text("\n".join(rows[: args.train_size or 24]) + "\n")
        base = [f"train.total_steps={args.steps}", f"rollout.backend={args.backend}", "eval.every_steps=null"]
        base += ["eval.before_train=false", f"data.train_files=[{subset}]"]
    else:
        preset = "configs/demo.yaml"
        args.train_size = args.train_size or 600
        base = [f"train.total_steps={args.steps}", f"data.task_train_size={args.train_size}"]
        base += [f"eval.every_steps={args.eval_every}", "eval.before_train=true"]
    print(f"{preset} {' '.join(base + args.overrides)}; target held-out {args.target:.0%}", flush=True)
    results: dict[str, list[dict]] = {side: [] for side in SIDES}
    for seed in range(args.seeds):
        order = list(SIDES) if seed % 2 == 0 else list(SIDES)[::-1]
        for side in order:
            seeds = [f"data.seed={seed}", f"rollout.seed={seed}", f"train.seed={seed}"]
            extra = args.pf if SIDES[side] else (RECORD if args.record else [])
            name = "_".join(["prefilter", *(x.split(".")[-1].replace("=", "") for x in extra)]) if SIDES[side] else "ds"
            run_dir = out / name / f"seed{seed}"
            t0 = time.perf_counter()
            if (run_dir / "metrics.jsonl").exists() and (run_dir / "checkpoints").exists() and args.pf:
                rows = read_metrics(run_dir)  # a finished run of an earlier invocation: its figures, read back
            else:
                rows = train(preset, base + seeds + SIDES[side] + extra + args.overrides, run_dir)
            r = summarise(rows, args.target) if not args.smollm2 else summarise_real(rows)
            r |= {"seed": seed, "wall_s": time.perf_counter() - t0}
            results[side].append(r)
            print(f"  seed {seed} {side:<17} " + line(r, args), flush=True)
    report(results, args)
    for side, runs in results.items():
        predictability(side, runs)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def summarise_real(rows: list[dict]) -> dict:
    """The SmolLM2 runs: no held-out curve (too slow on a CPU), only what generation cost."""
    steps = [r for r in rows if "sampling/tokens_generated" in r]
    return generation(steps) | {"train_acc": statistics.fmean(r["rollout/acc_mean"] for r in steps)}


def line(r: dict, args) -> str:
    s = (
        f"tokens/trained {r['tokens_per_trained']:.2f}  generation {r['gen_s']:.0f} s "
        f"(dropped groups {r['dropped_gen_s']:.0f} s)  informative {r['informative']:.2f}  skipped {r['skipped']:.0f}"
    )
    if args.smollm2:
        return s + f"  steps {r['step_s']:.0f} s  train acc {r['train_acc']:.3f}"
    return s + (
        f"  passes {r['drawn'] / args.train_size:.1f}  to {args.target:.0%}: step {fmt(r['reached_step'], 'd')}, "
        f"{fmt(r['tokens_to_target'], ',.0f')} tokens, {fmt(r['gen_s_to_target'], '.1f')} s generating, "
        f"{fmt(r['step_s_to_target'], '.1f')} s of steps  held-out {r['first_acc']:.3f} -> {r['final_acc']:.3f}"
    )


def report(results: dict[str, list[dict]], args) -> None:
    keys = ["tokens_per_trained", "gen_s", "dropped_gen_s", "informative"]
    keys += ["step_s", "train_acc"] if args.smollm2 else ["tokens_to_target", "step_s_to_target", "final_acc"]
    print(
        "\nmean [95% CI] over seeds" + ("" if args.smollm2 else f" (to target: seeds that reached {args.target:.0%})")
    )
    means = {}
    for side, runs in results.items():
        cells = []
        for k in keys:
            xs = [r[k] for r in runs if r.get(k) is not None]
            if not xs:
                cells.append(f"{k} -")
                continue
            m, h = mean_ci(xs)
            means[side, k] = (m, h)
            cells.append(
                f"{k} {m:,.3g} [{m - h:,.3g}, {m + h:,.3g}]" + (f" ({len(xs)})" if len(xs) < len(runs) else "")
            )
        print(f"  {side:<17} " + "  ".join(cells))
    a, b = list(SIDES)
    for k, label in (
        ("tokens_per_trained", "generated tokens per trained token"),
        ("tokens_to_target", "generated tokens to the target"),
        ("step_s_to_target", "step time to the target"),
        ("gen_s", "generation seconds over the run"),
        ("step_s", "step time over the run"),
    ):
        if (a, k) in means and (b, k) in means:
            print(f"  {label}: {means[a, k][0] / max(means[b, k][0], 1e-9):.2f}x less with the prefilter")
    if ("final_acc" in keys) and (a, "final_acc") in means and (b, "final_acc") in means:
        (ma, ha), (mb, _) = means[a, "final_acc"], means[b, "final_acc"]
        inside = ma - ha <= mb <= ma + ha
        print(
            f"  final held-out: {mb:.3f} with the prefilter, {'inside' if inside else 'outside'} dynamic "
            f"sampling's 95% CI [{ma - ha:.3f}, {ma + ha:.3f}]"
        )


def predictability(side: str, runs: list[dict]) -> None:
    """How well the prompts' record predicts, over a side's runs: the groups generated in each state the record can
    be in when a prompt is drawn, and the share of them that were informative. Then the most any rule on that record
    could save: skip whole states, least informative first (a prompt never generated cannot be skipped), and the
    informative share of what is left, the informative groups it would lose, and the generated groups per trained
    group against generating every draw."""
    groups = {s: sum(r["record"][0].get(s, 0) for r in runs) for s in STATES}
    informative = {s: sum(r["record"][1].get(s, 0) for r in runs) for s in STATES}
    total, total_inf = sum(groups.values()), sum(informative.values())
    if not total:
        return
    print(f"\n{side}: the prompts' record when each group was drawn ({len(runs)} runs, {total:,.0f} groups)")
    for s in STATES:
        if groups[s]:
            rate = informative[s] / groups[s]
            print(f"  {s:<18} {groups[s]:>7,.0f} groups ({groups[s] / total:.2f})  informative {rate:.2f}")
    print(f"  skipping whole states, least informative first (all generated: {total / total_inf:.2f} per trained):")
    kept, kept_inf = total, total_inf
    order = sorted((s for s in STATES if s != "unseen" and groups[s]), key=lambda s: informative[s] / groups[s])
    for s in order:
        kept, kept_inf = kept - groups[s], kept_inf - informative[s]
        if not kept_inf:
            break
        print(
            f"    + {s:<18} informative share {kept_inf / kept:.2f}  "
            f"informative groups lost {1 - kept_inf / total_inf:.2f}"
            f"  generated per trained {kept / kept_inf:.2f} ({total / total_inf / (kept / kept_inf):.2f}x fewer)"
        )


if __name__ == "__main__":
    main()
