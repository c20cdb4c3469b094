"""The DAPO-Math-17K reference grader (verl `math_dapo`), kept exact so scores match the paper.

Two graders share the normalisation below:
  dapo          exactly the reference: the normalised strings must be equal ("025" != "25")
  dapo_relaxed  the same, plus equal integers spelled differently ("025" == "25", "27.0" == "27")

The answer normalisation is the one published with Minerva (Lewkowycz et al. 2022, appendix D)
and used by the DAPO reference: keep the text after the last `=`, apply literal substitutions,
delete unit and filler words, unwrap `$..$`, `\\text{}`, `\\textbf{}`, `\\overline{}`, `\\boxed{}`,
expand `\\fracab` / `\\sqrta`, drop `$`, and drop commas from a digits-and-commas number.
"""

from __future__ import annotations

import re
from functools import lru_cache

from dapo.rewards.extract import ANSWER_LINE, plain_integer_value

# The reference scores only the last 300 characters (the longest MATH-500 answer is 159).
TAIL_CHARS = 300
INVALID = "[INVALID]"

# Order matters: "an " before "a ", the `,\text{and}` form before the bare one.
_LITERAL_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)

# Deleted wherever they occur, in this order (later entries see the result of earlier ones).
_DELETED: tuple[str, ...] = (
    "square",
    "ways",
    "integers",
    "dollars",
    "mph",
    "inches",
    "hours",
    "km",
    "units",
    "\\ldots",
    "sue",
    "points",
    "feet",
    "minutes",
    "digits",
    "cents",
    "degrees",
    "cm",
    "gm",
    "pounds",
    "meters",
    "meals",
    "edges",
    "students",
    "childrentickets",
    "multiples",
    "\\text{s}",
    "\\text{.}",
    "\\text{\ns}",
    "\\text{}^2",
    "\\text{}^3",
    "\\text{\n}",
    "\\text{}",
    "\\mathrm{th}",
    "^\\circ",
    "^{\\circ}",
    "\\;",
    ",\\!",
    "{,}",
    '"',
    "\\dots",
)

# (pattern, replacement) applied with re.sub in this order. Each runs on at most a few hundred
# characters (the response tail); the lazy/greedy pairs are at worst quadratic in that length.
_UNWRAP: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"(.*?)(\$)(.*?)(\$)(.*)"), r"$\3$"),  # keep the first $...$ span of each line
    (re.compile(r"(\\text\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\textbf\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\overline\{)(.*?)(\})"), r"\2"),
    (re.compile(r"(\\boxed\{)(.*)(\})"), r"\2"),
    (re.compile(r"(frac)([^{])(.)"), r"frac{\2}{\3}"),  # \frac12 -> \frac{1}{2}
    (re.compile(r"(sqrt)([^{])"), r"sqrt{\2}"),  # \sqrt2 -> \sqrt{2}
)


def normalize_final_answer(answer: str) -> str:
    """Minerva/DAPO normalisation of one final answer string."""
    answer = answer.split("=")[-1]
    for old, new in _LITERAL_SUBSTITUTIONS:
        answer = answer.replace(old, new)
    for word in _DELETED:
        answer = answer.replace(word, "")
    for pattern, replacement in _UNWRAP:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():  # "100,000" -> "100000"
        answer = answer.replace(",", "")
    return answer.strip()


@lru_cache(maxsize=4096)
def normalized_truth(ground_truth: str) -> str:
    # A group of G responses shares one ground truth; normalise it once.
    return normalize_final_answer(ground_truth)


def same_answer(pred: str, truth: str) -> bool:
    """The reference comparison: plain string equality of the normalised answers."""
    return pred == truth


def same_answer_relaxed(pred: str, truth: str) -> bool:
    """String equality after normalisation, or equal integers in different spellings.

    A departure from the reference, so it has its own grader name (`dapo_relaxed`): "025" == "25",
    "27.0" == "27", "+3" == "3", "1,000.0" == "1000", and only when both sides are plain
    integer/decimal literals ("2.50" != "2.5" still, as non-integers keep the string compare).
    """
    if pred == truth:
        return True
    a = plain_integer_value(pred)
    return a is not None and a == plain_integer_value(truth)


def _extract(response: str) -> str:
    tail = response[-TAIL_CHARS:]
    found = ANSWER_LINE.findall(tail)
    return normalize_final_answer(found[-1] if found else INVALID)


def grade_dapo(response: str, ground_truth: str) -> tuple[float, bool, str]:
    """(score, acc, pred) exactly as the DAPO reference (verl `math_dapo.compute_score`) grades."""
    pred = _extract(response)
    acc = same_answer(pred, normalized_truth(ground_truth))
    return (1.0 if acc else -1.0), acc, pred


def grade_dapo_relaxed(response: str, ground_truth: str) -> tuple[float, bool, str]:
    """(score, acc, pred) as `grade_dapo`, but equal integers in different spellings also match."""
    pred = _extract(response)
    acc = same_answer_relaxed(pred, normalized_truth(ground_truth))
    return (1.0 if acc else -1.0), acc, pred
