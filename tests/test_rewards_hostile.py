"""Hostile responses: nothing is executed, and every one is graded (wrong) within its time limit."""

from __future__ import annotations

import time

import pytest
from hostile_corpus import TRUTH, hostile_responses

from dapo.rewards import Grade, RewardPool, grade
from dapo.rewards.math_equiv import TAIL_CHARS, _costly, _simple_number, extract_prediction

# In-process graders read a bounded tail with linear-time regexes: far below this per response.
IN_PROCESS_LIMIT_S = 1.0
POOL_TIMEOUT_S = 5.0


def test_corpus_is_large_enough():
    assert len(hostile_responses()) >= 50


@pytest.mark.parametrize("grader", ["dapo", "dapo_relaxed", "arith", "gsm8k"])
def test_in_process_graders_are_fast_and_execute_nothing(tmp_path, grader):
    sentinel = tmp_path / "pwned"
    slow = []
    for name, response in hostile_responses(str(sentinel)):
        t0 = time.perf_counter()
        g = grade(response, TRUTH, grader)
        if time.perf_counter() - t0 > IN_PROCESS_LIMIT_S:
            slow.append(name)
        assert g.score == -1.0 and not g.acc, name
        assert isinstance(g.pred, str) and len(g.pred) <= 1000, name
    assert not slow
    assert not sentinel.exists()


def test_every_grader_through_the_pool(tmp_path):
    sentinel = tmp_path / "pwned"
    corpus = hostile_responses(str(sentinel))
    graders = ["dapo", "math", "gsm8k", "arith"]
    items = [(response, grader) for grader in graders for _, response in corpus]
    with RewardPool(num_workers=2, timeout_s=POOL_TIMEOUT_S) as pool:
        result = pool.score([r for r, _ in items], [TRUTH] * len(items), [g for _, g in items])
    names = [f"{grader}/{name}" for grader in graders for name, _ in corpus]
    wrong_but_correct = [n for n, g in zip(names, result.grades) if g.acc or g.score != -1.0]
    assert not wrong_but_correct
    # Every item came back; a timed-out one cost at most one limit on one of two workers.
    assert len(result.grades) == len(items)
    assert result.seconds < 30 + POOL_TIMEOUT_S * (result.num_timeouts + result.num_crashes) / 2
    assert not sentinel.exists()


def test_math_prescreens_are_linear_on_their_worst_inputs():
    # The `math` grader's own regexes run before math-verify, in-process, on up to TAIL_CHARS
    # characters. Inputs shaped to make overlapping `\s*` runs or nested scans backtrack:
    n = TAIL_CHARS - 2
    worst = [
        "^" + " " * n, "^" + " " * (n - 1) + "x", "(" + "^" * n, "{" + "^" * n, "(" * (n // 2) + "^" * (n // 2),
        "1" * n + "x", ")" + " " * (n - 1) + "^", "(" + ")^" * (n // 2), "^1" + "." * (n - 1), "**" + " " * n,
        "\\binom" + "a" * (n - 6), "1" + " " * (n - 1) + "x", "$" + " " * n, "\\frac{" + " " * n,
    ]
    for text in worst:
        t0 = time.perf_counter()
        _costly(text)
        _simple_number(text)
        extract_prediction("\\boxed{" + text + "}")
        assert time.perf_counter() - t0 < 0.05, repr(text[:20])


@pytest.mark.parametrize("response", ["Answer: 2\x00", "\\boxed{2\x00}", "Answer: $2\x00$", "\\boxed{\\frac{4}{2}\x00}"])
def test_a_nul_inside_an_answer_is_not_the_answer(response):
    for grader in ("math", "dapo", "arith"):
        assert not grade(response, "2", grader).acc, grader
    assert grade(response.replace("\x00", ""), "2", "math").acc  # the same answer without it is right


def test_a_ground_truth_with_a_nul_is_refused():
    with pytest.raises(ValueError, match="ground truth contains a NUL character"):
        grade("Answer: 2", "2\x00", "math")


def test_math_graders_own_time_limit_reports_a_timeout(monkeypatch):
    from dapo.rewards import math_equiv

    monkeypatch.setattr(math_equiv, "_INTERNAL_TIMEOUT_S", 1e-4)  # far below one LaTeX parse
    g = grade("\\boxed{\\sin^2(x) + \\cos^2(y) + \\frac{x}{7}}", "\\sin^2(x) + \\frac{x}{7} + \\cos^2(y) + 0", "math")
    assert g == Grade(-1.0, False, "[TIMEOUT]")
    monkeypatch.setattr(math_equiv, "_INTERNAL_TIMEOUT_S", 2.0)
    assert grade("\\boxed{\\cos^2(y) + \\frac{x}{7} + \\sin^2(x)}", "\\sin^2(x) + \\frac{x}{7} + \\cos^2(y)", "math").acc
