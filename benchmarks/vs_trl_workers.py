"""The workers of benchmarks/vs_trl.py: one side (ours or TRL) trained in one process, its steps timed.

benchmarks/vs_trl.py starts each in a fresh subprocess (`--worker SIDE --json OUT`) and reads the JSON it
writes: the steps' times and the held-out evaluations with the training time before each. The settings both
sides share, and TRL's names for them, are in that script's docstring.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# the settings both sides share; TRL's names for them are in benchmarks/vs_trl.py's docstring
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

    def __init__(self, real: bool, lr: float | None = None):
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
        if lr is not None:  # --lr 1e-12: both policies stay the base model, so the sides sample one distribution
            self.lr = lr

    @property
    def eval_key(self) -> str:
        return f"eval/{self.bench}/avg@{self.eval_n}"


# ---- our side ------------------------------------------------------------------------------------


class TargetReached(Exception):
    pass


def time_our_steps(args, st: Setting) -> dict:
    """Wrap the loop's evaluation and step logging to read CPU time at each logged step, with evaluation's
    share taken out (measuring only); stop training once the target is logged. Returns the record it fills:
    "marks" (step, CPU time, evaluation CPU time so far) and "eval" (evaluation CPU time so far)."""
    import dapo.evaluation
    import dapo.reporting.run_log
    import dapo.training

    cpu = {"eval": 0.0, "marks": []}
    evaluate, log = dapo.evaluation.evaluate, dapo.reporting.run_log.RunLogger.log

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

    dapo.training.evaluate, dapo.reporting.run_log.RunLogger.log = timed_evaluate, timed_log
    return cpu


def our_overrides(args, st: Setting, run_dir: str, overrides: list[str]) -> list[str]:
    """The preset's overrides for this side: the shared settings, the run's length and seeds, evaluation."""
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
    return [
        f"model.path={st.model}",
        f"run.dir={run_dir}",
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
    ]


def our_result(st: Setting, rows: list[dict], base: list[dict], cpu_marks: list, total: float) -> dict:
    """Each step's training time (wall and CPU) from the logged metrics and the CPU marks, and the held-out
    evaluations with the training time before each."""
    steps, evals, clock, cpu_clock = [], [], 0.0, 0.0
    if base:
        evals.append({"step": 0, "train_s": 0.0, "train_cpu_s": 0.0, "acc": base[0][st.eval_key]})
    marks = [m for m in cpu_marks if m[0] > 0 or m is cpu_marks[0]]
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
                "gen_tokens": r.get("sampling/tokens_generated", 0.0),
                "old_logprob": r.get("perf/time_old_logprob_s", 0.0),
                "update": r.get("perf/time_update_s", 0.0),
                "gen_rounds": r["sampling/gen_rounds"],
            }
        )
        if st.eval_key in r:
            evals.append({"step": r["step"], "train_s": clock, "train_cpu_s": cpu_clock, "acc": r[st.eval_key]})
    return {"steps": steps, "evals": evals, "total_s": total}


def run_ours(args, overrides: list[str]) -> dict:
    from dapo.config import load_config
    from dapo.reporting.run_log import read_metrics
    from dapo.training import train

    st = Setting(args.real, args.lr)
    cpu = time_our_steps(args, st)
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(st.preset, our_overrides(args, st, tmp, overrides))
        t0 = time.perf_counter()
        cpu["marks"].append((0, time.process_time(), 0.0))
        try:
            train(cfg)
        except TargetReached:
            pass
        total = time.perf_counter() - t0
        rows = [r for r in read_metrics(cfg.run_dir) if r.get("step", 0) > 0]
        base = [r for r in read_metrics(cfg.run_dir) if r.get("step", 0) == 0 and st.eval_key in r]
    return our_result(st, rows, base, cpu["marks"], total)


# ---- TRL's side ----------------------------------------------------------------------------------


def trl_dataset(st: Setting):
    """The training problems as TRL's dataset rows: the same prompt text our side trains on."""
    from datasets import Dataset

    from dapo.data import arith
    from dapo.data.files import load_examples

    if st.real:  # the problems as user turns: TRL applies the chat template, as our side does
        train_examples = load_examples(ROOT / "data/word_problems/train.jsonl", template="raw")
        rows = [
            {"prompt": [{"role": "user", "content": ex.text()}], "ground_truth": ex.ground_truth}
            for ex in train_examples
        ]
    else:
        train_examples = arith.make_examples("train", 3000, seed=0, difficulty="demo")  # what data.task=arith uses
        rows = [{"prompt": ex.text(), "ground_truth": ex.ground_truth} for ex in train_examples]
    return Dataset.from_list(rows)


