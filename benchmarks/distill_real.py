"""On-policy distillation on a real model: SmolLM2-135M-Instruct taught by a DAPO-trained SmolLM2, with vLLM.

    make smollm2
    python benchmarks/distill_real.py --json benchmarks/results/distillation/smollm2.json   # about 40 minutes

The teacher is SmolLM2-135M-Instruct trained with DAPO by configs/smollm2_135m.yaml (vLLM, seed 0,
--teacher-steps steps, exported with `dapo export`); it is evaluated before and after. The student is the same base
model, trained --steps steps with seed 1 in each arm (distill_demo.py's arms: DAPO, pure distillation, DAPO plus
the teacher's term). Held-out: avg@4 on --eval-problems word problems (data/word_problems/test.jsonl) at the start
(the base model's, once, in the teacher's run) and after the last step. Each run has the machine to itself, so its
step time per phase (generation, grading, old log-probs, the teacher's pass, the update) is its own.
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
from dapo.reporting.run_log import read_metrics  # noqa: E402
from distill_demo import ARMS  # noqa: E402
from runs import Run, generation, machine, run_alone  # noqa: E402

PRESET = "configs/smollm2_135m.yaml"
KEY = "eval/word/avg@4"
PHASES = {
    "generate": "perf/time_generate_s",
    "reward": "perf/time_reward_s",
    "old_logprob": "perf/time_old_logprob_s",
    "teacher_logprob": "perf/time_teacher_logprob_s",
    "update": "perf/time_update_s",
    "step": "perf/time_step_s",
}


def common(args) -> list[str]:
    return [
        "rollout.backend=vllm",
        f"eval.num_problems={args.eval_problems}",
        "eval.every_steps=null",  # held-out at the end (and at step 0 in the teacher's run)
    ]


def phases(rows: list[dict]) -> dict:
    """Each phase's mean seconds a step, evaluation left out of the step."""
    steps = [r for r in rows if "perf/time_step_s" in r and r.get("step", 0) > 0]
    out = {name: round(statistics.fmean(r.get(key, 0.0) for r in steps), 2) for name, key in PHASES.items()}
    out["step"] = round(statistics.fmean(r["perf/time_step_s"] - r.get("perf/time_eval_s", 0.0) for r in steps), 2)
    return out


def summary(run, arm: str) -> dict:
    rows = [r for r in run.rows if r.get("step", 0) > 0]
    gen = generation([r for r in rows if "sampling/tokens_generated" in r])
    times = phases(rows)
    held = [r for r in run.rows if KEY in r]
    kl = [r["teacher/reverse_kl_mean"] for r in rows if "teacher/reverse_kl_mean" in r]
    return {
        "arm": arm,
        "held_out_before": held[0][KEY] if held[0].get("step") == 0 else None,
        "held_out_after": held[-1][KEY],
        "steps": gen["steps"],
        "tokens_per_trained_token": round(gen["tokens_per_trained"], 3),
        "seconds_per_step": times,
        "teacher_share_of_step": round(times["teacher_logprob"] / max(times["step"], 1e-9), 4),
        "reverse_kl_last": kl[-1] if kl else None,
        "wall_s": round(run.wall_s, 1),
        "load": run.load.describe(),
    }


def done_runs(out: Path) -> list[tuple[str, str]]:
    """(run directory name, arm) of the runs under ``out`` that finished, the teacher's first."""
    names = [("teacher", "teacher (DAPO, seed 0)"), *((arm, arm) for arm in ARMS)]
    return [(name, arm) for name, arm in names if (out / name / "checkpoints").is_dir()]


def from_disk(run_dir: Path) -> Run:
    """A finished run read back from its directory: its rows; its wall seconds from its steps' and evaluations'
    times; its load not recorded."""
    rows = read_metrics(run_dir)
    wall = sum(r.get("perf/time_step_s", 0.0) for r in rows) + sum(r.get("perf/time_eval_s", 0.0) for r in rows
                                                                      if r.get("step") == 0)  # fmt: skip
    return Run(run_dir.name, rows, wall, 0.0, NotRecorded())


class NotRecorded:
    def describe(self) -> str:
        return "load not recorded (summarised from the run directories; each run had the machine to itself)"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--teacher-steps", type=int, default=12)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--eval-problems", type=int, default=50)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--out", default="runs/distill_real")
    p.add_argument("--json", help="write the results file here")
    p.add_argument("--from-runs", action="store_true", help="summarise the runs already in --out; train nothing")
    args = p.parse_args()
    out = Path(args.out).resolve()
    if args.from_runs:
        results = [summary(from_disk(out / name), arm) for name, arm in done_runs(out)]
        for r in results[1:]:
            r["held_out_before"] = results[0]["held_out_before"]  # the same base model
        return write(args, results)
    seeding = ["train.seed={0}", "data.seed={0}", "rollout.seed={0}"]

    teacher_run = run_alone(
        PRESET,
        [
            *common(args),
            f"train.total_steps={args.teacher_steps}",
            "eval.before_train=true",
            *(s.format(0) for s in seeding),
        ],  # fmt: skip (its checkpoint: the one every run writes at its end)
        out / "teacher",
    )
    teacher = out / "teacher_model"
    ckpt = sorted((out / "teacher" / "checkpoints").glob("step_*"))[-1]
    subprocess.run([sys.executable, "-m", "dapo.cli", "export", str(ckpt), str(teacher)], check=True, cwd=ROOT)
    results = [summary(teacher_run, "teacher (DAPO, seed 0)")]
    print(json.dumps(results[-1]), flush=True)
    for arm in args.arms.split(","):
        run = run_alone(
            PRESET,
            [
                *common(args),
                f"train.total_steps={args.steps}",
                "eval.before_train=false",
                f"teacher.path={teacher}",
                *ARMS[arm],
                *(s.format(1) for s in seeding),
            ],  # fmt: skip
            out / arm,
        )
        results.append(summary(run, arm))
        results[-1]["held_out_before"] = results[0]["held_out_before"]  # the same base model
        print(json.dumps(results[-1]), flush=True)
    write(args, results)


def write(args, results: list[dict]) -> None:
    if args.json:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        record = {
            "title": "On-policy distillation on SmolLM2-135M-Instruct: a DAPO-trained SmolLM2 as the teacher",
            "group": "The demo and the Python API example",
            "measures": (
                f"configs/smollm2_135m.yaml with vLLM: the teacher trained {args.teacher_steps} steps with DAPO "
                "(seed 0); "
                f"the student (the same base model) {args.steps} steps in each arm (seed 1); held-out avg@4 on "
                f"{args.eval_problems} word problems before and after; seconds a step per phase, each run alone. "
                "One seed an arm."
            ),
            "command": "python benchmarks/distill_real.py " + " ".join(sys.argv[1:]),
            "date": date.today().isoformat(),
            "commit": commit,
            "machine": machine(),
            "load": "; ".join(sorted({r["load"] for r in results})),
            "figures": {"runs": results},
        }
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
