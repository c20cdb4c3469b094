"""The row layouts dapo reads, and one row read into an ``Example``.

A row's problem comes from one text column and its ground truth from one answer column, both chosen from the first
row that has them (a row's own columns may first be renamed by data.columns, ``instruction=problem``):

============================  ===================  =========================================================
layout                        text column          answer column, and how the ground truth is read from it
============================  ===================  =========================================================
DAPO's (verl, DAPO-Math-17K)  prompt               reward_model.ground_truth, as written
TRL's                         prompt               ground_truth, answer or solution (as below)
plain, MATH's                 problem or question  ground_truth or answer, as written
GSM8K's                       question             answer: the number after ``####``
NuminaMath's, open-r1's       problem or question  solution: its last ``\\boxed{}``
============================  ===================  =========================================================

``prompt`` is a string or a chat list ``[{role, content}]`` (the problem is its last user turn); the others are
strings. A row with several answer columns takes them in the order ground_truth, answer, solution (MATH's rows have
both a solution and its answer). An ``answer`` holding a ``####`` line gives the number after it; a ``solution``
gives its last ``\\boxed{}``, else the number after ``####``, else itself when it is one line (a bare answer, as
trl-lib's DeepMath-103K). Every row may add ``data_source`` (the data set it is from: its grader) and ``id``.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dapo.data.prompts import Example, Message, apply_template

TEXT_COLUMNS = ("prompt", "problem", "question")
# the answer columns, in the order a row with several is read by
ANSWER_COLUMNS = ("reward_model.ground_truth", "ground_truth", "answer", "solution")

LAYOUTS_READ = (
    "prompt (a string or a chat list) with reward_model.ground_truth, ground_truth, answer or solution (DAPO's, "
    "TRL's); problem or question with ground_truth, answer or solution (plain, MATH's, GSM8K's answer after "
    "'####', NuminaMath's and open-r1's solution ending in \\boxed{})"
)

_BOX_OPENERS = ("\\boxed{", "\\fbox{")
# how a ground truth was read from its column
AS_WRITTEN, AFTER_HASHES, BOXED = "as written", "after '####'", "last \\boxed{}"


class DataError(ValueError):
    """A data file that cannot be turned into examples; the message names the file, row and field."""


@dataclass(frozen=True)
class Layout:
    """The two columns a data set's rows are read from."""

    text: str  # prompt, problem or question
    answer: str  # reward_model.ground_truth, ground_truth, answer or solution

    @property
    def name(self) -> str:
        if self.text == "prompt":
            return "DAPO's" if self.answer == "reward_model.ground_truth" else "TRL's"
        if self.answer == "solution":
            return "NuminaMath's"
        return "GSM8K's" if (self.text, self.answer) == ("question", "answer") else "plain"

    def needs(self) -> str:
        """What each row needs, as an error's fix says it."""
        text = "'prompt' (string or [{role, content}])" if self.text == "prompt" else f"'{self.text}'"
        if self.name == "GSM8K's":
            return f"each row needs {text} and an 'answer' ending in '#### <number>'"
        if self.answer == "solution":
            return f"each row needs {text} and a 'solution' ending in \\boxed{{<answer>}}"
        return f"each row needs {text} and '{self.answer}'"


def describe(layout: Layout, read_as: str, renames: Mapping[str, str]) -> str:
    """The layout as a start line names it: ``GSM8K's (question, answer after '####')``, with the columns renamed
    (``plain (problem <- instruction, answer <- output)``); ``read_as``: how most ground truths were read."""
    theirs = {ours: theirs for theirs, ours in renames.items()}

    def col(name: str) -> str:
        return f"{name} <- {theirs[name]}" if name in theirs else name

    how = {AFTER_HASHES: f" {AFTER_HASHES}", BOXED: f"'s {BOXED}"}.get(read_as, "")
    return f"{layout.name} ({col(layout.text)}, {col(layout.answer)}{how})"


def renames_of(columns: list[str] | tuple[str, ...]) -> dict[str, str]:
    """data.columns' ``THEIRS=OURS`` items as a mapping (checked by the config's rules)."""
    return dict(item.split("=", 1) for item in columns)


