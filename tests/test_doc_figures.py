"""Every figure of a measured run on the front pages (README.md, docs/index.md, docs/getting-started.md,
docs/python-api.md) is the figure of its results file, and every figure on those pages has an entry here.

A results file is the JSON a measuring command wrote under benchmarks/results/ (with the command, the date and the
commit), or for runs measured before those files existed the dated record that holds the run's figures (a GPU
report, the table of a docs page). FIGURES says, for each figure-bearing phrase, the text as the page writes it with
each figure a {field}, and where each field comes from; NOT_MEASURED names the figures that are no measurement
(a confidence level). A percentage, a time, a ratio or a count on those pages that neither covers fails the test.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = ("README.md", "docs/index.md", "docs/getting-started.md", "docs/python-api.md")
DEMO = "benchmarks/results/demo.json"
API = "benchmarks/results/python_api_example.json"
SEEDS = "docs/async.md"  # the demo at lr 5e-4 against 2.5e-4, 5 paired seeds (benchmarks/async_rollout.py)
SMOLLM2 = "docs/real-model.md"  # the SmolLM2-135M-Instruct run, 2026-11-23
GPU_H200 = "benchmarks/gpu_report_h200.md"  # make gpu-check, 2026-11-26, the demo at lr 5e-4
GPU_H100 = "benchmarks/gpu_report_h100_50f02d4.md"
MODELS = "docs/models.md"  # tests/test_arch_matrix.py's outcome, family by family
FAIR = "benchmarks/results/fair_share.json"  # a step alone and beside busy processes (benchmarks/fair_share.py)

# what counts as a figure on the pages: a percentage, a time, a ratio, a count of what a run checked or won
FIGURE = re.compile(
    r"\d+(?:\.\d+)?%"
    r"|\b\d+(?:\.\d+)?(?:-\d+(?:\.\d+)?)? ?(?:ms|s|seconds?|min|minutes?|hours?)\b"
    r"|\b(?:a|an) (?:minute|hour)\b"
    r"|\b\d+(?:\.\d+)?x\b"
    r"|\b\d[\d,]* (?:tests|architectures)\b"
    r"|\b\d+ (?:\w+ )?of \d+\b"
)


def pct(v: float) -> str:
    return f"{100 * v:.1f}%"  # as the run's summary prints a fraction: 0.28625 -> 28.6%


def points(v: float) -> str:
    return f"{100 * v:.1f}"


def whole(v) -> str:
    return f"{float(v):.0f}"


def two(v: float) -> str:
    return f"{v:.2f}"


def as_is(v) -> str:
    return str(v)


def _lr_row(lr: str, column: int) -> Callable[[str], str]:
    """A column of the k = 0 row of docs/async.md's staleness table at learning rate ``lr``."""

    def cell(text: str) -> str:
        found = re.search(rf"^\s*\|\s*\**{re.escape(lr)}\**\s*\|\s*0\s*\|(.*)$", text, flags=re.M)
        return found[1].split("|")[column].strip().strip("*") if found else None

    return cell


def seeds_higher(text: str) -> str | None:
    """On how many of the paired seeds the demo at lr 2.5e-4 beat 5e-4 (held-out at step 60), as "N of M"."""
    new, old = _lr_row("2.5e-4", 0)(text), _lr_row("5e-4", 0)(text)
    if new is None or old is None:
        return None
    pairs = list(zip(map(float, new.split("/")), map(float, old.split("/")), strict=True))
    return f"{sum(a > b for a, b in pairs)} of {len(pairs)}"


def exact_architectures(text: str) -> str | None:
    """The families docs/models.md lists as exact; the count it states must be the names it lists."""
    found = re.search(r"\*\*Exact \((\d+)\):\*\* ([^.]*)\.", text)
    if not found:
        return None
    listed = len(found[2].split())
    return found[1] if listed == int(found[1]) else f"{found[1]} (but {listed} listed)"


def smollm2_step_s(content: dict) -> str | None:
    """The wall seconds of a SmolLM2 step alone at the newer commit of the fair-share benchmark."""
    (table,) = content["figures"].values()
    rows = [r for r in table if r["side"].startswith("SmolLM2") and content["commit"][:7] in r["side"]]
    return f"{rows[0]['wall s/step alone']:.0f}" if len(rows) == 1 else None


def _gpu_demo(what: str) -> str:
    return rf"\| h \| `dapo\.cli demo model\.device=cuda [^|]*\| PASS \| avg@4 {what}"


@dataclass
class Figure:
    page: str
    text: str  # as the page writes it (any line breaks as spaces), each figure a {field}
    fields: dict[str, tuple[str, str | Callable, Callable]] = field(default_factory=dict)
    # field -> (results file, key, format): a JSON key path ("after.avg", "evaluations.1.avg"), a regex whose
    # group 1 is the figure in a Markdown record, or a function of the file's text


