"""benchmarks/runs.py: a ratio of times is printed only where every run behind it saw no more load than its own jobs,
a Meter counts the CPU seconds of the processes a block starts as well as its own, and machine() says which CPU
the figures come from."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from runs import Load, Meter, machine, time_ratio, withheld  # noqa: E402

QUIET = {"mean": 1.2, "own_jobs": 1, "foreign_frac": 0.01, "clean": True}
BUSY = {"mean": 6.13, "own_jobs": 1, "foreign_frac": 0.818, "clean": False}


def test_a_ratio_of_times_is_given_only_where_no_run_shared_the_machine():
    assert time_ratio([3.0, 3.0], [2.0, 2.0], [QUIET, QUIET]) == "1.50x"
    assert time_ratio([3.0], [2.0], [QUIET, BUSY]) == (
        "(no wall ratio: 1 of 2 runs shared the machine with other work, e.g. load average 6.13 for 1 own job, "
        "81.8% of the CPU to other processes)"
    )
    assert time_ratio([3.0], [2.0], [QUIET, BUSY], what="CPU").startswith("(no CPU ratio: 1 of 2 runs")


def test_withheld_names_the_busy_side_or_the_unrecorded_load():
    assert withheld([QUIET, QUIET], "MFU") is None
    assert withheld([BUSY], "overhead", unit="sides") == (
        "(no overhead: it shared the machine with other work: load average 6.13 for 1 own job, 81.8% of the CPU to "
        "other processes)"
    )
    assert withheld([QUIET, None, None], "ratio") == "(no ratio: the load of 2 of 3 runs was not recorded)"


@pytest.mark.parametrize(
    ("mean", "foreign_cpu_s", "clean"),
    [(1.4, 0.0, True), (1.6, 0.0, False), (1.0, 0.4, False), (1.0, 0.09, True)],
)
def test_a_load_is_clean_up_to_its_own_jobs_and_a_little_foreign_cpu(mean, foreign_cpu_s, clean):
    # one own job on a 2-core machine for 1 s: 0.5 of load average and 5% of the 2 CPU seconds are allowed
    load = Load(own_jobs=1, samples=[mean], machine_cpu_s=1.0 + foreign_cpu_s, own_cpu_s=1.0, capacity_s=2.0)
    assert load.clean() is clean


def test_the_tick_counters_own_error_is_not_counted_as_other_processes_work():
    # a 20 ms block reads /proc/stat's 10 ms ticks: two ticks more than its own are the counters, not other work
    load = Load(own_jobs=1, samples=[1.0], machine_cpu_s=0.04, own_cpu_s=0.02, capacity_s=0.04, tick_s=0.03)
    assert load.foreign_frac == 0.0
    assert load.clean()


def test_a_meter_counts_the_cpu_of_the_processes_a_block_starts_and_adds_blocks_up():
    meter = Meter(own_jobs=1)
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass"
    for _ in range(2):
        with meter:
            subprocess.run([sys.executable, "-c", burn], check=True)
    assert meter.cpu_s >= 0.8  # the children's 0.4 CPU s each, interpreter start-up on top
    assert meter.cpu_s <= 1.1 * meter.wall_s + 0.05  # one single-threaded child at a time: counted once
    assert len(meter.load.samples) >= 4  # each block's start and end at least
    assert meter.record()["load"]["own_jobs"] == 1


# a process that leaves a grandchild burning 0.6 CPU s after it has exited, as a run leaves its reward pool's
# forkserver and workers; the meter's process is the one that measures (the subreaper setting stays with it)
ORPHANING = """
import subprocess, sys
sys.path.insert(0, sys.argv[1])
from runs import Meter
burn = "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.6: pass"
leave = f"import subprocess, sys; subprocess.Popen([sys.executable, '-c', {burn!r}])"
meter = Meter(own_jobs=1, orphans=sys.argv[2] == "adopt")
with meter:
    subprocess.run([sys.executable, "-c", leave], check=True)
print(meter.cpu_s)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_CHILD_SUBREAPER is Linux's")
def test_a_meter_that_adopts_orphans_counts_the_cpu_of_processes_its_run_left_running():
    benchmarks = str(Path(__file__).resolve().parents[1] / "benchmarks")

    def cpu_s(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", ORPHANING, benchmarks, mode], capture_output=True, text=True)
        assert out.returncode == 0, out.stderr
        return float(out.stdout.split()[-1])

    adopted, lost = cpu_s("adopt"), cpu_s("leave")
    assert adopted >= 0.6 + 0.02  # the grandchild's 0.6 s, and the child's start-up
    assert lost < 0.6  # without adoption the grandchild goes to init, and its seconds with it
    assert adopted - lost >= 0.5


def test_machine_reads_this_machines_cpuinfo():
    cpu = machine()
    assert set(cpu) == {"cpu", "amx", "avx512", "cores", "usable_cores"}
    assert isinstance(cpu["cpu"], str) and cpu["cpu"]
    flags = next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    assert cpu["amx"] is ("amx_tile" in flags.split()) and cpu["avx512"] is ("avx512f" in flags.split())
    assert cpu["cores"] == os.cpu_count() and 1 <= cpu["usable_cores"] <= cpu["cores"]


def test_machine_tells_amx_and_avx512_from_the_flags_and_says_none_where_there_are_no_flags():
    xeon = "processor\t: 0\nmodel name\t: Intel(R) Xeon(R) Platinum 8481C\nflags\t\t: fpu avx2 avx512f amx_tile\n"
    epyc = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu avx avx2\n"
    assert machine(xeon)["cpu"] == "Intel(R) Xeon(R) Platinum 8481C"
    assert (machine(xeon)["amx"], machine(xeon)["avx512"]) == (True, True)
    assert (machine(epyc)["amx"], machine(epyc)["avx512"]) == (False, False)
    assert (machine("")["amx"], machine("")["avx512"]) == (None, None)
