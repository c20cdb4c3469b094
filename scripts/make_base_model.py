#!/usr/bin/env python
"""Build the demo's base model (assets/arith-base/): a tiny Qwen2 warm-started on the arith task.

The warm start is ordinary supervised fine-tuning (next-token cross-entropy on the response and
its EOS). The first ``--clean-frac`` of the steps use correct worked solutions, so the skill is
learnt quickly; the rest use solutions whose steps are wrong with probability ``--error-rate``.
The model ends up knowing the procedure (greedy decoding is mostly right) while keeping real
probability on slips: sampling at temperature 1.0 reproduces them, and a correctness reward has
something real to remove.

Held-out accuracy (base_model_eval.json) is measured as training measures it: samples from the
package's HF rollout engine, graded by the `arith` grader.

Deterministic for a given seed and thread count; under three minutes on two idle CPU cores:

    python scripts/make_base_model.py                 # writes assets/arith-base/
    python scripts/make_base_model.py --out /tmp/m --steps 200   # quicker, for experiments

The ablation study's base model (assets/arith-long-base/) continues from the demo's model on the
"long" difficulty, so it only has to learn longer problems, not the procedure; two stages, the
second with a lower learning rate (about 15 minutes on one core; sampled accuracy 19%, greedy 40%):

    python scripts/make_base_model.py --difficulty long --init assets/arith-base --out /tmp/long-stage1 \
        --steps 500 --lr 1e-3 --warmup 20 --clean-frac 0.7 --error-rate 0.12 --max-new-tokens 40 --threads 1
    python scripts/make_base_model.py --difficulty long --init /tmp/long-stage1 --out assets/arith-long-base \
        --steps 300 --lr 5e-4 --warmup 10 --clean-frac 0.6 --error-rate 0.1 --max-new-tokens 40 --threads 1

The ablation study's base model (assets/arith-loop-base/) continues from the demo's model on the
demo's problems with solutions that repeat their result line before the answer (``--ramble-rate``),
so it loops: about 16% of its samples run past a 32-token limit (about 3 minutes on one core;
sampled accuracy 26%, greedy 0.5%, since greedy decoding always takes the repeat):

    python scripts/make_base_model.py --difficulty demo --init assets/arith-base --out assets/arith-loop-base \
        --steps 300 --lr 5e-4 --warmup 20 --clean-frac 0.0 --error-rate 0.35 --ramble-rate 0.7 \
        --max-new-tokens 32 --threads 1

The tool demo's base model (assets/arith-tools-base/, configs/demo_tools.yaml) continues from the demo's model with
some solutions that compute with the Python tool (``--tool-rate``): a ```python block that prints the problem's
expression, the ```output block the sandbox prints (not a target: the tool writes it), and the answer read off
it; some calls miscopy an operand (``--tool-error-rate``), so a call is not a sure answer. Half of its solutions
call the tool: a base that calls in only a minority of its samples (``--tool-rate 0.25``: 16%) stops calling within
ten DAPO steps, as the text path's updates outweigh the calls' (docs/tools.md, "The demo with a tool"):

    python scripts/make_base_model.py --difficulty demo --init assets/arith-base --out assets/arith-tools-base \
        --steps 300 --lr 5e-4 --warmup 20 --clean-frac 0.0 --error-rate 0.35 --tool-rate 0.5 \
        --tool-error-rate 0.1 --max-new-tokens 64 --threads 1
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

from dapo.data import arith
from dapo.model import tiny
from dapo.rewards import grade
from dapo.rollout.base import SamplingParams
from dapo.rollout.hf import HFRolloutEngine

REPO = Path(__file__).resolve().parent.parent


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=REPO / "assets" / "arith-base")
    p.add_argument("--difficulty", default="demo", choices=sorted(arith.DIFFICULTIES))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--error-rate", type=float, default=0.35, help="chance that a step's result is wrong")
    p.add_argument(
        "--clean-frac",
        type=float,
        default=0.6,
        help="share of the steps, at the start, trained on correct solutions only",
    )
    p.add_argument(
        "--ramble-rate",
        type=float,
        default=0.0,
        help="chance that the result line is written once more before the answer (repeatable)",
    )
    p.add_argument(
        "--tool-rate",
        type=float,
        default=0.0,
        help="chance that a solution computes with the Python tool (a ```python block, its ```output, the answer)",
    )
    p.add_argument(
        "--tool-error-rate",
        type=float,
        default=0.0,
        help="chance that a tool solution's code miscopies one operand of the problem",
    )
    p.add_argument(
        "--init", type=Path, default=None, help="continue from this model directory instead of a fresh model"
    )
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--hidden-size", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate-size", type=int, default=384)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-problems", type=int, default=200)
    p.add_argument("--eval-samples", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=48)
    return p.parse_args(argv)


def training_batch(rng: random.Random, tokenizer, args, error_rate: float):
    """Right-padded ids, attention mask and labels (-100 on prompt and padding)."""
    seqs, labels = [], []
    for _ in range(args.batch_size):
        while True:
            problem = arith.random_problem(rng, args.difficulty)
            # Held-out problems must stay unseen, or the demo's accuracy would measure recall.
            if arith.split_of(problem) == "train":
                break
        p_ids = tokenizer(problem, add_special_tokens=False)["input_ids"]
        if rng.random() < args.tool_rate:
            call, output, answer = tool_solution(problem, rng, args.tool_error_rate)
            c_ids, o_ids = (tokenizer(t, add_special_tokens=False)["input_ids"] for t in (call, output))
            a_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
            seqs.append(p_ids + c_ids + o_ids + a_ids)
            # the output block is the tool's: context to read, never a target (as in training, docs/tools.md)
            labels.append([-100] * len(p_ids) + c_ids + [-100] * len(o_ids) + a_ids)
            continue
        response = ramble(arith.noisy_solution(problem, rng, error_rate), rng, args.ramble_rate)
        r_ids = tokenizer(response, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        seqs.append(p_ids + r_ids)
        labels.append([-100] * len(p_ids) + r_ids)
    width = max(len(s) for s in seqs)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([s + [pad] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    lab = torch.tensor([row + [-100] * (width - len(row)) for row in labels])
    return ids, mask, lab


def tool_solution(problem: str, rng: random.Random, error_rate: float) -> tuple[str, str, str]:
    """A solution that computes with the Python tool: the call, the output block the sandbox would print for it,
    and the answer read off that output. With probability ``error_rate`` the code miscopies one operand (a slip
    the tool cannot fix: it prints the value of the wrong expression)."""
    nums, ops = arith.parse(problem)
    if rng.random() < error_rate:
        i = rng.randrange(len(nums))
        nums[i] = rng.choice([d for d in range(1, 10) if d != nums[i]])
    expr = "".join(f"{n}{o}" for n, o in zip(nums, [*ops, ""]))
    value = arith.compute(expr + "=")
    call = f"```python\nprint({expr})\n```\n"
    return call, f"```output\n{value}\n```\n", f"Answer: {value}"


def ramble(response: str, rng: random.Random, rate: float) -> str:
    """Write the result line again at random before the answer: length the answer does not need.

    After the last working line the line is repeated with probability ``rate``, and again with
    the same chance, so some responses loop on it and run past the limit before they reach their
    ``Answer:`` line, as a looping model does. The working and the answer are unchanged: a policy
    can only gain by dropping the repeats.
    """
    *working, answer = response.split("\n")
    while working and rng.random() < rate:
        working.append(working[-1])
    return "\n".join(working + [answer])


def accuracy(
    model, tokenizer, examples, *, samples: int, do_sample: bool, max_new_tokens: int, seed: int, tools: bool = False
) -> float:
    """Share of responses the `arith` grader scores right, sampled by the package's rollout engine
    (the trainer's own sampling and grading path); with ``tools``, with the Python tool in its sandbox."""
    engine = HFRolloutEngine(model, tokenizer)
    if tools:
        from dapo.rollout.multi_turn import ToolRollout
        from dapo.tools import PythonTool, Sandbox

        engine = ToolRollout(engine, tokenizer, PythonTool(Sandbox()), max_turns=2, max_calls=1)
    prompt_ids = [tokenizer(e.prompt, add_special_tokens=False)["input_ids"] for e in examples]
    params = SamplingParams(
        n=samples, temperature=1.0 if do_sample else 0.0, top_p=1.0, top_k=0, max_new_tokens=max_new_tokens, seed=seed
    )
    gen = engine.generate(prompt_ids, params)
    truths = [e.ground_truth for e in examples for _ in range(samples)]  # prompt-major, as gen's rows
    if tools:
        calls = sum(log.calls for log in gen.tool_logs) / len(truths)
        print(f"tool calls per response ({'sampled' if do_sample else 'greedy'}): {calls:.3f}", flush=True)
    return sum(grade(text, truth, "arith").acc for text, truth in zip(gen.texts, truths)) / len(truths)


def load_or_build_model(args):
    """The tokenizer and model to warm-start: those in --init, or a fresh tiny Qwen2 of the given sizes."""
    if args.init is not None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.init, trust_remote_code=False)
        model = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32, trust_remote_code=False)
        return tokenizer, model
    tokenizer = tiny.build_tokenizer()
    model = tiny.build_model(
        tokenizer,
        hidden_size=args.hidden_size,
        num_layers=args.layers,
        num_heads=args.heads,
        intermediate_size=args.intermediate_size,
        seed=args.seed,
    )
    return tokenizer, model


