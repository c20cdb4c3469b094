"""SIGTERM at random moments: each trial starts the tiny training from outside (`dapo train`, or `torchrun` with 2
gloo ranks), sends SIGTERM after a random delay, starts the run again to finish it, and checks that the final
weights and AdamW state are bit-identical to an uninterrupted run's.

    python benchmarks/preempt_sweep.py [--trials 6] [--seed 0] [--steps 12] [--ranks 1|2]

The delay is drawn (seeded) uniformly from the time the uninterrupted run spent between its first row and its
last, counted from the stopped run's first row, so the signal falls anywhere in steps 2 to the last: generation,
grading, the old log-probs, the update, a checkpoint write (run.save_every=2), or the run's last moments.
Trials alternate synchronous and asynchronous checkpoints (run.async_checkpoint). With --ranks 2 the signal goes
to the torchrun launcher, which forwards it to both ranks. Printed per trial: the delay, where the signal landed
(the phase named in the stop line), the step of the checkpoint, the seconds from the signal to the exit, the exit
code, and whether the resumed run ended bit-identical.
"""

from __future__ import annotations

import argparse
import random
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from dapo import checkpoint
from dapo.checkpoint import shards as checkpoint_shards
from dapo.model import tiny

ROOT = Path(__file__).resolve().parents[1]
OVERRIDES = [  # the tests' small run (tests/conftest.py): about a second a step on 2 CPU cores
    "run.name=t",
    "run.progress=false",
    "run.loggers=console",
    "train.prompts_per_step=4",
    "train.mini_batch_prompts=2",
    "train.max_tokens_per_micro_batch=256",
    "rollout.group_size=4",
    "rollout.max_response_tokens=16",
    "algo.overlong_buffer_tokens=4",
    "algo.dynamic_sampling=false",
    "eval.num_problems=4",
    "eval.n=2",
    "eval.every_steps=null",
    "eval.before_train=false",
    "reward.num_workers=1",
    "train.lr=1e-3",
    "train.warmup_steps=0",
    "run.save_every=2",
]
LINE = re.compile(r"stopped by (SIG\w+) at step (\d+) \((.*?)\): (.*)")


def command(ranks: int, model: Path, runs: Path, steps: int, asynchronous: bool) -> list[str]:
    launcher = [sys.executable]
    if ranks > 1:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
    return [
        *launcher,
        "-m",
        "dapo.cli",
        "train",
        "configs/demo.yaml",
        *OVERRIDES,
        f"model.path={model}",
        f"run.dir={runs}",
        f"train.total_steps={steps}",
        f"run.async_checkpoint={str(asynchronous).lower()}",
    ]


def env() -> dict:
    import os

    return {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1", "COLUMNS": "500"}


def rows(run: Path) -> int:
    metrics = run / "metrics.jsonl"
    return metrics.read_text().count("\n") if metrics.exists() else 0


def start(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def run_through(cmd: list[str], run: Path, steps: int) -> float:
    """The run to its end; the seconds from its first row to its last."""
    proc = start(cmd)
    while rows(run) < 1 and proc.poll() is None:
        time.sleep(0.02)
    t0 = time.perf_counter()
    while rows(run) < steps and proc.poll() is None:
        time.sleep(0.02)
    span = time.perf_counter() - t0
    _, err = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"the run failed (exit {proc.returncode}):\n{err[-3000:]}")
    return span


def final_state(run: Path, ranks: int) -> dict:
    """The last checkpoint's weights and AdamW state, flattened."""
    last = checkpoint.latest_checkpoint(run)
    if ranks > 1:

        def flat(tree, prefix=""):
            if isinstance(tree, torch.Tensor):
                return {prefix: tree}
            if isinstance(tree, dict):
                return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}.{key}").items()}
            return {}

        return flat(checkpoint_shards.read_shards(last / "shards"))
    from safetensors.torch import load_file

    state = checkpoint.load_trainer_state(last)["policy"]["optimizer"]["state"]
    moments = {f"{k}.{m}": torch.as_tensor(v[m]) for k, v in state.items() for m in ("exp_avg", "exp_avg_sq", "step")}
    return {**load_file(str(last / "model" / "model.safetensors")), **moments}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--ranks", type=int, default=1, choices=(1, 2))
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = Path(tempfile.mkdtemp(prefix="preempt_sweep"))
    model = work / "model"
    tokenizer = tiny.build_tokenizer()
    tiny.save(tiny.build_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=0), tokenizer, model)

    reference, span = {}, {}
    for asynchronous in (False, True):
        runs = work / f"ref_{asynchronous}"
        cmd = command(args.ranks, model, runs, args.steps, asynchronous)
        span[asynchronous] = run_through(cmd, runs / "t", args.steps)
        reference[asynchronous] = final_state(runs / "t", args.ranks)
    print(
        f"{args.ranks} rank(s), {args.steps} steps, run.save_every=2; uninterrupted: first row to last "
        f"{span[False]:.1f} s (sync checkpoints), {span[True]:.1f} s (async); the two end bit-identical: "
        f"{same(reference[False], reference[True])}"
    )
    header = f"{'trial':>5} | {'async':>5} | {'delay s':>7} | {'landed in':<28} | {'step':>4} | exit | "
    header += f"{'exit s':>6} | resumed"
    print(header)
    print("-" * len(header))
    passed = 0
    for trial in range(args.trials):
        asynchronous = trial % 2 == 1
        delay = rng.uniform(0.0, span[asynchronous])
        runs = work / f"trial_{trial}"
        cmd = command(args.ranks, model, runs, args.steps, asynchronous)
        proc = start(cmd)
        while rows(runs / "t") < 1 and proc.poll() is None:
            time.sleep(0.02)
        time.sleep(delay)
        t0 = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate()
        seconds = time.perf_counter() - t0
        lines = [m for x in err.splitlines() if (m := LINE.match(x))]
        if lines:
            landed, step = lines[0].group(3), lines[0].group(2)
        else:
            done = rows(runs / "t") >= args.steps  # the training loop was over: the process ignores it
            landed, step = ("after the last step" if done else "no stop line"), "-"
        last = checkpoint.latest_checkpoint(runs / "t")
        saved_ok = not lines or (last is not None and str(checkpoint.step_of(last)) == step) or step == "0"
        run_through(cmd, runs / "t", args.steps)  # started again: resumes (or finds the run finished) and ends
        ok = saved_ok and same(final_state(runs / "t", args.ranks), reference[asynchronous])
        passed += ok
        print(
            f"{trial:>5} | {str(asynchronous).lower():>5} | {delay:>7.2f} | {landed:<28} | {step:>4} | "
            f"{proc.returncode:>4} | {seconds:>6.2f} | {'bit-identical' if ok else 'DIFFERS'}"
        )
    print(f"{passed}/{args.trials} trials resumed bit-identical; work files in {work}")
    sys.exit(0 if passed == args.trials else 1)


if __name__ == "__main__":
    main()
