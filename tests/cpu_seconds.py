"""A pytest plugin (loaded by conftest.py): each test's CPU seconds, its process's and those of the processes it
started and waited for (a launch's ranks, a killed run), and the 15 that took the most at the end of the run. Wall
seconds (--durations) say where a worker waited; CPU seconds say what a slower or busier machine pays for."""

import os
import resource
import time

import pytest

_SHOWN = 15
_START = pytest.StashKey[float]()
_WALL_START = pytest.StashKey[float]()


def _cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[_START], item.stash[_WALL_START] = _cpu_seconds(), time.time()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown":  # setup, call and teardown together: the fixtures a test builds are its cost
        report = outcome.get_result()
        report.user_properties.append(("cpu_s", _cpu_seconds() - item.stash[_START]))
        # when and in which worker it ran (a --junitxml file then shows how the workers' time was spent)
        report.user_properties += [
            ("started", item.stash[_WALL_START]),
            ("worker", os.environ.get("PYTEST_XDIST_WORKER", "")),
        ]


def pytest_terminal_summary(terminalreporter):
    costs = [
        (dict(report.user_properties)["cpu_s"], report.nodeid)
        for reports in terminalreporter.stats.values()
        for report in reports
        if getattr(report, "when", None) == "teardown" and "cpu_s" in dict(getattr(report, "user_properties", ()))
    ]
    if not costs:
        return
    terminalreporter.write_sep("=", f"{_SHOWN} tests that took the most CPU seconds ({sum(c for c, _ in costs):.0f} "
                                    "in all, with the processes they waited for)")  # fmt: skip
    for cpu_s, nodeid in sorted(costs, reverse=True)[:_SHOWN]:
        terminalreporter.write_line(f"{cpu_s:8.1f}s {nodeid}")
