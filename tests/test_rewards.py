"""Graders on real answer strings: correct, wrong, equivalent spellings, missing, multiple answers."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from dapo.rewards import GRADERS, Grade, grade, grader_for
from dapo.rewards.minerva import normalize_final_answer


def acc(response: str, truth: str, grader: str) -> bool:
    g = grade(response, truth, grader)
    assert g.score == (1.0 if g.acc else -1.0)
    return g.acc


# ---------------------------------------------------------------------------------------------
# dapo: the DAPO-Math-17K reference grader


@pytest.mark.parametrize(
    "raw, normalized",
    [
        ("x = \\$1,000", "1000"),
        ("\\frac12", "\\frac{1}{2}"),
        ("\\sqrt2", "\\sqrt{2}"),
        ("45^\\circ", "45"),
        ("\\text{Evelyn}", "Evelyn"),
        ("10 square feet", "10"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("$\\frac{\\pi}{2}$", "\\frac{\\pi}{2}"),
        ("5\\text{ cm}", "5"),
        ("an integer 7", "integer7"),  # "an " and spaces dropped, only listed words deleted
        ("\\overline{AB}", "AB"),
        ("x\\mbox{ and }y", "x,y"),  # spaces go, mbox -> text, then \text{and} -> ","
        ("3\\mbox{ and }4", "34"),  # ... and "3,4" is then digits with a comma: "34" (as the reference)
    ],
)
def test_normalize_final_answer(raw, normalized):
    assert normalize_final_answer(raw) == normalized


DAPO_CORRECT = [
    ("Let me think... so the sum is 25.\nAnswer: 25", "25"),
    ("answer : 25", "25"),  # case-insensitive, spaces around the colon
    ("Answer:25", "25"),
    ("Answer: $25$", "25"),
    ("Answer: \\boxed{25}", "25"),
    ("Answer: $x = 25$", "25"),  # text after the last '='
    ("Answer: 25 degrees", "25"),
    ("Answer: \\frac12", "\\frac{1}{2}"),  # shorthand expanded
    ("Answer: $\\frac{\\sqrt{3}}{2}$", "\\frac{\\sqrt{3}}{2}"),
    ("Answer: 3\nthen I checked\nAnswer: 25", "25"),  # the last Answer: line wins
    ("Answer: 1,000", "1000"),  # digits with commas lose them on both sides (the reference does this)
]


@pytest.mark.parametrize("response, truth", DAPO_CORRECT)
def test_dapo_correct(response, truth):
    assert acc(response, truth, "dapo")
    assert acc(response, truth, "dapo_relaxed")  # the relaxation only ever adds matches


DAPO_WRONG = [
    ("Answer: 26", "25"),
    ("Answer: 25\nwait, no.\nAnswer: 24", "25"),  # last wins, and it is wrong
    ("The answer is 25.", "25"),  # no Answer: line
    ("\\boxed{25}", "25"),  # the reference does not read boxes
    ("Answer: 25\n" + "more reasoning " * 30, "25"),  # outside the last 300 characters
    ("Answer: 250", "25"),
    ("Answer: 2.50", "2.5"),  # non-integer decimals keep the reference's string compare
    ("Answer: 0.5", "\\frac{1}{2}"),  # no math equivalence in the reference grader
    ("Answer: \\dfrac{1}{2}", "\\frac{1}{2}"),  # nor LaTeX synonyms
    ("Answer: 25.5", "25"),
]


@pytest.mark.parametrize("response, truth", DAPO_WRONG)
def test_dapo_wrong(response, truth):
    assert not acc(response, truth, "dapo")
    assert not acc(response, truth, "dapo_relaxed")


# The reference (verl math_dapo) compares normalised strings, so equal integers spelled differently
# are wrong there; `dapo` keeps that, `dapo_relaxed` accepts them.
SPELLED_DIFFERENTLY = [
    ("Answer: 025", "25", "025"),
    ("Answer: 25", "025", "25"),
    ("Answer: 27.0", "27", "27.0"),
    ("Answer: +3", "3", "+3"),
    ("Answer: 3.00", "3", "3.00"),
    ("Answer: 1,000.0", "1000", "1,000.0"),  # commas go only from a digits-and-commas string
    ("Answer: -3", "-3.0", "-3"),
]


@pytest.mark.parametrize("response, truth, pred", SPELLED_DIFFERENTLY)
def test_dapo_is_the_reference_string_compare(response, truth, pred):
    assert grade(response, truth, "dapo") == Grade(-1.0, False, pred)
    assert grade(response, truth, "dapo_relaxed") == Grade(1.0, True, pred)


def test_dapo_pred_and_invalid():
    assert grade("Answer: $\\boxed{25}$", "25") == Grade(1.0, True, "25")
    assert grade("no answer here", "25") == Grade(-1.0, False, "[INVALID]")
    assert grade("", "25").pred == "[INVALID]"


# ---------------------------------------------------------------------------------------------
# math: math-verify equivalence


MATH_CORRECT = [
    ("so the point is $\\boxed{\\left( 3, \\frac{\\pi}{2} \\right)}$.", "(3,\\pi/2)"),
    ("Answer: (3, \\pi/2)", "\\left( 3, \\frac{\\pi}{2} \\right)"),
    ("\\boxed{0.5}", "\\frac{1}{2}"),
    ("\\boxed{\\frac{14}{3}}", "\\frac{28}{6}"),
    ("\\boxed{[2, 5)}", "[2,5)"),
    ("\\boxed{(-\\infty, 3]}", "(-\\infty,3]"),
    ("\\boxed{\\{2, 1\\}}", "\\{1,2\\}"),
    ("\\boxed{10\\%}", "10"),
    ("Answer: 0.1", "10\\%"),
    ("\\boxed{5 \\text{ cm}}", "5"),
    ("\\boxed{1,000,000}", "1000000"),
    ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}"),
    ("\\boxed{\\text{(C)}}", "C"),
    ("\\boxed{3\\sqrt{2}}", "\\sqrt{18}"),
    ("\\boxed{(x+1)^2}", "x^2+2x+1"),
    ("\\boxed{27}", "27.0"),  # AMC answers are stored as floats
    ("\\boxed{025}", "25"),
    ("Answer: $\\dfrac{3}{4}$.", "0.75"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}"),  # nested braces inside the box
    ("first \\boxed{7}, then corrected: \\boxed{8}", "8"),  # the last box wins
    ("\\boxed{8}\nAnswer: 7", "8"),  # a box beats an Answer: line
    ("\\boxed{x \\in [2,5)}", "[2,5)"),
]


@pytest.mark.parametrize("response, truth", MATH_CORRECT)
def test_math_correct(response, truth):
    assert acc(response, truth, "math")


MATH_WRONG = [
    ("\\boxed{\\left( 3, \\frac{\\pi}{3} \\right)}", "(3,\\pi/2)"),
    ("\\boxed{0.51}", "\\frac{1}{2}"),
    ("\\boxed{[2, 5]}", "[2,5)"),
    ("\\boxed{12}", "1, 2"),  # not the Minerva comma rule
    ("\\boxed{8}, no wait \\boxed{7}", "8"),
    ("the answer is 8", "8"),  # neither a box nor an Answer: line
    ("so \\boxed{8", "8"),  # unterminated box, no Answer: line
    ("\\boxed{}", "8"),
    ("\\boxed{x^2+2x}", "x^2+2x+1"),
]


@pytest.mark.parametrize("response, truth", MATH_WRONG)
def test_math_wrong(response, truth):
    assert not acc(response, truth, "math")


def test_math_only_reads_the_tail():
    assert acc("\\boxed{4}" + " filler" * 50, "4", "math")
    assert not acc("\\boxed{4}" + " filler" * 200, "4", "math")  # box more than 1000 chars back


def test_math_in_a_worker_thread():
    # math-verify's own timeouts use SIGALRM, which raises outside the main thread; grading
    # there must still work (with its timeouts off).
    out: list[Grade] = []
    errors: list[BaseException] = []

    def run():
        try:
            out.append(grade("\\boxed{\\frac{2}{4}}", "0.5", "math"))
            out.append(grade("\\boxed{\\frac{3}{4}}", "0.5", "math"))
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    t = threading.Thread(target=run)
    t.start()
    t.join(60)
    assert not errors and [g.acc for g in out] == [True, False]


# ---------------------------------------------------------------------------------------------
# gsm8k


GSM8K_TRUTH = (
    "Janet sells 16 - 3 - 4 = <<16-3-4=9>>9 duck eggs a day.\nShe makes 9 * 2 = $<<9*2=18>>18 every day.\n#### 18"
)


GSM8K_CORRECT = [
    ("She sells 9 eggs for $2 each.\nAnswer: 18", GSM8K_TRUTH),
    ("Answer: $18", GSM8K_TRUTH),
    ("Answer: 18.00 dollars", GSM8K_TRUTH),
    ("9 * 2 = 18", "18"),  # no Answer: line: the last number
    ("#### 18", "18"),
    ("Answer: 1,000", "1000"),
    ("Answer: 1000", "#### 1,000"),
    ("Answer: -4", "-4"),
    ("Answer: 5\nAnswer: 18 (9 eggs at $2)", "18"),  # last line, first number on it
]


@pytest.mark.parametrize("response, truth", GSM8K_CORRECT)
def test_gsm8k_correct(response, truth):
    assert acc(response, truth, "gsm8k")


GSM8K_WRONG = [
    ("Answer: 17", GSM8K_TRUTH),
    ("Answer: 17\nCheck: 9 * 2 = 18", "18"),  # the Answer: line beats later numbers
    ("I don't know", "18"),
    ("18 - 20", "18"),  # last number is 20 (the minus is binary, not a sign)
    ("Answer: 18.5", "18"),
]


@pytest.mark.parametrize("response, truth", GSM8K_WRONG)
def test_gsm8k_wrong(response, truth):
    assert not acc(response, truth, "gsm8k")


def test_gsm8k_bad_truth_is_a_clear_error():
    with pytest.raises(ValueError, match="gsm8k ground truth"):
        grade("Answer: 1", "#### eighteen", "gsm8k")


# ---------------------------------------------------------------------------------------------
# arith: the built-in synthetic task


ARITH_CORRECT = [
    ("Answer: 12", "12"),
    ("Answer:  -7 ", "-7"),
    ("Answer: +7", "7"),
    ("Answer: 007", "7"),
    ("Answer: -0", "0"),
    ("Answer: 3\nAnswer: 12", "12"),
    ("Answer: " + "9" * 900, "9" * 900),
]


@pytest.mark.parametrize("response, truth", ARITH_CORRECT)
def test_arith_correct(response, truth):
    assert acc(response, truth, "arith")


ARITH_WRONG = [
    ("Answer: 7.0", "7"),
    ("Answer: 7 apples", "7"),
    ("Answer: \uff17", "7"),
    ("Answer: 12\nAnswer: 13", "12"),
    ("12", "12"),
    ("Answer: 1 2", "12"),
    ("Answer: 3+4", "7"),
    ("Answer: " + "9" * 900, "9" * 899 + "8"),
]


@pytest.mark.parametrize("response, truth", ARITH_WRONG)
def test_arith_wrong(response, truth):
    assert not acc(response, truth, "arith")


def test_arith_bad_truth_is_a_clear_error():
    with pytest.raises(ValueError, match="integer string"):
        grade("Answer: 1", "1.5", "arith")


# ---------------------------------------------------------------------------------------------
# API edges


def test_registry_and_errors():
    assert set(GRADERS) == {"dapo", "dapo_relaxed", "math", "gsm8k", "arith"}
    with pytest.raises(ValueError, match="valid graders: arith, dapo, dapo_relaxed, gsm8k, math"):
        grade("Answer: 1", "1", "sympy")
    with pytest.raises(TypeError, match="ground_truth must be str"):
        grade("Answer: 1", 1, "dapo")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="response must be str"):
        grade(None, "1", "dapo")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "source, expected",
    [
        ("math_dapo", "dapo"),
        ("DAPO-17k", "dapo"),
        ("math", "dapo"),
        ("math_dapo_reasoning", "dapo"),
        ("aime2024", "dapo"),
        ("AIME-2025", "dapo"),
        ("math500", "math"),
        ("HuggingFaceH4/MATH-500", "math"),
        ("amc2023", "math"),
        ("openai/gsm8k", "gsm8k"),
        ("gsm8k", "gsm8k"),
        ("arith", "arith"),
        ("something_else", "dapo"),
    ],
)
def test_grader_for(source, expected):
    assert grader_for(source) == expected


def test_grader_for_default_and_errors():
    assert grader_for("unknown", default="math") == "math"
    with pytest.raises(ValueError, match="unknown grader"):
        grader_for("gsm8k", default="nope")


def test_rewards_layer_imports_no_torch():
    # Worker processes import this package; it must not drag in torch or the trainer.
    code = (
        "import sys, dapo.rewards; "
        "bad = [m for m in ('torch', 'transformers', 'sympy', 'math_verify') if m in sys.modules]; "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def grader_cases() -> list[tuple[str, str, str, bool]]:
    """Every (response, truth, grader, right) case above: what tests/test_grading_load.py grades in process and in
    the pool, on an idle machine and a busy one."""
    cases = [(r, t, g, True) for r, t in DAPO_CORRECT for g in ("dapo", "dapo_relaxed")]
    cases += [(r, t, g, False) for r, t in DAPO_WRONG for g in ("dapo", "dapo_relaxed")]
    cases += [(r, t, "dapo", False) for r, t, _ in SPELLED_DIFFERENTLY]
    cases += [(r, t, "dapo_relaxed", True) for r, t, _ in SPELLED_DIFFERENTLY]
    for grader, right, wrong in (
        ("math", MATH_CORRECT, MATH_WRONG),
        ("gsm8k", GSM8K_CORRECT, GSM8K_WRONG),
        ("arith", ARITH_CORRECT, ARITH_WRONG),
    ):
        cases += [(r, t, grader, True) for r, t in right] + [(r, t, grader, False) for r, t in wrong]
    return cases
