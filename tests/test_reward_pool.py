"""RewardPool: per-call time limits in worker processes, crash recovery, ordering, lifecycle."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from dapo.rewards import Grade, RewardPool, grade
from dapo.rewards import pool as pool_module
from hostile_graders import HOSTILE_GRADERS

LIMIT_S = 0.5  # CPU seconds
# "Never stalls", checked without timing the pool: a call that hangs on an answer sleeping far
# longer than this bound fails here (a hung item costs the wall backstop, then twice it on its
# retry: 6 s); how fast a time-out really is lives in benchmarks/reward_pool_latency.py.
NEVER_STALLS_S = 60.0
HANGS = "600"  # a _test_sleep item's seconds: ten times NEVER_STALLS_S


def _pids(pool: RewardPool) -> list[int]:
    return [w.process.pid for w in pool._workers]


def _gone(pid: int, within_s: float = 20.0) -> bool:
    """Whether process `pid` has exited (and been reaped) within `within_s`."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def _score_returns(pool: RewardPool, *args, within_s: float = NEVER_STALLS_S):
    """pool.score(*args) run in a thread; fails if it has not returned after `within_s`."""
    out: list = []
    thread = threading.Thread(target=lambda: out.append(pool.score(*args)), daemon=True)
    thread.start()
    thread.join(within_s)
    assert not thread.is_alive(), f"score() still running after {within_s:.0f} s: a hung grader stalled the pool"
    assert out, "score() raised in its thread"
    return out[0]


@pytest.fixture(scope="module")
def pool():
    with RewardPool(num_workers=2, timeout_s=LIMIT_S, extra_graders=HOSTILE_GRADERS) as p:
        yield p


MIXED = [
    ("Answer: 25", "25", "dapo"),
    ("Answer: 26", "25", "dapo"),
    ("\\boxed{\\frac{1}{2}}", "0.5", "math"),
    ("\\boxed{\\frac{1}{3}}", "0.5", "math"),
    ("Answer: $1,000", "#### 1000", "gsm8k"),
    ("9 * 2 = 17", "18", "gsm8k"),
    ("Answer: -7", "-7", "arith"),
    ("Answer: 7.0", "7", "arith"),
]


def test_results_match_in_process_and_keep_order(pool):
    # 600 items: many chunks over both workers; results must line up with their inputs.
    items = [MIXED[i % len(MIXED)] for i in range(600)]
    items = [(f"step {i}\n{r}", t, g) for i, (r, t, g) in enumerate(items)]
    result = pool.score(*map(list, zip(*items)))
    assert result.grades == [grade(r, t, g) for r, t, g in items]
    assert [g.acc for g in result.grades[:8]] == [True, False] * 4
    assert result.num_timeouts == result.num_crashes == 0


def test_a_hung_item_is_retried_once_then_ungraded_and_its_workers_replaced(pool):
    before = set(_pids(pool))
    responses = [f"Answer: {i}" for i in range(40)]
    truths = [str(i) for i in range(40)]
    graders = ["dapo"] * 40
    graders[5], truths[5] = "_test_sleep", HANGS  # off the CPU: the wall-clock backstop stops it, twice
    result = _score_returns(pool, responses, truths, graders)
    assert result.grades[5] == Grade(-1.0, False, "[TIMEOUT]") and result.grades[5].ungraded
    assert result.num_timeouts == 1 and result.num_retried == 1 and result.num_crashes == 0
    assert all(g.acc and not g.ungraded for i, g in enumerate(result.grades) if i != 5)
    after = set(_pids(pool))
    assert len(before - after) == 1  # the worker of the first try (the retry's, started for it, went too)
    assert all(_gone(pid) for pid in before - after)
    # and the pool, with its new worker, answers the next call correctly
    again = _score_returns(pool, ["Answer: 7", "Answer: 8"], ["7", "9"], "dapo")
    assert [g.acc for g in again.grades] == [True, False] and again.num_timeouts == 0
    assert set(_pids(pool)) == after


def test_back_to_back_timeouts_in_one_chunk(pool, monkeypatch):
    # 40 items go out in chunks of 5: items 6 and 7 share a chunk, so the second timeout happens
    # in the re-sent remainder of the first one's chunk.
    n = 40
    replaced: list[int] = []
    real_replace = RewardPool._replace
    monkeypatch.setattr(RewardPool, "_replace", lambda self, slot: (replaced.append(slot), real_replace(self, slot)))
    graders, truths = ["arith"] * n, [str(i) for i in range(n)]
    for i in (6, 7, 30):
        graders[i], truths[i] = "_test_sleep", HANGS
    result = _score_returns(pool, [f"Answer: {i}" for i in range(n)], truths, graders)
    assert [i for i, g in enumerate(result.grades) if g.pred == "[TIMEOUT]"] == [6, 7, 30]
    assert all(g.acc for i, g in enumerate(result.grades) if i not in (6, 7, 30))
    assert result.num_timeouts == 3 and result.num_retried == 3
    assert len(replaced) == 6  # per hung item, the worker of its first try and the fresh one of its retry
    assert len(set(_pids(pool))) == 2


