"""Mathematical equivalence of LaTeX answers through math-verify.

The prediction is the content of the last `\\boxed{}` in the response tail, else the last
`Answer:` line; math-verify parses both sides into sympy and compares them (fractions vs decimals,
tuples, intervals, sets, percentages, units in `\\text{}`, thousands separators).

Time: the work math-verify does for one comparison is bounded here in CPU seconds (not by
math-verify, which would swallow its own time-out and report a plain "not equal"): past the limit
`GradingTimeout` is raised, and the caller retries the answer once with twice the limit before it
gives up on it (``graders.grade``, the pool). CPU seconds, not wall seconds: a machine busy with
other work stretches the wall time of a parse several times over, and a verdict must not depend
on the load. One-time costs (importing math-verify and sympy, the first parse of each kind of
expression, about 2 CPU seconds) are paid by `warm_up` before any answer's clock starts. The
limit is a signal, so it works only in a process's main thread; elsewhere the caller must bound
the time (RewardPool kills a worker past its limit). A cheap screen also refuses the inputs that
make sympy compute astronomically large integers (power towers, huge factorials), since no signal
can interrupt a big-integer multiplication running in C.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import threading
from fractions import Fraction
from functools import cache, lru_cache

from dapo.rewards.extract import last_answer_line, last_boxed
from dapo.rewards.minerva import normalize_final_answer, normalized_truth, same_answer

# A boxed answer plus the sentence around it fits easily; long reasoning before it is irrelevant.
TAIL_CHARS = 1000
INVALID = "[INVALID]"

# CPU seconds math-verify may spend on one comparison (both parses and the check) where a signal
# can stop it: after `warm_up`, a new kind of expression costs at most ~0.3 s on a slow core. Below
# the pool's default 5 s so that a slow-but-harmless answer stops here instead of costing a worker.
_INTERNAL_TIMEOUT_S = 2.0
_limit_factor = 1.0  # 2.0 while an answer that ran out of time is tried again (`longer_limit`)


class GradingTimeout(BaseException):
    """The `math` grader's own time limit struck. A BaseException, so that the `except Exception`
    handlers inside math-verify and sympy let it through instead of turning it into "not equal"."""


# Answers that make sympy build integers with billions of digits: power towers, `**` chains,
# factorials of 4+ digit numbers or of expressions, repeated `!`, binomials and exponents of huge
# numbers. Checked only on the extracted answer (at most TAIL_CHARS long).
_COSTLY = re.compile(
    r"\^\s*(?:\d+(?:\.\d+)?|e|\\pi)\s*\^"  # 2^3^4, e^e^e (right-associative towers, no braces)
    r"|\((?=[^()]*\^)[^()]*\)\s*\^[\s{(]*\d{4,}"  # (10^{100000})^{100000}
    r"|\*\*[^*]*\*\*"  # 9**9**9
    r"|(?<!\d)\d{4,}\s*!"  # 1000000!
    r"|\((?=[^()]*(?:\^|\d{4}))[^()]*\)\s*!"  # (10^{10})!
    r"|\{(?=[^{}]*(?:\^|\d{4}))[^{}]*\}\s*!"  # {10^{10}}!
    r"|!\s*!"  # 10!!!!
    r"|\\(?:factorial|Gamma|[dt]?binom|choose)\b[^0-9^]{0,8}(?:\d{5,}|\d*\s*\^)"  # \binom{10^9}{..}
    r"|(?:\^|\*\*)[\s{(]*\d{7,}",  # 10^{1000000000}
    re.ASCII,
)
# Every pattern above has one way to split any input (no two adjacent runs that can match the
# same characters), so a failed search over TAIL_CHARS characters stays linear.


def _is_constant(text: str, i: int, step: int) -> bool:
    """Whether text[i] is the last (step -1) or first (step +1) character of `e` or `\\pi`."""
    if step < 0:
        while i >= 0 and text[i].isspace():
            i -= 1
        if text.endswith("\\pi", 0, i + 1):
            return True
        return i >= 0 and text[i] == "e" and (i == 0 or not (text[i - 1].isalpha() or text[i - 1] == "\\"))
    if text.startswith("\\pi", i):
        return True
    return text.startswith("e", i) and (i + 1 == len(text) or not text[i + 1].isalpha())


def _has_power_tower(text: str) -> bool:
    """Whether a numeric power sits inside a braced exponent: 10^{10^{10}}, 10^{{10}^{10}}, e^{e^{e}}.

    Symbolic towers (e^{-x^2}, 2^{2^n}) are cheap for sympy and pass. Linear scan.
    """
    exponent_depth = 0  # how many of the open brace groups are exponents
    stack: list[bool] = []
    after_caret = False
    prev = ""  # previous non-space character
    n = len(text)
    for i, c in enumerate(text):
        if c == "{":
            stack.append(after_caret)
            exponent_depth += after_caret
        elif c == "}":
            if stack:
                exponent_depth -= stack.pop()
        elif c == "^" and exponent_depth and (prev.isdigit() or prev in "})" or _is_constant(text, i - 1, -1)):
            j = i + 1
            while j < n and (text[j].isspace() or text[j] in "{("):
                j += 1
            if j < n and (text[j].isdigit() or _is_constant(text, j, +1)):
                return True
        if not c.isspace():
            after_caret = c == "^"
            prev = c
    return False


def _costly(text: str) -> bool:
    return bool(_COSTLY.search(text)) or _has_power_tower(text)


@cache
def _math_verify():
    """(the module, its extraction configs), imported on first use: math-verify pulls in sympy and antlr
    (~0.5 s), which processes that only run the other graders should not pay for."""
    import math_verify
    from math_verify import ExprExtractionConfig, LatexExtractionConfig

    return math_verify, (LatexExtractionConfig(), ExprExtractionConfig())


@contextlib.contextmanager
def longer_limit(factor: float):
    """The block's comparisons get ``factor`` times the usual CPU limit (the retry of an answer that ran out)."""
    global _limit_factor
    previous, _limit_factor = _limit_factor, factor
    try:
        yield
    finally:
        _limit_factor = previous


