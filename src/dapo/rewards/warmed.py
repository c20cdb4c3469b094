"""Imported by the grading pool's fork server (``RewardPool``): the math grader's one-time costs (imports,
the first parse of each kind of expression: about 2 CPU seconds) are paid there once, and every worker forked
from it starts warm, so that no answer's time limit is spent on them."""

from dapo.rewards import math_equiv

math_equiv.warm_up()
