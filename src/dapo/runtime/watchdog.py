"""The step watchdog: every rank says which phase it is in, and a thread notices when one runs late.

The loop marks its phases (``with phase("update"): ...``; ``step_phase`` for the step's blocks, the
batch collector for generation and grading). The phases nest: ``step > collect >
generate``. A phase's limit comes from the run's own history: ``run.watchdog_factor`` times the
slowest completed instance of the same phase (never below ``run.watchdog_floor_s``), and
``run.watchdog_first_s`` while none has completed yet (the first generation, the first evaluation).

When a phase of this rank passes its limit the watchdog thread writes every thread's Python stack
(faulthandler) to the rank's log (``train.log``, ``train.rank<k>.log``) and prints one line saying
which rank and phase is late and for how long; past ``run.watchdog_exit_factor`` times the limit it
prints one more line and ends the process with exit code 124 (``os._exit``: a rank stuck in C code
or in a collective never returns to Python's exit path), so a scheduler restarts it into a resume.

The collectives in which ranks wait for one another (``parallel``: objects gathered and broadcast,
barriers) mark themselves with ``waiting(...)``: a rank that waits for a late rank says so, and ends
only at ``run.watchdog_exit_factor`` times its own exit limit, after the late rank has dumped the
stack that explains the hang.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

EXIT_CODE = 124  # as timeout(1): the process ran past its time
# The step's blocks the watchdog does not time: each is a varying number of watched phases (a step with or without an
# evaluation or a save; one to algo.max_gen_rounds generation rounds), so its own history would say nothing
UNWATCHED = ("step", "collect")


@dataclass
class _Open:
    path: str  # "step > collect > generate"
    t0: float
    waiting: str | None = None  # the collective this phase is waiting in, if any
    said: bool = False  # the late line was printed


@dataclass
class _Thread:
    """One thread's open phases, outermost first, and the phase its last error left."""

    stack: list[_Open] = field(default_factory=list)
    failed_in: str | None = None


class Phases:
    """Every thread's open phases and the slowest completed instance of each phase path."""

    def __init__(self):
        self.threads: dict[int, _Thread] = {}
        self.slowest: dict[str, float] = {}
        self.lock = threading.Lock()

    def here(self) -> _Thread:
        ident = threading.get_ident()
        t = self.threads.get(ident)
        if t is None:
            with self.lock:
                t = self.threads.setdefault(ident, _Thread())
        return t


PHASES = Phases()


@contextlib.contextmanager
def phase(name: str):
    """Mark the block as phase ``name`` of this thread (nested in the thread's open phases)."""
    t = PHASES.here()
    path = f"{t.stack[-1].path} > {name}" if t.stack else name
    entry = _Open(path, time.monotonic())
    t.stack.append(entry)
    if len(t.stack) == 1:
        t.failed_in = None
    try:
        yield
    except BaseException:
        if t.failed_in is None:
            t.failed_in = path  # the innermost phase the error went through
        raise
    else:
        seconds = time.monotonic() - entry.t0
        if seconds > PHASES.slowest.get(path, 0.0):
            PHASES.slowest[path] = seconds
    finally:
        t.stack.pop()


def step_phase(name: str) -> contextlib.AbstractContextManager:
    """The watchdog's context for the training step's block ``name``: ``phase(name)``, or nothing for ``UNWATCHED``."""
    return contextlib.nullcontext() if name in UNWATCHED else phase(name)


@contextlib.contextmanager
def waiting(what: str):
    """Mark the block as waiting for the other ranks in collective ``what`` (inside the current phase)."""
    t = PHASES.here()
    entry = t.stack[-1] if t.stack else None
    if entry is None or entry.waiting is not None:
        yield
        return
    entry.waiting = what
    try:
        yield
    finally:
        entry.waiting = None


def failed_in() -> str | None:
    """The innermost phase the last error of this thread's outermost phase went through."""
    return PHASES.here().failed_in


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 600 else f"{s / 60:.1f} min"


