"""RewardPool: grade untrusted responses in worker processes, with a time limit on every call.

How it works
- Workers are started once (forkserver context where available, else spawn; never fork, the
  trainer has torch threads) and reused across `score` calls.
- `score` cuts the batch into chunks and hands one chunk at a time to each idle worker. A worker
  streams its results back every few milliseconds, and before each item it writes
  (item index, start time) into a small shared array. The parent, waiting on the pipes, reads
  that array: an item running longer than `timeout_s` gets its worker killed (SIGKILL), the item
  scores -1 as "[TIMEOUT]", a fresh worker takes the slot and the rest of the chunk is sent again.
  A worker that dies (segfault, os._exit, MemoryError) is handled the same way with "[CRASH]".
- No signals are used in the calling process; in their main thread workers let the `math` grader
  use SIGALRM as a first, softer limit (it raises GradingTimeout: the item scores "[TIMEOUT]",
  counts as a time-out, and the worker stays).
- Responses are cut to the tail each grader reads before they cross the pipe.
- Graders: the built-in ones (graders.RAW_GRADERS), plus any the caller names as import paths
  ("package.module:function") in `extra_graders`; workers import those with importlib. Names in a
  `score` call are only looked up, so a data row cannot make a worker import anything.
- Reward functions: a user's functions `(response, ground_truth) -> score` or `(score, correct)`,
  given as objects in `reward_fns`. They reach the workers pickled, that is by module and name, so
  each must be defined at the top level of a module; one defined in the caller's main script is
  found by running that script again in the worker as `__mp_main__`, as multiprocessing's spawn
  does (its `if __name__ == "__main__":` block does not run). They run under the same time limit,
  memory cap and crash isolation as the built-in graders.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import io
import logging
import math
import multiprocessing as mp
import numbers
import os
import pickle
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

from dapo.rewards.graders import RAW_GRADERS, TAIL_CHARS, TIMEOUT_PRED, Grade, GradingTimeout, check_inputs

CRASH_PRED = "[CRASH]"

# A worker sends what it has graded at least this often, so results stream back while it works.
_FLUSH_S = 0.01
# Chunks: small enough to balance load over workers, large enough that pipe round trips
# (~100 us) are small next to the grading work they carry.
_MAX_CHUNK = 256
_CHUNKS_PER_WORKER = 4
# A worker must import and warm up in this time (math-verify + sympy take ~1-2 s under spawn).
_STARTUP_TIMEOUT_S = 60.0
# Consecutive workers that die before becoming ready before the pool gives up.
_MAX_STARTUP_FAILURES = 3
# An item whose worker died this many times without the death being pinned on it is a crash.
_MAX_ATTEMPTS = 3


@dataclass
class PoolResult:
    grades: list[Grade]
    num_timeouts: int
    num_crashes: int
    seconds: float


# ----------------------------------------------------------------------------------------------
# Graders given by the caller as import paths ("package.module:function").


def _resolve(path: str) -> Callable[[str, str], tuple[float, bool, str]]:
    """The function an import path "package.module:function" names (imported with importlib)."""
    module_name, _, attr = path.partition(":")
    fn = getattr(importlib.import_module(module_name), attr, None)
    if not callable(fn):
        raise ValueError(f"extra grader {path!r}: {module_name} has no function {attr!r}")
    return fn


def _check_extra_graders(extra: Mapping[str, str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for name, path in (extra or {}).items():
        if not isinstance(name, str) or not name or name in RAW_GRADERS:
            raise ValueError(
                f"extra grader name {name!r}: must be a new, non-empty name (built-ins: "
                f"{', '.join(sorted(RAW_GRADERS))})"
            )
        if not isinstance(path, str) or path.count(":") != 1 or not all(path.split(":")):
            raise ValueError(f"extra grader {name!r}: {path!r} is not an import path 'package.module:function'")
        out[name] = path
    return out


# ----------------------------------------------------------------------------------------------
# Reward functions given by the caller as objects.

REWARD_FN = "reward_fn"  # the grader name of a reward function given to dapo.train or dapo.evaluate

# True in a grading worker: code that must not run there (a training run started by a main script
# the worker re-runs to find a reward function) checks it and says what to change.
IN_WORKER = False


class RewardFnError(TypeError):
    """A reward function that cannot be sent to the workers, or that returned something unusable."""


class _MainReferences(pickle.Pickler):
    """A pickler that notes whether the object refers to anything defined in ``__main__``."""

    uses_main = False

    def persistent_id(self, obj):
        if isinstance(obj, (types.FunctionType, type)) and getattr(obj, "__module__", None) == "__main__":
            self.uses_main = True
        return None


def _main_script(name: str) -> dict:
    """What a worker needs to run the caller's main script again (multiprocessing's own description)."""
    from multiprocessing import spawn

    data = spawn.get_preparation_data("dapo-reward-worker")
    main = {k: data[k] for k in ("sys_path", "init_main_from_name", "init_main_from_path") if k in data}
    module = main.get("init_main_from_name", "")
    if "init_main_from_path" not in main and (not module or module == "__main__" or module.endswith(".__main__")):
        raise RewardFnError(
            f"{name} is defined in an interactive session or a package's __main__, which the "
            "reward workers cannot import; define it in a .py file and import it from there"
        )
    return main


def pickle_reward_fn(name: str, fn) -> tuple[bytes, dict]:
    """``fn`` as the workers receive it: its pickle, and what ``multiprocessing.spawn.prepare`` needs
    there to unpickle it: the caller's sys.path, and its main script when ``fn`` lives in it."""
    if not callable(fn):
        raise RewardFnError(f"{name}={fn!r} is not callable; give a function (response, ground_truth) -> score")
    buffer = io.BytesIO()
    pickler = _MainReferences(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    try:
        pickler.dump(fn)
    except (pickle.PicklingError, AttributeError, TypeError) as err:
        what = getattr(fn, "__qualname__", type(fn).__name__)
        raise RewardFnError(
            f"{name}={what} cannot be sent to the reward worker processes ({err}); define it with "
            "def at the top level of a module or of your script (not a lambda, closure or nested "
            "function)"
        ) from None
    return buffer.getvalue(), _main_script(name) if pickler.uses_main else {"sys_path": list(sys.path)}


def _check_score(name: str, out) -> tuple[float, bool]:
    """A reward function's return value as (score, correct): a number (correct when > 0), or
    (score, correct) with correct a bool."""

    def number(x) -> bool:  # numpy's scalars count (they register as numbers.Real); a bool is not a score
        return isinstance(x, numbers.Real) and type(x).__name__ not in ("bool", "bool_")

    if number(out):
        score, correct = float(out), float(out) > 0
    elif isinstance(out, tuple) and len(out) == 2 and number(out[0]) and type(out[1]).__name__ in ("bool", "bool_"):
        score, correct = float(out[0]), bool(out[1])
    else:
        raise RewardFnError(
            f"{name} returned {out!r:.80} ({type(out).__name__}); return a float score, or a "
            "tuple (score, correct) with correct a bool"
        )
    if not math.isfinite(score):
        raise RewardFnError(f"{name} returned the score {score}; return a finite number")
    return score, correct


def _as_grader(name: str, fn) -> Callable[[str, str], tuple[float, bool, str]]:
    def grade(response: str, ground_truth: str) -> tuple[float, bool, str]:
        score, correct = _check_score(name, fn(response, ground_truth))
        # the response's last line stands for its answer: maj@n votes on it, samples/ show it
        lines = response.strip().splitlines()
        return score, correct, lines[-1].strip()[:100] if lines else ""

    return grade


def _load_reward_fns(reward_fns: dict[str, bytes], main: dict) -> dict:
    from multiprocessing import spawn

    global IN_WORKER
    IN_WORKER = True
    spawn.prepare(main)  # the caller's sys.path; with a main script, runs it as __mp_main__, made __main__ here
    return {name: _as_grader(name, pickle.loads(blob)) for name, blob in reward_fns.items()}


# ----------------------------------------------------------------------------------------------
# Worker side.


def _die_with_parent() -> None:
    # Linux: SIGKILL this worker when the process that started it exits, even if it is stuck in a
    # grading call and never reads the closed pipe.
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(1, 9)  # PR_SET_PDEATHSIG, SIGKILL
        except (OSError, AttributeError):
            pass


def _limit_memory(extra_mb: int | None) -> None:
    """Cap the worker's address space at its size now plus `extra_mb`.

    Relative, not absolute, so the cap still works if the fork server happens to have loaded
    something large. An answer that makes sympy allocate without bound then fails fast with
    MemoryError (scored as a crash) instead of pushing the machine into swap.
    """
    if not extra_mb:
        return
    try:
        import resource

        current = 0
        if sys.platform.startswith("linux"):
            with open("/proc/self/statm") as f:
                current = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        limit = current + (extra_mb << 20)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):
        pass  # no address-space limit on this platform: the time limit still holds


