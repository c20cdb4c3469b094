"""Scoring a round's responses: the rule reward from the grading pool (+1 / -1, or a caller's reward function's
score), then the soft overlong punishment (eq. 13). A response the pool gave up grading (out of time twice) is
marked ungraded (reward.ungraded=leave_out: the advantage leaves it out) or scored wrong (reward.ungraded=wrong)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dapo.algorithm import advantages
from dapo.rewards.graders import TIMEOUT_PRED, graders_for
from dapo.rewards.pool import CRASH_PRED

NO_ANSWER = ("[INVALID]", "")  # what every grader predicts for a response without an answer


@dataclass
class Scored:
    acc: torch.Tensor  # (N,) float 0/1
    reward: torch.Tensor  # (N,) correctness reward + overlong shaping
    overlong_penalty: torch.Tensor  # (N,) <= 0: the shaping part alone
    preds: list[str]
    # per response: grading gave up on it (reward.ungraded=leave_out): no advantage, no loss
    ungraded: list[bool] = field(default_factory=list)
    timeouts: int = 0  # responses whose grading ran out of time twice (ungraded, or scored wrong)
    worker_crashes: int = 0  # responses whose grading worker died (scored wrong)
    retried: int = 0  # responses graded a second time, with twice the limit, after running out of time


class Scorer:
    """Turns response texts into rewards: rule reward from the grading pool, then eq. 13 shaping.

    With ``reward_from_score`` (a caller's reward function) the grader's own score is the reward
    instead of algo.correct_reward / wrong_reward; a response whose grading timed out or crashed
    gets algo.wrong_reward, as under the built-in graders. ``leave_out_ungraded`` (reward.ungraded=leave_out) marks a
    response whose grading was given up on instead of counting it wrong."""

    def __init__(
        self,
        pool,
        *,
        grader: str,
        algo_cfg,
        max_response_tokens: int,
        reward_from_score: bool = False,
        leave_out_ungraded: bool = True,
    ):
        self.pool = pool
        self.grader = grader
        self.a = algo_cfg
        self.max_response_tokens = max_response_tokens
        self.reward_from_score = reward_from_score
        self.leave_out_ungraded = leave_out_ungraded

    def __call__(
        self, texts: list[str], ground_truths: list[str], data_sources: list[str], lengths, truncated
    ) -> Scored:
        result = self.pool.score(texts, ground_truths, graders_for(data_sources, self.grader))
        acc = torch.tensor([float(g.acc) for g in result.grades])  # (N,)
        if self.reward_from_score:
            reward = torch.tensor(
                [self.a.wrong_reward if g.pred in (TIMEOUT_PRED, CRASH_PRED) else g.score for g in result.grades],
                dtype=torch.float32,
            )  # (N,)
        else:
            reward = torch.where(acc > 0, self.a.correct_reward, self.a.wrong_reward)  # (N,)
        penalty = torch.zeros_like(reward)
        if self.a.soft_overlong_punishment:
            penalty = advantages.overlong_penalty(
                lengths,
                max_response_tokens=self.max_response_tokens,
                overlong_buffer_tokens=self.a.overlong_buffer_tokens,
                penalty_factor=self.a.overlong_penalty_factor,
            )
        ungraded = [self.leave_out_ungraded and g.ungraded for g in result.grades]
        preds = [g.pred for g in result.grades]
        return Scored(
            acc, reward + penalty, penalty, preds, ungraded, result.num_timeouts, result.num_crashes, result.num_retried
        )
