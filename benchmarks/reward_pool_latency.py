"""How long RewardPool takes to give up on a hung verifier, and to be ready again afterwards.

    .venv/bin/python benchmarks/reward_pool_latency.py [--limit 1.0] [--runs 3] [--workers 2]

The tests check that a hung grader comes back as "[TIMEOUT]" and that the pool keeps working;
the figures live here. Printed, as the median over runs, for a pool with `--limit` seconds per
grading call:
- time-out latency: a call whose one item sleeps 60 s, from call to return (ideal: the limit);
- recovery: the next call (one quick item) right after it, which waits for the replacement
  worker if it is not ready yet;
- crash recovery: a call whose one item kills its worker (os._exit), then the next call;
- their ratios to the limit;
- throughput of 5000 short `dapo` responses through the pool (responses/s);
- the slowest in-process grade of a hostile response (tests/hostile_corpus.py), per grader, and
  the slowest `math` prescreen on its worst-case inputs.
The calls to the pool are measured for load (benchmarks/runs.py's Meter: the CPU seconds of this process and its
workers beside the wall seconds; a worker each its own jobs): where they saw more, a late time-out may be the
machine's, and the ratios to the limit are not printed (a line says why).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # before the pool starts: its workers import hostile_graders
sys.path.insert(0, str(ROOT / "benchmarks"))
from dapo.rewards import RewardPool, grade  # noqa: E402
from dapo.rewards.math_equiv import TAIL_CHARS, _costly, _simple_number, extract_prediction  # noqa: E402
from hostile_corpus import TRUTH, hostile_responses, prescreen_worst_inputs  # noqa: E402
from hostile_graders import HOSTILE_GRADERS  # noqa: E402
from runs import Meter, withheld  # noqa: E402


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def measure_once(pool: RewardPool, workers: int, rows: dict[str, list[float]]) -> None:
    """One round of every figure: a time-out and the call after it, a crash and the call after it, throughput."""
    t, r = timed(lambda: pool.score(["x"], ["60"], "_test_sleep"))
    assert r.grades[0].pred == "[TIMEOUT]", r.grades
    rows["timeout"].append(t)
    t, r = timed(lambda: pool.score(["Answer: 1"] * workers, ["1"] * workers, "dapo"))
    assert all(g.acc for g in r.grades)
    rows["recovery"].append(t)
    t, r = timed(lambda: pool.score(["x"], ["1"], "_test_crash"))
    assert r.grades[0].pred == "[CRASH]", r.grades
    rows["crash"].append(t)
    t, r = timed(lambda: pool.score(["Answer: 1"] * workers, ["1"] * workers, "dapo"))
    rows["crash_recovery"].append(t)
    n = 5000
    t, r = timed(lambda: pool.score([f"Reasoning...\nAnswer: {i % 97}" for i in range(n)], ["5"] * n, "dapo"))
    rows["tput"].append(n / t)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--limit", type=float, default=1.0, help="RewardPool timeout_s")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    limit = args.limit

    rows: dict[str, list[float]] = {"timeout": [], "recovery": [], "crash": [], "crash_recovery": [], "tput": []}
    meter = Meter(own_jobs=args.workers)
    with RewardPool(num_workers=args.workers, timeout_s=limit, extra_graders=HOSTILE_GRADERS) as pool:
        pool.score(["Answer: 1"], ["1"], "dapo")  # workers up
        for _ in range(args.runs):
            with meter:
                measure_once(pool, args.workers, rows)

    med = {k: statistics.median(v) for k, v in rows.items()}
    reason = withheld([meter.load.summary()], "ratio to the limit", unit="measurements")

    def of_limit(seconds: float) -> str:
        return "    -" if reason else f"{seconds / limit:5.2f}"

    print(f"RewardPool, {args.workers} workers, limit {limit:.2f} s, median of {args.runs} runs")
    print(f"  time-out latency     {med['timeout']:7.3f} s   {of_limit(med['timeout'])} x limit")
    print(f"  recovery (next call) {med['recovery']:7.3f} s   {of_limit(med['recovery'])} x limit")
    print(
        f"  time-out + recovery  {med['timeout'] + med['recovery']:7.3f} s   "
        f"{of_limit(med['timeout'] + med['recovery'])} x limit"
    )
    print(f"  crash latency        {med['crash']:7.3f} s   {of_limit(med['crash'])} x limit")
    print(f"  crash recovery       {med['crash_recovery']:7.3f} s   {of_limit(med['crash_recovery'])} x limit")
    print(f"  throughput           {med['tput']:7.0f} short dapo responses/s")
    print(f"  the pool's calls: {meter.cpu_s:.2f} CPU s (this process and its workers), {meter.wall_s:.2f} wall s")
    if reason:
        print(f"  {reason}")

    corpus = hostile_responses()
    for grader in ("dapo", "dapo_relaxed", "arith", "gsm8k"):
        worst = max((timed(lambda: grade(r, TRUTH, grader))[0], name) for name, r in corpus)
        print(f"  in-process {grader:<13} slowest hostile response {worst[0] * 1e3:8.2f} ms ({worst[1]})")
    texts = prescreen_worst_inputs(TAIL_CHARS - 2)
    slowest = max(
        timed(lambda: (_costly(t), _simple_number(t), extract_prediction("\\boxed{" + t + "}")))[0] for t in texts
    )
    print(f"  math prescreens, slowest worst-case input {slowest * 1e3:8.2f} ms ({len(texts)} inputs)")


if __name__ == "__main__":
    main()