def _demo_line(page: str) -> Figure:
    return Figure(
        page,
        "held-out accuracy: arith avg@4 {before} [..] before -> {after} [..] after step {step} (95% CI)",
        {"before": (DEMO, "before.avg", pct), "after": (DEMO, "after.avg", pct), "step": (DEMO, "after.step", as_is)},
    )


def _wall_line(page: str) -> Figure:
    return Figure(page, "wall time: {wall} s", {"wall": (DEMO, "wall_s", whole)})


def _architectures(page: str, text: str) -> Figure:
    return Figure(page, text, {"count": (MODELS, exact_architectures, as_is)})


API_FIGURES = {
    "script": (API, "script_s", whole),
    "before": (API, "before.avg", pct),
    "after": (API, "after.avg", pct),
    "date": (API, "date", as_is),
}
SEED_FIGURES = {
    "count": (SEEDS, seeds_higher, as_is),
    "new": (SEEDS, _lr_row("2.5e-4", 1), lambda v: v.split()[0]),
    "old": (SEEDS, _lr_row("5e-4", 1), lambda v: v.split()[0]),
}
GPU_FIGURES = {
    "before": (GPU_H200, _gpu_demo(r"([\d.]+%)"), as_is),
    "after": (GPU_H200, _gpu_demo(r"[\d.]+% -> ([\d.]+%)"), as_is),
    "fastest": (GPU_H200, _gpu_demo(r"[^|]*wall time ([\d.]+) s"), whole),
    "slowest": (GPU_H100, _gpu_demo(r"[^|]*wall time ([\d.]+) s"), whole),
    "date": (GPU_H200, r"^written (\d{4}-\d\d-\d\d)", as_is),
}
SMOLLM2_FIGURES = {
    "before": (SMOLLM2, r"\| base model \| \**([\d.]+%)", as_is),
    "after": (SMOLLM2, r"\| after 20 steps \| \**([\d.]+%)", as_is),
    "minutes": (SMOLLM2, r"([\d.]+) minutes of wall time", as_is),
}

FIGURES = [
    _demo_line("README.md"),
    _wall_line("README.md"),
    Figure("README.md", "DAPO on it: {minutes} minutes on 2 CPU cores with vLLM", SMOLLM2_FIGURES),
    Figure(
        "README.md",
        "SmolLM2-135M-Instruct went from {before} to {after} held-out on word problems in 20 steps and {minutes} "
        "minutes on 2 CPU cores",
        SMOLLM2_FIGURES,
    ),
    Figure(
        "README.md",
        "on a 2-core AMD EPYC without AVX-512 or AMX a step takes {step} s",
        {"step": (FAIR, smollm2_step_s, as_is)},
    ),
    _architectures("README.md", "the {count} architectures checked exactly"),
    _architectures("README.md", "exact log-probs on {count} architectures"),
    Figure("README.md", "It ran for {script} s on 2 cores ({before} -> {after} held-out, measured {date}", API_FIGURES),
    Figure(
        "README.md",
        "the demo at its former learning rate, 5e-4 ({before} -> {after} in {fastest}-{slowest} s, measured {date})",
        GPU_FIGURES,
    ),
    Figure(
        "docs/index.md",
        "The demo ends with `held-out accuracy: arith avg@4 {before} [..] before -> {after} [..] after step {step}` "
        "after {wall} s on 2 CPU cores",
        {**_demo_line("").fields, **_wall_line("").fields},
    ),
    _architectures("docs/index.md", "{count} architectures checked exactly"),
    _demo_line("docs/getting-started.md"),
    _wall_line("docs/getting-started.md"),
    Figure(
        "docs/getting-started.md",
        "it took {wall} s after installation (60 steps of 32 prompts x 8 samples, a median {step} s each: generation "
        "{generate} s, log-probs {logprobs} s, update {update} s; {steps} s of steps with the evaluations) and went "
        "from {before} to {after} held-out (held-out avg@4 along the way: {e10}, {e20}, {e30}, {e40}, {e50} and "
        "{e60}% at steps 10 to 60)",
        {
            "wall": (DEMO, "wall_s", whole),
            "step": (DEMO, "median_s.step", two),
            "generate": (DEMO, "median_s.generate", two),
            "logprobs": (DEMO, "median_s.old_logprob", two),
            "update": (DEMO, "median_s.update", two),
            "steps": (DEMO, "steps_s", whole),
            "before": (DEMO, "before.avg", pct),
            "after": (DEMO, "after.avg", pct),
            **{f"e{10 * i}": (DEMO, f"evaluations.{i}.avg", points) for i in range(1, 7)},
        },
    ),
    Figure(
        "docs/getting-started.md", "(the base model's {before} does not move)", {"before": (DEMO, "before.avg", pct)}
    ),
    Figure("docs/getting-started.md", "2.5e-4 learned more on {count} paired seeds, {new} against {old}", SEED_FIGURES),
    Figure(
        "docs/getting-started.md",
        "(`dapo demo model.device=cuda train.lr=5e-4`) went from {before} to {after} in {fastest}-{slowest} s "
        "(`make gpu-check` on an H200 and an H100, {date}",
        GPU_FIGURES,
    ),
    Figure(
        "docs/python-api.md",
        "it ran for {script} s and took the demo's base model from {before} to {after} held-out avg@4",
        API_FIGURES,
    ),
    Figure(
        "docs/python-api.md",
        "measured {date} at commit {commit}",
        {"date": API_FIGURES["date"], "commit": (API, "commit", lambda c: c[:7])},
    ),
    # outside the pages scanned, the same figures where they are said again
    Figure("configs/demo.yaml", "beat 5e-4 on {count} paired seeds at 60 steps ({new} against {old}", SEED_FIGURES),
]