def test_the_limit_counts_the_workers_cpu_seconds_not_the_wall_clock(pool):
    """A grader that waits 3 limits off the CPU is within its limit (the backstop is 4); one that computes for 1.6
    limits runs out, and its retry, in a fresh worker (one that has graded nothing) with twice the limit, grades it."""
    pids = set(_pids(pool))
    waits, computes = str(3 * LIMIT_S), str(1.6 * LIMIT_S)
    graders = ["_test_sleep", "_test_spin", "dapo"]
    result = _score_returns(pool, ["x", "x", "Answer: 3"], [waits, computes, "3"], graders)
    assert [g.acc for g in result.grades] == [True, True, True]
    assert result.num_retried == 1 and result.num_timeouts == 0
    after = set(_pids(pool))
    # the worker that ran out was replaced; the retry's (the spinning grader answers with its pid) lives on: the one
    # started for it, or one the first try's chunks had not reached, whichever was free first
    assert len(pids - after) == 1 and int(result.grades[1].pred) in after


def test_an_answer_that_computes_past_twice_the_limit_is_ungraded(pool):
    result = _score_returns(pool, ["x", "Answer: 1"], [str(3 * LIMIT_S), "1"], ["_test_spin", "dapo"])
    assert result.grades[0] == Grade(-1.0, False, "[TIMEOUT]") and result.grades[0].ungraded
    assert result.grades[1].acc and result.num_retried == 1 and result.num_timeouts == 1


@pytest.mark.parametrize("crasher", ["_test_crash", "_test_segfault", "_test_memory"])
def test_worker_death_scores_crash_and_worker_is_replaced(pool, crasher):
    before = set(_pids(pool))
    graders = ["dapo"] * 30
    graders[12] = crasher
    result = pool.score([f"Answer: {i}" for i in range(30)], [str(i) for i in range(30)], graders)
    assert result.grades[12] == Grade(-1.0, False, "[CRASH]")
    assert result.num_crashes == 1 and result.num_timeouts == 0
    assert all(g.acc for i, g in enumerate(result.grades) if i != 12)
    assert len(before - set(_pids(pool))) == 1


def test_grader_exception_is_a_crash_but_keeps_the_worker(pool):
    before = set(_pids(pool))
    result = pool.score(["Answer: 1", "x", "Answer: 2"], ["1", "1", "2"], ["dapo", "_test_raise", "dapo"])
    assert [g.pred for g in result.grades] == ["1", "[CRASH]", "2"]
    assert result.num_crashes == 1
    assert set(_pids(pool)) == before


def test_graders_own_time_limit_counts_as_a_timeout_and_is_retried_in_a_fresh_worker(pool):
    """The math grader stops math-verify itself (GradingTimeout) before the pool's limit strikes: the item is tried
    again in a fresh worker, and reward/timeouts counts it when that runs out too."""
    result = pool.score(["Answer: 1", "x", "Answer: 2"], ["1", "1", "2"], ["dapo", "_test_own_timeout", "dapo"])
    assert [g.pred for g in result.grades] == ["1", "[TIMEOUT]", "2"]
    assert result.grades[1] == Grade(-1.0, False, "[TIMEOUT]")
    assert result.num_timeouts == 1 and result.num_retried == 1 and result.num_crashes == 0


def test_pool_still_healthy_after_failures_and_reuses_workers(pool):
    pids = _pids(pool)
    for _ in range(3):
        result = pool.score(["Answer: 3"] * 50, ["3"] * 50, "dapo")
        assert all(g.acc for g in result.grades) and result.num_timeouts == result.num_crashes == 0
    assert _pids(pool) == pids  # started once, reused across calls


def test_call_interrupted_midway_leaves_no_stale_results(pool, monkeypatch):
    # Ctrl-C (or any exception) while workers are busy: their late results belong to the
    # interrupted call and must not leak into the next one.
    from dapo.rewards import pool as pool_module

    def interrupted(self, slot):
        raise KeyboardInterrupt

    pool.score(["Answer: 1"], ["1"], "dapo")  # workers up, so the interrupted call dispatches
    with monkeypatch.context() as patch:
        patch.setattr(pool_module.RewardPool, "_receive", interrupted)
        with pytest.raises(KeyboardInterrupt):
            pool.score(["x"] * 8, ["0.1"] * 8, "_test_sleep")  # each item reports "slept"
    result = pool.score([f"Answer: {i}" for i in range(8)], [str(i) for i in range(8)], "dapo")
    assert [g.pred for g in result.grades] == [str(i) for i in range(8)]


def test_no_signal_handlers_in_the_caller(pool):
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGALRM, signal.SIGCHLD, signal.SIGTERM)}
    pool.score(["\\boxed{1}"] * 20, ["1"] * 20, "math")
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers


