"""The manual speaks to users about the product: README.md and every page under docs/ (the generated reference
included) name no machine lent to the project, no lease or per-call size limit, no session's minutes, no issue the
work came from, no goal or target set for the project, no CI script and no rehearsal. Each offending line is listed
with its page and line number."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# (what the words are, the pattern), matched case-insensitively on each line with its link targets removed: an
# anchor such as results.md#...-goals is another page's heading, not words this page says
PROJECT_WORDS = [
    ("a machine lent to the project", r"\blent\b"),
    ("a lease of a machine", r"\blease[sd]?\b"),
    ("a per-call size limit", r"\b(?:KiB|MiB|GiB|KB|MB|GB) a call\b|\bone call carries\b"),
    ("a session's time", r"\b(?:this|that|the|a|one|each|later|earlier|next|previous|same) session\b|\bsession's\b"),
    ("device time given to the project", r"\bdevice time\b"),
    ("the issue the work came from", r"\bthe issue(?:'s)?\b|(?<!verl )\bissue #?\d+"),
    ("a goal set for the project", r"\bgoals?\b"),
    ("a target set for the project", r"\b(?:the|our|a) target (?:was|is|were)\b"),
    ("the CI script", r"\.ci/"),
    ("a rehearsal", r"\brehears(?:e|ed|al|als|ing)\b"),
]
LINK_TARGET = re.compile(r"\]\([^)]*\)")


def manual_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def offending_lines(text: str) -> list[tuple[int, str, str]]:
    """(line number, what the words are, the line) for every line of ``text`` that uses project-internal words."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        words = LINK_TARGET.sub("]()", line)
        for what, pattern in PROJECT_WORDS:
            if re.search(pattern, words, flags=re.IGNORECASE):
                found.append((number, what, line.strip()))
    return found


def test_the_manual_uses_no_project_internal_words():
    hits = [
        f"{page.relative_to(ROOT)}:{number}: {what}: {line[:160]}"
        for page in manual_pages()
        for number, what, line in offending_lines(page.read_text(encoding="utf-8"))
    ]
    assert not hits, "the manual should speak of the product only; reword these lines:\n" + "\n".join(hits)


def test_the_check_reads_the_readme_and_every_page_with_the_reference():
    names = {str(p.relative_to(ROOT)) for p in manual_pages()}
    assert {"README.md", "docs/gpu.md", "docs/troubleshooting.md", "docs/reference/config.md"} <= names


@pytest.mark.parametrize(
    "line",
    [
        "### One lent machine, 15 minutes: the calls",
        "its 98 MB GGUF is more than one call carries there (64 MiB a call, the tree included)",
        "more than a 15-minute lease after a start of one to two; the demos run again in a later lease",
        "not measured in this session (no CPU time left); the latest session's machine",
        "At most 15 minutes of device time",
        "(The issue's 6.7% and 47 tokens were a run of the same command)",
        "see issue #12",
        "k = 1 costs -1.5 points (within the 2-point goal, intervals overlapping)",
        "The target was +10 points within 60 minutes",
        "a clone's `bash .ci/run` adds the installation",
        "## Rehearsed without a GPU",
    ],
)
def test_each_kind_of_project_word_is_caught(line):
    assert offending_lines(line), line


@pytest.mark.parametrize(
    "line",
    [
        "dapo train configs/demo.yaml model.lora.rank=8 model.lora.target_modules=[q_proj,v_proj]",
        "train low-rank adapters (peft) on the target layers and freeze every base weight",
        "racing N seeds per side to the held-out target (median of 5 seeds per side)",
        "the grading pool (worker processes with a per-call time limit)",
        "| `tools.memory_mb` | int | `1024` | >= 64 MiB | address space per call |",
        "SIGUSR1 kills torchrun at once and the ranks, in sessions of their own, train on",
        'the authors: "around 320", verl issue #795',
        "[Results](results.md#what-the-figures-say-and-what-bounds-the-missed-goals) has what bounds each figure",
        "the release notes; the silent failure",
    ],
)
def test_product_words_are_left_alone(line):
    assert not offending_lines(line), offending_lines(line)