# figures on the pages that are no measurement: (page, the text around it, why)
NOT_MEASURED = [
    ("README.md", "avg@n, pass@k, maj@n, 95% CI", "the interval's confidence level"),
    ("README.md", 'print(f"held-out avg@{held_out.n} {held_out.avg:.3f}, 95% CI {held_out.ci}")', "the same"),
    ("docs/index.md", "maj@n with 95% intervals", "the same"),
    ("docs/getting-started.md", "with its 95% bootstrap interval", "the same"),
    ("docs/python-api.md", 'print(f"held-out avg@{held_out.n} {held_out.avg:.3f}, 95% CI {held_out.ci}")', "the same"),
]


def flat(text: str) -> str:
    """Text with every run of white space one space: a phrase reads the same across a line break."""
    return " ".join(text.split())


def read_pages() -> dict[str, str]:
    return {page: (ROOT / page).read_text() for page in {*PAGES, *(f.page for f in FIGURES)}}


def read_sources() -> dict[str, object]:
    paths = {source for f in FIGURES for source, _, _ in f.fields.values()}
    return {p: json.loads((ROOT / p).read_text()) if p.endswith(".json") else (ROOT / p).read_text() for p in paths}


def lookup(source: object, key: str | Callable):
    """The figure ``key`` names in a results file (parsed JSON: among its figures, else its date, commit...) or in a
    Markdown record (text); None if absent."""
    if callable(key):
        return key(source)
    if isinstance(source, str):
        found = re.search(key, source, flags=re.M)
        return found[1] if found else None
    for value in (source.get("figures", {}), source):
        for part in key.split("."):
            try:
                value = value[int(part)] if isinstance(value, list) else value[part]
            except (KeyError, IndexError, ValueError, TypeError):
                value = None
                break
        if value is not None:
            return value
    return None


def pattern(fig: Figure) -> re.Pattern:
    """The phrase with any figures in its fields' places: where it stands on the page, whatever it says."""
    parts = re.split(r"\{(\w+)\}", flat(fig.text))
    # a figure is up to 40 characters ("4 of 5", "75.3% [73.2, 77.4]"); one that ends the phrase ends at a space
    return re.compile(
        "".join(
            re.escape(p) if i % 2 == 0 else r"(.{1,40}?)" if parts[i + 1] else r"(\S+)" for i, p in enumerate(parts)
        )
    )


def mismatches(pages: dict[str, str], sources: dict[str, object]) -> list[str]:
    """One line for each phrase whose figures are not its results files' figures."""
    problems = []
    for fig in FIGURES:
        values = {name: lookup(sources[src], key) for name, (src, key, _) in fig.fields.items()}
        if missing := [f"{fig.fields[n][0]} has no {fig.fields[n][1]!r}" for n, v in values.items() if v is None]:
            problems.append(f"{fig.page}: {flat(fig.text)!r}: " + "; ".join(missing))
            continue
        expected = flat(fig.text).format(**{n: fig.fields[n][2](v) for n, v in values.items()})
        page = flat(pages[fig.page])
        if expected not in page:
            found = pattern(fig).search(page)
            says = repr(found[0]) if found else "nothing like it"
            sources_named = ", ".join(sorted({src for src, _, _ in fig.fields.values()}))
            problems.append(f"{fig.page}: expected {expected!r} (from {sources_named}); the page says {says}")
    return problems


