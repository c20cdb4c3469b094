"""This project against TRL's GRPOTrainer (DAPO loss) on the demo task: seconds per step, time to accuracy.

    pip install -e '.[bench]'            # TRL is a benchmark-only extra
    python benchmarks/vs_trl.py [--runs 3] [--steps 6] [--target 0.6] [--max-steps 60] [--threads 2]

Both sides train the shipped assets/arith-base on the same arith train problems (the same prompt
text), with G=8, 48 new tokens at most, lr 5e-4 after the same 5-step warmup, 32 prompts and 2
optimizer updates per step, 64 responses per forward/backward pass, eps 0.2/0.28, token-mean
loss, truncated responses masked out of the loss, no KL term, reward +1/-1 from the arith grader,
sampling at temperature 1 with transformers' generate and its KV cache, float32 weights, no
gradient checkpointing, and the same torch thread count.

TRL's settings for that (TRL counts completions, and one of its steps is one optimizer update):
per_device_train_batch_size=64 (responses per pass), gradient_accumulation_steps=2 (128 responses,
16 prompts, per update), steps_per_generation=4 (64 x 4 = 256 responses = 32 prompts x 8 generated
at once and used for 2 updates), num_iterations=1, num_generations=8, loss_type="dapo",
epsilon=0.2, epsilon_high=0.28, mask_truncated_completions=True, beta=0, use_vllm=False,
bf16=False and gradient_checkpointing=False (TRL's defaults are True for both; this project trains
in float32 without checkpointing), warmup_steps=10 with a constant schedule (10 updates = our 5
steps). One step of ours = two of TRL's, and that pair is what "s/step" times for TRL.

Our side runs twice: "equal" has the settings above (dynamic sampling off, overlong filtering on,
soft overlong punishment off, no dual clip: what TRL does); "default" is configs/demo.yaml as
shipped (dynamic sampling with adaptive over-sampling, soft overlong punishment, dual clip).

Part 1, s/step: each run starts each side in a fresh subprocess (memory and threads clean), the
order alternating run by run; the first --warmup steps of each are dropped, the rest give the
run's median; printed is the median over runs. Time is given as the process's CPU time (with one
torch thread, what other processes on a shared machine barely disturb; grading in our reward
pool's worker processes, ~1% of a step, is not in it) and as wall time. Part 2, time to accuracy: each side trains from
the base model and is evaluated every --eval-every steps with dapo.evaluate (avg@4 on the same 200
held-out problems, the same sampling and seed for both); printed is the training time (CPU and
wall, evaluation excluded) until avg@4 first reaches --target.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("ours-equal", "trl", "ours-default")

# the settings both sides share; TRL's names for them are in the docstring above
G, MAX_NEW, LR, PROMPTS, UPDATES, MICRO, WARMUP = 8, 48, 5e-4, 32, 2, 64, 5
EVAL_PROBLEMS, EVAL_N, EVAL_SEED = 200, 4, 1234
OURS_EQUAL = [
    "algo.dynamic_sampling=false", "algo.overlong_filtering=true", "algo.soft_overlong_punishment=false",
    "algo.dual_clip=null", "algo.loss_agg=token-mean", "algo.kl_coef=0",
]


# ---- workers: one side, one process ------------------------------------------------------------


class TargetReached(Exception):
    pass


def run_ours(args, overrides: list[str]) -> dict:
    import dapo.evaluate
    import dapo.log
    from dapo.config import load_config
    from dapo.log import read_metrics
    from dapo.train import train

    # CPU time is read where the loop logs each step; evaluation's share is taken out (measuring only)
    cpu = {"eval": 0.0, "marks": []}
    evaluate, log = dapo.evaluate.evaluate, dapo.log.RunLogger.log

    def timed_evaluate(*a, **kw):
        c0 = time.process_time()
        out = evaluate(*a, **kw)
        cpu["eval"] += time.process_time() - c0
        return out

    def timed_log(self, step, metrics):
        cpu["marks"].append((step, time.process_time(), cpu["eval"]))
        out = log(self, step, metrics)
        if args.target and metrics.get(f"eval/arith/avg@{EVAL_N}", 0.0) >= args.target:
            raise TargetReached  # the step is logged; nothing after it is measured
        return out

    dapo.evaluate.evaluate, dapo.log.RunLogger.log = timed_evaluate, timed_log
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(ROOT / "configs/demo.yaml", [
            f"model.path={ROOT / 'assets/arith-base'}", f"run.dir={tmp}", "run.name=bench", "run.progress=false",
            "run.tensorboard=false", "run.save_every=null", "run.resume=false", "run.samples_per_step=0",
            "model.device=cpu", f"rollout.group_size={G}", f"rollout.max_response_tokens={MAX_NEW}",
            f"train.lr={LR}", f"train.prompts_per_step={PROMPTS}", f"train.mini_batch_prompts={PROMPTS // UPDATES}",
            f"train.warmup_steps={WARMUP}", f"train.total_steps={args.total}",
            f"eval.every_steps={args.eval_every or 'null'}", "eval.before_train=false", f"eval.num_problems={EVAL_PROBLEMS}",
            f"eval.n={EVAL_N}", f"eval.seed={EVAL_SEED}", *overrides,
        ])
        t0 = time.perf_counter()
        cpu["marks"].append((0, time.process_time(), 0.0))
        try:
            train(cfg)
        except TargetReached:
            pass
        total = time.perf_counter() - t0
        rows = [r for r in read_metrics(cfg.run_dir) if r.get("step", 0) > 0]
    key = f"eval/arith/avg@{EVAL_N}"
    steps, evals, clock, cpu_clock = [], [], 0.0, 0.0
    for r, (_, c0, e0), (_, c1, e1) in zip(rows, cpu["marks"], cpu["marks"][1:]):
        # training time of the step: evaluation and the final checkpoint are not training
        seconds = r["perf/time_step_s"] - r.get("perf/time_eval_s", 0.0) - r.get("perf/time_checkpoint_s", 0.0)
        cpu_s = (c1 - c0) - (e1 - e0)
        clock += seconds
        cpu_clock += cpu_s
        steps.append({"s": seconds, "cpu_s": cpu_s, "generate": r["perf/time_generate_s"],
                      "old_logprob": r["perf/time_old_logprob_s"], "update": r["perf/time_update_s"],
                      "gen_rounds": r["sampling/gen_rounds"]})
        if key in r:
            evals.append({"step": r["step"], "train_s": clock, "train_cpu_s": cpu_clock, "acc": r[key]})
    return {"steps": steps, "evals": evals, "total_s": total}


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dapo.evaluate import evaluate, load_benchmark
    from dapo.rewards import RewardPool, grade
    from dapo.rollout.base import SamplingParams
    from dapo.rollout.hf import HFRolloutEngine
    from dapo.tasks import arith
    from dapo.data import make_encoder

    path = ROOT / "assets/arith-base"
    tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, trust_remote_code=False)
    train_examples = arith.make_examples("train", 3000, seed=0, difficulty="demo")  # what data.task=arith uses
    dataset = Dataset.from_list([{"prompt": ex.text(), "ground_truth": ex.ground_truth} for ex in train_examples])

    def arith_reward(prompts, completions, ground_truth, **kwargs) -> list[float]:
        return [1.0 if grade(c, t, "arith").acc else -1.0 for c, t in zip(completions, ground_truth)]

    timings = {"generate": 0.0}
    clock = {"last": None, "last_cpu": None, "train": 0.0, "train_cpu": 0.0}
    steps, evals = [], []
    _, eval_examples = load_benchmark("arith", num_problems=EVAL_PROBLEMS)
    encode = make_encoder(tokenizer, 2048)
    pool = RewardPool(num_workers=2, timeout_s=5.0)

    class Timer(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            clock["last"], clock["last_cpu"] = time.perf_counter(), time.process_time()

        def on_step_end(self, a, state, control, model=None, **kw):
            if state.global_step % UPDATES:
                return
            seconds, cpu_s = time.perf_counter() - clock["last"], time.process_time() - clock["last_cpu"]
            clock["train"] += seconds
            clock["train_cpu"] += cpu_s
            steps.append({"s": seconds, "cpu_s": cpu_s, "generate": timings["generate"]})
            timings["generate"] = 0.0
            step = state.global_step // UPDATES
            if args.eval_every and step % args.eval_every == 0:
                engine = HFRolloutEngine(model, tokenizer)
                sampling = SamplingParams(n=EVAL_N, temperature=1.0, top_p=1.0, max_new_tokens=MAX_NEW, seed=EVAL_SEED)
                res = evaluate(engine, encode, eval_examples, pool, sampling, name="arith", grader="arith")
                evals.append({"step": step, "train_s": clock["train"], "train_cpu_s": clock["train_cpu"], "acc": res.avg})
                print(f"trl step {step}: avg@{EVAL_N} {res.avg:.3f}", flush=True)
                if args.target and res.avg >= args.target:
                    control.should_training_stop = True
            clock["last"], clock["last_cpu"] = time.perf_counter(), time.process_time()  # evaluation is not training

    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
            save_strategy="no", logging_steps=10, seed=0, data_seed=0, max_steps=args.total * UPDATES,
            learning_rate=LR, lr_scheduler_type="constant_with_warmup", warmup_steps=WARMUP * UPDATES,
            weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, max_grad_norm=1.0,
            per_device_train_batch_size=MICRO, gradient_accumulation_steps=PROMPTS * G // UPDATES // MICRO,
            steps_per_generation=PROMPTS * G // MICRO, num_iterations=1, num_generations=G,
            max_completion_length=MAX_NEW, temperature=1.0, top_p=1.0, top_k=0, use_vllm=False,
            loss_type="dapo", epsilon=0.2, epsilon_high=0.28, mask_truncated_completions=True, beta=0.0,
            scale_rewards="group", disable_tqdm=True,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=arith_reward, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[Timer()])
        generate_turn = trainer._generate_single_turn

        def timed_generate(*a, **kw):  # measures only; TRL's own generation runs unchanged
            t0 = time.perf_counter()
            out = generate_turn(*a, **kw)
            timings["generate"] += time.perf_counter() - t0
            return out

        trainer._generate_single_turn = timed_generate
        t0 = time.perf_counter()
        with pool:
            trainer.train()
        total = time.perf_counter() - t0
    return {"steps": steps, "evals": evals, "total_s": total}


def worker(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    if args.worker == "trl":
        out = run_trl(args)
    else:
        out = run_ours(args, OURS_EQUAL if args.worker == "ours-equal" else [])
    Path(args.json).write_text(json.dumps(out))


# ---- the driver ----------------------------------------------------------------------------------


def launch(side: str, args, *, total: int, eval_every: int, target: float) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        out = f.name
    cmd = [sys.executable, __file__, "--worker", side, "--json", out, "--threads", str(args.threads),
           "--total", str(total), "--eval-every", str(eval_every), "--target", str(target)]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{side} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    result = json.loads(Path(out).read_text())
    os.unlink(out)
    return result


def load() -> str:
    return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())


def per_step(args, sides: list[str]) -> dict[str, dict]:
    runs: dict[str, list[dict]] = {s: [] for s in sides}
    for run in range(args.runs):
        order = sides if run % 2 == 0 else sides[::-1]
        for side in order:
            res = launch(side, args, total=args.warmup + args.steps, eval_every=0, target=0.0)
            kept = res["steps"][args.warmup :]
            med = {k: statistics.median(s[k] for s in kept) for k in kept[0]}
            runs[side].append(med)
            print(f"  run {run + 1} {side:13s} {med['s']:.2f} s/step, {med['cpu_s']:.2f} CPU s/step  ({load()})", flush=True)
    return {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in runs.items()}


def to_target(args, sides: list[str]) -> dict[str, dict]:
    out = {}
    for side in sides:
        res = launch(side, args, total=args.max_steps, eval_every=args.eval_every, target=args.target)
        hit = next((e for e in res["evals"] if e["acc"] >= args.target), None)
        best = max((e["acc"] for e in res["evals"]), default=0.0)
        out[side] = {"hit": hit, "best": best, "evals": res["evals"]}
        where = (f"{hit['train_cpu_s']:.1f} CPU s, {hit['train_s']:.1f} s wall (step {hit['step']}, avg@4 {hit['acc']:.3f})" if hit
                 else f"not reached in {args.max_steps} steps (best {best:.3f})")
        print(f"  {side:13s} {where}  ({load()})", flush=True)
        print("    " + ", ".join(f"step {e['step']}: {e['acc']:.3f} @ {e['train_cpu_s']:.0f} CPU s" for e in res["evals"]),
              flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3, help="alternated runs of each side for s/step")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per run (after the warm-up)")
    parser.add_argument("--warmup", type=int, default=2, help="steps dropped at the start of each run")
    parser.add_argument("--threads", type=int, default=1, help="torch threads, both sides")
    parser.add_argument("--target", type=float, default=0.6, help="held-out avg@4 to reach")
    parser.add_argument("--max-steps", type=int, default=60, help="cap on steps in the accuracy race")
    parser.add_argument("--eval-every", type=int, default=5)
    parser.add_argument("--skip-steps", action="store_true", help="skip part 1 (s/step)")
    parser.add_argument("--skip-accuracy", action="store_true", help="skip part 2 (time to accuracy)")
    parser.add_argument("--sides", default=",".join(SIDES), help="comma-separated: " + ", ".join(SIDES))
    parser.add_argument("--worker", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--total", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    try:
        import trl
    except ImportError:
        sys.exit("TRL is not installed: pip install -e '.[bench]'")
    import torch
    import transformers

    sides = [s for s in SIDES if s in args.sides.split(",")]
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, trl {trl.__version__}, "
          f"{args.threads} threads, {os.cpu_count()} CPUs, {load()}")
    if not args.skip_steps:
        print(f"s/step: {args.runs} alternated runs x {args.steps} steps (+{args.warmup} warm-up) per side")
        med = per_step(args, sides)
        print(f"\n{'side':13s} {'CPU s/step':>10s} {'s/step':>7s} {'generate':>9s} {'rest':>6s}  "
              f"TRL / side (CPU)  (wall)")
        for side in sides:
            m = med[side]
            print(f"{side:13s} {m['cpu_s']:10.2f} {m['s']:7.2f} {m['generate']:9.2f} {m['s'] - m['generate']:6.2f}  "
                  + (f"{med['trl']['cpu_s'] / m['cpu_s']:15.2f}x  {med['trl']['s'] / m['s']:5.2f}x" if "trl" in med else ""))
    if not args.skip_accuracy:
        print(f"\ntime to held-out avg@4 >= {args.target} (eval every {args.eval_every} steps, cap {args.max_steps})")
        res = to_target(args, sides)
        trl_hit = res["trl"]["hit"] if "trl" in res else None
        for side in sides:
            hit = res[side]["hit"]
            if side != "trl" and hit and trl_hit:
                print(f"{side}: {hit['train_cpu_s'] / trl_hit['train_cpu_s']:.2f} of TRL's CPU time to the target, "
                      f"{hit['train_s'] / trl_hit['train_s']:.2f} of its wall time")


if __name__ == "__main__":
    main()