def _worker_main(
    conn,
    progress,
    memory_limit_mb: int | None,
    extra_graders: dict[str, str],
    reward_fns: dict[str, bytes],
    main: dict | None,
) -> None:
    """Grade chunks until the pipe closes. progress = [index in progress, its start time]."""
    _die_with_parent()
    try:
        user_fns = _load_reward_fns(reward_fns, main) if reward_fns else {}
    except BaseException as err:  # the caller's code failed here: say why instead of dying silently
        conn.send(("failed", f"{type(err).__name__}: {err}"))
        return
    _limit_memory(memory_limit_mb)  # after the caller's module has loaded: the cap is on what grading adds
    grader_fns = {**RAW_GRADERS, **{name: _resolve(path) for name, path in extra_graders.items()}, **user_fns}
    # math-verify logs every timeout with the offending text; workers stay quiet.
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # Warm up (sympy, antlr and regex caches) so the first real item is not charged for it.
    RAW_GRADERS["math"]("The answer is \\boxed{\\frac{1}{2}}", "0.5")
    RAW_GRADERS["dapo"]("Answer: 1", "1")
    conn.send(("ready", os.getpid()))
    clock = time.monotonic
    while True:
        try:
            task = conn.recv()
        except (EOFError, OSError):
            return
        if task is None:
            return
        indices, responses, truths, graders = task
        out: list[tuple] = []
        last_flush = clock()
        for i, response, truth, name in zip(indices, responses, truths, graders):
            progress[1] = clock()  # start time first, index second: the parent reads index twice
            progress[0] = i
            try:
                score, acc, pred = grader_fns[name](response, truth)
                out.append((i, score, acc, pred, None, None))
            except GradingTimeout:  # the grader's own, softer limit: counted as a time-out, worker stays
                out.append((i, -1.0, False, TIMEOUT_PRED, "timeout", None))
            except MemoryError:
                # The heap may be in a bad state: report the item, then let a fresh worker take over.
                out.append((i, -1.0, False, CRASH_PRED, "crash", None))
                conn.send(out)
                os._exit(3)
            except RewardFnError as err:  # a reward function that returns the wrong thing: the caller must fix it
                out.append((i, -1.0, False, CRASH_PRED, "invalid", str(err)))
            except Exception as err:  # a grader bug on this input: counted as a crash, worker stays
                out.append((i, -1.0, False, CRASH_PRED, "crash", f"{type(err).__name__}: {err}"))
            now = clock()
            if now - last_flush >= _FLUSH_S:
                conn.send(out)
                out = []
                last_flush = now
        if out:
            conn.send(out)


