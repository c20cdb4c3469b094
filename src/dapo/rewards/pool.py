"""RewardPool: grade untrusted responses in worker processes, with a time limit on every response.

Workers start once and are reused. `score` sends them chunks of items; before each item a worker writes
(index, start time, its CPU seconds so far) into a shared array, so the parent can SIGKILL the worker of an
item past its limit or blame the item a dead worker was on ("[CRASH]"), start a replacement and resend the rest
of the chunk. The limit is the worker's own CPU seconds on the item (`timeout_s`), read from the kernel, so a
machine busy with other work gives the same verdicts; a wall-clock backstop `_WALL_FACTOR` times longer stops a
worker stuck off the CPU (sleeping, waiting on I/O). Start-up (imports, math-verify's warm-up, inherited from
the fork server) is on no item's clock. An item that runs out of time is graded once more in a fresh worker with
`RETRY_FACTOR` times the limit; one that runs out again is given up on ("[TIMEOUT]", `Grade.ungraded`), never
scored as a wrong answer by the pool's callers. Why not pebble (limits per task, ~10x slower one task per
response): docs/architecture.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import math
import multiprocessing as mp
import os
import sys
import threading
import time
import types
import warnings
import weakref
from collections import Counter, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for

from dapo.rewards import math_equiv
from dapo.rewards.graders import (
    RAW_GRADERS,
    RETRY_FACTOR,
    TIMEOUT_PRED,
    Grade,
    check_batch,
    check_extra_graders,
    resolve_grader,
)
from dapo.rewards.math_equiv import GradingTimeout
from dapo.rewards.reward_fn import REWARD_FN, RewardFnError, load_reward_fns, pickle_reward_fn, pickle_reward_fns

CRASH_PRED = "[CRASH]"
_FAILED = {"timeout": (-1.0, False, TIMEOUT_PRED), "crash": (-1.0, False, CRASH_PRED)}
_FLUSH_S = 0.01  # a worker sends what it has graded at least this often
_MAX_CHUNK, _CHUNKS_PER_WORKER = 256, 4  # balance load, yet keep pipe round trips few
_STARTUP_TIMEOUT_S = 60.0  # importing and warming up math-verify takes ~2-3 CPU seconds under spawn
_WALL_FACTOR = 4.0  # the wall-clock backstop, in multiples of the CPU limit: a worker on a quarter of a core passes
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_MAX_STARTUP_FAILURES = 3  # workers in a row that die before ready: the pool gives up
_MAX_ATTEMPTS = 3  # deaths between items before the next item is blamed for them
_WARMING = -2.0  # a worker's item index while it warms math-verify up: on no item's clock, judged as start-up is

# True in a grading worker: code that must not run there (a main script re-run to find a reward function) checks it.
IN_WORKER = False


@dataclass
class PoolResult:
    grades: list[Grade]
    num_timeouts: int  # given up on after their retry: ungraded
    num_crashes: int
    seconds: float
    num_retried: int = 0  # ran out of time once and were graded again with RETRY_FACTOR times the limit


def _cpu_seconds(pid: int) -> float | None:
    """The CPU seconds (user + system) process ``pid`` has used, from the kernel; None where it does not say."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()  # after the command name, which may hold spaces
        return (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
    except (OSError, IndexError, ValueError):
        return None


def _limit_memory(extra_mb: int | None) -> None:
    """Cap the address space at its size now plus `extra_mb`: runaway sympy fails fast with MemoryError."""
    if not extra_mb:
        return
    with contextlib.suppress(ImportError, ValueError, OSError):  # no cap on this platform: the time limit holds
        import resource

        with open("/proc/self/statm") as f:  # relative: a fork server that preloaded much still gets a cap
            current = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (current + (extra_mb << 20),) * 2)


