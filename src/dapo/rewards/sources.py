"""Which prompt template and which grader each data set of a run gets, and why: one line per data set at the start
of a run. reward.grader=auto picks a grader from a name (the rows' data_source, else the file's or the folder's
name, or the dataset id), which a user may not have meant as one; where the name names no known data set, the rows
decide (``row_graders``): GSM8K's '####' answers go to gsm8k, answers in LaTeX (or read from a \\boxed{}) to math,
others to dapo. The line says how the rows were read, what decided and how to change it.

    data data/mine.jsonl: layout GSM8K's (question, answer after '####'), template dapo (data.template), grader gsm8k
        (reward.grader=auto: the file's name 'mine' names no known data set; its rows have GSM8K's '####' answers;
        set reward.grader to change it)
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dapo.data.layouts import AFTER_HASHES, AS_WRITTEN, BOXED
from dapo.rewards.graders import grader_for, graders_for, known_grader

_SHOWN_SOURCES = 6  # a file whose rows name more data sources lists these many, then how many more
_CHANGE = "set reward.grader to change it"
# an answer written in LaTeX: a command (\frac, \sqrt, \pi), a power or index, braces, or math mode
_LATEX = re.compile(r"\\[A-Za-z]+|[\^_{}$]")


@dataclass(frozen=True)
class DataSet:
    """A data set of a run, as its start line names it."""

    label: str  # "data data/mine.jsonl", "eval aime2024"
    examples: Sequence  # its Examples (their data_source picks the grader under reward.grader=auto)
    template: str | None  # the prompt template it was read with; None: the built-in task, which writes its own
    # where the data source of rows without their own comes from, and that name: ("file's name", "mine")
    named: tuple[str, str] | None = None
    layout: str | None = None  # how its rows were read: "GSM8K's (question, answer after '####')"
    read_as: str = AS_WRITTEN  # how most ground truths were read from their column (dapo.data.layouts)
    skipped: int = 0  # bad rows left out (data.on_bad_row=skip)
    rows: int = 0  # rows read

    @classmethod
    def of(cls, label: str, read, template: str | None) -> DataSet:
        """The data set ``read`` (a ``dapo.data.files.DataRead``) as ``label`` names it."""
        return cls(label, read.examples, template, read.named, read.layout, read.read_as, read.skipped, read.rows)


def rows_grader(examples: Sequence, read_as: str) -> tuple[str, str] | None:
    """The grader rows call for, and why, where their data source's name says none: GSM8K's '####' answers go to
    gsm8k, answers read from a \\boxed{} or written in LaTeX to math; None where nothing in them says."""
    if read_as == AFTER_HASHES:
        return "gsm8k", "its rows have GSM8K's '####' answers"
    if read_as == BOXED:
        return "math", "its rows' answers are their solutions' last \\boxed{}"
    latex = sum(_LATEX.search(ex.ground_truth) is not None for ex in examples)
    if latex:
        return "math", f"{latex:,} of its {len(examples):,} answers are written in LaTeX"
    return None


def row_graders(sets: Sequence[DataSet]) -> dict[str, tuple[str, str]]:
    """reward.grader=auto's grader, and why, for each data source whose name names no known data set but whose rows
    say one (``rows_grader``); the first data set holding a source decides for it."""
    chosen: dict[str, tuple[str, str]] = {}
    for data in sets:
        if data.template is None:  # the built-in task names its own
            continue
        by_source: dict[str, list] = {}
        for ex in data.examples:
            by_source.setdefault(ex.data_source, []).append(ex)
        for source, examples in by_source.items():
            if source not in chosen and known_grader(source) is None:
                if (found := rows_grader(examples, data.read_as)) is not None:
                    chosen[source] = found
    return chosen


def auto_graders(sets: Sequence[DataSet]) -> dict[str, str]:
    """The graders the rows chose (``row_graders``), by data source: what the grading pool is given for
    reward.grader=auto (``dapo.rewards.graders_for``)."""
    return {source: grader for source, (grader, _) in row_graders(sets).items()}


def graders_of(sets: Sequence[DataSet], grader: str | Mapping[str, str]) -> set[str]:
    """The graders the rows of ``sets`` go to under ``grader`` (reward.grader, or ``auto_graders``' choices)."""
    return {name for data in sets for name in graders_for([ex.data_source for ex in data.examples], grader)}


def grading_line(
    data: DataSet, *, grader: str, custom: str | None = None, chosen: Mapping[str, tuple[str, str]] | None = None
) -> str:
    """``data``'s line: how its rows were read, its template and its grader, with why (``grader``: reward.grader;
    ``custom``: what grades instead of it, "your reward function"; ``chosen``: ``row_graders`` of the run's sets)."""
    if data.template is None:
        return f"{data.label}: built-in arith task, {_grader_part(data, grader, custom, chosen or {})}"
    read = f"layout {data.layout}, " if data.layout else ""
    if data.skipped:
        rows = f"bad row{'s' * (data.skipped != 1)}"
        read += f"{data.skipped:,} {rows} of {data.rows:,} left out (data.on_bad_row=skip), "
    template = f"template {data.template} (data.template)"
    return f"{data.label}: {read}{template}, {_grader_part(data, grader, custom, chosen or {})}"


def _grader_part(data: DataSet, grader: str, custom: str | None, chosen: Mapping[str, tuple[str, str]]) -> str:
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
        if known is not None:
            return f"grader {known} (from the {named}; {_CHANGE})"
        if source in chosen:
            decided, why = chosen[source]
            return f"grader {decided} (reward.grader=auto: the {named} names no known data set; {why}; {_CHANGE})"
        return f"grader {grader_for(source)} (reward.grader=auto: the {named} names no known data set; {_CHANGE})"
    shown = [_source_part(data, source, n, chosen) for source, n in list(counts.items())[:_SHOWN_SOURCES]]
    more = len(counts) - len(shown)
    listed = ", ".join(shown) + (f" and {more} more" if more else "")
    return f"graders by each row's data_source: {listed} (reward.grader=auto; {_CHANGE})"


def _source_part(data: DataSet, source: str, n: int, chosen: Mapping[str, tuple[str, str]]) -> str:
    """``math_dapo -> dapo (3 rows)`` of a line listing a file's data sources."""
    decided = known_grader(source) or chosen.get(source, (None,))[0]
    said = f"{n:,} row{'s' * (n != 1)}"
    if known_grader(source) is None:
        said += ", no known data set" + (", by its rows" if decided else "")
    if data.named is not None and data.named[1] == source:
        said += f", the {data.named[0]}"
    return f"{source} -> {decided or grader_for(source)} ({said})"