# ----------------------------------------------------------------------------------------------
# Parent side.


def _context():
    methods = mp.get_all_start_methods()
    if "forkserver" in methods:
        ctx = mp.get_context("forkserver")
        # Preloaded once in the fork server, so a replacement worker starts in milliseconds
        # instead of re-importing sympy (ignored if the fork server is already running).
        ctx.set_forkserver_preload(["dapo.rewards.pool", "math_verify"])
        return ctx
    return mp.get_context("spawn")


@contextlib.contextmanager
def _main_module_hidden():
    """Start children without re-running the caller's `__main__` in them.

    spawn and forkserver children normally re-import the parent's main script (so that objects
    defined there unpickle). Workers need nothing from it, and a trainer script's top-level
    imports (torch) would make every worker start slowly; scripts without an
    `if __name__ == "__main__":` guard would even recurse. The start method reads
    `sys.modules["__main__"]` synchronously inside `Process.start()`, so a bare stand-in for that
    call is enough.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


class _Worker:
    """One worker process and the parent's view of it."""

    def __init__(
        self,
        ctx,
        memory_limit_mb: int | None,
        extra_graders: dict[str, str],
        reward_fns: dict[str, bytes],
        main: dict | None,
    ):
        self.progress = ctx.RawArray(ctypes.c_double, 2)
        parent_conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_worker_main,
            args=(child_conn, self.progress, memory_limit_mb, extra_graders, reward_fns, main),
            daemon=True,
            name="dapo-reward-worker",
        )
        with _main_module_hidden():
            self.process.start()
        child_conn.close()
        self.conn = parent_conn
        self.started = time.monotonic()
        self.ready = False
        self.remaining: deque[int] = deque()  # indices sent and not yet answered, in order

    def in_progress(self) -> tuple[int, float] | None:
        """(index, start time) of the item being graded; None while the worker moves between items."""
        first = self.progress[0]
        start = self.progress[1]
        if self.progress[0] != first:
            return None
        return int(first), start

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)
        self.conn.close()