def renamed(row: dict, renames: Mapping[str, str]) -> dict:
    """``row`` with its columns renamed by ``renames`` (THEIRS -> OURS); a renamed column wins over one of that name."""
    if not renames:
        return row
    out = {k: v for k, v in row.items() if k not in renames.values()}
    out.update({renames[k]: v for k, v in row.items() if k in renames})
    return out


def _has(row: dict, dotted: str) -> bool:
    head, _, rest = dotted.partition(".")
    return row.get(head) is not None if not rest else isinstance(row.get(head), dict)


def detect(row: dict) -> Layout | None:
    """The layout of ``row``, or None where it has no text column or no answer column."""
    text = next((c for c in TEXT_COLUMNS if row.get(c) is not None), None)
    answer = next((c for c in ANSWER_COLUMNS if _has(row, c)), None)
    if text is None or answer is None:
        return None
    return Layout(text, answer)


def no_layout(row: dict, where: str, renames: Mapping[str, str]) -> DataError:
    """The error for a row that fits no layout: the layouts read, and the nearest one with the columns to rename."""
    return DataError(f"{where}: cannot tell the layout from fields {sorted(row)}; dapo reads {LAYOUTS_READ}; "
                     f"{_nearest(row, renames)}")  # fmt: skip


def _nearest(row: dict, renames: Mapping[str, str]) -> str:
    strings = sorted((k for k, v in row.items() if isinstance(v, str) and v.strip()), key=lambda k: len(row[k]))
    text = next((c for c in TEXT_COLUMNS if row.get(c) is not None), None)
    answer = next((c for c in ANSWER_COLUMNS if _has(row, c)), None)
    done = ",".join(f"{k}={v}" for k, v in renames.items())

    def rename(*pairs: tuple[str, str]) -> str:
        return "data.columns=[" + ",".join(filter(None, [done, *(f"{a}={b}" for a, b in pairs)])) + "]"

    if text is not None:  # the problem is there, the answer not
        others = [k for k in strings if k != text]
        fix = f"rename its answer column, e.g. {rename((others[0], 'answer'))}" if others else "add an answer column"
        return f"nearest: {Layout(text, 'answer').name} ({text}, answer), but no answer column; {fix}"
    if answer is not None:  # the answer is there, the problem not
        others = [k for k in strings if k != answer]
        fix = f"rename its problem column, e.g. {rename((others[-1], 'problem'))}" if others else "add a problem column"
        return f"nearest: plain (problem, {answer}), but no problem column; {fix}"
    if len(strings) >= 2:  # the longest text is likely the problem, the shortest its answer
        return f"nearest: plain (problem, answer); rename its columns, e.g. {rename((strings[-1], 'problem'), (strings[0], 'answer'))}"  # noqa: E501
    return "a row needs a problem and its answer"


def read_row(layout: Layout, row: dict, row_no: int, where: str, template: str) -> tuple[Example, str]:
    """``row`` (the ``row_no``-th, 1-based) as an Example of ``layout``, and how its ground truth was read (AS_WRITTEN,
    AFTER_HASHES or BOXED); a row that does not fit raises DataError naming ``where`` and the field. Its data source
    is the row's own or empty (the caller's default)."""
    raw = _field(row, layout.text, where, layout)
    if layout.text == "prompt" and not isinstance(raw, str):
        prompt: str | tuple = _chat(raw, where, template, layout)
    else:
        prompt = apply_template(_text(raw, layout.text, where, layout), template)
    truth, how = _ground_truth(layout, row, where)
    uid = str(row_no - 1)
    extra = row.get("extra_info")
    if row.get("id") is not None:
        uid = str(row["id"])
    elif isinstance(extra, dict) and extra.get("index") is not None:
        uid = str(extra["index"])
    source = row.get("data_source")
    if source is not None and not isinstance(source, str):
        raise DataError(
            f"{where}: field 'data_source' must be a string, got {type(source).__name__}; "
            "drop it or give the data set's name"
        )
    if source is not None:
        _no_nul(source, "data_source", where)
    return Example(uid=uid, prompt=prompt, ground_truth=truth, data_source=source or ""), how


