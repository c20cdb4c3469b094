"""Synthetic multi-step integer arithmetic with worked solutions, a verifiable task that runs on a CPU.

A problem is a short expression such as ``7+3*4-2=``. Its worked solution rewrites the
expression one operation at a time (multiplications first, then left to right), one line per
step, and ends like a DAPO-Math-17K response::

    7+12-2
    19-2
    17
    Answer: 17

The "demo" difficulty uses three one-digit operands (``6+5*3=``); "hard" uses five to eight
operands up to 19, with long enough solutions to study truncation; "long" uses four to six
one-digit operands: easy steps, but many of them. The prompt is the whole text
the model sees (no template, no chat turn), so a character-level model learns it in minutes. Train and test
problems are split by a hash of the problem text,
so no problem can ever land in both splits, whatever ``n`` and ``seed`` are.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import operator
import random
import re
from dataclasses import dataclass

from dapo.data.prompts import Example

DATA_SOURCE = "arith"
SPLITS = ("train", "test")
# Fraction of the problem space reserved for "test": hash bucket 0 of 5.
_TEST_BUCKETS = 5
# Problem spaces up to this many candidate expressions are listed in full rather than sampled,
# so asking for more problems than exist fails at once with the exact count.
_ENUMERATE_LIMIT = 200_000


@dataclass(frozen=True)
class Difficulty:
    name: str
    min_operands: int
    max_operands: int
    max_operand: int  # operands are drawn from 1..max_operand
    max_value: int  # every intermediate value stays within 0..max_value


DIFFICULTIES = {
    # 3 one-digit operands, values below 100: responses of 12-20 characters. A ~1M-parameter
    # model learns this in about two CPU minutes; with 4 operands it does not.
    "demo": Difficulty("demo", min_operands=3, max_operands=3, max_operand=9, max_value=99),
    # 5-8 operands up to 19, values up to 999: responses of roughly 30-120 characters, so a
    # 64-96 token response limit truncates a sizeable share of them.
    "hard": Difficulty("hard", min_operands=5, max_operands=8, max_operand=19, max_value=999),
    # 4-6 one-digit operands, values below 100: every step is as easy as a demo step, but there
    # are 3-5 of them, so the chance of a slip (and so the pass rate) varies from prompt to prompt,
    # and responses of 24-50 tokens (median 34) run past a 40-token limit on about a quarter of
    # the problems. The ablation study (configs/ablation/) uses it.
    "long": Difficulty("long", min_operands=4, max_operands=6, max_operand=9, max_value=99),
}

_TOKEN_RE = re.compile(r"\d+|[+\-*]")
_PROBLEM_RE = re.compile(r"^\s*\d+(?:\s*[+\-*]\s*\d+)*\s*=?\s*$")


def _difficulty(name: str) -> Difficulty:
    try:
        return DIFFICULTIES[name]
    except KeyError:
        raise ValueError(f"unknown arith difficulty {name!r}; choose one of {sorted(DIFFICULTIES)}") from None


def parse(problem_text: str) -> tuple[list[int], list[str]]:
    """Split ``"7+3*4-2="`` into ``([7, 3, 4, 2], ['+', '*', '-'])``."""
    if not isinstance(problem_text, str) or not _PROBLEM_RE.match(problem_text):
        raise ValueError(
            f"not an arith problem: {problem_text!r}; expected non-negative integers joined by "
            "+, - or * with an optional trailing '=', e.g. '7+3*4-2='"
        )
    tokens = _TOKEN_RE.findall(problem_text)
    return [int(t) for t in tokens[0::2]], tokens[1::2]


_APPLY = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def _next_index(ops: list[str]) -> int:
    # Multiplication binds tighter; among equal precedence, work left to right.
    return ops.index("*") if "*" in ops else 0


def _reduce(nums: list[int], ops: list[str], i: int, value: int) -> tuple[list[int], list[str]]:
    return nums[:i] + [value] + nums[i + 2 :], ops[:i] + ops[i + 1 :]


def _render(nums: list[int], ops: list[str]) -> str:
    return str(nums[0]) + "".join(op + str(n) for op, n in zip(ops, nums[1:]))


def _trace(nums: list[int], ops: list[str]) -> list[int]:
    """Every intermediate value, in the order the worked solution produces them."""
    values = []
    while ops:
        i = _next_index(ops)
        v = _APPLY[ops[i]](nums[i], nums[i + 1])
        values.append(v)
        nums, ops = _reduce(nums, ops, i, v)
    return values


def compute(problem_text: str) -> int:
    """The value of the expression, with the usual precedence."""
    nums, ops = parse(problem_text)
    values = _trace(nums, ops)
    return values[-1] if values else nums[0]


def _worked(nums: list[int], ops: list[str], step_value) -> str:
    lines = []
    step = 0
    while ops:
        i = _next_index(ops)
        v = step_value(step, nums, ops, i)
        nums, ops = _reduce(nums, ops, i, v)
        lines.append(_render(nums, ops))
        step += 1
    if not lines:
        lines.append(str(nums[0]))
    lines.append(f"Answer: {nums[0]}")
    return "\n".join(lines)


def solution(problem_text: str) -> str:
    """The correct worked solution: one reduction per line, then ``Answer: N``."""
    nums, ops = parse(problem_text)
    return _worked(nums, ops, lambda step, n, o, i: _APPLY[o[i]](n[i], n[i + 1]))


def plausible_mistake(value: int, rng: random.Random) -> int:
    """A wrong value of the kind a person makes: off by one or two, or one digit wrong."""
    while True:
        if rng.random() < 0.5:
            wrong = value + rng.choice((-2, -1, 1, 2))
        else:
            digits = list(str(value))
            pos = rng.randrange(len(digits))
            # A leading zero would not be a number a solver writes down.
            lowest = 1 if pos == 0 and len(digits) > 1 else 0
            choices = [str(d) for d in range(lowest, 10) if str(d) != digits[pos]]
            digits[pos] = rng.choice(choices)
            wrong = int("".join(digits))
        if wrong >= 0 and wrong != value:
            return wrong


def noisy_solution(problem_text: str, rng: random.Random, error_rate: float) -> str:
    """A worked solution where each step's result is wrong with probability ``error_rate``.

    Later steps are computed correctly from the wrong value, so a mistake propagates to the
    answer exactly as it would for a careless solver. This is the warm-start data for the demo's
    base model: it learns the right procedure but keeps real probability on slips, which
    reinforcement learning with a correctness reward can then remove.
    """
    if not 0.0 <= error_rate <= 1.0:
        raise ValueError(f"error_rate must be within [0, 1], got {error_rate}")
    nums, ops = parse(problem_text)

    def step_value(step, n, o, i):
        right = _APPLY[o[i]](n[i], n[i + 1])
        if rng.random() >= error_rate:
            return right
        for _ in range(10):
            wrong = plausible_mistake(right, rng)
            rest_n, rest_o = _reduce(n, o, i, wrong)
            # Keep every later value non-negative, like the problems themselves.
            if all(v >= 0 for v in _trace(rest_n, rest_o)):
                return wrong
        return right

    return _worked(nums, ops, step_value)


def split_of(problem_text: str) -> str:
    """Which split a problem belongs to, decided by its text alone."""
    key = problem_text.strip().rstrip("=").strip()
    bucket = hashlib.blake2b(key.encode(), digest_size=8).digest()[0] % _TEST_BUCKETS
    return "test" if bucket == 0 else "train"


def random_problem(rng: random.Random, difficulty: str = "demo") -> str:
    """One problem text (e.g. ``"7+3*4-2="``) of the given difficulty, from either split."""
    spec = _difficulty(difficulty)
    while True:
        k = rng.randint(spec.min_operands, spec.max_operands)
        nums = [rng.randint(1, spec.max_operand) for _ in range(k)]
        ops = [rng.choice("+-*") for _ in range(k - 1)]
        if all(0 <= v <= spec.max_value for v in _trace(nums, ops)):
            return _render(nums, ops) + "="


def _candidates(spec: Difficulty) -> int:
    return sum(spec.max_operand**k * 3 ** (k - 1) for k in range(spec.min_operands, spec.max_operands + 1))


@functools.lru_cache(maxsize=8)
def _all_problems(difficulty: str, split: str) -> tuple[str, ...]:
    spec = _difficulty(difficulty)
    out = []
    for k in range(spec.min_operands, spec.max_operands + 1):
        for nums in itertools.product(range(1, spec.max_operand + 1), repeat=k):
            for ops in itertools.product("+-*", repeat=k - 1):
                if all(0 <= v <= spec.max_value for v in _trace(list(nums), list(ops))):
                    text = _render(list(nums), list(ops)) + "="
                    if split_of(text) == split:
                        out.append(text)
    return tuple(out)


def make_examples(split: str, n: int, *, seed: int = 0, difficulty: str = "demo") -> list[Example]:
    """``n`` distinct problems of ``split`` ("train" or "test"), deterministic in ``seed``.

    Small problem spaces (the "demo" one: about 3,600 train and 900 test problems) are listed in
    full and a seeded shuffle picks ``n``; large ones are sampled until ``n`` distinct problems
    are found.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {list(SPLITS)}")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n must be a positive integer, got {n!r}")
    spec = _difficulty(difficulty)
    rng = random.Random(f"arith:{difficulty}:{split}:{seed}")
    if _candidates(spec) <= _ENUMERATE_LIMIT:
        pool = list(_all_problems(difficulty, split))
        if n > len(pool):
            raise ValueError(
                f"the {difficulty!r} {split} split has only {len(pool)} distinct problems, "
                f"{n} were asked for; ask for at most {len(pool)}"
            )
        rng.shuffle(pool)
        problems = pool[:n]
    else:
        seen: set[str] = set()
        problems = []
        attempts = 0
        while len(problems) < n:
            attempts += 1
            if attempts > 100 * n + 100_000:
                raise ValueError(
                    f"found only {len(problems)} distinct {difficulty!r} {split} problems in "
                    f"{attempts - 1} draws; ask for fewer"
                )
            problem = random_problem(rng, difficulty)
            if problem not in seen and split_of(problem) == split:
                seen.add(problem)
                problems.append(problem)
    return [
        Example(
            uid=f"arith-{difficulty}-{p.rstrip('=')}",
            prompt=p,
            ground_truth=str(compute(p)),
            data_source=DATA_SOURCE,
        )
        for p in problems
    ]


__all__ = [
    "DATA_SOURCE",
    "DIFFICULTIES",
    "Difficulty",
    "compute",
    "make_examples",
    "noisy_solution",
    "parse",
    "plausible_mistake",
    "random_problem",
    "solution",
    "split_of",
]
