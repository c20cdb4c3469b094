"""Whether two training runs are the same run: every logged value that is not a clock reading, row by row, and the
weights of their last checkpoints, bit for bit. For a change that must not change behaviour (a refactor, a move):
train the same command before and after it, then

    python scripts/same_runs.py RUN_DIR_BEFORE RUN_DIR_AFTER [--ignore KEY ...] [--renamed OLD=NEW ...]

Exit code 0 when they agree, 1 with what differs. Clock readings (``perf/time_*``, rates, waits, peak memory) and
the keys given with ``--ignore`` (a metric the change added or removed on purpose) are left out; a metric the change
renamed is compared under its new name (``--renamed sampling/groups_from_buffer=sampling/groups_from_held_over``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

CLOCK = re.compile(
    r"^(perf/|timing_s/|tools/seconds$|async/(trainer_wait_s|engine_wait_s|collect_s)$|sampling/dropped_gen_(s|time_frac)$|time$|wall)"
)


def rows(run_dir: Path, ignore: set[str], renamed: dict[str, str] | None = None) -> list[dict]:
    out, renamed = [], renamed or {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            row = {renamed.get(k, k): v for k, v in json.loads(line).items()}
            out.append({k: v for k, v in row.items() if not CLOCK.match(k) and k not in ignore})
    return out


def last_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    steps = sorted((run_dir / "checkpoints").glob("step_*"))
    if not steps:
        return {}
    files = sorted(steps[-1].glob("*/*.safetensors"))
    return {f"{f.parent.name}/{k}": v for f in files for k, v in load_file(f).items()}


def compare(a: Path, b: Path, ignore: set[str], renamed: dict[str, str] | None = None) -> list[str]:
    problems = []
    ra, rb = rows(a, ignore, renamed), rows(b, ignore)
    if len(ra) != len(rb):
        problems.append(f"{len(ra)} rows against {len(rb)}")
    for x, y in zip(ra, rb):
        if x.keys() != y.keys():
            problems.append(f"step {x.get('step')}: keys differ: {sorted(x.keys() ^ y.keys())}")
        diff = [k for k in x.keys() & y.keys() if x[k] != y[k]]
        if diff:
            problems.append(
                f"step {x.get('step')}: {len(diff)} values differ, e.g. {diff[0]}: {x[diff[0]]} vs {y[diff[0]]}"
            )
    wa, wb = last_weights(a), last_weights(b)
    if wa.keys() != wb.keys():
        problems.append(f"the last checkpoints hold other tensors: {sorted(wa.keys() ^ wb.keys())[:5]}")
    unequal = [k for k in wa.keys() & wb.keys() if not torch.equal(wa[k], wb[k])]
    if unequal:
        problems.append(f"{len(unequal)} of {len(wa)} tensors differ, e.g. {unequal[0]}")
    return problems


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("before", type=Path)
    p.add_argument("after", type=Path)
    p.add_argument("--ignore", nargs="*", default=[], help="metric keys left out of the comparison")
    p.add_argument("--renamed", nargs="*", default=[], metavar="OLD=NEW", help="metrics the change renamed")
    args = p.parse_args()
    renamed = dict(item.split("=", 1) for item in args.renamed)
    problems = compare(args.before, args.after, set(args.ignore), renamed)
    n_rows, n_tensors = len(rows(args.after, set(args.ignore))), len(last_weights(args.after))
    if problems:
        print(f"{args.before} and {args.after} differ:\n  " + "\n  ".join(problems))
        return 1
    print(f"the same: {n_rows} metrics rows (clock readings left out) and {n_tensors} tensors of the last checkpoint")
    return 0


if __name__ == "__main__":
    sys.exit(main())