def _worker_main(conn, progress, memory_limit_mb, warm_math, extra_graders, reward_fns, main) -> None:
    """Grade chunks until the pipe closes; progress = [index in progress, its start time, its CPU seconds then]."""
    global IN_WORKER
    IN_WORKER = True
    if sys.platform.startswith("linux"):  # SIGKILL when the parent exits, even mid-grade (PR_SET_PDEATHSIG)
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None).prctl(1, 9)
    try:
        user_fns = load_reward_fns(reward_fns, main) if reward_fns else {}
    except BaseException as err:  # the caller's code failed here: say why instead of dying silently
        conn.send(("failed", f"{type(err).__name__}: {err}"))
        return
    _limit_memory(memory_limit_mb)  # after the caller's module has loaded: the cap is on what grading adds
    fns = {**RAW_GRADERS, **{name: resolve_grader(path) for name, path in extra_graders.items()}, **user_fns}
    logging.getLogger("math_verify").setLevel(logging.ERROR)  # it logs every timeout with the text
    if warm_math:  # once, on no item's clock (done already where the fork server preloaded it)
        math_equiv.warm_up()
    RAW_GRADERS["dapo"]("Answer: 1", "1")
    conn.send(("ready", os.getpid()))
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):  # the pool closed the pipe
            return
        out, last_flush = [], time.monotonic()
        for i, response, truth, name, factor in task:
            if name == "math":
                _warm_math_up(progress)
            progress[2] = time.process_time()  # start times first, index last: the parent reads index twice
            progress[1] = time.monotonic()
            progress[0] = i
            try:
                with math_equiv.longer_limit(factor):
                    out.append((i, fns[name](response, truth), None, None))
            except GradingTimeout:  # the grader's own, softer limit: a time-out, worker stays
                out.append((i, _FAILED["timeout"], "timeout", None))
            except MemoryError:  # the heap may be broken: report the item, then let a fresh worker take over
                conn.send([*out, (i, _FAILED["crash"], "crash", None)])
                os._exit(3)
            except RewardFnError as err:  # a reward function that returns the wrong thing: the caller must fix it
                out.append((i, _FAILED["crash"], "invalid", str(err)))
            except Exception as err:  # a grader bug on this input: a crash, worker stays
                out.append((i, _FAILED["crash"], "crash", f"{type(err).__name__}: {err}"))
            if time.monotonic() - last_flush >= _FLUSH_S:
                conn.send(out)
                out, last_flush = [], time.monotonic()
        if out:
            conn.send(out)


def _warm_math_up(progress) -> None:
    """math-verify's one-time costs in a worker of a pool that was told it would grade no math (``warm_math``),
    before the first math answer's clock starts: the parent judges a worker at _WARMING as it judges start-up."""
    if math_equiv.warm_up.cache_info().currsize:
        return
    progress[1] = time.monotonic()
    progress[0] = _WARMING
    math_equiv.warm_up()


def _context(warm_math: bool):
    """forkserver, else spawn; never fork (the trainer has torch threads)."""
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    # replacements start in ms, not seconds, with the math grader's one-time costs paid once, in the server (only
    # where math is graded: ~2 CPU seconds, which a run of the other graders would pay at every start for nothing).
    # One server serves the process: the preload of the first pool to start it holds for the pools after it (a later
    # pool that grades math, after one that did not, warms each worker as it starts: on no answer's clock, but slower).
    ctx.set_forkserver_preload(["dapo.rewards.pool", *(["dapo.rewards.warmed"] if warm_math else [])])
    return ctx


@contextlib.contextmanager
def _main_module_hidden():
    """Start children without re-running the caller's `__main__` (slow torch imports; scripts without a
    main guard would recurse). `Process.start()` reads it synchronously, so a stand-in for that call does."""
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


class _Worker:
    """One worker process and the parent's view of it."""

    def __init__(self, ctx, args: tuple):
        self.progress = ctx.RawArray(ctypes.c_double, 3)  # item index, its wall start, the CPU seconds at its start
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main, args=(child_conn, self.progress, *args), daemon=True, name="dapo-reward-worker"
        )
        with _main_module_hidden():
            self.process.start()
        child_conn.close()
        self.started, self.ready = time.monotonic(), False
        self.remaining: deque[int] = deque()  # indices sent and not yet answered, in order
        self.fresh = True  # has graded nothing: where an item that ran out of time is graded again
        self.limit_s = math.inf  # the CPU limit of the items of the chunk it holds

    def send(self, items: list[tuple], limit_s: float) -> None:
        self.remaining, self.fresh, self.limit_s = deque(i for i, *_ in items), False, limit_s
        # the clocks run from now: a worker stuck before its first item is judged too
        self.progress[2], self.progress[1], self.progress[0] = self.cpu_seconds() or 0.0, time.monotonic(), -1
        self.conn.send(items)

    def cpu_seconds(self) -> float | None:
        return _cpu_seconds(self.process.pid)

    def over_limit(self, now: float) -> bool:
        """Whether start-up or the item in progress has run out of time: its CPU seconds past ``limit_s``, or its
        wall seconds past the backstop (wall seconds alone where the kernel gives no CPU seconds)."""
        if not self.ready:
            return now > self.started + _STARTUP_TIMEOUT_S
        if not self.remaining:
            return False
        index, start, cpu_start = self.progress[0], self.progress[1], self.progress[2]
        if index == _WARMING:
            return now > start + _STARTUP_TIMEOUT_S
        cpu = self.cpu_seconds()
        if self.progress[0] != index:  # read between items: judged at the next look
            return False
        if cpu is None:
            return now - start > self.limit_s
        return cpu - cpu_start > self.limit_s or now - start > _WALL_FACTOR * self.limit_s

    def stop(self) -> None:
        self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        with contextlib.suppress(Exception):  # interpreter shutdown: best effort, the daemon flag covers the rest
            worker.stop()
    workers.clear()


