"""Hostile responses: nothing is executed, and every one is graded (wrong) within its time limit."""

from __future__ import annotations

import threading

import pytest

from dapo.rewards import Grade, RewardPool, grade
from dapo.rewards.math_equiv import TAIL_CHARS, _costly, _simple_number, extract_prediction
from hostile_corpus import TRUTH, hostile_responses, prescreen_worst_inputs

POOL_TIMEOUT_S = 5.0
# How fast the graders are on these inputs is measured by benchmarks/reward_pool_latency.py.
# Here only "returns at all" is checked, with a bound far above any machine's time (typically
# well under a millisecond per response), so a busy machine cannot fail it but a hang can.
RETURNS_WITHIN_S = 20.0


def _returns(fn, *args, within_s: float = RETURNS_WITHIN_S):
    out: list = []
    thread = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    thread.start()
    thread.join(within_s)
    assert not thread.is_alive(), f"{fn.__name__} still running after {within_s:.0f} s"
    assert out, f"{fn.__name__} raised in its thread"
    return out[0]


def test_corpus_is_large_enough():
    assert len(hostile_responses()) >= 50


@pytest.mark.parametrize("grader", ["dapo", "dapo_relaxed", "arith", "gsm8k"])
def test_in_process_graders_are_fast_and_execute_nothing(tmp_path, grader):
    sentinel = tmp_path / "pwned"
    corpus = hostile_responses(str(sentinel))
    grades = _returns(lambda: [grade(response, TRUTH, grader) for _, response in corpus])
    for (name, _), g in zip(corpus, grades, strict=True):
        assert g.score == -1.0 and not g.acc, name
        assert isinstance(g.pred, str) and len(g.pred) <= 1000, name
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
    # Every item came back, and the counters agree with the grades they summarise.
    assert len(result.grades) == len(items)
    assert result.num_timeouts == sum(g.pred == "[TIMEOUT]" for g in result.grades)
    assert result.num_crashes == sum(g.pred == "[CRASH]" for g in result.grades)
    assert not sentinel.exists()


def test_math_prescreens_return_on_their_worst_inputs():
    # The `math` grader's own regexes run before math-verify, in-process, on up to TAIL_CHARS
    # characters. Inputs shaped to make overlapping `\s*` runs or nested scans backtrack:
    worst = prescreen_worst_inputs(TAIL_CHARS - 2)
    # Each must return (benchmarks/reward_pool_latency.py prints the time each takes).
    for text in worst:
        _returns(lambda: (_costly(text), _simple_number(text), extract_prediction("\\boxed{" + text + "}")))


@pytest.mark.parametrize(
    "response", ["Answer: 2\x00", "\\boxed{2\x00}", "Answer: $2\x00$", "\\boxed{\\frac{4}{2}\x00}"]
)
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
    assert grade(
        "\\boxed{\\cos^2(y) + \\frac{x}{7} + \\sin^2(x)}", "\\sin^2(x) + \\frac{x}{7} + \\cos^2(y)", "math"
    ).acc