def warm_start(model, tokenizer, args, rng: random.Random, started: float) -> None:
    """The supervised warm start: AdamW over --steps batches, linear warm-up then cosine decay to 5% of --lr,
    correct solutions for the first --clean-frac of the steps and noisy ones after."""
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.98))

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = (step - args.warmup) / max(1, args.steps - args.warmup)
        return args.lr * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))

    model.train()
    for step in range(args.steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        error_rate = 0.0 if step < args.clean_frac * args.steps else args.error_rate
        ids, mask, labels = training_batch(rng, tokenizer, args, error_rate)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  {time.time() - started:6.1f}s", flush=True)


def held_out_accuracy(model, tokenizer, args, held_out) -> tuple[float, float]:
    """Sampled (--eval-samples per problem, temperature 1) and greedy accuracy on the held-out problems."""
    sampled = accuracy(
        model,
        tokenizer,
        held_out,
        samples=args.eval_samples,
        do_sample=True,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        tools=args.tool_rate > 0,
    )
    greedy = accuracy(
        model,
        tokenizer,
        held_out,
        samples=1,
        do_sample=False,
        max_new_tokens=args.max_new_tokens,
        seed=args.seed,
        tools=args.tool_rate > 0,
    )
    return sampled, greedy


def report_args(args) -> dict:
    """The arguments as the report records them: paths inside the repository relative to it, --out left out."""
    return {
        k: (
            str(v.relative_to(REPO))
            if isinstance(v, Path) and v.is_relative_to(REPO)
            else str(v)
            if isinstance(v, Path)
            else v
        )
        for k, v in vars(args).items()
        if k != "out"
    }


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = random.Random(f"make_base_model:{args.seed}")

    tokenizer, model = load_or_build_model(args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params:,}", flush=True)

    warm_start(model, tokenizer, args, rng, started)
    train_s = time.time() - started

    held_out = arith.make_examples("test", args.eval_problems, seed=0, difficulty=args.difficulty)
    sampled, greedy = held_out_accuracy(model, tokenizer, args, held_out)

    tiny.save(model, tokenizer, args.out)
    size = sum(f.stat().st_size for f in Path(args.out).iterdir() if f.is_file())
    report = {
        "parameters": n_params,
        "size_bytes_on_disk": size,
        "held_out_problems": len(held_out),
        "sampled_accuracy_T1": round(sampled, 4),
        "samples_per_problem": args.eval_samples,
        "greedy_accuracy": round(greedy, 4),
        "train_seconds": round(train_s, 1),
        "total_seconds": round(time.time() - started, 1),
        "args": report_args(args),
        "torch": torch.__version__,
    }
    (Path(args.out) / "base_model_eval.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
