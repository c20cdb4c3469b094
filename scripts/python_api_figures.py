"""The figures the manual quotes about the README's Python API example, measured by running it as written.

    python scripts/python_api_figures.py [--write benchmarks/results/python_api_example.json]

Takes the example from README.md's "Python API" section the way tests/test_api.py does (its readme_example),
runs it with this Python as a script in an empty directory (so it trains from scratch, into runs/my_task there),
passes on what it prints, and reads back the figures it printed: held-out accuracy before and after training
with their 95% intervals, the evaluate() line, the training's wall time, and the whole script's wall time.
--write writes them as JSON with the command, the date and the commit (tests/test_doc_figures.py checks the
manual's figures against that file).
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]

from measurement import fail, record, write  # noqa: E402
from test_api import readme_example  # noqa: E402

# its section of benchmarks/RESULTS.md (scripts/results_page.py renders the page from the results file)
PAGE = {
    "title": "The README's Python API example",
    "group": "The demo and the Python API example",
    "measures": "README.md's Python API example run as written, as a script in an empty directory, so it trains from "
    "scratch: held-out avg@4 before and after (95% intervals), the evaluate() line, the training's and the whole "
    "script's wall seconds.",
}

_PCT = r"([\d.]+)% \[([\d.]+), ([\d.]+)\]"
SUMMARY = re.compile(rf"held-out accuracy: (\S+) avg@(\d+) {_PCT} before -> {_PCT} after step (\d+)")
EVALUATE = re.compile(r"held-out avg@(\d+) (\d\.\d+), 95% CI \(([-\d.e]+), ([-\d.e]+)\)")
WALL = re.compile(r"wall time: (\d+) s")


def parse(printed: str) -> dict:
    """The figures in what the example printed (percentages as fractions)."""
    summary, evaluated, wall = SUMMARY.search(printed), EVALUATE.search(printed), WALL.search(printed)
    if not (summary and evaluated and wall):
        fail("the example did not print its summary and evaluate() lines:\n" + printed[-2000:])
    frac = [float(v) / 100 for v in summary.groups()[2:8]]
    return {
        "data": summary[1],
        "n": int(summary[2]),
        "before": {"avg": frac[0], "ci": frac[1:3]},
        "after": {"step": int(summary[9]), "avg": frac[3], "ci": frac[4:6]},
        "evaluate": {
            "n": int(evaluated[1]),
            "avg": float(evaluated[2]),
            "ci": [float(evaluated[3]), float(evaluated[4])],
        },
        "train_wall_s": float(wall[1]),
    }


def run_example() -> tuple[str, float]:
    """Run the README's example as a script in a fresh directory; what it printed and its wall time."""
    with tempfile.TemporaryDirectory(prefix="python-api-example-") as tmp:
        script = Path(tmp) / "example.py"
        script.write_text(readme_example())
        start = time.perf_counter()
        proc = subprocess.Popen([sys.executable, str(script)], cwd=tmp, stdout=subprocess.PIPE, text=True)
        printed = []
        for line in proc.stdout:
            print(line, end="", flush=True)
            printed.append(line)
        if proc.wait() != 0:
            fail(f"the README's example failed with exit code {proc.returncode}")
        return "".join(printed), time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--write", type=Path, help="write the figures, command, date and commit to this JSON file")
    args = ap.parse_args(argv)
    printed, script_s = run_example()
    fig = {**parse(printed), "script_s": script_s}
    print(f"the example ran for {script_s:.0f} s")
    if args.write:
        quoted = [line for line in printed.splitlines() if any(p.search(line) for p in (SUMMARY, EVALUATE, WALL))]
        written_by = shlex.join(["python", "scripts/python_api_figures.py", *(argv or sys.argv[1:])])
        command = "python example.py  # README.md's Python API example as written, in an empty directory"
        write(args.write, record(command, written_by, fig, printed=quoted, **PAGE))


if __name__ == "__main__":
    main()
