"""On-policy distillation on the demo: DAPO, pure distillation and DAPO with a teacher, from the demo's base model.

    python benchmarks/distill_demo.py --make-teacher --seeds 5 --json benchmarks/results/distillation/demo.json
    python benchmarks/distill_demo.py --teacher runs/demo/teacher --seeds 5 --steps 60   # a teacher you have

The teacher is the demo's own DAPO-trained model (configs/demo.yaml, 60 steps, seed 0, exported with `dapo export`;
--make-teacher trains it, its held-out accuracy read from its last evaluation). The student is the demo's base
model (assets/arith-base). Arms, each configs/demo.yaml with the same seeds (seed k sets data, rollout and train):
  dapo          DAPO as the demo runs it (no teacher)
  distill       pure distillation: teacher.coef=1, teacher.reward_advantage=false (no group dropped)
  dapo_teacher  DAPO plus the teacher's term: teacher.coef=1
  distill_full, dapo_teacher_full   the same with teacher.signal=full (the exact KL over the vocabulary, in the
                loss) and four passes over each batch from the first step (train.ppo_epochs=4, train.warmup_steps=0)
--arms picks them (default: the first three; dapo is always run, its final accuracy being the target).
A seed's arms run together, one core each, in processes of their own (benchmarks/runs.py records the load they saw).
Per arm: held-out accuracy at equal steps (the last evaluation) and at equal generated tokens (each curve read at
the fewest tokens any run generated), generated tokens per trained token, the steps and generated tokens until a
run first reaches DAPO's final accuracy (its seeds' mean), and the teacher pass's share of a step's time; means with
95% t-intervals over seeds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from datetime import date
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from runs import Load, Run, generation, machine, mean_ci, run_alone, run_together  # noqa: E402

FOUR_PASSES = ["train.ppo_epochs=4", "train.warmup_steps=0"]
ARMS = {
    "dapo": [],
    "distill": ["teacher.coef=1", "teacher.reward_advantage=false"],
    "dapo_teacher": ["teacher.coef=1"],
    "distill_full": ["teacher.coef=1", "teacher.reward_advantage=false", "teacher.signal=full", *FOUR_PASSES],
    "dapo_teacher_full": ["teacher.coef=1", "teacher.signal=full", *FOUR_PASSES],
}
KEY = "eval/arith/avg@4"  # the demo's held-out accuracy (200 problems x 4 samples unless --eval-problems)


def make_teacher(out: Path) -> tuple[Path, float]:
    """The demo trained as `make demo` trains it (60 steps, seed 0), exported; its final held-out accuracy."""
    run = run_alone(
        "configs/demo.yaml", ["eval.before_train=false", "eval.every_steps=null", "run.save_every=60"], out / "teacher"
    )
    model = out / "teacher_model"
    checkpoint = sorted((out / "teacher" / "checkpoints").glob("step_*"))[-1]
    subprocess.run([sys.executable, "-m", "dapo.cli", "export", str(checkpoint), str(model)], check=True, cwd=ROOT)
    return model, [r for r in run.rows if KEY in r][-1][KEY]


def curve(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(step, generated tokens so far, held-out accuracy) at each evaluation."""
    out, tokens = [], 0.0
    for r in rows:
        tokens += r.get("sampling/tokens_generated", 0.0)
        if KEY in r:
            out.append((r["step"], tokens, r[KEY]))
    return out


def at_tokens(points: list[tuple[int, float, float]], budget: float) -> float:
    """The accuracy of the last evaluation at or under ``budget`` generated tokens."""
    return [acc for _, tokens, acc in points if tokens <= budget][-1]


def first_reaching(points: list[tuple[int, float, float]], target: float) -> tuple[int | None, float | None]:
    """Steps and generated tokens of the first evaluation at or above ``target`` (None: never)."""
    return next(((step, tokens) for step, tokens, acc in points if acc >= target), (None, None))


def ci(xs: list[float]) -> dict | None:
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    m, h = mean_ci(xs)
    return {"mean": round(m, 4), "ci95": round(h, 4)}