class Watchdog:
    """Watches the open phases of the thread that starts it; see the module's docstring.

    ``exit`` ends the process (tests pass one that records the call instead)."""

    def __init__(
        self,
        *,
        rank: int,
        log_path: Path,
        factor: float,
        floor_s: float,
        first_s: float,
        exit_factor: float,
        console=None,
        exit=os._exit,
        phases: Phases = PHASES,
        backstop: bool = False,
    ):
        self.rank, self.log_path = rank, Path(log_path)
        self.factor, self.floor_s, self.first_s, self.exit_factor = factor, floor_s, first_s, exit_factor
        self.console = console
        self.exit = exit
        self.phases = phases
        self.lines: list[str] = []  # what it printed, for the caller and the tests
        # a rank stuck in C code that holds the interpreter lock stops this thread too: faulthandler's own timer,
        # which needs no lock, is re-armed every tick a little past the first exit due, and ends the process
        # (exit code 1, the stacks in the log) if the ticks stop coming
        self._backstop = open(self.log_path, "a", encoding="utf-8") if backstop else None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._owner: int | None = None
        # a tenth of the shortest limit, between 50 ms and 1 s: a late phase is seen within 10% of its limit
        self.tick = min(1.0, max(0.05, min(floor_s, first_s) / 10))

    def limit(self, path: str) -> tuple[float, str]:
        """Seconds after which phase ``path`` is late, and how that was reached."""
        slowest = self.phases.slowest.get(path)
        if slowest is None:
            return self.first_s, f"its first run, run.watchdog_first_s={self.first_s:g}"
        limit = max(self.floor_s, self.factor * slowest)
        return limit, (
            f"{self.factor:g} x its slowest completed run, {_seconds(slowest)}"
            if limit > self.floor_s
            else f"the floor run.watchdog_floor_s={self.floor_s:g}"
        )

    def start(self) -> Watchdog:
        self._owner = threading.get_ident()
        self._thread = threading.Thread(target=self._watch, name="dapo-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._backstop is not None:
            faulthandler.cancel_dump_traceback_later()
            self._backstop.close()
            self._backstop = None

    def exit_limit(self, entry: _Open) -> float:
        """Seconds after which the open phase ``entry`` ends the process."""
        return self.limit(entry.path)[0] * self.exit_factor * (self.exit_factor if entry.waiting else 1.0)

    def _watch(self) -> None:
        while not self._stop.wait(self.tick):
            t = self.phases.threads.get(self._owner)
            stack, now = (list(t.stack) if t is not None else []), time.monotonic()
            if stack:
                self.check(stack, now)
            if self._backstop is not None and not self._stop.is_set():
                if stack:
                    due = min(entry.t0 + self.exit_limit(entry) for entry in stack) - now
                    faulthandler.dump_traceback_later(
                        max(due, 0.0) + 10 * self.tick + 2.0, exit=True, file=self._backstop
                    )
                else:
                    faulthandler.cancel_dump_traceback_later()

    def check(self, stack: list[_Open], now: float) -> None:
        """Say (once) the innermost late phase of ``stack``; end the process past the exit limit."""
        for entry in reversed(stack):
            limit, why = self.limit(entry.path)
            elapsed = now - entry.t0
            if elapsed <= limit:
                continue
            waiting = entry.waiting
            # a rank that waits for the others ends at exit_factor x its own exit limit: the rank everyone waits
            # for, whose stack explains the hang, has said so and dumped it by then (ranks' limits differ a little)
            exit_at = self.exit_limit(entry)
            if not entry.said:
                entry.said = True
                self._dump(f"rank {self.rank} late in {entry.path} after {_seconds(elapsed)}")
                wait = f", waiting for the other ranks in {waiting}" if waiting else ""
                self._say(
                    f"watchdog: rank {self.rank} is late in {entry.path}{wait}: {_seconds(elapsed)}, its limit "
                    f"{_seconds(limit)} ({why}); every thread's stack is in {self.log_path}; the process "
                    f"ends at {_seconds(exit_at)} (run.watchdog_exit_factor={self.exit_factor:g})"
                )
            if elapsed > exit_at:
                self._dump(f"rank {self.rank} ends in {entry.path} after {_seconds(elapsed)}")
                self._say(
                    f"watchdog: rank {self.rank} stopped after {_seconds(elapsed)} in {entry.path}"
                    f"{f' (waiting for the other ranks in {waiting})' if waiting else ''}, past "
                    f"{self.exit_factor:g} x its limit; exit code {EXIT_CODE}: start the run again to resume "
                    f"from its last checkpoint (stacks: {self.log_path})"
                )
                for stream in (sys.stdout, sys.stderr):
                    with contextlib.suppress(Exception):
                        stream.flush()
                self._stop.set()  # once (an ``exit`` that returns, as in the tests, ends the watching)
                self.exit(EXIT_CODE)
            return

    def _dump(self, header: str) -> None:
        """Every thread's Python stack into the rank's log (faulthandler writes it without the GIL's help
        from the threads it walks, so a thread stuck anywhere is still shown)."""
        try:
            with open(self.log_path, "a", encoding="utf-8") as f:
                f.write(
                    f"{time.strftime('%Y-%m-%d %H:%M:%S')} WARNING dapo.runtime.watchdog: {header}; "
                    "every thread's stack:\n"
                )
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
                f.flush()
        except OSError as err:  # a full or missing disk must not stop the line on the console
            self.lines.append(f"(could not write the stacks to {self.log_path}: {err})")

    def _say(self, line: str) -> None:
        self.lines.append(line)
        stream = self.console or sys.stderr
        # one write of the line and its newline: the ranks share the launcher's pipe, and a write under
        # PIPE_BUF bytes is never interleaved with another rank's, where print's two writes can be
        with contextlib.suppress(Exception):
            stream.write(line + "\n")
            stream.flush()


def start(cfg, *, rank: int, log_path: Path | None) -> Watchdog | None:
    """The run's watchdog (``cfg``: the RunConfig), started on this thread; None when switched off."""
    if not cfg.watchdog or log_path is None:
        return None
    return Watchdog(
        rank=rank,
        log_path=log_path,
        factor=cfg.watchdog_factor,
        floor_s=cfg.watchdog_floor_s,
        first_s=cfg.watchdog_first_s,
        exit_factor=cfg.watchdog_exit_factor,
        backstop=True,
    ).start()
