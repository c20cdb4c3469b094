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


def test_a_pool_told_it_grades_no_math_warms_up_off_the_clock_before_a_first_math_answer():
    """A run whose rows go to no `math` grader starts its pool without math-verify's ~2 CPU seconds of warm-up
    (RewardPool(warm_math=False)); should a math answer come all the same, its worker warms up first, on no answer's
    clock: right under a limit far below the warm-up's cost, not timed out. In a fresh process, whose fork server
    has warmed nothing."""
    script = r"""
import json
from dapo.rewards import RewardPool
with RewardPool(num_workers=1, timeout_s=0.3, warm_math=False) as pool:
    arith = pool.score(["12 + 7 = 19. Answer: 19"], ["19"], ["arith"]).grades[0]
    math = pool.score([r"so $\boxed{\left( 3, \frac{\pi}{2} \right)}$"], [r"(3,\pi/2)"], ["math"])
print(json.dumps([arith.acc, math.grades[0].acc, math.grades[0].ungraded, math.num_retried]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.splitlines()[-1]) == [True, True, False, 0]


@pytest.mark.parametrize(
    ("overrides", "warm"),
    [
        ([], False),  # the demo: the built-in task and its held-out split, graded by arith
        (["eval.benchmarks=[math500]"], True),  # MATH-500's rows go to math
        (["reward.grader=math"], True),
        (["reward.function={tmp}/mine.py:exact"], False),  # a reward function grades every row
    ],
)
def test_a_runs_pool_warms_math_verify_up_only_where_its_rows_may_be_graded_by_math(tmp_path, overrides, warm):
    from dapo.config import load_config
    from dapo.rewards.setup import grading_function, grading_pool
    from dapo.run_setup import auto_grader, graders_of, setup_eval_sets, setup_train_sets

    (tmp_path / "mine.py").write_text("def exact(response, truth):\n    return float(truth in response)\n")
    cfg = load_config("configs/demo.yaml", ["eval.num_problems=4", *(o.format(tmp=tmp_path) for o in overrides)])
    train_sets, eval_sets = setup_train_sets(cfg, None), setup_eval_sets(cfg, None)
    graders = graders_of(cfg, train_sets, eval_sets, auto_grader(cfg, train_sets, eval_sets))
    with grading_pool(cfg, grading_function(cfg), graders=graders) as pool:
        assert pool.warm_math is warm, graders
