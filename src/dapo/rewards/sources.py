"""Which prompt template and which grader each data set of a run gets, and why: one line per data set at the start
of a run. reward.grader=auto picks a grader from a name (the rows' data_source, else the file's or the folder's
name), which a user may not have meant as one; the line says which name decided and how to change it.

    data data/mine.jsonl: template dapo (data.template), grader dapo (reward.grader=auto: the file's name 'mine'
        names no known data set; set reward.grader to change it)
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from dapo.rewards.graders import grader_for, known_grader

_SHOWN_SOURCES = 6  # a file whose rows name more data sources lists these many, then how many more
_CHANGE = "set reward.grader to change it"


@dataclass(frozen=True)
class DataSet:
    """A data set of a run, as its start line names it."""

    label: str  # "data data/mine.jsonl", "eval aime2024"
    examples: Sequence  # its Examples (their data_source picks the grader under reward.grader=auto)
    template: str | None  # the prompt template it was read with; None: the built-in task, which writes its own
    # where the data source of rows without their own comes from, and that name: ("file's name", "mine")
    named: tuple[str, str] | None = None


def grading_line(data: DataSet, *, grader: str, custom: str | None = None) -> str:
    """``data``'s line: its template and its grader, with why (``grader``: reward.grader; ``custom``: what grades
    instead of it, "your reward function")."""
    read = f"template {data.template} (data.template)" if data.template else "built-in arith task"
    return f"{data.label}: {read}, {_grader_part(data, grader, custom)}"


def _grader_part(data: DataSet, grader: str, custom: str | None) -> str:
    if custom is not None:
        return f"grader: {custom}"
    if grader != "auto":
        return f"grader {grader} (reward.grader={grader})"
    if data.template is None:  # the built-in task: its rows name it
        return f"grader {grader_for(data.examples[0].data_source)} (reward.grader=auto)"
    counts = Counter(ex.data_source for ex in data.examples)
    if len(counts) == 1:
        (source,) = counts
        if data.named is None:  # rows given in Python
            what = "data source"
        else:
            what = data.named[0] if data.named[1] == source else "rows' data_source"
        named = f"{what} {source!r}"
        known = known_grader(source)
        if known is None:
            return f"grader {grader_for(source)} (reward.grader=auto: the {named} names no known data set; {_CHANGE})"
        return f"grader {known} (from the {named}; {_CHANGE})"
    shown = [
        f"{source} -> {grader_for(source)} ({n:,} row{'s' * (n != 1)}"
        + ("" if known_grader(source) else ", no known data set")
        + (f", the {data.named[0]}" if data.named is not None and data.named[1] == source else "")
        + ")"
        for source, n in list(counts.items())[:_SHOWN_SOURCES]
    ]
    more = len(counts) - len(shown)
    listed = ", ".join(shown) + (f" and {more} more" if more else "")
    return f"graders by each row's data_source: {listed} (reward.grader=auto; {_CHANGE})"
