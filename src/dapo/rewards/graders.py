"""Grader registry: name -> (response, ground_truth) -> Grade, plus routing by dataset name.

Graders are pure functions of two strings. They never evaluate model output: answers are
compared as normalised strings, Decimals, canonical digit strings, or (for `math`) sympy objects
built by math-verify's LaTeX parser.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass

from dapo.rewards import math_equiv, minerva, numeric
from dapo.rewards.math_equiv import GradingTimeout

TIMEOUT_PRED = "[TIMEOUT]"  # the prediction of a response whose grading ran out of time, retry included
RETRY_FACTOR = 2.0  # an answer that ran out of time is graded once more with this many times the limit


@dataclass(frozen=True)
class Grade:
    score: float  # +1.0 correct, -1.0 otherwise
    acc: bool
    pred: str  # the extracted prediction ("[INVALID]" when none)

    @property
    def ungraded(self) -> bool:
        """Whether grading gave up on the response (out of time, retry included): its score says nothing about
        it, so training leaves it out of its group (reward.ungraded) and evaluation counts it apart."""
        return self.pred == TIMEOUT_PRED


def _as_grade(fn: Callable[[str, str], tuple[float, bool, str]]) -> Callable[[str, str], Grade]:
    def graded(response: str, ground_truth: str) -> Grade:
        return Grade(*fn(response, ground_truth))

    graded.__name__ = fn.__name__
    graded.__doc__ = fn.__doc__
    return graded


# The raw (score, acc, pred) functions: worker processes send these tuples back, not Grades.
RAW_GRADERS: dict[str, Callable[[str, str], tuple[float, bool, str]]] = {
    "dapo": minerva.grade_dapo,  # exactly the reference (verl math_dapo)
    "dapo_relaxed": minerva.grade_dapo_relaxed,  # the reference + equal integers in any spelling
    "math": math_equiv.grade_math,
    "gsm8k": numeric.grade_gsm8k,
    "arith": numeric.grade_arith,
}

GRADERS: dict[str, Callable[[str, str], Grade]] = {name: _as_grade(fn) for name, fn in RAW_GRADERS.items()}

# How much of the end of a response each grader reads. The pool slices responses before sending
# them to workers, so a 20k-character reasoning trace costs 300 bytes of IPC for `dapo`.
TAIL_CHARS: dict[str, int] = {
    "dapo": minerva.TAIL_CHARS,
    "dapo_relaxed": minerva.TAIL_CHARS,
    "math": math_equiv.TAIL_CHARS,
    "gsm8k": numeric.TAIL_CHARS,
    "arith": numeric.TAIL_CHARS,
}

# Ground truths that can be malformed (a data bug, not a wrong answer) are checked up front.
_TRUTH_CHECKS: dict[str, Callable[[str], object]] = {
    "gsm8k": numeric.gsm8k_truth,
    "arith": numeric.arith_truth,
}


def check_grader(name: str) -> None:
    if name not in GRADERS:
        raise ValueError(f"unknown grader {name!r}; valid graders: {', '.join(sorted(GRADERS))}")


def check_inputs(response: object, ground_truth: object, grader: str) -> None:
    """Raise a one-line TypeError/ValueError for inputs no grader can score."""
    check_grader(grader)
    if not isinstance(response, str):
        raise TypeError(f"response must be str, got {type(response).__name__}")
    if not isinstance(ground_truth, str):
        raise TypeError(f"ground_truth must be str, got {type(ground_truth).__name__}")
    if "\0" in ground_truth:  # a data bug (data.py refuses such rows): no answer should match it
        raise ValueError(f"ground truth contains a NUL character: {ground_truth!r}")
    check = _TRUTH_CHECKS.get(grader)
    if check is not None:
        check(ground_truth)


def resolve_grader(path: str) -> Callable[[str, str], tuple[float, bool, str]]:
    """The function an import path "package.module:function" names."""
    module_name, _, attr = path.partition(":")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"extra grader {path!r}: {module_name} has no function {attr!r}")
    return fn


def check_extra_graders(extra_graders: Mapping[str, str] | None) -> dict[str, str]:
    """Graders beyond the built-in ones, name -> "package.module:function", each imported once here to
    fail in one line rather than in every worker."""
    checked: dict[str, str] = {}
    for name, path in (extra_graders or {}).items():
        if not isinstance(name, str) or not name or name in RAW_GRADERS:
            builtin = ", ".join(sorted(RAW_GRADERS))
            raise ValueError(f"extra grader name {name!r}: must be a new, non-empty name (built-ins: {builtin})")
        if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
            raise ValueError(f"extra grader {name!r}: {path!r} is not an import path 'package.module:function'")
        resolve_grader(path)
        checked[name] = path
    return checked


def check_batch(
    responses: Sequence, ground_truths: Sequence, graders: Sequence[str] | str, custom: Container[str]
) -> list[tuple[str, str, str]]:
    """The items as the pool's workers get them: (the tail of the response its grader reads, truth, grader).
    A one-line TypeError/ValueError ("item 3: ...") for an item no grader can score; custom: the names of
    extra graders and reward functions (any str ground truth)."""
    n = len(responses)
    if len(ground_truths) != n:
        raise ValueError(f"{n} responses but {len(ground_truths)} ground truths")
    graders = [graders] * n if isinstance(graders, str) else graders
    if len(graders) != n:
        raise ValueError(f"{n} responses but {len(graders)} grader names")
    checked: set[tuple[str, str]] = set()  # each distinct (truth, grader) once: groups share truths
    items = []
    for i, (response, truth, name) in enumerate(zip(responses, ground_truths, graders)):
        try:
            if (truth, name) in checked:
                pass
            elif name in custom:
                if not isinstance(truth, str):
                    raise TypeError(f"ground_truth must be str, got {type(truth).__name__}")
            else:
                check_inputs("", truth, name)
            if not isinstance(response, str):
                raise TypeError(f"response must be str, got {type(response).__name__}")
        except (TypeError, ValueError) as err:
            raise type(err)(f"item {i}: {err}") from None
        checked.add((truth, name))
        tail = TAIL_CHARS.get(name)  # only the tail a grader reads crosses the pipe
        items.append((response[-tail:] if tail else response, truth, name))
    return items


def grade(response: str, ground_truth: str, grader: str = "dapo") -> Grade:
    """Grade one response in this process (no pool; the graders' own CPU-time limits, in the main thread only).
    An answer that runs out of time is tried once more with RETRY_FACTOR times the limit, then given up on
    (``Grade.ungraded``)."""
    check_inputs(response, ground_truth, grader)
    try:
        return GRADERS[grader](response, ground_truth)
    except GradingTimeout:
        pass
    try:
        with math_equiv.longer_limit(RETRY_FACTOR):
            return GRADERS[grader](response, ground_truth)
    except GradingTimeout:
        return Grade(-1.0, False, TIMEOUT_PRED)


_DAPO_SOURCES = {"mathdapo", "math", "mathdaporeasoning", "dapo17k", "dapomath17k", "dapomath"}
_MATH_SOURCES = {"mathlighteval", "hendrycksmath", "competitionmath", "minervamath"}


def grader_for(data_source: str, default: str = "dapo") -> str:
    """Grader name for a dataset name (``default`` for a name ``known_grader`` does not know).

    Follows verl's routing where it has one ("math_dapo", "math", "aime*" -> the DAPO grader, so
    AIME scores are comparable with the paper); LaTeX-answer benchmarks go to `math`.
    """
    check_grader(default)
    return known_grader(data_source) or default


def known_grader(data_source: str) -> str | None:
    """The grader a known data set's name routes to, or None for a name of no known data set."""
    if not isinstance(data_source, str):
        raise TypeError(f"data_source must be str, got {type(data_source).__name__}")
    # "HuggingFaceH4/MATH-500" -> "math500", "DAPO-17k" -> "dapo17k"
    key = re.sub(r"[^a-z0-9]", "", data_source.strip().lower().rsplit("/", 1)[-1])
    if key.startswith("aime") or key in _DAPO_SOURCES:
        return "dapo"
    if key.startswith(("math500", "amc", "olympiad")) or key in _MATH_SOURCES:
        return "math"
    if key.startswith(("gsm8k", "word")):  # one number, stated in words around it
        return "gsm8k"
    if key.startswith("arith"):
        return "arith"
    return None


def graders_for(data_sources: list[str], grader: str | Mapping[str, str] = "auto") -> list[str]:
    """The grader of each row: ``grader`` for all, or with ``auto`` each row's by its data source. A mapping is
    ``auto`` with the graders a run chose by their rows for the data sources whose names say none
    (``dapo.rewards.sources.auto_graders``)."""
    if isinstance(grader, Mapping):
        return [grader.get(s) or grader_for(s) for s in data_sources]
    return [grader_for(s) for s in data_sources] if grader == "auto" else [grader] * len(data_sources)