def uncovered(pages: dict[str, str]) -> list[str]:
    """One line for each figure on PAGES that no entry of FIGURES or NOT_MEASURED covers."""
    problems = []
    for page in PAGES:
        text = flat(pages[page])
        spans = [m.span() for f in FIGURES if f.page == page for m in pattern(f).finditer(text)]
        for entry_page, phrase, _ in NOT_MEASURED:
            if entry_page == page:
                spans += [(m.start(), m.end()) for m in re.finditer(re.escape(flat(phrase)), text)]
        for m in FIGURE.finditer(text):
            if not any(start <= m.start() and m.end() <= end for start, end in spans):
                context = text[max(m.start() - 60, 0) : m.end() + 20]
                problems.append(f"{page}: {m[0]!r} in '...{context}...' has no entry in FIGURES or NOT_MEASURED")
    return problems


def test_every_figure_on_the_pages_is_its_results_files():
    assert mismatches(read_pages(), read_sources()) == []


def test_every_figure_on_the_pages_has_an_entry():
    assert uncovered(read_pages()) == []


def test_every_entry_of_not_measured_is_on_its_page():
    pages = read_pages()
    assert [(p, t) for p, t, _ in NOT_MEASURED if flat(t) not in flat(pages[p])] == []


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks" / "results").glob("*.json")), ids=lambda p: p.name)
def test_a_results_file_says_what_measured_it_when_and_at_which_commit(path):
    content = json.loads(path.read_text())
    assert content["command"] and content["figures"], content
    if "recorded_in" in content:  # transcribed from an earlier record: where and when that record was written
        recorded = content["recorded_in"]
        assert re.fullmatch(r"[0-9a-f]{40}", recorded["commit"]) and re.fullmatch(r"\d{4}-\d\d-\d\d", recorded["date"])
        return
    assert content["written_by"].startswith(("python scripts/", "python benchmarks/")), content
    assert re.fullmatch(r"\d{4}-\d\d-\d\d", content["date"]), content["date"]
    assert re.fullmatch(r"[0-9a-f]{40}", content["commit"]), content["commit"]


def test_a_figure_changed_on_a_page_fails_naming_the_page_and_both_figures():
    pages, sources = read_pages(), read_sources()
    demo = sources[DEMO]["figures"]
    after, changed = pct(demo["after"]["avg"]), pct(demo["after"]["avg"] + 0.011)
    before, step = pct(demo["before"]["avg"]), demo["after"]["step"]
    line = f"before -> {after} [..] after step {step}"
    assert line in pages["docs/getting-started.md"]
    pages["docs/getting-started.md"] = pages["docs/getting-started.md"].replace(line, line.replace(after, changed))
    expected = f"held-out accuracy: arith avg@4 {before} [..] before -> {after} [..] after step {step} (95% CI)"
    assert mismatches(pages, sources) == [
        f"docs/getting-started.md: expected {expected!r} (from {DEMO}); the page says "
        f"{expected.replace(after, changed)!r}"
    ]


def test_a_results_file_measured_again_fails_every_page_that_quotes_it():
    pages, sources = read_pages(), read_sources()
    figures = sources[API]["figures"]
    figures["script_s"] += 30
    failed = mismatches(pages, sources)
    assert [line.split(":")[0] for line in failed] == ["README.md", "docs/python-api.md"], failed
    assert f"expected 'It ran for {figures['script_s']:.0f} s on 2 cores (" in failed[0]
    del figures["script_s"]
    assert mismatches(pages, sources)[0].endswith(f"{API} has no 'script_s'")


def test_a_figure_without_an_entry_is_listed():
    pages = read_pages()
    pages["docs/index.md"] += "\nA step of the demo takes 1.4 s, 12% of it grading; 3 of 4 runs sped up 1.5x.\n"
    listed = uncovered(pages)
    assert [line.split(" in '")[0] for line in listed] == [
        "docs/index.md: '1.4 s'",
        "docs/index.md: '12%'",
        "docs/index.md: '3 of 4'",
        "docs/index.md: '1.5x'",
    ]
    assert listed[0].endswith(
        "A step of the demo takes 1.4 s, 12% of it grading;...' has no entry in FIGURES or NOT_MEASURED"
    )


def test_the_seed_count_is_counted_from_the_table():
    table = (
        "| 5e-4 | 0 | 67.4 / 68.4 / 67.6 / 75.4 / 70.5 | 69.8% [65.7, 74.0] |\n"
        "| **2.5e-4** | 0 | 75.0 / 77.1 / 77.0 / 74.0 / 73.5 | **75.3% [73.2, 77.4]** |\n"
    )
    assert seeds_higher(table) == "4 of 5"
    assert seeds_higher(table.replace("74.0 / 73.5", "76.0 / 73.5")) == "5 of 5"
    assert _lr_row("2.5e-4", 1)(table) == "75.3% [73.2, 77.4]"
