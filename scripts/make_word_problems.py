"""Write the word-problem data set (data/word_problems/{train,test}.jsonl): one- and two-step
arithmetic stories in plain English, small numbers, integer answers, in the plain {problem, answer}
layout every data loader of the project reads.

It is the real-model preset's task (configs/smollm2_135m.yaml): hard enough that a 135M-parameter
instruct model is right on a minority of its samples, easy enough that it is sometimes right,
which is what group-relative RL needs. Train and test share no problem text: each story is
assigned to a split by a hash of its text.

    python scripts/make_word_problems.py            # rewrites data/word_problems/ (seeded, stdlib only)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
from pathlib import Path

NAMES = [
    "Tom",
    "Anna",
    "Ben",
    "Lily",
    "Sam",
    "Mia",
    "Jack",
    "Emma",
    "Leo",
    "Zoe",
    "Max",
    "Ella",
    "Noah",
    "Ava",
    "Omar",
    "Sara",
    "Ravi",
    "Nina",
    "Paul",
    "Kate",
]
ITEMS = [
    "apples",
    "pencils",
    "stickers",
    "marbles",
    "books",
    "cookies",
    "cards",
    "balloons",
    "stamps",
    "shells",
    "coins",
    "flowers",
    "toy cars",
    "candies",
    "eggs",
    "oranges",
]
# Asked of every problem: a small model that is told the form of the answer rambles less, and the
# gsm8k grader reads the number on an "Answer:" line or else the last number of the response.
INSTRUCTION = "Reply with the final answer as a number."
CONTAINERS = ["boxes", "bags", "baskets", "jars", "packs", "rows", "shelves", "plates"]


def _one_step(rng: random.Random) -> tuple[str, int]:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.randrange(6)
    if kind == 0:
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        return f"{name} has {a} {item}. {name} buys {b} more {item}. How many {item} does {name} have now?", a + b
    if kind == 1:
        a = rng.randint(5, 40)
        b = rng.randint(1, a - 1)
        return f"{name} had {a} {item} and gave {b} of them to {other}. How many {item} does {name} have left?", a - b
    if kind == 2:
        a, b = rng.randint(2, 9), rng.randint(2, 9)
        box = rng.choice(CONTAINERS)
        return f"There are {a} {box} with {b} {item} in each. How many {item} are there in total?", a * b
    if kind == 3:
        each, k = rng.randint(2, 9), rng.randint(2, 6)
        return (
            f"{name} shares {each * k} {item} equally among {k} friends. How many {item} does each friend get?"
        ), each
    if kind == 4:
        a, b = rng.randint(2, 30), rng.randint(2, 30)
        return f"{name} has {a} {item} and {other} has {b} {item}. How many {item} do they have together?", a + b
    a = rng.randint(2, 25)
    b = a + rng.randint(1, 20)
    return f"{name} has {a} {item}. {other} has {b} {item}. How many more {item} does {other} have than {name}?", b - a


def _two_step(rng: random.Random) -> tuple[str, int]:
    name, other = rng.sample(NAMES, 2)
    item = rng.choice(ITEMS)
    kind = rng.randrange(3)
    if kind == 0:
        a, b = rng.randint(5, 30), rng.randint(2, 20)
        c = rng.randint(1, a + b - 1)
        return (
            f"{name} has {a} {item}. {name} finds {b} more and then gives {c} to {other}. "
            f"How many {item} does {name} have now?"
        ), a + b - c
    if kind == 1:
        a, b, c = rng.randint(2, 6), rng.randint(2, 6), rng.randint(1, 10)
        box = rng.choice(CONTAINERS)
        return (
            f"{name} buys {a} {box} of {item} with {b} {item} in each, and already had {c} {item}. "
            f"How many {item} does {name} have?"
        ), a * b + c
    a = rng.randint(2, 15)
    return (
        f"{name} has {a} {item}. {other} has twice as many {item} as {name}. How many {item} do they have together?"
    ), 3 * a


def split_of(text: str) -> str:
    """One test story in five, decided by the text alone."""
    return "test" if hashlib.blake2b(text.encode(), digest_size=8).digest()[0] % 5 == 0 else "train"


def make(n_train: int, n_test: int, seed: int) -> dict[str, list[dict]]:
    rng = random.Random(seed)
    out: dict[str, list[dict]] = {"train": [], "test": []}
    want = {"train": n_train, "test": n_test}
    seen: set[str] = set()
    while any(len(out[s]) < want[s] for s in out):
        text, answer = (_two_step if rng.random() < 0.3 else _one_step)(rng)
        split = split_of(text)
        if text in seen or len(out[split]) >= want[split]:
            continue
        seen.add(text)
        problem = f"{text}\n{INSTRUCTION}"
        out[split].append({"id": f"word-{split}-{len(out[split])}", "problem": problem, "answer": str(answer)})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(Path(__file__).resolve().parents[1] / "data" / "word_problems"))
    p.add_argument("--train", type=int, default=4000)
    p.add_argument("--test", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for split, rows in make(args.train, args.test, args.seed).items():
        (out / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{out / split}.jsonl: {len(rows)} problems")


if __name__ == "__main__":
    main()