def summarise(runs: dict[str, list], teacher_acc: float | None) -> dict:
    """Every seed's figures, and each arm's means, from the runs' metrics rows."""
    curves = {arm: [curve(r.rows) for r in rs] for arm, rs in runs.items()}
    target = statistics.fmean(points[-1][2] for points in curves["dapo"])  # DAPO's final held-out accuracy
    budget = min(points[-1][1] for pts in curves.values() for points in pts)  # the fewest tokens any run generated
    third = statistics.fmean(points[-1][1] for points in curves["dapo"]) / 3  # a third of DAPO's generated tokens
    per_seed, arms = [], []
    for arm, rs in runs.items():
        seeds = []
        for run, points in zip(rs, curves[arm]):
            steps = [r for r in run.rows if "sampling/tokens_generated" in r]
            gen = generation(steps)
            reach_step, reach_tokens = first_reaching(points, target)
            teacher_s = sum(r.get("perf/time_teacher_logprob_s", 0.0) for r in steps)
            seed = {
                "arm": arm,
                "seed": run.name,
                "final_acc": points[-1][2],
                "acc_at_equal_tokens": at_tokens(points, budget),
                "acc_at_a_third_of_dapo_tokens": at_tokens(points, third),
                "tokens_generated": gen["tokens"],
                "tokens_per_trained_token": round(gen["tokens_per_trained"], 3),
                "steps_to_dapo_final": reach_step,
                "tokens_to_dapo_final": reach_tokens,
                "teacher_share_of_step_s": round(teacher_s / max(gen["step_s"], 1e-9), 4),
                "step_s": round(gen["step_s"] / max(gen["steps"], 1), 2),
                "wall_s": round(run.wall_s, 1),
                "load": run.load.describe(),
            }
            seeds.append(seed)
        per_seed += seeds
        arms.append(
            {"arm": arm, "seeds": len(seeds)}
            | {
                k: ci([s[k] for s in seeds])
                for k in ("final_acc", "acc_at_equal_tokens", "acc_at_a_third_of_dapo_tokens")
            }
            | {"tokens_per_trained_token": ci([s["tokens_per_trained_token"] for s in seeds])}
            | {k: ci([s[k] for s in seeds]) for k in ("steps_to_dapo_final", "tokens_to_dapo_final")}
            | {"reached": sum(s["steps_to_dapo_final"] is not None for s in seeds)}
            | {"teacher_share_of_step_s": ci([s["teacher_share_of_step_s"] for s in seeds])}
        )
    return {
        "teacher_held_out_acc": teacher_acc,
        "dapo_final_acc": round(target, 4),
        "equal_token_budget": budget,
        "a_third_of_dapo_tokens": round(third),
        "arms": arms,
        "every_seed": per_seed,
    }


def seed_runs(seed: int, common: list[str], out: Path, arms: list[str]) -> list[Run]:
    """A seed's arms, run together; kept in out/seed<k>.json with their settings, so a rerun with the same settings
    and more seeds runs only the new ones."""
    seeding = [f"train.seed={seed}", f"data.seed={seed}", f"rollout.seed={seed}"]
    specs = [("configs/demo.yaml", common + seeding + ARMS[arm], out / arm / f"seed{seed}") for arm in arms]
    kept = out / f"seed{seed}.json"
    settings = [overrides for _, overrides, _ in specs]
    if kept.is_file() and (saved := json.loads(kept.read_text()))["settings"] == settings:
        return [Run(r["name"], r["rows"], r["wall_s"], r["cpu_s"], Load(**r["load"])) for r in saved["runs"]]
    runs = run_together(specs, threads=1)
    kept.write_text(json.dumps({"settings": settings, "runs": [{**vars(r), "load": vars(r.load)} for r in runs]}))
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher", help="the teacher's model directory (else --make-teacher)")
    p.add_argument("--make-teacher", action="store_true", help="train the demo and export it as the teacher")
    p.add_argument("--teacher-acc", type=float, help="with --teacher: its held-out accuracy, as measured")
    p.add_argument("--seeds", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-problems", type=int, default=100)
    p.add_argument("--out", default="runs/distill_demo")
    p.add_argument("--json", help="write the results file here")
    p.add_argument("--arms", default="dapo,distill,dapo_teacher", help=f"a comma-separated list of {', '.join(ARMS)}")
    args = p.parse_args()
    out = Path(args.out).resolve()
    teacher_acc = args.teacher_acc
    if args.make_teacher:
        teacher, teacher_acc = make_teacher(out)
    elif args.teacher:
        teacher = Path(args.teacher).resolve()
    else:
        sys.exit("give --teacher DIR or --make-teacher")
    common = [f"train.total_steps={args.steps}", f"eval.every_steps={args.eval_every}", "eval.before_train=false"]
    common += [f"eval.num_problems={args.eval_problems}", f"teacher.path={teacher}"]
    arms = ["dapo", *(a for a in args.arms.split(",") if a != "dapo")]
    if unknown := set(arms) - set(ARMS):
        sys.exit(f"--arms: {', '.join(sorted(unknown))} unknown; choose from {', '.join(ARMS)}")
    runs: dict[str, list] = {arm: [] for arm in arms}
    for seed in range(1, args.seeds + 1):
        for arm, run in zip(arms, seed_runs(seed, common, out, arms)):
            runs[arm].append(run)
            print(f"seed {seed} {arm}: held-out {curve(run.rows)[-1][2]:.3f}, {run.load.describe()}", flush=True)
    figures = summarise(runs, teacher_acc)
    print(json.dumps(figures["arms"], indent=1))
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        result = {
            "title": "On-policy distillation on the demo: DAPO, pure distillation and DAPO with a teacher"
            + (", the teacher's full signal" if any(a.endswith("_full") for a in arms) else ""),
            "group": "The demo and the Python API example",
            "measures": (
                f"The demo's base model taught by the demo's own DAPO-trained model (held-out {teacher_acc}), "
                f"{args.seeds} seeds an arm started together, {args.steps} steps, held-out on {args.eval_problems} "
                "problems x 4 samples every "
                f"{args.eval_every} steps; ± the 95% t-interval over seeds."
            ),
            "command": "python benchmarks/distill_demo.py " + " ".join(sys.argv[1:]),
            "date": date.today().isoformat(),
            "commit": commit,
            "machine": machine(),
            "load": "; ".join(sorted({s["load"] for s in figures["every_seed"]})),
            "figures": figures,
            "notes": [
                f"Each seed's {len(arms)} arms ran together in processes of one thread each, on 2 cores that other "
                "jobs shared: wall and step seconds are of that load, held-out figures and token counts are not.",
            ],
        }
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