@contextlib.contextmanager
def _cpu_time_limit(seconds: float):
    """Raise GradingTimeout in the block once this process has spent ``seconds`` CPU seconds in it
    (ITIMER_PROF: user + system time, which waiting for a busy core does not add to); no limit outside
    the main thread (signals go only there), where the caller bounds the time."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expire(signum, frame):
        raise GradingTimeout(f"math grading took over {seconds:g} CPU seconds")

    previous = signal.signal(signal.SIGPROF, expire)
    signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_PROF, 0)
        signal.signal(signal.SIGPROF, previous)


# One of each kind of expression whose first parse or comparison in a process costs far more than
# later ones (sympy builds its printers, assumption tables and solvers lazily): tuples with constants,
# polynomials, roots, intervals, sets, percentages, text, relations.
_WARM_UP = (
    ("\\left( 3, \\frac{\\pi}{2} \\right)", "(3,\\pi/2)"),
    ("(x+1)^2", "x^2+2x+1"),
    ("3\\sqrt{2}", "\\sqrt{18}"),
    ("[2, 5)", "[2,5)"),
    ("\\{2, 1\\}", "\\{1,2\\}"),
    ("10\\%", "0.1"),
    ("\\text{(C)}", "C"),
    ("x \\in [2,5)", "[2,5)"),
    ("\\sin(\\pi/6)", "\\frac{1}{2}"),
)


@cache
def warm_up() -> None:
    """Pay the math grader's one-time costs now, on no answer's clock: the imports and one comparison of each
    kind in _WARM_UP (about 2 CPU seconds, once per process; a grading worker inherits it from its fork server)."""
    mv, _ = _math_verify()
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it warns of every timeout it does not set
    for pred, truth in _WARM_UP:
        mv.verify(_parse(f"${truth}$"), _parse(f"${pred}$"), timeout_seconds=None)


def _parse(text: str) -> list:
    mv, config = _math_verify()
    # math-verify's own alarm is off (None): ours covers the whole comparison, see _time_limit
    return mv.parse(text, extraction_config=config, parsing_timeout=None)


@lru_cache(maxsize=4096)
def _parsed_truth(ground_truth: str) -> tuple:
    # Reference answers are LaTeX without delimiters ("\left( 3, \frac{\pi}{2} \right)").
    return tuple(_parse(f"${ground_truth}$") or _parse(ground_truth))


def _parsed_prediction(pred: str) -> list:
    # `$` and `\$` inside a boxed answer or an Answer line are decoration, not math; so is the
    # full stop that ends a sentence ("Answer: $\dfrac{3}{4}$.").
    bare = pred.replace("\\$", "").replace("$", "").strip().rstrip(".").strip()
    return _parse(f"${bare}$") or _parse(pred)


# No adjacent optional-whitespace runs: each `\s*` sits between literals or digits, so a failed
# match on 1000 characters of spaces cannot backtrack polynomially.
_SIMPLE_NUMBER = re.compile(
    r"(?P<sign>[+-]?)(?:"
    r"(?P<int>[0-9]{1,100})(?P<dec>\.[0-9]{1,100})?"
    r"|\\[dt]?frac\{\s*(?P<fn>[+-]?[0-9]{1,100})\s*\}\{\s*(?P<fd>[+-]?[0-9]{1,100})\s*\}"
    r"|(?P<sn>[0-9]{1,100})\s*/\s*(?P<sd>[0-9]{1,100})"
    r")",
    re.ASCII,
)


def _simple_number(text: str) -> tuple[Fraction, bool] | None:
    """(value, exact) for "25", "-0.5", "\\frac{14}{3}", "$7/2$."; exact is False for decimals."""
    text = text.strip().removesuffix(".").strip()
    if len(text) > 2 and text[0] == "$" and text[-1] == "$":
        text = text[1:-1].strip()
    m = _SIMPLE_NUMBER.fullmatch(text)
    if m is None:
        return None
    sign = -1 if m["sign"] == "-" else 1
    if m["int"] is not None:
        value, exact = Fraction(m["int"] + (m["dec"] or "")), m["dec"] is None
    else:
        num, den = (int(m["fn"]), int(m["fd"])) if m["fn"] is not None else (int(m["sn"]), int(m["sd"]))
        if den == 0:
            return None
        value, exact = Fraction(num, den), True
    return sign * value, exact


@lru_cache(maxsize=16384)
def equivalent(pred: str, ground_truth: str) -> bool:
    """Whether the extracted prediction equals the ground truth mathematically.

    Cached: the G responses of one prompt often agree on the same few answers.
    """
    if "\0" in pred or "\0" in ground_truth:  # the normalisation would drop it: "2\0" is not "2"
        return False
    # Two plain numbers (integers, decimals, fractions: most competition answers) are compared
    # exactly, skipping ~10-20 ms of LaTeX parsing. Unequal values involving a decimal go on to
    # math-verify, which accepts a rounded decimal (0.333333 for 1/3).
    a, b = _simple_number(pred), _simple_number(ground_truth)
    if a is not None and b is not None:
        if a[0] == b[0]:
            return True
        if a[1] and b[1]:
            return False
    # Equal under the DAPO/Minerva normalisation: correct by the reference's own standard, and
    # the commonest case (the same spelling as the reference) skips sympy entirely. Not when a
    # comma is involved: that normalisation reads "1, 2" (two solutions) as 12.
    if "," not in pred and "," not in ground_truth:
        if same_answer(normalize_final_answer(pred), normalized_truth(ground_truth)):
            return True
    if _costly(pred) and not _costly(ground_truth):
        return False
    warm_up()
    with _cpu_time_limit(_INTERNAL_TIMEOUT_S * _limit_factor):
        truth = _parsed_truth(ground_truth)
        guess = _parsed_prediction(pred)
        if not truth or not guess:
            return False
        mv, _ = _math_verify()
        return bool(mv.verify(list(truth), guess, timeout_seconds=None))


def extract_prediction(response: str) -> str | None:
    """Last boxed answer in the response tail, else the last Answer: line, else None."""
    tail = response[-TAIL_CHARS:]
    boxed = last_boxed(tail)
    if boxed is not None and boxed.strip():
        return boxed.strip()
    line = last_answer_line(tail)
    return line.strip() if line is not None else None


def grade_math(response: str, ground_truth: str) -> tuple[float, bool, str]:
    pred = extract_prediction(response)
    if pred is None:
        return -1.0, False, INVALID
    acc = equivalent(pred, ground_truth)
    return (1.0 if acc else -1.0), acc, pred
