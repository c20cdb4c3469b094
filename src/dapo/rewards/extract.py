"""Answer extraction shared by the graders: the `Answer:` line, the last `\\boxed{}`, numbers.

Everything here runs on model output, so every function expects an already length-capped string
(the graders slice the tail first) and uses only regexes that scan linearly: no nested
quantifiers, no alternations that can overlap on long runs.
"""

from __future__ import annotations

import re
from decimal import Decimal

from dapo.data.layouts import last_boxed  # noqa: F401 (one reader of \boxed{} for the data's answers and the graders')

# The DAPO prompt asks for "Answer: $Answer" on the last line; the reference grader takes the last
# match of this exact pattern (verl math_dapo.is_correct_minerva), so the `dapo` grader must too.
ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# A number as people write it: optional sign, thousands groups or plain digits, optional decimals.
# The minus counts only when it is not a binary minus (not after a digit, letter or bracket).
_NUMBER = re.compile(r"(?:(?<![\w)\]}])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?", re.ASCII)

# A plain literal: what "025", "27.0", "1,000", "-3" look like once spaces are gone.
_PLAIN_LITERAL = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?", re.ASCII)


def last_answer_line(text: str) -> str | None:
    """Content of the last `Answer: ...` line (case-insensitive), or None."""
    found = ANSWER_LINE.findall(text)
    return found[-1] if found else None


def numbers(text: str) -> list[str]:
    """All numbers in `text`, as written (commas kept), in order."""
    return _NUMBER.findall(text)


def to_decimal(number: str) -> Decimal | None:
    """Value of a number written with optional `$`, commas, sign and decimals; None if it is not one."""
    cleaned = number.strip().replace(",", "").replace("$", "").strip()
    if len(cleaned) > 1000 or not _PLAIN_LITERAL.fullmatch(cleaned):
        return None
    return Decimal(cleaned)  # a plain literal always converts


def plain_integer_value(text: str) -> int | None:
    """Integer value of a plain integer/decimal literal ("025", "27.0", "1,000"); None otherwise.

    Non-integral decimals ("2.5") return None: the only relaxation of the reference string
    compare is that equal integers spelled differently are equal.
    """
    if len(text) > 400 or not _PLAIN_LITERAL.fullmatch(text):  # 400: more than any 300-char tail
        return None
    value = Decimal(text.replace(",", ""))
    if value != value.to_integral_value():
        return None
    return int(value)
