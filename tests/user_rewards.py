"""Reward functions as a user writes them for ``dapo.train(cfg, reward_fn=...)``, and misbehaving ones.

They run in the reward pool's worker processes, which unpickle them by module and name: this module
must be importable there (tests/ is on sys.path under pytest, and the pool passes its sys.path on).
"""

from __future__ import annotations

import os
import time


def wrong_type(response: str, ground_truth: str):
    return "yes"


def make_closure():
    def inner(response: str, ground_truth: str) -> float:
        return 1.0

    return inner


def quarter(response: str, ground_truth: str) -> float:
    """0.25 for every response: a score that is neither the built-in graders' +1 nor their -1."""
    return 0.25


def right_but_negative(response: str, ground_truth: str) -> tuple[float, bool]:
    """(-0.5, True) for every response: the score and the correctness are read separately."""
    return -0.5, True


def hang_on_truth(response: str, ground_truth: str) -> float:
    """Hangs on rows whose answer is 'hang'; 1.0 for the rest."""
    if ground_truth == "hang":
        time.sleep(60)
    return 1.0


def die_or_raise_on_truth(response: str, ground_truth: str) -> float:
    """Kills its worker on rows whose answer is 'die', raises on those whose answer is 'bug'; 1.0 for the rest."""
    if ground_truth == "die":
        os._exit(1)
    if ground_truth == "bug":
        raise ValueError("the user's bug")
    return 1.0


def numpy_scores(response: str, ground_truth: str):
    """numpy's scalars, as a function computing its score with numpy returns them."""
    import numpy as np

    return (np.float32(0.5), np.bool_(False)) if ground_truth == "pair" else np.float64(-0.25)


def boolean(response: str, ground_truth: str) -> bool:
    return True


def not_a_number(response: str, ground_truth: str) -> float:
    return float("nan")
