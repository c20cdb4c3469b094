"""The same verdicts on any machine: every grader case of tests/test_rewards.py, and 64 MATH-500 responses, graded in
a fresh process in process and in the pool, on an idle machine and with 4 busy processes on the cores. The limits
count CPU seconds, and one-time start-up is on no answer's clock, so a busy machine changes no verdict."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from test_rewards import grader_cases

ROOT = Path(__file__).resolve().parents[1]
BUSY_PROCESSES = 4


def math500_responses(count: int = 64) -> list[tuple[str, str, str]]:
    """``count`` responses to MATH-500's first problems, graded by `math`: by turns the reference answer respelled
    (what the grader must see through: \\dfrac, no \\left/\\right, spaces), the reference answer on an Answer: line,
    the next problem's answer (wrong but for coincidences), and the answer doubled (wrong)."""
    rows = [json.loads(line) for line in (ROOT / "data/math500/test.jsonl").read_text().splitlines()[: count + 1]]
    out = []
    for i, row in enumerate(rows[:count]):
        truth = row["answer"]
        respelled = truth.replace("\\frac", "\\dfrac").replace("\\left", "").replace("\\right", "").replace(",", ", ")
        response = [
            f"Putting it together, the answer is $\\boxed{{{respelled}}}$.",
            f"So we are done.\nAnswer: {truth}",
            f"Therefore $\\boxed{{{rows[i + 1]['answer']}}}$.",
            f"This gives $\\boxed{{2({truth})}}$.",
        ][i % 4]
        out.append((response, truth, "math"))
    return out


def _verdicts(cases: list, tmp_path: Path, busy: int) -> dict:
    """tests/grading_verdicts.py's verdicts on ``cases``, with ``busy`` processes spinning beside it."""
    path = tmp_path / "cases.json"
    path.write_text(json.dumps(cases))
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(busy)]
    try:
        done = subprocess.run(
            [sys.executable, str(ROOT / "tests/grading_verdicts.py"), str(path)],
            capture_output=True, text=True, timeout=900, cwd=ROOT,
        )  # fmt: skip
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.slow
def test_verdicts_are_the_same_in_process_and_in_the_pool_idle_and_busy(tmp_path):
    cases = [(r, t, g) for r, t, g, _ in grader_cases()]
    math500 = math500_responses()
    everything = cases + math500
    idle = _verdicts(everything, tmp_path, busy=0)
    busy = _verdicts(everything, tmp_path, busy=BUSY_PROCESSES)
    expected = [right for *_, right in grader_cases()]
    for run in (idle, busy):
        for how in ("in_process", "pool"):
            verdicts = run[how]
            assert not any(ungraded for *_, ungraded in verdicts), how  # nothing given up on
            assert [acc for _, acc, _, _ in verdicts[: len(cases)]] == expected, how
    assert idle["in_process"] == idle["pool"] == busy["in_process"] == busy["pool"]
    assert idle["retried"] == busy["retried"] == 0
    # held-out accuracy over the MATH-500 responses: the respelled and the plain reference answers are right, the
    # others wrong but for two: problem 22's next answer is "x=5" (its own is 5), and math-verify reads problem 23's
    # "2(x=5)" as the equation's right side, 5
    accs = [acc for _, acc, _, _ in busy["pool"][len(cases) :]]
    assert [i for i, a in enumerate(accs) if a != (i % 4 < 2)] == MATH500_COINCIDENCES
    assert sum(accs) / len(accs) == pytest.approx((32 + len(MATH500_COINCIDENCES)) / 64)


MATH500_COINCIDENCES = [22, 23]
