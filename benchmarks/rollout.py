"""Rollout tokens/s: HFRolloutEngine.generate against one bare model.generate call on the same prompts.

    python benchmarks/rollout.py [--runs 5] [--threads 2] [--write FILE]

Workloads: one demo training round (32 arith prompts x G=8, 48 new tokens), one demo evaluation
chunk (200 held-out prompts x 4) and a round of the hard task (32 x 8, 96 new tokens, prompts of
varied length). The bare call is what a user would write: the prompts tokenized with left
padding, num_return_sequences=G, the same sampling settings (temperature 1, top-p 1, no top-k),
the same max_new_tokens and the same seed, so both sides sample the same tokens where the
padding is the same. Tokens are counted up to and including each row's EOS.
The engine's time includes everything it returns beyond the ids: cutting at EOS, the truncation
flags and the decoded texts. The two alternate within each run after a warm-up call; printed is
the median over runs, and overhead = bare tokens/s / ours - 1, per run, then the median.
Time is the process's CPU time (one torch thread), printed beside wall time (each side's CPU and wall seconds
summed over the timed runs). Each side's calls are measured for load (benchmarks/runs.py's Meter): where either
side saw more load than its own torch threads, the overhead is not printed, and a line says why.

What it is for: checking that the engine adds nothing to speak of over the bare call it wraps, after a change to
rollout/hf.py. --write FILE writes the table as a results file (benchmarks/results/rollout/), with the machine and each
workload's load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

from dapo.data import arith
from dapo.data.prompts import make_encoder
from dapo.model.loading import load_model_and_tokenizer
from dapo.rollout.base import SamplingParams
from dapo.rollout.hf import HFRolloutEngine

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from runs import Meter, withheld  # noqa: E402

WORKLOADS = [  # name, split, difficulty, prompts, samples per prompt, max new tokens
    ("demo train round 32x8", "train", "demo", 32, 8, 48),
    ("demo eval 200x4", "test", "demo", 200, 4, 48),
    ("hard train round 32x8", "train", "hard", 32, 8, 96),
]


def count_tokens(rows: list[list[int]], eos: set[int]) -> int:
    total = 0
    for r in rows:
        n = next((i + 1 for i, t in enumerate(r) if t in eos), len(r))
        total += n
    return total


def bare_generate(model, tokenizer, texts: list[str], params: SamplingParams, eos: set[int]) -> int:
    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    torch.manual_seed(params.seed)
    with torch.no_grad():
        out = model.generate(
            **enc,
            do_sample=True,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0,
            max_new_tokens=params.max_new_tokens,
            num_return_sequences=params.n,
            pad_token_id=tokenizer.pad_token_id,
            eos_token_id=sorted(eos),
        )
    return count_tokens(out[:, enc["input_ids"].shape[1] :].tolist(), eos)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model", default=str(ROOT / "assets/arith-base"))
    parser.add_argument("--write", help="write the table to this results file (benchmarks/results/*.json)")
    args = parser.parse_args()
    rows, loads = [], []
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(args.model)
    model.train(False)
    engine = HFRolloutEngine(model, tokenizer)
    encode = make_encoder(tokenizer, 2048)
    print(
        f"torch {torch.__version__}, {args.threads} threads, median of {args.runs} alternated runs, "
        f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}"
    )
    print(
        f"{'workload':24s} {'tokens':>7s} {'bare tok/s':>11s} {'ours tok/s':>11s} {'overhead':>9s} {'(wall)':>9s}"
        f"  {'bare CPU / wall s':>17s} {'ours CPU / wall s':>17s}"
    )
    for name, split, difficulty, prompts, n, max_new in WORKLOADS:
        examples = arith.make_examples(split, prompts, seed=0, difficulty=difficulty)
        ids = [encode(ex) for ex in examples]
        texts = [ex.text() for ex in examples]
        bare_rates, ours_rates, ratios, wall_ratios = [], [], [], []
        meters = {"bare": Meter(args.threads), "ours": Meter(args.threads)}
        for run in range(args.runs + 1):
            params = SamplingParams(n=n, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=max_new, seed=run)
            timings = {}
            sides = ("bare", "ours") if run % 2 == 0 else ("ours", "bare")
            for side in sides:
                t0, c0 = time.perf_counter(), time.process_time()
                with meters[side] if run else Meter(args.threads):  # the warm-up call is not measured
                    if side == "bare":
                        tokens = bare_generate(model, tokenizer, texts, params, engine.eos_ids)
                    else:
                        tokens = engine.generate(ids, params).num_tokens
                timings[side] = (tokens, time.process_time() - c0, time.perf_counter() - t0)
            if run == 0:
                continue  # warm-up
            bare = timings["bare"][0] / timings["bare"][1]
            ours = timings["ours"][0] / timings["ours"][1]
            bare_rates.append(bare)
            ours_rates.append(ours)
            ratios.append(bare / ours)
            wall_ratios.append((timings["bare"][0] / timings["bare"][2]) / (timings["ours"][0] / timings["ours"][2]))
        reason = withheld([m.load.summary() for m in meters.values()], "overhead", unit="sides")
        overhead = "-" if reason else f"{100 * (statistics.median(ratios) - 1):+.1f}%"
        wall_overhead = "-" if reason else f"{100 * (statistics.median(wall_ratios) - 1):+.1f}%"
        print(
            f"{name:24s} {timings['ours'][0]:7d} {statistics.median(bare_rates):11,.0f} "
            f"{statistics.median(ours_rates):11,.0f} {overhead:>9s} {wall_overhead:>9s}  "
            + "  ".join(f"{m.cpu_s:8.2f} / {m.wall_s:6.2f}" for m in meters.values()),
            flush=True,
        )
        if reason:
            print(f"  {reason}", flush=True)
        loads += [m.load.summary() for m in meters.values()]
        rows.append(
            {
                "workload": name,
                "tokens": timings["ours"][0],
                "bare tok/s": round(statistics.median(bare_rates)),
                "ours tok/s": round(statistics.median(ours_rates)),
                "overhead (CPU)": reason or overhead,
                "overhead (wall)": reason or wall_overhead,
            }
        )
    if args.write:
        write(args, rows, loads)


def write(args, rows: list[dict], loads: list[dict]) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    import measurement

    command = "python " + " ".join(sys.argv)
    content = {
        "title": "The HF rollout engine against a bare generate call",
        "group": "A training step on the CPU",
        "measures": (
            f"Generated tokens per CPU second of HFRolloutEngine.generate and of one bare model.generate call on the "
            f"same prompts, sampling settings and seed, {args.threads} torch thread(s), alternated, median of "
            f"{args.runs} runs; overhead = bare / ours - 1 (below 0: the engine is faster)."
        ),
        **measurement.record(command, command, {"workloads": rows}),
        "load": (
            f"load average {min(x['mean'] for x in loads):.2f}-{max(x['mean'] for x in loads):.2f} for its own "
            f"{loads[0]['own_jobs']} thread(s), {100 * max(x['foreign_frac'] for x in loads):.1f}% of the CPU at "
            "most to other processes"
        ),
        "notes": [],
    }
    measurement.write(args.write, content)


if __name__ == "__main__":
    main()