class RewardPool:
    """Grade responses in `num_workers` processes; every grading call is limited to `timeout_s`.

    Use as a context manager or call `close()`; workers are also stopped on garbage collection and at
    interpreter exit. Calls from several threads are serialised.
    """

    def __init__(
        self,
        num_workers: int = 2,
        timeout_s: float = 5.0,
        *,
        memory_limit_mb: int | None = 2048,
        warm_math: bool = True,
        extra_graders: Mapping[str, str] | None = None,
        reward_fns: Mapping[str, Callable] | None = None,
    ):
        """memory_limit_mb: address space a worker may add after start-up (None: unlimited).

        warm_math: pay math-verify's one-time costs (~2 CPU seconds) when the pool starts, before any answer's
        clock; False for a pool that grades no `math` answer, whose workers then pay them only before a first one.

        extra_graders: name -> "package.module:function" (response, ground_truth) -> (score, acc, pred),
        imported by the workers (on sys.path when the pool starts).

        reward_fns: name -> a function (response, ground_truth) -> a float score (correct when > 0) or
        (score, correct: bool), defined at a module's top level or in the main script (see reward_fn.py);
        the response's last line is its prediction (what maj@n votes on). A call that raises scores as a
        crash (warned once per pool); one that returns anything else raises RewardFnError from `score`.
        """
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not (timeout_s > 0 and math.isfinite(timeout_s)):  # inf would let one answer hold a worker forever
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s}")
        self.num_workers, self.timeout_s, self.warm_math = num_workers, float(timeout_s), warm_math
        self.extra_graders = check_extra_graders(extra_graders)
        self._reward_fns, main = pickle_reward_fns(reward_fns, {*RAW_GRADERS, *self.extra_graders})
        self._worker_args = (memory_limit_mb, warm_math, self.extra_graders, self._reward_fns, main)
        self._warned: set[str] = set()  # reward functions whose exception was shown once
        self._ctx = _context(warm_math)
        self._lock = threading.Lock()
        self._workers: list[_Worker] = [_Worker(self._ctx, self._worker_args) for _ in range(num_workers)]
        self._startup_failures = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def score(self, responses: Sequence[str], ground_truths: Sequence[str], graders: Sequence[str] | str) -> PoolResult:
        """Grade responses[i] against ground_truths[i] with graders[i]; results in input order."""
        t0 = time.perf_counter()
        items = check_batch(responses, ground_truths, graders, {*self.extra_graders, *self._reward_fns})
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            results, failures = self._run(items)
        grades = [Grade(*r) for r in results]
        seconds = time.perf_counter() - t0
        return PoolResult(grades, failures["timeout"], failures["crash"], seconds, failures["retried"])

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # One `score` call, under the lock: its items, the chunks not yet sent, the results so far.

    def _run(self, items: list[tuple[str, str, str]]) -> tuple[list, Counter]:
        n = len(items)
        size = max(1, min(_MAX_CHUNK, math.ceil(n / (self.num_workers * _CHUNKS_PER_WORKER))))
        self._pending = deque(list(range(s, min(n, s + size))) for s in range(0, n, size))
        self._retries: deque[int] = deque()  # items that ran out of time once, for a fresh worker
        self._items, self._results, self._left = items, [None] * n, n
        self._failures, self._attempts = Counter(), Counter()
        for slot, w in enumerate(self._workers):
            if w.remaining:  # still busy for a call that was interrupted: its results are stale
                self._replace(slot)
        # how often busy workers' CPU clocks are read: a tenth of the limit, at most 4 times a second
        look_s = min(0.25, self.timeout_s / 10)
        while self._left:
            self._dispatch()
            workers, now = list(self._workers), time.monotonic()
            busy = any(w.remaining or not w.ready for w in workers)
            ready = wait_for([x for w in workers for x in (w.conn, w.process.sentinel)], look_s if busy else 1.0)
            for slot, w in enumerate(workers):
                if w.conn in ready or w.process.sentinel in ready:
                    self._receive(slot)
            now = time.monotonic()
            for slot, w in enumerate(self._workers):
                if w.over_limit(now):
                    self._lost(slot, "timeout")
        return self._results, self._failures

    def _dispatch(self) -> None:
        """Idle workers get work: an item to grade again goes alone to a fresh worker (where none is ready or
        starting, an idle one that has graded is replaced for it), the chunks in order to the others."""
        for slot, w in enumerate(self._workers):
            if not (w.ready and not w.remaining):
                continue
            if self._retries and not w.fresh and not any(x.fresh for x in self._workers):
                self._replace(slot)
                continue
            if self._retries and w.fresh:
                chunk, limit = [self._retries.popleft()], RETRY_FACTOR
            elif self._pending:
                chunk, limit = self._pending.popleft(), 1.0
            else:
                continue
            try:
                w.send([(i, *self._items[i], limit) for i in chunk], limit * self.timeout_s)
            except OSError:
                self._lost(slot, "crash")

    def _receive(self, slot: int) -> None:
        w = self._workers[slot]
        if not self._drain(w) or not w.process.is_alive():
            self._lost(slot, "crash")

    def _drain(self, w: _Worker) -> bool:
        """Handle what the worker sent; False once its pipe is closed (it died; a message cut short too)."""
        try:
            while w.conn.poll():
                message = w.conn.recv()
                if message[0] == "ready":
                    w.ready, self._startup_failures = True, 0
                elif message[0] == "failed":
                    raise RuntimeError(f"a reward worker could not load the reward function: {message[1]}")
                else:
                    for i, result, failure, detail in message:
                        self._settle(w, i, result, failure, detail)
        except (EOFError, OSError):
            return False
        return True

    def _settle(self, w: _Worker, i: int, result: tuple, failure: str | None, detail: str | None = None) -> None:
        if failure == "invalid":
            raise RewardFnError(detail)
        w.remaining.remove(i)  # the first one, unless it is a dead worker's item
        if failure == "timeout" and w.limit_s == self.timeout_s:  # its first time out: once more, with longer
            self._retries.append(i)
            self._failures["retried"] += 1
            return
        self._results[i], self._left = result, self._left - 1
        self._failures[failure] += 1
        name = self._items[i][2]
        if failure == "crash" and name in self._reward_fns and name not in self._warned:
            self._warned.add(name)
            warnings.warn(
                f"{name} raised {detail}; the response scores as a crash ({CRASH_PRED}, -1, counted "
                "in reward/worker_crashes), here and in every later call that raises",
                stacklevel=2,
            )

    def _lost(self, slot: int, failure: str) -> None:
        """A worker dead or past its limit (start-up included): stop it, blame its item, replace it, resend the
        rest of its chunk."""
        w = self._workers[slot]
        w.process.kill()
        w.process.join(timeout=5)
        self._drain(w)  # results it sent before it died are still in the pipe
        i = int(w.progress[0])  # the worker is dead: this value no longer moves
        if not w.ready:
            self._startup_failures += 1
            if self._startup_failures >= _MAX_STARTUP_FAILURES:
                code = w.process.exitcode
                why = "did not start in time" if failure == "timeout" else f"exited with code {code} during startup"
                raise RuntimeError(f"reward worker {why}; {_MAX_STARTUP_FAILURES} workers in a row failed to start")
        elif w.remaining and i not in w.remaining:  # stopped between items: blame the next one only if that
            i = w.remaining[0]  # keeps happening (not for a kill from outside)
            self._attempts[i] += 1
            if self._attempts[i] < _MAX_ATTEMPTS:
                i = None
        if i in w.remaining:
            self._settle(w, i, _FAILED[failure], failure)
        if w.remaining:
            self._pending.appendleft(list(w.remaining))
        self._replace(slot)

    def _replace(self, slot: int) -> None:
        self._workers[slot].stop()
        self._workers[slot] = _Worker(self._ctx, self._worker_args)


__all__ = ["PoolResult", "REWARD_FN", "RewardFnError", "RewardPool", "TIMEOUT_PRED", "CRASH_PRED", "pickle_reward_fn"]
