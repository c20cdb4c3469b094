"""Graders whose answers are single numbers: GSM8K and the built-in arithmetic task."""

from __future__ import annotations

import re
from decimal import Decimal

from dapo.rewards.extract import last_answer_line, numbers, to_decimal

# Both tasks end with a short answer; the tail is all that is ever read.
TAIL_CHARS = 1000
INVALID = "[INVALID]"

# The arithmetic task accepts exactly an optional sign and ASCII digits, spaces around allowed.
_STRICT_INT = re.compile(r"\s*([+-]?)([0-9]+)\s*", re.ASCII)


def gsm8k_truth(ground_truth: str) -> Decimal:
    """Value of a GSM8K ground truth: the number after the last `####`, or a bare number."""
    text = ground_truth.rsplit("####", 1)[-1]
    value = to_decimal(text)
    if value is None:
        raise ValueError(f"gsm8k ground truth is not a number (after '####' if present): {ground_truth[-80:]!r}")
    return value


def grade_gsm8k(response: str, ground_truth: str) -> tuple[float, bool, str]:
    """The number on the last Answer: line (its first number), else the last number in the tail."""
    truth = gsm8k_truth(ground_truth)
    tail = response[-TAIL_CHARS:]
    line = last_answer_line(tail)
    # "Answer: 18 dollars (9 eggs x $2)" -> the leading number is the answer.
    found = numbers(line) if line is not None else numbers(tail)
    if not found:
        return -1.0, False, INVALID
    pred = found[0] if line is not None else found[-1]
    value = to_decimal(pred)
    acc = value is not None and value == truth
    return (1.0 if acc else -1.0), acc, pred


def _canonical_int(text: str) -> str | None:
    """'+007' -> '7', '-0' -> '0', ' 12 ' -> '12'; None unless strictly [sign]digits.

    Compared as canonical digit strings rather than int(): a 1 MB answer would otherwise hit
    Python's int-parsing limit (and the quadratic cost it guards against).
    """
    m = _STRICT_INT.fullmatch(text)
    if m is None:
        return None
    sign, digits = m.groups()
    digits = digits.lstrip("0") or "0"
    return digits if sign != "-" or digits == "0" else "-" + digits


def arith_truth(ground_truth: str) -> str:
    value = _canonical_int(ground_truth)
    if value is None:
        raise ValueError(f"arith ground truth must be an integer string, got {ground_truth[:80]!r}")
    return value


def grade_arith(response: str, ground_truth: str) -> tuple[float, bool, str]:
    """The last Answer: line, parsed strictly as an integer, equal to the ground truth."""
    truth = arith_truth(ground_truth)
    line = last_answer_line(response[-TAIL_CHARS:])
    if line is None:
        return -1.0, False, INVALID
    value = _canonical_int(line)
    acc = value is not None and value == truth
    return (1.0 if acc else -1.0), acc, line.strip()[:100]