def _ground_truth(layout: Layout, row: dict, where: str) -> tuple[str, str]:
    col = layout.answer
    value = _field(row, col, where, layout)
    hashes = col == "answer" and isinstance(value, str) and "####" in value
    if not (col == "solution" or layout.name == "GSM8K's" or hashes):  # a bare answer
        return _answer_text(row, col, where, layout), AS_WRITTEN
    value = _text(value, col, where, layout)
    if col == "solution" and (boxed := last_boxed(value)) is not None:
        boxed = boxed.strip()
        if not boxed:
            raise DataError(f"{where}: field 'solution' ends in an empty \\boxed{{}}; {layout.needs()}")
        return _no_nul(boxed, col, where), BOXED
    if "####" in value:
        truth = value.rsplit("####", 1)[1].strip().replace(",", "")
        if not truth:
            raise DataError(f"{where}: field '{col}' has nothing after '####'; {layout.needs()}")
        return _no_nul(truth, col, where), AFTER_HASHES
    if layout.name == "GSM8K's":
        raise DataError(f"{where}: field 'answer' has no '#### <number>' final line; {layout.needs()}")
    if col == "solution" and "\n" in value.strip():
        raise DataError(
            f"{where}: field 'solution' has no \\boxed{{}} answer and no '####' line, and is more than a bare answer; "
            f"{layout.needs()}, or give the answer in a column of its own (data.columns=[COLUMN=answer])"
        )
    return _no_nul(value.strip(), col, where), AS_WRITTEN


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` (or `\\fbox{...}`), braces matched; None if absent or unterminated.

    Like the MATH reference (last_boxed_only_string) only the last opener counts: an unterminated
    last box is usually a truncated response, and an earlier box is often an intermediate result.
    The graders read model output with it too (``dapo.rewards.extract``): it scans once, linearly.
    """
    start = max(text.rfind(opener) for opener in _BOX_OPENERS)
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    body_start = i
    n = len(text)
    while i < n:  # linear in the (capped) text length
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[body_start:i]
        i += 1
    return None


def _field(row: dict, dotted: str, where: str, layout: Layout) -> Any:
    cur: Any = row
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur or cur[part] is None:
            raise DataError(f"{where}: field '{dotted}' is missing; {layout.needs()}")
        cur = cur[part]
    return cur


def _answer_text(row: dict, field: str, where: str, layout: Layout) -> str:
    value = _field(row, field, where, layout)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        # JSON writers turn 27 into 27.0; the answer a model writes is "27".
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: field '{field}' is empty; {layout.needs()}")
        return _no_nul(value.strip(), field, where)
    raise DataError(
        f"{where}: field '{field}' must be a string or a number, got {type(value).__name__}; {layout.needs()}"
    )


def _text(value: Any, field: str, where: str, layout: Layout) -> str:
    if not isinstance(value, str):
        raise DataError(f"{where}: field '{field}' must be a string, got {type(value).__name__}; {layout.needs()}")
    if not value.strip():
        raise DataError(f"{where}: field '{field}' is empty; {layout.needs()}")
    return _no_nul(value, field, where)


def _no_nul(value: str, field: str, where: str) -> str:
    # no text or answer holds a NUL; graders that normalise answers would drop it and call "2\0" equal to "2"
    if "\0" in value:
        raise DataError(f"{where}: field '{field}' contains a NUL character (\\x00); remove it from the file")
    return value


def _chat(value: Any, where: str, template: str, layout: Layout) -> tuple:
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(
            f"{where}: field 'prompt' must be a string or a non-empty list of "
            f"{{role, content}} messages, got {type(value).__name__}; {layout.needs()}"
        )
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(
                f"{where}: field 'prompt[{i}]' must be a {{role, content}} message with string values; {layout.needs()}"
            )
        role = _no_nul(m["role"], f"prompt[{i}].role", where)
        messages.append((role, _no_nul(m["content"], f"prompt[{i}].content", where)))
    users = [i for i, (role, _) in enumerate(messages) if role == "user"]
    if not users:
        raise DataError(f"{where}: field 'prompt' has no 'user' message; {layout.needs()}")
    # The problem is the (last) user turn; system turns and earlier history pass through.
    last = users[-1]
    role, content = messages[last]
    if not content.strip():
        raise DataError(f"{where}: field 'prompt[{last}].content' is empty; {layout.needs()}")
    messages[last] = (role, apply_template(content, template))
    return tuple(Message(r, c) for r, c in messages)