class HeldOut:
    """avg@n with the evaluator our side uses (vLLM for the real model); not timed as training. Its reward
    pool, which grades the held-out answers, runs while TRL trains (`with held_out.pool`)."""

    def __init__(self, st: Setting, model, tokenizer):
        from dapo.data.prompts import make_encoder
        from dapo.evaluation import load_benchmark
        from dapo.rewards import RewardPool

        self.st, self.model, self.tokenizer = st, model, tokenizer
        _, self.examples = load_benchmark(
            st.bench, num_problems=st.eval_problems, template="raw" if st.real else "dapo"
        )
        self.encode = make_encoder(tokenizer, 2048)
        self.pool = RewardPool(num_workers=2, timeout_s=5.0)
        self.engine = None

    def __call__(self) -> float:
        from dapo.evaluation import evaluate
        from dapo.rollout.base import SamplingParams

        st = self.st
        if self.engine is None:
            from dapo.config import RolloutConfig
            from dapo.rollout.build import engine_on

            backend = "vllm" if st.real else "hf"
            self.engine = engine_on(
                RolloutConfig(backend=backend, kv_cache_gib=0.5),
                self.model,
                self.tokenizer,
                max_model_len=256 + st.max_new,
            )
        if self.engine.backend == "vllm":
            self.engine.update_weights(self.model.named_parameters())
        sampling = SamplingParams(
            n=st.eval_n, temperature=st.temperature, top_p=1.0, max_new_tokens=st.max_new, seed=st.eval_seed
        )
        return evaluate(
            self.engine, self.encode, self.examples, self.pool, sampling, name=st.bench, grader=st.grader
        ).avg


def trl_timer(args, st: Setting, held_out: HeldOut, timings: dict, steps: list, evals: list):
    """A TRL callback that times each of our steps (st.updates of TRL's), evaluates every --eval-every of them
    (outside the timed span) and stops training at the target."""
    from transformers import TrainerCallback

    clock = {"last": None, "last_cpu": None, "train": 0.0, "train_cpu": 0.0}

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
            steps.append(
                {"s": seconds, "cpu_s": cpu_s, "generate": timings["generate"], "gen_tokens": timings["tokens"]}
            )
            print(
                f"trl step {state.global_step // st.updates}: {seconds:.1f} s (generate {timings['generate']:.1f} s)",
                flush=True,
            )
            timings["generate"], timings["tokens"] = 0.0, 0
            step = state.global_step // st.updates
            if args.eval_every and step % args.eval_every == 0:
                acc = held_out()
                evals.append({"step": step, "train_s": clock["train"], "train_cpu_s": clock["train_cpu"], "acc": acc})
                print(f"trl step {step}: avg@{st.eval_n} {acc:.3f}", flush=True)
                if args.target and acc >= args.target:
                    control.should_training_stop = True
            clock["last"], clock["last_cpu"] = time.perf_counter(), time.process_time()  # evaluation is not training

    return Timer()


def trl_config(args, st: Setting, output_dir: str):
    """GRPOConfig at the shared settings (the mapping is in benchmarks/vs_trl.py's docstring)."""
    from trl import GRPOConfig

    per_update = st.prompts * st.G // st.updates
    vllm = {"use_vllm": True, "vllm_mode": "colocate", "vllm_gpu_memory_utilization": 0.3} if args.trl_vllm else {}
    return GRPOConfig(
        output_dir=output_dir,
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


def time_trl_generation(trainer, timings: dict) -> None:
    """Add the time of TRL's generation calls to timings["generate"] and the tokens they generated to
    timings["tokens"]."""
    generate_turn = trainer._generate_single_turn

    def timed_generate(*a, **kw):  # measures only; TRL's own generation runs unchanged
        t0 = time.perf_counter()
        out = generate_turn(*a, **kw)
        timings["generate"] += time.perf_counter() - t0
        timings["tokens"] += sum(len(c) for c in out[0])  # completion ids, each up to and including its EOS
        return out

    trainer._generate_single_turn = timed_generate


def run_trl(args) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    from dapo.rewards import grade

    st = Setting(args.real, args.lr)
    tokenizer = AutoTokenizer.from_pretrained(st.model, trust_remote_code=False)
    model = AutoModelForCausalLM.from_pretrained(st.model, dtype=torch.float32, trust_remote_code=False)
    dataset = trl_dataset(st)

    def reward(prompts, completions, ground_truth, **kwargs) -> list[float]:
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        return [1.0 if grade(c, t, st.grader).acc else -1.0 for c, t in zip(texts, ground_truth)]

    timings = {"generate": 0.0, "tokens": 0}
    steps, evals = [], []
    held_out = HeldOut(st, model, tokenizer)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = GRPOTrainer(
            model=model,
            reward_funcs=reward,
            args=trl_config(args, st, tmp),
            train_dataset=dataset,
            processing_class=tokenizer,
            callbacks=[trl_timer(args, st, held_out, timings, steps, evals)],
        )
        time_trl_generation(trainer, timings)
        t0 = time.perf_counter()
        with held_out.pool:
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
