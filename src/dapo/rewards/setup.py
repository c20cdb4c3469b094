"""The grading a run's reward.* settings ask for: what grades every response (a caller's reward function, the one
reward.function names, or reward.grader's graders) and the pool of worker processes it grades in."""

from __future__ import annotations

from collections.abc import Iterable

from dapo.config import ConfigError
from dapo.rewards.pool import RewardPool
from dapo.rewards.reward_fn import grader_name, reward_function


def grading_function(cfg, reward_fn=None, *, probe_truth: str = "1"):
    """What grades every response instead of reward.grader: a caller's ``reward_fn`` (the Python API), else the
    function reward.function names (imported here and tried on the response "Answer: <probe_truth>"), else None.
    Both given: a ConfigError saying which to drop."""
    one_reward_function(cfg, reward_fn)
    return reward_fn if cfg.reward.function is None else reward_function(cfg.reward.function, probe_truth)


def one_reward_function(cfg, reward_fn) -> None:
    """A ConfigError when both reward.function and a caller's ``reward_fn`` are given, saying which to drop."""
    if reward_fn is not None and cfg.reward.function is not None:
        raise ConfigError(
            f"reward.function={cfg.reward.function} and a reward_fn are both given; grade with one: leave reward_fn "
            "out to use reward.function, or set cfg.reward.function = None to use reward_fn"
        )


def grading_pool(cfg, reward_fn=None, *, graders: Iterable[str] | None = None) -> RewardPool:
    """The grading workers reward.* asks for; ``reward_fn`` (``grading_function``'s) grades there, as REWARD_FN (a
    caller's) or REWARD_FUNCTION (reward.function's). ``graders``: the graders the rows go to, where known; the
    workers warm math-verify up as they start unless no row goes to the math grader (a reward function grades every
    row: its own one-time costs are its module's imports, paid before the workers are ready)."""
    reward_fns = None if reward_fn is None else {grader_name(reward_fn): reward_fn}
    warm_math = reward_fn is None and (graders is None or "math" in set(graders))
    return RewardPool(
        num_workers=cfg.reward.num_workers, timeout_s=cfg.reward.timeout_s, reward_fns=reward_fns, warm_math=warm_math
    )