def _stop_all(workers: list[_Worker]) -> None:
    for worker in workers:
        try:
            worker.stop()
        except Exception:  # interpreter shutdown: best effort, the daemon flag covers the rest
            pass
    workers.clear()


class RewardPool:
    """Grade responses in `num_workers` processes; every grading call is limited to `timeout_s`.

    Use as a context manager or call `close()`; workers are also stopped on garbage collection
    and at interpreter exit. Not for concurrent use from several threads (calls are serialised).
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
        """num_workers processes; timeout_s per grading call; memory_limit_mb: address space a
        worker may add after start-up (None: unlimited).

        extra_graders: name -> "package.module:function", graders besides the built-in ones that
        `score` may then be asked for by name. Each function takes (response, ground_truth) and
        returns (score, acc, pred); workers import it with importlib, so its module must be
        importable there (on sys.path when the pool starts). Only this argument and the next add
        graders: names passed to `score` are looked up, never imported.

        reward_fns: name -> a function object (response, ground_truth) -> a float score (correct when
        > 0) or (score, correct: bool); the grade holds that score, and the response's last line as
        its prediction (what maj@n votes on). It must be picklable by reference: defined at a module's
        top level, or in the main script, which each worker then runs again with `if __name__ ==
        "__main__":` blocks skipped; RewardFnError says so otherwise. A call that raises scores as a
        crash (shown once per pool as a warning); one that returns anything else raises
        RewardFnError from `score`.
        """
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers}")
        if not (timeout_s > 0 and math.isfinite(timeout_s)):  # inf would let one answer hold a worker forever
            raise ValueError(f"timeout_s must be a finite number > 0, got {timeout_s}")
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.memory_limit_mb = memory_limit_mb
        self.extra_graders = _check_extra_graders(extra_graders)
        for path in self.extra_graders.values():  # fail here, in one line, not in every worker
            _resolve(path)
        self._reward_fns: dict[str, bytes] = {}
        self._main: dict | None = None
        for name, fn in (reward_fns or {}).items():
            if not isinstance(name, str) or not name or name in RAW_GRADERS or name in self.extra_graders:
                raise ValueError(f"reward function name {name!r}: must be a new, non-empty name")
            self._reward_fns[name], main = pickle_reward_fn(name, fn)
            if len(main) > len(self._main or {}):  # one that names the main script covers the others too
                self._main = main
        self._warned: set[str] = set()  # reward functions whose exception was shown once
        self._ctx = _context()
        self._lock = threading.Lock()
        self._workers: list[_Worker] = [self._new_worker() for _ in range(num_workers)]
        self._startup_failures = 0
        self._closed = False
        self._finalizer = weakref.finalize(self, _stop_all, self._workers)

    # -- public ---------------------------------------------------------------------------------

    def score(self, responses: Sequence[str], ground_truths: Sequence[str], graders: Sequence[str] | str) -> PoolResult:
        """Grade responses[i] against ground_truths[i] with graders[i]; results in input order."""
        t0 = time.perf_counter()
        n = len(responses)
        if len(ground_truths) != n:
            raise ValueError(f"{n} responses but {len(ground_truths)} ground truths")
        if isinstance(graders, str):
            graders = [graders] * n
        elif len(graders) != n:
            raise ValueError(f"{n} responses but {len(graders)} grader names")
        payload = self._payload(responses, ground_truths, graders)
        with self._lock:
            if self._closed:
                raise RuntimeError("RewardPool is closed")
            run = _Run(self, payload)
            run.execute()
        return PoolResult(run.grades(), run.num_timeouts, run.num_crashes, time.perf_counter() - t0)

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._finalizer()

    def __enter__(self) -> RewardPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- internals ------------------------------------------------------------------------------

    def _payload(self, responses, ground_truths, graders) -> list[tuple[str, str, str]]:
        checked: set[tuple[str, str]] = set()
        payload = []
        for i, (response, truth, name) in enumerate(zip(responses, ground_truths, graders)):
            if (truth, name) not in checked:  # each distinct (truth, grader) once: groups share truths
                try:
                    if name in self.extra_graders or name in self._reward_fns:
                        if not isinstance(truth, str):
                            raise TypeError(f"ground_truth must be str, got {type(truth).__name__}")
                    else:
                        check_inputs("", truth, name)
                except (TypeError, ValueError) as err:
                    raise type(err)(f"item {i}: {err}") from None
                checked.add((truth, name))
            if not isinstance(response, str):
                raise TypeError(f"item {i}: response must be str, got {type(response).__name__}")
            tail = TAIL_CHARS.get(name)
            payload.append((response[-tail:] if tail else response, truth, name))
        return payload

    def _new_worker(self) -> _Worker:
        return _Worker(self._ctx, self.memory_limit_mb, self.extra_graders, self._reward_fns, self._main)

    def _replace(self, slot: int) -> None:
        self._workers[slot].stop()
        self._workers[slot] = self._new_worker()


class _Run:
    """The state of one `score` call: pending chunks, results, counters."""

    def __init__(self, pool: RewardPool, payload: list[tuple[str, str, str]]):
        self.pool = pool
        self.payload = payload
        n = len(payload)
        size = max(1, min(_MAX_CHUNK, math.ceil(n / (pool.num_workers * _CHUNKS_PER_WORKER))))
        self.pending: deque[list[int]] = deque(list(range(s, min(n, s + size))) for s in range(0, n, size))
        self.results: list[tuple | None] = [None] * n
        self.left = n
        self.attempts: dict[int, int] = {}
        self.num_timeouts = 0
        self.num_crashes = 0

    def grades(self) -> list[Grade]:
        return [Grade(r[0], r[1], r[2]) for r in self.results]  # type: ignore[index]

    def execute(self) -> None:
        workers = self.pool._workers
        for slot, w in enumerate(workers):
            if w.remaining:  # still busy for a call that was interrupted: its results are stale
                w.remaining.clear()
                self.pool._replace(slot)
        while self.left:
            self._dispatch()
            waitables = {}
            for slot, w in enumerate(workers):
                waitables[w.conn] = slot
                waitables[w.process.sentinel] = slot
            for obj in wait_for(list(waitables), timeout=self._wait_s()):
                slot = waitables[obj]
                if obj is workers[slot].conn or obj == workers[slot].process.sentinel:  # not replaced yet
                    self._receive(slot)
            self._enforce_limits()

    # -- steps ----------------------------------------------------------------------------------

    def _dispatch(self) -> None:
        for slot, w in enumerate(self.pool._workers):
            if not self.pending:
                return
            if not w.ready or w.remaining:
                continue
            chunk = self.pending.popleft()
            w.remaining = deque(chunk)
            # Start the clock now, with index -1 ("not started") until the worker writes its own.
            w.progress[1] = time.monotonic()
            w.progress[0] = -1
            items = [self.payload[i] for i in chunk]
            try:
                w.conn.send((chunk, [it[0] for it in items], [it[1] for it in items], [it[2] for it in items]))
            except (BrokenPipeError, OSError):
                self._on_death(slot)

    def _wait_s(self) -> float:
        now = time.monotonic()
        deadline = now + 1.0  # wake up at least once a second regardless
        for w in self.pool._workers:
            if not w.ready:
                deadline = min(deadline, w.started + _STARTUP_TIMEOUT_S)
            elif w.remaining:
                current = w.in_progress()
                if current is not None:
                    deadline = min(deadline, current[1] + self.pool.timeout_s)
        return max(0.0, deadline - now) + 0.001

    def _receive(self, slot: int) -> None:
        w = self.pool._workers[slot]
        closed = False
        try:
            while w.conn.poll():
                self._on_message(w, w.conn.recv())
        except (EOFError, OSError):
            closed = True
        if closed or not w.process.is_alive():
            self._on_death(slot)

    def _on_message(self, w: _Worker, message) -> None:
        if isinstance(message, tuple) and message and message[0] == "ready":
            w.ready = True
            self.pool._startup_failures = 0
            return
        if isinstance(message, tuple) and message and message[0] == "failed":
            raise RuntimeError(f"a reward worker could not load the reward function: {message[1]}")
        for i, score, acc, pred, failure, detail in message:
            if not w.remaining or w.remaining[0] != i:
                continue  # a result for an item already settled (cannot happen with in-order workers)
            if failure == "invalid":
                raise RewardFnError(detail)
            w.remaining.popleft()
            self._settle(i, (score, acc, pred))
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

    def _drain(self, w: _Worker) -> None:
        # Results the worker sent before it died or was killed are still in the pipe.
        try:
            while w.conn.poll():
                self._on_message(w, w.conn.recv())
        except Exception:  # EOF, or a message cut short by the kill
            pass

    def _enforce_limits(self) -> None:
        now = time.monotonic()
        for slot, w in enumerate(self.pool._workers):
            if not w.ready:
                if now - w.started > _STARTUP_TIMEOUT_S:
                    self._startup_failed(slot, "did not start in time")
                continue
            if not w.remaining:
                continue
            current = w.in_progress()
            if current is None or now - current[1] <= self.pool.timeout_s:
                continue
            w.process.kill()
            w.process.join(timeout=5)
            self._drain(w)
            if self._charge(w, TIMEOUT_PRED):
                self.num_timeouts += 1
            self._requeue_and_replace(slot)

    def _on_death(self, slot: int) -> None:
        w = self.pool._workers[slot]
        w.process.join(timeout=5)
        self._drain(w)
        if not w.ready:
            self._startup_failed(slot, f"exited with code {w.process.exitcode} during startup")
            return
        if self._charge(w, CRASH_PRED):
            self.num_crashes += 1
        self._requeue_and_replace(slot)

    def _charge(self, w: _Worker, pred: str) -> bool:
        """Settle the item a dead worker was grading as `pred`; False if none can be blamed."""
        if not w.remaining:
            return False
        index = int(w.progress[0])  # the worker is dead: this value no longer moves
        if index not in w.remaining:
            # Stopped between items or before its first: blame the next item only if that keeps
            # happening, so a worker killed for unrelated reasons costs no item its grade.
            index = w.remaining[0]
            self.attempts[index] = self.attempts.get(index, 0) + 1
            if self.attempts[index] < _MAX_ATTEMPTS:
                return False
        w.remaining.remove(index)
        self._settle(index, (-1.0, False, pred))
        return True

    def _requeue_and_replace(self, slot: int) -> None:
        w = self.pool._workers[slot]
        if w.remaining:
            self.pending.appendleft(list(w.remaining))
            w.remaining.clear()
        self.pool._replace(slot)

    def _startup_failed(self, slot: int, why: str) -> None:
        self.pool._startup_failures += 1
        if self.pool._startup_failures >= _MAX_STARTUP_FAILURES:
            raise RuntimeError(f"reward worker {why}; {_MAX_STARTUP_FAILURES} workers in a row failed to start")
        self.pool._replace(slot)


__all__ = ["PoolResult", "REWARD_FN", "RewardFnError", "RewardPool", "TIMEOUT_PRED", "CRASH_PRED", "pickle_reward_fn"]
