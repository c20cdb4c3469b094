"""A response whose grading was given up on (out of time twice) is never counted as a wrong answer: training leaves
it out of its group's advantage and of the loss (reward.ungraded=leave_out, the default) or scores it wrong
(reward.ungraded=wrong); evaluation leaves it out of avg@n, pass@k and maj@n and reports how many."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from dapo.algorithm import advantages
from dapo.algorithm.batch import RolloutBatch
from dapo.algorithm.step import assign_advantages
from dapo.collect.scoring import Scorer
from dapo.config import AlgoConfig
from dapo.evaluation import EvalResult, problem_pass_at, problem_summary
from dapo.rewards import Grade, PoolResult

TIMEOUT = Grade(-1.0, False, "[TIMEOUT]")


def test_a_timeout_is_ungraded_and_nothing_else_is():
    assert TIMEOUT.ungraded
    assert not Grade(-1.0, False, "[CRASH]").ungraded and not Grade(1.0, True, "7").ungraded


def test_informative_groups_compare_only_the_counted_rows():
    acc = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.0])
    counted = torch.tensor([True, True, True, True, True, True, True, False, True, False, False, False])
    assert advantages.informative_groups(acc, 4).tolist() == [True, True, True]
    # group 2's only wrong answer is ungraded: all right; group 3 has one counted row: nothing to compare
    assert advantages.informative_groups(acc, 4, counted=counted).tolist() == [True, False, False]


def test_an_ungraded_response_sets_no_baseline_and_is_not_trained_on():
    batch = RolloutBatch.of_responses(
        [[1]] * 4, [[2, 3]] * 4, group_size=4, reward=torch.tensor([1.0, -1.0, -1.0, -1.0]),
        ungraded=[False, False, False, True],
    )  # fmt: skip
    assign_advantages(batch, AlgoConfig(), 4)
    # the baseline is the three graded rows' (1, -1, -1): mean -1/3, unbiased std sqrt(4/3)
    std = math.sqrt(((4 / 3) ** 2 + 2 * (2 / 3) ** 2) / 2)
    expected = [(4 / 3) / (std + 1e-6), -(2 / 3) / (std + 1e-6), -(2 / 3) / (std + 1e-6), 0.0]
    assert batch.adv.tolist() == pytest.approx(expected, abs=1e-6)
    assert batch.trainable.tolist() == [True, True, True, False]
    assert batch.response_mask()[3].sum() == 0
    # the same rows graded: the fourth is a wrong answer and shares the baseline
    graded = RolloutBatch.of_responses([[1]] * 4, [[2, 3]] * 4, group_size=4, reward=batch.reward)
    assign_advantages(graded, AlgoConfig(), 4)
    assert graded.adv.tolist() == pytest.approx([1.5, -0.5, -0.5, -0.5], abs=1e-5)


class _GivesUp:
    """A pool whose second response ran out of time twice."""

    def score(self, texts, truths, graders):
        grades = [Grade(1.0, True, "3"), TIMEOUT, Grade(-1.0, False, "4")]
        return PoolResult(grades, num_timeouts=1, num_crashes=0, seconds=0.0, num_retried=1)


@pytest.mark.parametrize("leave_out, ungraded", [(True, [False, True, False]), (False, [False, False, False])])
def test_the_scorer_marks_or_scores_wrong_as_reward_ungraded_says(leave_out, ungraded):
    algo = AlgoConfig(soft_overlong_punishment=False)
    scorer = Scorer(_GivesUp(), grader="math", algo_cfg=algo, max_response_tokens=8, leave_out_ungraded=leave_out)
    scored = scorer(["a", "b", "c"], ["3"] * 3, ["x"] * 3, torch.tensor([2, 2, 2]), torch.zeros(3, dtype=torch.bool))
    assert scored.ungraded == ungraded
    assert scored.reward.tolist() == [1.0, -1.0, -1.0] and (scored.timeouts, scored.retried) == (1, 1)


def _sample(correct: bool, ungraded: bool = False, pred: str = "3") -> dict:
    return {"correct": correct, "ungraded": ungraded, "extracted_answer": "[TIMEOUT]" if ungraded else pred}


def test_evaluation_leaves_ungraded_samples_out_of_every_figure_and_counts_them():
    problem = SimpleNamespace(uid="p", ground_truth="3")
    samples = [_sample(True), _sample(False, pred="4"), _sample(False, ungraded=True), _sample(True)]
    row = problem_summary(problem, samples)
    assert (row["accuracy"], row["num_correct"], row["num_graded"], row["maj_correct"]) == (2 / 3, 2, 3, 1.0)
    assert problem_pass_at(row, 1) == pytest.approx(2 / 3)
    assert problem_pass_at(row, 4) == 1.0  # pass@3: only three were graded
    nothing = problem_summary(problem, [_sample(False, ungraded=True)] * 2)
    assert nothing["accuracy"] is None and nothing["num_graded"] == 0
    result = EvalResult("b", 4, 1, 2 / 3, (0.0, 1.0), {1: 2 / 3}, 1.0, 2.0, 0.0, ungraded=1)
    assert result.metrics()["eval/b/ungraded"] == 1


class _Engine:
    backend = "hf"

    def generate(self, prompt_ids, params):
        from dapo.rollout.base import Generation

        rows = len(prompt_ids) * params.n
        return Generation(prompt_ids * params.n, [[5, 6]] * rows, torch.zeros(rows, dtype=torch.bool), ["t"] * rows)


class _GivesUpOnEveryThird:
    def score(self, texts, truths, graders):
        right, wrong = Grade(1.0, True, "3"), Grade(-1.0, False, "4")
        grades = [[right, wrong, TIMEOUT][i % 3] for i in range(len(texts))]
        return PoolResult(grades, num_timeouts=sum(g.ungraded for g in grades), num_crashes=0, seconds=0.0)


def test_evaluate_reports_avg_over_the_graded_samples_and_the_ungraded_count():
    from dapo.evaluation import evaluate
    from dapo.rollout.base import SamplingParams

    examples = [SimpleNamespace(uid=f"p{i}", ground_truth="3", data_source="x", text=lambda: "q") for i in range(2)]
    result = evaluate(
        _Engine(), lambda ex: [1, 2], examples, _GivesUpOnEveryThird(), SamplingParams(n=3), name="b", grader="math"
    )
    # each problem: right, wrong, ungraded -> avg@3 1/2 (not 1/3), maj a tie of 3 and 4, 2 ungraded of 6
    assert (result.avg, result.ungraded, result.maj) == (0.5, 2, 0.5)
    assert result.pass_at == {1: 0.5, 2: 1.0}
