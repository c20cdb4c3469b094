"""Responses graded per second, `dapo` and `math`, in-process and through RewardPool.

    .venv/bin/python benchmarks/grading_throughput.py [--runs 3] [--workers 2]

The batch looks like one generation round: P prompts x G=16 responses each, a mix of correct
answers (in varied spellings), wrong answers, ~20k-character reasoning traces and hostile
strings (tests/hostile_corpus.py). Wrong answers mostly look like the right one with a digit
changed (as a model's near-misses do), otherwise another problem's answer. Ground truths:
DAPO-Math-17k integers for `dapo`, MATH-500 LaTeX answers for `math`.

As in training, one pool lives through all runs (its workers keep their warm parser tables) and
the in-process grader runs in one process too; after one warm-up batch, every run grades a new
batch (new prompts, new responses). Printed: the median over runs, each way's CPU seconds (the pool's: its
workers' too) beside its wall seconds over the timed runs, and the pool's rate over the in-process one, only where
neither way saw more load than the benchmark's own jobs (a worker each; benchmarks/runs.py's Meter).

What it is for: checking that a change to the reward pool (rewards/pool.py) or to a grader keeps its throughput,
the pool against grading in-process on the same batches.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from dapo.rewards import RewardPool, grade

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "benchmarks"))
from hostile_corpus import hostile_responses  # noqa: E402
from runs import Meter, withheld  # noqa: E402

GROUP = 16
WORDS = "so we compute the sum of the terms then factor and check each case carefully modulo".split()


def reasoning(rng: random.Random, chars: int) -> str:
    out, n = [], 0
    while n < chars:
        line = " ".join(rng.choice(WORDS) for _ in range(12)) + f" ${rng.randint(2, 99)}x + {rng.randint(1, 9)}$.\n"
        out.append(line)
        n += len(line)
    return "".join(out)


def respond(rng: random.Random, answer: str, kind: str, hostile: list[str]) -> str:
    if kind == "hostile":
        return rng.choice(hostile)
    body = reasoning(rng, 20_000 if kind == "long" else rng.randint(300, 2_000))
    return f"{body}The final answer is $\\boxed{{{answer}}}$.\nAnswer: {answer}"


def make_batch(truths: list[str], prompts: int, seed: int, spell) -> tuple[list[str], list[str]]:
    """P prompts x G responses: 45% correct, 35% wrong, 15% long traces, 5% hostile."""
    rng = random.Random(seed)
    hostile = [r for _, r in hostile_responses()]
    responses, gts = [], []
    for truth in rng.sample(truths, prompts):
        for _ in range(GROUP):
            kind = rng.choices(["correct", "wrong", "long", "hostile"], [45, 35, 15, 5])[0]
            right = kind == "correct" or (kind == "long" and rng.random() < 0.5)
            answer = spell(rng, truth) if right else near_miss(rng, truth, truths)
            responses.append(respond(rng, answer, kind, hostile))
            gts.append(truth)
    return responses, gts


def near_miss(rng: random.Random, truth: str, truths: list[str]) -> str:
    digits = [i for i, c in enumerate(truth) if c.isdigit()]
    if not digits or rng.random() < 0.3:
        return rng.choice(truths)
    i = rng.choice(digits)
    return truth[:i] + str((int(truth[i]) + rng.randint(1, 9)) % 10) + truth[i + 1 :]


def spell_integer(rng: random.Random, truth: str) -> str:
    value = int(truth)
    return rng.choice([str(value), f"{value}.0", f"{value:03d}" if 0 <= value < 1000 else str(value)])


def spell_latex(rng: random.Random, truth: str) -> str:
    if rng.random() < 0.5:
        return truth
    return truth.replace("\\left", "").replace("\\right", "").replace("\\dfrac", "\\frac").replace(" ", "")


def in_process(responses: list[str], gts: list[str], grader: str) -> float:
    t0 = time.perf_counter()
    for r, t in zip(responses, gts):
        grade(r, t, grader)
    return len(responses) / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()

    dapo_truths = sorted(
        set(
            pq.read_table(ROOT / "data/dapo_math_17k/dapo_math_17k.parquet", columns=["reward_model"])
            .column("reward_model")
            .combine_chunks()
            .field("ground_truth")
            .to_pylist()
        )
    )
    with open(ROOT / "data/math500/test.jsonl", encoding="utf-8") as f:
        math_truths = [json.loads(line)["answer"] for line in f]

    t0 = time.perf_counter()
    pool = RewardPool(num_workers=args.workers, timeout_s=5.0)
    pool.score(["Answer: 1"], ["1"], "dapo")
    print(f"pool start + first call, {args.workers} workers: {time.perf_counter() - t0:.2f} s")

    setups = [("dapo", dapo_truths, 256, spell_integer), ("math", math_truths, 64, spell_latex)]
    with pool:
        for grader, truths, prompts, spell in setups:
            single, multi, timeouts, crashes = [], [], 0, 0
            # own jobs: the pool's workers for both ways, which alternate within a minute of load average
            meters = {way: Meter(own_jobs=max(1, args.workers)) for way in ("in-process", "pool")}
            for run in range(args.runs + 1):
                responses, gts = make_batch(truths, prompts, seed=run, spell=spell)
                with meters["in-process"] if run else Meter():  # the warm-up is not measured
                    rate = in_process(responses, gts, grader)
                with meters["pool"] if run else Meter():
                    result = pool.score(responses, gts, grader)
                if run == 0:
                    continue  # warm-up: imports, parser tables, first-use caches
                single.append(rate)
                multi.append(len(responses) / result.seconds)
                timeouts, crashes = timeouts + result.num_timeouts, crashes + result.num_crashes
            chars = sum(map(len, responses)) / len(responses)
            print(
                f"{grader:5s} batch {len(responses)} (mean {chars:,.0f} chars): "
                f"in-process {statistics.median(single):,.0f}/s, "
                f"pool x{args.workers} {statistics.median(multi):,.0f}/s "
                f"(median of {args.runs}; timeouts {timeouts}, crashes {crashes})"
            )
            reason = withheld([m.load.summary() for m in meters.values()], "ratio", unit="ways")
            print(
                "      "
                + ", ".join(f"{way} {m.cpu_s:.2f} CPU s / {m.wall_s:.2f} wall s" for way, m in meters.items())
                + "; pool / in-process: "
                + (reason or f"{statistics.median(multi) / statistics.median(single):.2f}x")
            )


if __name__ == "__main__":
    main()
