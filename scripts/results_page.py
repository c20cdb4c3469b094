"""benchmarks/RESULTS.md, rendered from the results files benchmarks/results/*.json: each benchmark's latest figures
with the command that measured them, the commit, the date, the machine and the load it ran under.

    python scripts/results_page.py            # write benchmarks/RESULTS.md (make format)
    python scripts/results_page.py --check    # exit 1 if the page is not what the files render (make lint)

A results file holds one benchmark, or one setting of one:
  title, group   its heading, and the section it goes in (one of GROUPS)
  measures       what it measures, a sentence or two
  command        the command that measured it (a string, or a list of them)
  date, commit   of the measurement; null where the record does not say
  recorded_in    for figures transcribed from an earlier record: that record's file, commit and date
  machine        benchmarks/runs.py's machine() (cpu, amx, avx512, cores, usable_cores), any of them null where
                 not recorded, with gpu and note where they apply; null where nothing was recorded
  load           a sentence, or null where not recorded (a file written by scripts/measurement.py has the load
                 average inside machine)
  figures        a mapping: a list of records is a table of its own, anything else a row of the figures table
  notes          what the figures say, a sentence or two each
Figures superseded by a later measurement, or measured while other work shared the machine, are not kept: git keeps
every earlier version of this page (git log -p benchmarks/RESULTS.md).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "benchmarks" / "RESULTS.md"
MAX_LINES = 400
WIDTH = 120  # prose is wrapped here; a table row is one line whatever its length
GROUPS = (
    "The demo and the Python API example",
    "Against TRL",
    "A training step on the CPU",
    "Screening and generation ahead of training",
    "Tools and preemption",
    "On a GPU",
)
INTRO = (
    "Each benchmark's latest figures, with the command, commit, date, machine and load they were measured at (\"not "
    'recorded" where the record does not say). Figures superseded by a later measurement, or measured while other '
    "work shared the machine, are not here: git keeps them (`git log -p benchmarks/RESULTS.md`)."
)


def short(x: float) -> str:
    """A float as written (0.28625, 44.2), or to 4 significant figures where its repr is longer (47.12)."""
    text = repr(x)
    if len(text) <= 8 and "e" not in text:
        return text
    if abs(x) >= 1e4:
        return f"{x:,.0f}"
    decimals = max(0, 3 - math.floor(math.log10(abs(x)))) if x else 1
    return f"{x:.{decimals}f}"


def cell(value, nested: bool = False) -> str:
    """One figure as a table cell: a mean with its interval as "m ± h", a record as "key value, ...", a list as
    "a, b" (in brackets inside a record), nothing as "-"."""
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}" if abs(value) >= 1e4 else str(value)
    if isinstance(value, float):
        return short(value)
    if isinstance(value, dict):
        if set(value) == {"mean", "ci95"}:
            return f"{cell(value['mean'])} ± {cell(value['ci95'])}"
        return ", ".join(f"{k} {cell(v, nested=True)}" for k, v in value.items())
    if isinstance(value, list):
        joined = ", ".join(cell(v, nested=True) for v in value)
        return f"[{joined}]" if nested else joined
    return str(value).replace("|", "\\|").replace("\n", " ")


def table(rows: list[dict]) -> list[str]:
    """A Markdown table of records: the columns are their keys, in the order they first appear. Many records of few
    keys (a curve: step and value) are laid on their side, one row per key, so that a page of them stays short."""
    columns = list(dict.fromkeys(key for row in rows for key in row))
    if len(columns) <= 4 < len(rows) and len(rows) > len(columns) + 2:
        first, *rest = columns
        lines = ["| " + " | ".join([cell(first)] + [cell(row.get(first)) for row in rows]) + " |"]
        lines.append("|" + "---|" * (len(rows) + 1))
        return lines + ["| " + " | ".join([cell(c)] + [cell(row.get(c)) for row in rows]) + " |" for c in rest]
    lines = ["| " + " | ".join(cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    return lines + ["| " + " | ".join(cell(row.get(c)) for c in columns) + " |" for row in rows]


def is_table(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(v, dict) for v in value)


def figure_lines(figures: dict) -> list[str]:
    """Every figure that is not a table as a row of one "figure | value" table, first; then each list of records as
    a table of its own, under its name unless it is the only figure."""
    rows = [{"figure": k, "value": v} for k, v in figures.items() if not is_table(v)]
    lines = table(rows) + [""] if rows else []
    for name, value in figures.items():
        if is_table(value):
            lines += ([f"**{name}**", ""] if len(figures) > 1 else []) + table(value) + [""]
    return lines


def wrap(text: str, prefix: str = "") -> list[str]:
    indent = " " * len(prefix)
    return textwrap.wrap(text, WIDTH, initial_indent=prefix, subsequent_indent=indent, break_on_hyphens=False)


def machine_text(machine: dict | None) -> str:
    """ "NVIDIA H200, 2 cores, AMX, AVX-512 (a note); CPU model not recorded": what is known, then what is not."""
    if not machine:
        return "not recorded"
    known, unknown = [machine["gpu"]] if machine.get("gpu") else [], []
    if machine.get("cpu"):
        known.append(machine["cpu"])
    else:
        unknown.append("CPU model")
    cores = machine.get("cores", machine.get("cpus"))  # "cpus": files written before runs.machine()
    usable = machine.get("usable_cores")
    if cores:
        known.append(f"{cores} cores" + (f" ({usable} usable)" if usable and usable != cores else ""))
    elif not machine.get("gpu"):
        unknown.append("cores")
    for key, name in (("amx", "AMX"), ("avx512", "AVX-512")):
        if machine.get(key) is None:
            unknown.append(name)
        else:
            known.append(name if machine[key] else f"no {name}")
    text = ", ".join(known) + (f" ({machine['note']})" if machine.get("note") else "")
    if machine.get("gpu") and len(unknown) == 3:  # nothing of the host CPU: the GPU is the machine
        return text + "; host CPU not recorded"
    if len(unknown) == 3:
        return text + ", CPU not recorded"
    if unknown:
        missing = ", ".join(unknown[:-1]) + " and " * (len(unknown) > 1) + unknown[-1]
        text += f"; {missing} not recorded"
    return text


def load_text(content: dict) -> str:
    if content.get("load"):
        return content["load"]
    average = (content.get("machine") or {}).get("load_average_1min")
    if average:  # scripts/measurement.py's: when the measuring script started and when it wrote the file
        return f"load average {average['start']} when the measurement started, {average['end']} when it ended"
    return "not recorded"


def provenance(content: dict) -> str:
    """When, at which commit, on what and under which load the figures were measured; where they were recorded."""
    date, commit = content.get("date"), content.get("commit")
    when = "Measured" + (f" {date}" if date else "") + (f" at `{commit[:7]}`" if commit else "")
    missing = " and ".join(name for name, value in (("date", date), ("commit", commit)) if not value)
    if missing:
        when = (when + f"; {missing} not recorded") if date or commit else f"{missing.capitalize()} not recorded"
    if content.get("uncommitted_changes"):
        when += f" (with uncommitted changes to {len(content['uncommitted_changes'])} files)"
    recorded = content.get("recorded_in")
    if recorded:
        when += f"; on this page since `{recorded['commit'][:7]}` ({recorded['date']})"
    return f"{when}. Machine: {machine_text(content.get('machine'))}. Load: {load_text(content)}."


def command_text(content: dict) -> str:
    listed = content["command"] if isinstance(content["command"], list) else [content["command"]]
    return ("Command: " if len(listed) == 1 else "Commands: ") + "; ".join(f"`{c}`" for c in listed) + "."


def benchmark(content: dict) -> list[str]:
    """Its heading, what it measures and the command, its figures, then what they say and where they come from."""
    lines = [f"### {content['title']}", *wrap(f"{content['measures']} {command_text(content)}"), ""]
    lines += figure_lines(content["figures"])
    for item in [*content.get("notes", []), provenance(content)]:
        lines += wrap(item, "- ")
    return lines + [""]


REQUIRED = ("title", "group", "measures", "command", "figures")


def read_results(results_dir: Path = RESULTS) -> dict[str, dict]:
    """Every results file by name; a file that cannot make a section (a benchmark's raw output saved here, say)
    fails naming what it lacks."""
    results = {path.stem: json.loads(path.read_text()) for path in sorted(results_dir.glob("*.json"))}
    for name, content in results.items():
        if missing := [key for key in REQUIRED if key not in content]:
            raise ValueError(f"{results_dir / name}.json has no {', '.join(missing)}: not a results file of the page")
    return results


def render(results: dict[str, dict]) -> str:
    """The page: the intro, then each group of GROUPS with its benchmarks in the order of their files' names."""
    unknown = sorted(f"{name}.json: {c.get('group')!r}" for name, c in results.items() if c.get("group") not in GROUPS)
    if unknown:
        raise ValueError(f"a results file's group must be one of {GROUPS}; not {', '.join(unknown)}")
    lines = [
        "# Benchmark results",
        "",
        "<!-- rendered by scripts/results_page.py from benchmarks/results/*.json: edit those, then run it -->",
        "",
        *wrap(INTRO),
        "",
    ]
    for group in GROUPS:
        members = [content for content in results.values() if content["group"] == group]
        if members:
            lines += [f"## {group}", ""]
            for content in members:
                lines += benchmark(content)
    return "\n".join(lines).rstrip("\n") + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if the page is not what the results files render")
    args = ap.parse_args(argv)
    page = render(read_results())
    if args.check:
        if not PAGE.exists() or PAGE.read_text() != page:
            print("benchmarks/RESULTS.md is stale: python scripts/results_page.py (make format)", file=sys.stderr)
            return 1
        return 0
    PAGE.write_text(page)
    print(f"wrote {PAGE.relative_to(ROOT)} ({page.count(chr(10))} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
