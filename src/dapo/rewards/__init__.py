"""Rewards: answer extraction and equivalence for math answers, built-in task verifiers, and a
worker pool that grades untrusted model output under a per-call time limit.

Imports only the standard library here; math-verify is loaded on the first `math` grade.
"""

from dapo.rewards.graders import GRADERS, Grade, grade, grader_for, graders_for
from dapo.rewards.pool import REWARD_FN, PoolResult, RewardFnError, RewardPool

__all__ = [
    "GRADERS",
    "Grade",
    "grade",
    "grader_for",
    "graders_for",
    "PoolResult",
    "REWARD_FN",
    "RewardFnError",
    "RewardPool",
]
