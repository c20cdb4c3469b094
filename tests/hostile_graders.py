"""Graders that misbehave on purpose, to prove RewardPool's guarantees (tests and benchmarks only).

Each takes (response, ground_truth) and returns (score, acc, pred) like the built-in raw graders.
The pool's workers import them by path, so this module must be importable in the worker: tests/
is on sys.path under pytest (rootdir conftest), and benchmarks put it there before starting a pool.
"""

from __future__ import annotations

import ctypes
import os
import time

from dapo.rewards.math_equiv import GradingTimeout


def sleep(response: str, ground_truth: str) -> tuple[float, bool, str]:
    """Sleeps `ground_truth` seconds (10 if empty): a verifier that hangs."""
    time.sleep(float(ground_truth or 10))
    return 1.0, True, "slept"


def spin(response: str, ground_truth: str) -> tuple[float, bool, str]:
    """Computes for `ground_truth` CPU seconds (a verifier that is slow, not stuck); its prediction is the pid of
    the process that graded it."""
    end = time.process_time() + float(ground_truth)
    while time.process_time() < end:
        pass
    return 1.0, True, str(os.getpid())


def crash(response: str, ground_truth: str) -> tuple[float, bool, str]:
    os._exit(1)


def segfault(response: str, ground_truth: str) -> tuple[float, bool, str]:
    ctypes.string_at(0)  # reads address 0: SIGSEGV
    raise AssertionError("unreachable")


def memory(response: str, ground_truth: str) -> tuple[float, bool, str]:
    blob = bytearray(1 << 40)  # 1 TiB: MemoryError under the worker's address-space limit
    return 1.0, True, str(len(blob))


def raise_error(response: str, ground_truth: str) -> tuple[float, bool, str]:
    raise RuntimeError("grader bug")


def own_timeout(response: str, ground_truth: str) -> tuple[float, bool, str]:
    raise GradingTimeout("as the math grader's own limit does")


# name -> import path, as RewardPool(extra_graders=...) takes them
HOSTILE_GRADERS = {
    "_test_sleep": "hostile_graders:sleep",
    "_test_spin": "hostile_graders:spin",
    "_test_crash": "hostile_graders:crash",
    "_test_segfault": "hostile_graders:segfault",
    "_test_memory": "hostile_graders:memory",
    "_test_raise": "hostile_graders:raise_error",
    "_test_own_timeout": "hostile_graders:own_timeout",
}
