"""The tool sandbox: what one call costs, and how long each hostile program of the test corpus takes to end.

    .venv/bin/python benchmarks/sandbox.py [--calls 50] [--wall 3]

Printed: the median and 90th-percentile wall time of a trivial call (`print(1)`) with the bubblewrap sandbox and
with `tools.sandbox=none` (the same interpreter and limits, no namespaces), so the isolation's own price; a call
that imports numpy and sympy; then every program of tests/sandbox_corpus.py under a --wall second limit with
what the model saw, and the slowest. The tests (tests/test_sandbox.py) check containment; the figures live here.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "tests")]
from dapo.tools.sandbox import Limits, Sandbox  # noqa: E402
from sandbox_corpus import CORPUS  # noqa: E402


def timed(box: Sandbox, code: str, calls: int) -> list[float]:
    out = []
    for _ in range(calls):
        t0 = time.monotonic()
        box.run(code)
        out.append(time.monotonic() - t0)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--wall", type=float, default=3.0)
    args = ap.parse_args()
    limits = Limits(wall_s=args.wall, cpu_s=max(1, int(args.wall) - 1), memory_mb=768, file_mb=8, output_chars=512)
    box, bare = Sandbox(limits), Sandbox(limits, kind="none")
    box.check()
    print(f"{os.cpu_count()} CPUs; limits: {limits}")
    for name, code in (("print(1)", "print(1)"), ("import numpy, sympy", "import numpy, sympy")):
        for label, b in (("bwrap", box), ("none", bare)):
            t = sorted(timed(b, code, args.calls))
            median, p90 = 1000 * statistics.median(t), 1000 * t[int(0.9 * len(t))]
            print(f"  {name:22s} {label:6s} median {median:6.1f} ms  p90 {p90:6.1f} ms")
    outside = Path(tempfile.mkdtemp())
    (outside / "secret.txt").write_text("the secret")
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)
    fill = {"outside": outside, "port": listener.getsockname()[1], "pid": os.getpid(), "secret": "s3cr3t"}
    print(f"\nhostile corpus, {len(CORPUS)} programs, {args.wall:g} s wall-clock limit:")
    slowest = (0.0, "")
    for name, code, _ in CORPUS:
        t0 = time.monotonic()
        r = box.run(code.format(**fill))
        wall = time.monotonic() - t0
        slowest = max(slowest, (wall, name))
        seen = r.output.strip().splitlines()[-1][:70] if r.output.strip() else ""
        print(f"  {wall:5.2f} s  {name:38s} {seen}")
    print(f"slowest: {slowest[0]:.2f} s ({slowest[1]}), {slowest[0] - args.wall:+.2f} s against the limit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
