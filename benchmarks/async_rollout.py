"""What `rollout.max_staleness` buys: step time, and what staleness does to learning.

    python benchmarks/async_rollout.py --simulate          # the pipeline with controlled latencies (seconds, no model)
    python benchmarks/async_rollout.py                     # the demo at k = 0, 1, 2, 5 seeds each (~35 min on 2 cores)
    python benchmarks/async_rollout.py --lrs 5e-4,2.5e-4,1.25e-4   # the same at each learning rate, paired by seed
    python benchmarks/async_rollout.py --smollm2 --steps 3 # SmolLM2's preset, k = 0 against k = 1 (make smollm2)

--simulate runs the real scheduling (``dapo.collect.ahead.AheadThread``) with a collection that takes G seconds,
an update that takes U and a weight push that takes W, both sides sleeping (so two cores do not limit it), and
prints each mode's step time against the synchronous G + U + W and the ideal max(G, U) + W, at G/U = 0.5, 1, 2, 4.
Partial rollout (requests carried across a weight push) is not implemented, so it has no row. Sleeps wake late on a
busy machine: each row is measured for load (benchmarks/runs.py's Meter, one job of its own), and its ratios are
printed only where it saw no more.

The other modes train `python -m dapo.training` in a process per run, one at a time (seed s sets data, rollout and
train seeds), and read its metrics.jsonl: held-out avg@n before and after, the step time with evaluation left out
(wall and the trainer's CPU seconds), the staleness, the importance weights' statistics and how long each side
waited on the other; each run's process CPU seconds and the load it saw are measured from outside
(benchmarks/runs.py). Printed: each run, then per k the mean with a 95% t-interval over seeds, and the step time
against k = 0, a ratio printed only where no run behind it shared the machine with other work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
from dapo.collect.ahead import AheadThread  # noqa: E402
from dapo.reporting.run_log import held_out_keys  # noqa: E402
from runs import Meter, describe, machine, mean_ci, run_alone, time_ratio, withheld  # noqa: E402


# ---- the pipeline with controlled latencies ---------------------------------------------------------------------
def simulated_step_s(k: int, g: float, u: float, w: float, steps: int) -> float:
    """Mean step time over ``steps`` after the first (the pipeline filled), with the schedule of max_staleness=k."""
    if k == 0:
        t0 = time.perf_counter()
        for _ in range(steps):
            time.sleep(g + u + w)
        return (time.perf_counter() - t0) / steps

    def collect(step, version):
        time.sleep(g)
        return None, None, {}

    ahead = AheadThread(collect, max_staleness=k, first=1, last=steps + 1, published=0).start()
    ahead.take(1)
    time.sleep(u)
    ahead.release(1)
    time.sleep(w)
    ahead.publish(1)
    t0 = time.perf_counter()
    for step in range(2, steps + 2):
        ahead.take(step)
        time.sleep(u)  # the update
        ahead.release(step)
        time.sleep(w)  # the push: the trainer's, before the collections waiting on it may start
        ahead.publish(step)
    ahead.stop()
    return (time.perf_counter() - t0) / steps


def simulate(args) -> None:
    u, w = args.update_s, args.push_s
    print(f"update U = {u} s, weight push W = {w} s, {args.sim_steps} steps per figure (after the first)")
    print("| G/U | synchronous G+U+W | k=1 | k=2 | ideal max(G,U)+W | k=1 / ideal | speed-up of k=1 | CPU s, wall s |")
    print("|---|---|---|---|---|---|---|---|")
    reasons = []
    for ratio in (0.5, 1, 2, 4):
        g = ratio * u
        meter = Meter(own_jobs=1)
        with meter:
            sync = simulated_step_s(0, g, u, w, args.sim_steps)
            k1 = simulated_step_s(1, g, u, w, args.sim_steps)
            k2 = simulated_step_s(2, g, u, w, args.sim_steps)
        ideal = max(g, u) + w
        reason = withheld([meter.load.summary()], "ratio", unit="rows")
        ratios = ["-", "-"] if reason else [f"{k1 / ideal:.2f}", f"{sync / k1:.2f}x"]
        cells = [f"{ratio:g}", *(f"{x:.3f} s" for x in (sync, k1, k2, ideal)), *ratios]
        print("| " + " | ".join(cells + [f"{meter.cpu_s:.2f}, {meter.wall_s:.1f}"]) + " |")
        reasons += [f"G/U = {ratio:g}: {reason}"] if reason else []
    for line in reasons:
        print(line)


# ---- real runs --------------------------------------------------------------------------------------------------
def summarise(rows: list[dict]) -> dict:
    steps = [r for r in rows if "perf/time_step_s" in r and r.get("step", 0) >= 1]
    keys = held_out_keys(rows)
    evals = [r[keys[0]] for r in rows if keys and keys[0] in r]

    def mean(key, default=0.0):
        xs = [r[key] for r in steps if key in r]
        return statistics.fmean(xs) if xs else default

    # a step's time less its evaluation (held-out runs only every few steps; the step is what overlaps)
    step_s = [r["perf/time_step_s"] - r.get("perf/time_eval_s", 0.0) for r in steps]
    step_cpu_s = [r.get("perf/cpu_step_s", 0.0) - r.get("perf/cpu_eval_s", 0.0) for r in steps]
    return {
        "first_acc": evals[0] if evals else None,
        "final_acc": evals[-1] if evals else None,
        "step_s": statistics.fmean(step_s[1:] or step_s),  # the first step fills the pipeline
        "step_cpu_s": statistics.fmean(step_cpu_s[1:] or step_cpu_s),  # the trainer process's, every thread
        "staleness": mean("async/staleness_mean"),
        "is_weight_mean": mean("rollout/is_weight_mean", 1.0),
        "is_truncated_frac": mean("rollout/is_truncated_frac"),
        "is_masked_frac": mean("rollout/is_masked_frac"),
        "logprob_gap": mean("rollout/logprob_abs_diff_mean"),
        "trainer_wait_s": mean("async/trainer_wait_s"),
        "engine_wait_s": mean("async/engine_wait_s"),
        "train_acc": mean("rollout/acc_mean"),
        # the last third of the run, where the k sides have had the same number of updates to diverge
        "train_acc_last_third": statistics.fmean(
            r["rollout/acc_mean"] for r in steps[len(steps) * 2 // 3 :] if "rollout/acc_mean" in r
        )
        if steps
        else None,
        "policy_kl": mean("async/policy_kl"),
        "is_ess": mean("rollout/is_ess", 1.0),
    }


def line(r: dict) -> str:
    acc = "" if r["final_acc"] is None else f"held-out {r['first_acc']:.3f} -> {r['final_acc']:.3f}  "
    return (
        f"{acc}step {r['step_s']:.2f} s ({r.get('step_cpu_s', 0.0):.2f} CPU s)  staleness {r['staleness']:.2f}  "
        f"is weight {r['is_weight_mean']:.4f} "
        f"(truncated {r['is_truncated_frac']:.4f})  |logp gap| {r['logprob_gap']:.4f}  waits: trainer "
        f"{r['trainer_wait_s']:.2f} s, engine {r['engine_wait_s']:.2f} s  train acc {r['train_acc']:.3f} "
        f"(last third {r['train_acc_last_third']:.3f})  policy kl {r['policy_kl']:.5f}  is ess {r['is_ess']:.4f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--simulate", action="store_true")
    ap.add_argument("--update-s", type=float, default=0.2)
    ap.add_argument("--push-s", type=float, default=0.02)
    ap.add_argument("--sim-steps", type=int, default=10)
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--first-seed", type=int, default=0, help="seeds first-seed .. first-seed + seeds - 1")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--ks", default="0,1,2")
    ap.add_argument(
        "--lrs", default=None, help="train.lr values to sweep, e.g. 5e-4,2.5e-4,1.25e-4 (default: the preset's)"
    )
    ap.add_argument(
        "--modes",
        default="token_truncate",
        help="algo.rollout_is_mode values for k > 0, e.g. token_truncate,token_mask,token_m2,sequence_truncate",
    )
    ap.add_argument("--reuse", default=None, help="a --json of earlier runs: sides and seeds found there are not rerun")
    ap.add_argument("--smollm2", action="store_true", help="the SmolLM2 preset (one seed, no held-out curve)")
    ap.add_argument("--backend", default="hf", help="rollout.backend for --smollm2")
    ap.add_argument("--out", default=str(ROOT / "runs" / "bench_async"))
    ap.add_argument("--json", default=None)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.simulate:
        simulate(args)
        return
    ks = [int(k) for k in args.ks.split(",")]
    if args.smollm2:
        preset, seeds = "configs/smollm2_135m.yaml", 1
        base = [f"train.total_steps={args.steps}", f"rollout.backend={args.backend}", "eval.every_steps=null"]
        base += ["eval.before_train=false", "train.prompts_per_step=4", "train.mini_batch_prompts=2"]
        base += ["algo.max_gen_rounds=2"]
    else:
        preset, seeds = "configs/demo.yaml", args.seeds
        base = [f"train.total_steps={args.steps}"]
    out = Path(args.out) / ("smollm2" if args.smollm2 else "demo")
    print(f"{preset} {' '.join(base + args.overrides)}; {os.cpu_count()} cores", flush=True)
    lrs = args.lrs.split(",") if args.lrs else [None]
    modes = args.modes.split(",")
    reused = json.loads(Path(args.reuse).read_text()) if args.reuse else {}
    results: dict[str, list[dict]] = {}
    for lr in lrs:
        side = [f"train.lr={lr}"] if lr else []
        for seed in range(args.first_seed, args.first_seed + seeds):  # paired: each k of a seed shares its seeds
            for k, mode in [(j, m) for j in (ks if seed % 2 == 0 else ks[::-1]) for m in (modes if j else modes[:1])]:
                name = f"lr={lr or 'preset'} k={k}" + (f" {mode}" if k and mode != "token_truncate" else "")
                done = [r for r in reused.get(name, []) if r["seed"] == seed]
                if done:
                    results.setdefault(name, []).append(done[0])
                    continue
                extra = [f"rollout.max_staleness={k}"] + (
                    ["algo.rollout_is_cap=2", f"algo.rollout_is_mode={mode}"] if k else []
                )
                seeded = [f"data.seed={seed}", f"rollout.seed={seed}", f"train.seed={seed}"]
                run_dir = out / (f"lr{lr}" if lr else "") / (f"k{k}" + (f"_{mode}" if k else "")) / f"seed{seed}"
                run = run_alone(preset, base + side + seeded + extra + args.overrides, run_dir)
                r = summarise(run.rows) | {"seed": seed, "k": k, "lr": lr, "mode": mode if k else None}
                r |= {"wall_s": run.wall_s, "cpu_s": run.cpu_s, "load": run.load.summary()}
                results.setdefault(name, []).append(r)
                print(
                    f"  {name} seed {seed}  " + line(r) + f"  wall {r['wall_s']:.0f} s, CPU {r['cpu_s']:.0f} s"
                    f"  ({describe(r['load'])})",
                    flush=True,
                )
                if args.json:  # as it goes: a stopped sweep is picked up with --reuse
                    Path(args.json).write_text(json.dumps(results | {"machine": machine()}, indent=1))
    report(results)
    if args.json:
        Path(args.json).write_text(json.dumps(results | {"machine": machine()}, indent=1))


def report(results: dict[str, list[dict]]) -> None:
    """Per side, the mean [95% CI] over seeds; then each k > 0 against k = 0 of the same learning rate, paired by
    seed (the difference of held-out and last-third train accuracy, seed by seed)."""
    print("\nmean [95% CI] over seeds")
    keys = ("final_acc", "train_acc_last_third", "policy_kl", "is_ess", "step_s", "step_cpu_s", "is_truncated_frac")
    keys += ("is_masked_frac",)
    for side, runs in results.items():
        cells = []
        for key in keys:
            xs = [r[key] for r in runs if r.get(key) is not None]
            if xs:
                m, h = mean_ci(xs)
                cells.append(f"{key} {m:.4g} [{m - h:.4g}, {m + h:.4g}]")
        print(f"  {side}  " + "  ".join(cells))
    print("\npaired by seed, k against k = 0 at the same learning rate: mean difference [95% CI]")
    for side, runs in results.items():
        base = results.get(side.split(" k=", 1)[0] + " k=0")
        if not base or runs is base:
            continue
        by_seed = {r["seed"]: r for r in base}
        loads = [r.get("load") for r in base + runs]  # runs read back from an older --json have none
        wall = time_ratio([r["step_s"] for r in base], [r["step_s"] for r in runs], loads)
        cpu_s = [[r.get("step_cpu_s", 0.0) for r in rs] for rs in (base, runs)]
        cpu = time_ratio(*cpu_s, loads, what="CPU")
        print(f"  {side}  step time against k = 0: {wall} (CPU: {cpu})")
        for key in ("final_acc", "train_acc_last_third"):
            diffs = [r[key] - by_seed[r["seed"]][key] for r in runs if r["seed"] in by_seed and r.get(key) is not None]
            if diffs:
                m, h = mean_ci(diffs)
                per_seed = ", ".join(f"{d:+.3f}" for d in diffs)
                print(f"  {side}  {key} {m:+.4f} [{m - h:+.4f}, {m + h:+.4f}]  (per seed {per_seed})")


if __name__ == "__main__":
    main()
