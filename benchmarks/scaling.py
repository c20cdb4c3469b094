"""How a real-model step grows with G, prompts per step and response length.

    python benchmarks/scaling.py [--steps 2] [--budget 4096] [--points base,G4,...]   # make smollm2 first; ~20 min

Each point is `python -m dapo.training configs/smollm2_135m.yaml` in its own process with dynamic
sampling off (every step trains exactly P x G responses), no evaluation, vLLM rollout, the
preset's token budget per forward/backward pass (train.max_tokens_per_micro_batch=4096, or --budget). From the
last step's metrics: seconds per step (checkpoint excluded) and its phases, generation's share,
tokens trained, and each phase's peak resident memory (perf/peak_rss_<phase>_gb: collection, i.e.
vLLM's generation and grading; the old-log-prob pass; the update); and the process's peak over the
whole run (os.wait4). All of them hold vLLM's 0.5 GiB KV cache and its weights beside the trainer's
model, gradients and AdamW state. Beside the step's wall seconds, its CPU seconds (the trainer process's, every
thread); each point's process is measured for load (benchmarks/runs.py's Meter, the machine's cores its own jobs),
and a point that saw more is flagged below its row: its times compare with no other point's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from runs import Meter, describe  # noqa: E402

MODEL = Path("~/.cache/dapo/models/SmolLM2-135M-Instruct").expanduser()
BASE = {"G": 8, "P": 8, "L": 96}
POINTS = {
    "base": BASE,
    "G4": {**BASE, "G": 4},
    "G16": {**BASE, "G": 16},
    "P4": {**BASE, "P": 4},
    "P16": {**BASE, "P": 16},
    "L48": {**BASE, "L": 48},
    "L192": {**BASE, "L": 192},
}


def run_point(point: dict, steps: int, extra: tuple[str, ...] = ()) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        overrides = [
            f"rollout.group_size={point['G']}",
            f"train.prompts_per_step={point['P']}",
            f"train.mini_batch_prompts={point['P'] // 2}",
            f"rollout.max_response_tokens={point['L']}",
            f"algo.overlong_buffer_tokens={point['L'] // 4}",
            "algo.dynamic_sampling=false",
            "rollout.backend=vllm",
            "eval.benchmarks=[]",
            "eval.before_train=false",
            "run.save_every=null",
            f"train.total_steps={steps}",
            f"run.dir={tmp}",
            "run.name=p",
            "run.progress=false",
            "run.loggers=console",
            *extra,
        ]
        meter = Meter(own_jobs=os.cpu_count() or 1)
        with open(Path(tmp) / "stderr.txt", "w+") as err, meter:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dapo.training", str(ROOT / "configs/smollm2_135m.yaml"), *overrides],
                cwd=ROOT,
                stdout=subprocess.DEVNULL,
                stderr=err,
                env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
            )
            _, status, usage = os.wait4(proc.pid, 0)  # this child's own peak memory
            proc.returncode = os.waitstatus_to_exitcode(status)
            err.seek(0)
            if proc.returncode:
                sys.exit(f"{point} failed:\n{err.read()[-3000:]}")
        rows = [json.loads(line) for line in (Path(tmp) / "p" / "metrics.jsonl").read_text().splitlines()]
    return {
        "row": rows[-1],
        "peak_gb": usage.ru_maxrss / 2**20,
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "wall_s": meter.wall_s,
        "load": meter.load.summary(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=2, help="steps per point; the last is reported")
    ap.add_argument("--budget", type=int, default=None, help="train.max_tokens_per_micro_batch (the preset's: 4096)")
    ap.add_argument("--points", default=",".join(POINTS), help="which points, comma-separated: " + ",".join(POINTS))
    args = ap.parse_args()
    extra = (f"train.max_tokens_per_micro_batch={args.budget}",) if args.budget else ()
    if not (MODEL / "config.json").exists():
        sys.exit(f"needs {MODEL}: run `make smollm2` once")
    print(
        f"{'G':>3s} {'P':>3s} {'L':>4s} {'rows':>5s} {'s/step':>7s} {'generate':>9s} {'gen %':>6s} {'old logp':>9s} "
        f"{'update':>7s} {'push':>5s} {'trained tok':>11s} {'peak GiB: collect':>17s} {'old logp':>8s} {'update':>6s} "
        f"{'process':>7s} {'CPU s/step':>10s}",
        flush=True,
    )
    for name in args.points.split(","):
        point = POINTS[name]
        res = run_point(point, args.steps, extra)
        r = res["row"]

        def peak(phase: str) -> float:
            return r.get(f"perf/peak_rss_{phase}_gb", float("nan"))

        step = r["perf/time_step_s"] - r.get("perf/time_checkpoint_s", 0.0)
        gen = r["perf/time_generate_s"]
        tokens = (
            r["sampling/samples_generated"]
            / max(r["sampling/samples_per_trained_sample"], 1e-9)
            * r["rollout/response_length_mean"]
        )
        print(
            f"{point['G']:3d} {point['P']:3d} {point['L']:4d} {point['G'] * point['P']:5d} {step:7.1f} {gen:9.1f} "
            f"{100 * gen / step:5.0f}% {r.get('perf/time_old_logprob_s', 0):9.1f} "
            f"{r.get('perf/time_update_s', 0):7.1f} "
            f"{r.get('perf/time_weight_sync_s', 0):5.2f} {tokens:11.0f} {peak('collect'):17.2f} "
            f"{peak('old_logprob'):8.2f} "
            f"{peak('update'):6.2f} {res['peak_gb']:7.2f} "
            f"{r.get('perf/cpu_step_s', float('nan')) - r.get('perf/cpu_checkpoint_s', 0.0):10.1f}",
            flush=True,
        )
        if not res["load"]["clean"]:
            print(f"    (shared the machine: {describe(res['load'])}; its times compare with no other point's)")


if __name__ == "__main__":
    main()
