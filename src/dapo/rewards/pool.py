"""RewardPool: grade untrusted responses in worker processes, with a time limit on every call.

- Workers start once (forkserver, else spawn; never fork: the trainer has torch threads), load the
  graders, warm math-verify up, and are reused across `score` calls.
- `score` hands chunks of items to idle workers, which stream results back. Before each item a
  worker writes (index, start time) into a shared array, so the parent knows which item a worker
  is on: one past `timeout_s` gets its worker SIGKILLed and scores "[TIMEOUT]"; one whose worker
  dies (segfault, os._exit, MemoryError) scores "[CRASH]". A fresh worker takes the slot and the
  rest of the chunk is sent again. The caller's process sets no signal handlers.
- Not pebble: its time limit and ProcessExpired cover a whole task, and one task per response is
  ~10x slower than chunks (benchmarks/RESULTS.md, docs/architecture.md).
- Graders: the built-in ones, those named as import paths in `extra_graders`, and pickled reward
  functions (reward_fn.py). Names in a `score` call are only looked up, never imported.
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
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import wait as wait_for

from dapo.rewards.graders import (
    RAW_GRADERS,
    TAIL_CHARS,
    TIMEOUT_PRED,
    Grade,
    GradingTimeout,
    check_batch,
    check_extra_graders,
    resolve_grader,
)
from dapo.rewards.reward_fn import REWARD_FN, RewardFnError, load_reward_fns, pickle_reward_fn, pickle_reward_fns

CRASH_PRED = "[CRASH]"
_FLUSH_S = 0.01  # a worker sends what it has graded at least this often
_MAX_CHUNK, _CHUNKS_PER_WORKER = 256, 4  # balance load, yet keep pipe round trips few
_STARTUP_TIMEOUT_S = 60.0  # importing and warming up math-verify takes ~1-2 s under spawn
_MAX_STARTUP_FAILURES = 3  # workers in a row that die before ready: the pool gives up
_MAX_ATTEMPTS = 3  # deaths between items before the next item is blamed for them

# True in a grading worker: code that must not run there (a main script re-run to find a reward function) checks it.
IN_WORKER = False


@dataclass
class PoolResult:
    grades: list[Grade]
    num_timeouts: int
    num_crashes: int
    seconds: float


def _limit_memory(extra_mb: int | None) -> None:
    """Cap the address space at its size now plus `extra_mb`: runaway sympy fails fast with MemoryError."""
    if not extra_mb:
        return
    try:
        import resource

        with open("/proc/self/statm") as f:  # relative: a fork server that preloaded much still gets a cap
            current = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (current + (extra_mb << 20),) * 2)
    except (ImportError, ValueError, OSError):
        pass  # no cap on this platform: the time limit still holds


def _worker_main(conn, progress, memory_limit_mb, extra_graders, reward_fns, main) -> None:
    """Grade chunks until the pipe closes; progress = [index in progress, its start time]."""
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
    RAW_GRADERS["math"]("The answer is \\boxed{\\frac{1}{2}}", "0.5")  # warm up once, not on a real item
    RAW_GRADERS["dapo"]("Answer: 1", "1")
    conn.send(("ready", os.getpid()))
    while task := _recv(conn):
        out, last_flush = [], time.monotonic()
        for i, response, truth, name in task:
            progress[1] = time.monotonic()  # start time first, index second: the parent reads index twice
            progress[0] = i
            try:
                out.append((i, fns[name](response, truth), None, None))
            except GradingTimeout:  # the grader's own, softer limit: a time-out, worker stays
                out.append((i, (-1.0, False, TIMEOUT_PRED), "timeout", None))
            except MemoryError:  # the heap may be broken: report the item, then let a fresh worker take over
                conn.send([*out, (i, (-1.0, False, CRASH_PRED), "crash", None)])
                os._exit(3)
            except RewardFnError as err:  # a reward function that returns the wrong thing: the caller must fix it
                out.append((i, (-1.0, False, CRASH_PRED), "invalid", str(err)))
            except Exception as err:  # a grader bug on this input: a crash, worker stays
                out.append((i, (-1.0, False, CRASH_PRED), "crash", f"{type(err).__name__}: {err}"))
            if time.monotonic() - last_flush >= _FLUSH_S:
                conn.send(out)
                out, last_flush = [], time.monotonic()
        if out:
            conn.send(out)


def _recv(conn):
    try:
        return conn.recv()
    except (EOFError, OSError):
        return None


def _context():
    if "forkserver" not in mp.get_all_start_methods():
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["dapo.rewards.pool", "math_verify"])  # replacements start in ms, not seconds
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
        self.progress = ctx.RawArray(ctypes.c_double, 2)
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main, args=(child_conn, self.progress, *args), daemon=True, name="dapo-reward-worker"
        )
        with _main_module_hidden():
            self.process.start()
        child_conn.close()
        self.started, self.ready = time.monotonic(), False
        self.remaining: deque[int] = deque()  # indices sent and not yet answered, in order

    def in_progress(self) -> tuple[int, float] | None:
        """(index, start time) of the item being graded; None while the worker moves between items."""
        first, start = self.progress[0], self.progress[1]
        return None if self.progress[0] != first else (int(first), start)

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
        extra_graders: Mapping[str, str] | None = None,
        reward_fns: Mapping[str, Callable] | None = None,
    ):
        """memory_limit_mb: address space a worker may add after start-up (None: unlimited).

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
        self.num_workers, self.timeout_s = num_workers, float(timeout_s)
        self.extra_graders = check_extra_graders(extra_graders)
        self._reward_fns, main = pickle_reward_fns(reward_fns, {*RAW_GRADERS, *self.extra_graders})
        self._worker_args = (memory_limit_mb, self.extra_graders, self._reward_fns, main)
        self._warned: set[str] = set()  # reward functions whose exception was shown once
        self._ctx = _context()
        self._lock = threading.Lock()
        self._workers: list[_Worker] = [self._new_worker() for _ in range(num_workers)]
        self._startup_failures = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    def score(self, responses: Sequence[str], ground_truths: Sequence[str], graders: Sequence[str] | str) -> PoolResult:
        """Grade responses[i] against ground_truths[i] with graders[i]; results in input order."""
        t0 = time.perf_counter()
        graders = check_batch(responses, ground_truths, graders, {*self.extra_graders, *self._reward_fns})
        payload = [  # only the tail a grader reads crosses the pipe
            (response[-TAIL_CHARS[name] :] if name in TAIL_CHARS else response, truth, name)
            for response, truth, name in zip(responses, ground_truths, graders)
        ]
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            run = _Run(self, payload)
            run.execute()
        grades = [Grade(*r) for r in run.results]
        return PoolResult(grades, run.num_timeouts, run.num_crashes, time.perf_counter() - t0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _new_worker(self) -> _Worker:
        return _Worker(self._ctx, self._worker_args)

    def _replace(self, slot: int) -> None:
        self._workers[slot].stop()
        self._workers[slot] = self._new_worker()


class _Run:
    """One `score` call: chunks not yet sent, results, counters."""

    def __init__(self, pool: RewardPool, payload: list[tuple[str, str, str]]):
        self.pool, self.payload, n = pool, payload, len(payload)
        size = max(1, min(_MAX_CHUNK, math.ceil(n / (pool.num_workers * _CHUNKS_PER_WORKER))))
        self.pending: deque[list[int]] = deque(list(range(s, min(n, s + size))) for s in range(0, n, size))
        self.results: list[tuple | None] = [None] * n
        self.left, self.attempts = n, {}
        self.num_timeouts = self.num_crashes = 0

    def execute(self) -> None:
        for slot, w in enumerate(self.pool._workers):
            if w.remaining:  # still busy for a call that was interrupted: its results are stale
                w.remaining.clear()
                self.pool._replace(slot)
        while self.left:
            self._dispatch()
            workers = list(self.pool._workers)
            ready = wait_for([x for w in workers for x in (w.conn, w.process.sentinel)], timeout=self._wait_s())
            for slot, w in enumerate(workers):
                if w.conn in ready or w.process.sentinel in ready:
                    self._receive(slot)
            self._enforce_limits()

    def _dispatch(self) -> None:
        for slot, w in enumerate(self.pool._workers):
            if not self.pending:
                return
            if w.ready and not w.remaining:
                chunk = self.pending.popleft()
                w.remaining = deque(chunk)
                w.progress[1], w.progress[0] = time.monotonic(), -1  # the clock runs from now: "not started"
                try:
                    w.conn.send([(i, *self.payload[i]) for i in chunk])
                except OSError:
                    self._lost(slot, CRASH_PRED)

    def _wait_s(self) -> float:
        now = time.monotonic()
        deadline = now + 1.0  # wake up at least once a second regardless
        for w in self.pool._workers:
            current = w.in_progress() if w.remaining else None
            if not w.ready:
                deadline = min(deadline, w.started + _STARTUP_TIMEOUT_S)
            elif current is not None:
                deadline = min(deadline, current[1] + self.pool.timeout_s)
        return max(0.0, deadline - now) + 0.001

    def _receive(self, slot: int) -> None:
        w = self.pool._workers[slot]
        if not self._drain(w, quiet=False) or not w.process.is_alive():
            self._lost(slot, CRASH_PRED)

    def _drain(self, w: _Worker, quiet: bool = True) -> bool:
        """Handle what the worker sent; False once its pipe is closed (it died). quiet: after a kill."""
        try:
            while w.conn.poll():
                self._on_message(w, w.conn.recv())
        except (EOFError, OSError):
            return False
        except Exception:  # a message cut short by the kill
            if not quiet:
                raise
        return True

    def _on_message(self, w: _Worker, message) -> None:
        if message[0] == "ready":
            w.ready, self.pool._startup_failures = True, 0
            return
        if message[0] == "failed":
            raise RuntimeError(f"a reward worker could not load the reward function: {message[1]}")
        for i, result, failure, detail in message:
            if not w.remaining or w.remaining[0] != i:
                continue  # an item already settled (cannot happen with in-order workers)
            if failure == "invalid":
                raise RewardFnError(detail)
            w.remaining.popleft()
            self._settle(i, result)
            self.num_crashes += failure == "crash"
            self.num_timeouts += failure == "timeout"
            name = self.payload[i][2]
            if failure == "crash" and name in self.pool._reward_fns and name not in self.pool._warned:
                self.pool._warned.add(name)
                warnings.warn(
                    f"{name} raised {detail}; the response scores as a crash ({CRASH_PRED}, -1, counted "
                    "in reward/worker_crashes), here and in every later call that raises",
                    stacklevel=2,
                )

    def _settle(self, i: int, result: tuple) -> None:
        if self.results[i] is None:
            self.results[i] = result
            self.left -= 1

    def _enforce_limits(self) -> None:
        now = time.monotonic()
        for slot, w in enumerate(self.pool._workers):
            current = w.in_progress() if w.remaining else None
            if not w.ready and now - w.started > _STARTUP_TIMEOUT_S:
                self._startup_failed(slot, "did not start in time")
            elif w.ready and current is not None and now - current[1] > self.pool.timeout_s:
                self._lost(slot, TIMEOUT_PRED)

    def _lost(self, slot: int, pred: str) -> None:
        """A worker dead or past the limit: stop it, blame its item as `pred`, replace it, resend the rest."""
        w = self.pool._workers[slot]
        w.process.kill()
        w.process.join(timeout=5)
        self._drain(w)  # results it sent before it died are still in the pipe
        if not w.ready:
            self._startup_failed(slot, f"exited with code {w.process.exitcode} during startup")
            return
        if self._charge(w, pred):
            self.num_timeouts += pred == TIMEOUT_PRED
            self.num_crashes += pred == CRASH_PRED
        if w.remaining:
            self.pending.appendleft(list(w.remaining))
            w.remaining.clear()
        self.pool._replace(slot)

    def _charge(self, w: _Worker, pred: str) -> bool:
        """Settle the item a dead worker was grading as `pred`; False if none can be blamed."""
        if not w.remaining:
            return False
        index = int(w.progress[0])  # the worker is dead: this value no longer moves
        if index not in w.remaining:
            # stopped between items: blame the next one only if that keeps happening (not for an outside kill)
            index = w.remaining[0]
            self.attempts[index] = self.attempts.get(index, 0) + 1
            if self.attempts[index] < _MAX_ATTEMPTS:
                return False
        w.remaining.remove(index)
        self._settle(index, (-1.0, False, pred))
        return True

    def _startup_failed(self, slot: int, why: str) -> None:
        self.pool._startup_failures += 1
        if self.pool._startup_failures >= _MAX_STARTUP_FAILURES:
            raise RuntimeError(f"reward worker {why}; {_MAX_STARTUP_FAILURES} workers in a row failed to start")
        self.pool._replace(slot)


__all__ = ["PoolResult", "REWARD_FN", "RewardFnError", "RewardPool", "TIMEOUT_PRED", "CRASH_PRED", "pickle_reward_fn"]