def test_input_validation(pool):
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        pool.score(["a", "b"], ["1"], "dapo")
    with pytest.raises(ValueError, match="2 responses but 3 grader names"):
        pool.score(["a", "b"], ["1", "2"], ["dapo"] * 3)
    with pytest.raises(ValueError, match="item 1: unknown grader 'nope'"):
        pool.score(["a", "b"], ["1", "2"], ["dapo", "nope"])
    with pytest.raises(ValueError, match="item 2: gsm8k ground truth"):
        pool.score(["a"] * 3, ["1", "2", "many"], "gsm8k")
    with pytest.raises(TypeError, match="item 0: response must be str"):
        pool.score([b"Answer: 1"], ["1"], "dapo")
    assert pool.score([], [], "dapo").grades == []


def test_long_responses_are_cut_before_grading(pool):
    # 200k characters of reasoning: only the tail crosses the pipe, and the answer is still found.
    long = "reasoning " * 20_000
    result = pool.score([long + "\nAnswer: 9", long + "\\boxed{9}"], ["9", "9"], ["dapo", "math"])
    assert [g.acc for g in result.grades] == [True, True]


def test_items_travel_in_chunks_not_one_round_trip_each(pool, monkeypatch):
    # How fast is benchmarks/grading_throughput.py's business; what is checked here is that
    # 5000 items cost a few dozen pipe round trips, not 5000.
    n = 5000
    sent: list[int] = []
    real_dispatch = pool_module.RewardPool._dispatch

    def counting_dispatch(self):
        waiting = len(self._pending)
        real_dispatch(self)
        sent.append(waiting - len(self._pending))

    monkeypatch.setattr(pool_module.RewardPool, "_dispatch", counting_dispatch)
    result = pool.score([f"Reasoning...\nAnswer: {i % 97}" for i in range(n)], ["5"] * n, "dapo")
    assert [g.acc for g in result.grades] == [i % 97 == 5 for i in range(n)]
    # chunk size = min(_MAX_CHUNK=256, ceil(5000 / (2 workers * 4 chunks per worker)) = 625) = 256,
    # so ceil(5000 / 256) = 20 chunks, each sent once (no worker died)
    assert sum(sent) == 20


def test_repeated_create_and_close():
    for _ in range(4):
        pool = RewardPool(num_workers=2, timeout_s=2.0)
        pids = _pids(pool)
        assert pool.score(["Answer: 4"], ["4"], "dapo").grades[0].acc
        pool.close()
        assert all(_gone(pid) for pid in pids)
    with pytest.raises(RuntimeError, match="closed"):
        pool.score(["Answer: 4"], ["4"], "dapo")
    pool.close()  # closing twice is harmless


def test_garbage_collection_stops_workers():
    pool = RewardPool(num_workers=1, timeout_s=2.0)
    pids = _pids(pool)
    del pool
    gc.collect()
    assert all(_gone(pid) for pid in pids)


def test_script_without_main_guard_and_no_orphans_at_exit(tmp_path):
    # No `if __name__ == "__main__":` guard, a top-level side effect, and no close(): workers
    # must not re-run the script (the side effect happens once), and atexit must stop them.
    runs = tmp_path / "runs.txt"
    script = tmp_path / "leaky.py"
    script.write_text(
        textwrap.dedent(
            f"""
            with open({str(runs)!r}, "a") as f:
                f.write("ran\\n")
            from dapo.rewards import RewardPool
            pool = RewardPool(num_workers=2, timeout_s=5.0)
            assert pool.score(["Answer: 1"], ["1"], "dapo").grades[0].acc
            print(*(w.process.pid for w in pool._workers))
            """
        )
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert runs.read_text() == "ran\n"
    pids = [int(p) for p in done.stdout.split()]
    assert len(pids) == 2 and all(_gone(pid) for pid in pids)


def test_bad_arguments():
    with pytest.raises(ValueError, match="num_workers"):
        RewardPool(num_workers=0)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardPool(timeout_s=0)
    for unbounded in (float("inf"), float("nan")):  # no limit at all: one answer could hold a worker forever
        with pytest.raises(ValueError, match="timeout_s must be a finite number > 0"):
            RewardPool(timeout_s=unbounded)
    with pytest.raises(ValueError, match="not an import path"):
        RewardPool(extra_graders={"mine": "hostile_graders.sleep"})
    with pytest.raises(ValueError, match="must be a new"):
        RewardPool(extra_graders={"dapo": "hostile_graders:sleep"})
    with pytest.raises(ValueError, match="has no function 'nope'"):
        RewardPool(extra_graders={"mine": "hostile_graders:nope"})


def test_graders_by_name_are_only_those_the_pool_was_given():
    # A grader name in a score call (which may come from a data row) is looked up, never imported.
    with RewardPool(num_workers=1, timeout_s=LIMIT_S, extra_graders={"mine": "hostile_graders:raise_error"}) as p:
        with pytest.raises(ValueError, match="unknown grader 'hostile_graders:sleep'"):
            p.score(["x"], ["1"], "hostile_graders:sleep")
        with pytest.raises(ValueError, match="unknown grader '_test_sleep'"):
            p.score(["x"], ["1"], "_test_sleep")
        result = p.score(["Answer: 1", "x"], ["1", "1"], ["dapo", "mine"])
        assert [g.pred for g in result.grades] == ["1", "[CRASH]"] and result.num_crashes == 1
