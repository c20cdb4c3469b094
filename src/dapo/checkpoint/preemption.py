"""A checkpoint on the way out: what a run does on SIGTERM, SIGUSR1 or SIGINT.

Schedulers stop a job with a signal and a grace period before SIGKILL: Slurm sends SIGTERM (and SIGUSR1 first
with ``--signal``), Kubernetes and spot instances SIGTERM, a user Ctrl-C (SIGINT). On any of them every rank

  1. abandons or finishes the phase it is in. Generation, grading and the old-log-prob pass of a step whose
     update has not begun are abandoned: they only read the weights, and the resumed run redoes the step whole
     from the same seeds, so only their time is lost. The update is finished (an optimizer step cannot be
     half-applied), and with it the rest of its step (weight push, evaluation, its checkpoint if one is due, its
     metrics row); a checkpoint write in flight, synchronous or in the background, is completed;
  2. writes a checkpoint of the last completed step, unless it has one already;
  3. prints one line (rank 0) and exits with ``EXIT_CODE``.

One process leaves an abandonable phase at once: the handler raises ``Stop`` in it. Several ranks never leave a
phase alone (the others would wait for it in a collective forever): they agree at the step's boundaries (before
the step, after the collection, after the old log-probs) with an all-reduce of their flags, so a signal to any
one rank stops them all at the same point and they write one checkpoint together; a generation round in flight
is finished first.

``run.preempt_grace_s`` bounds the time from the signal to the exit. Past it the process exits (with the same
code) without the new checkpoint, saying so: the previous checkpoint is whole (a write cut short leaves only a
.tmp_* directory). A second signal ends the process at once, the same way, unless it comes within ``REPEAT_S`` of
the first: that is the same stop delivered twice, as when Slurm signals every process of a job step and torchrun
forwards the signal it got as well. A signal that reaches a rank already stopping for another rank's signal (a
launcher's forwarding, slower than the ranks' agreement) is its first, not a second.

Launchers: torchrun forwards SIGTERM and SIGINT (SIGUSR1 only when named in ``--signals-to-handle``) to each
rank's process group and kills the ranks ``--shutdown-timeout`` (30) s later; ``dapo launch-ray``'s driver sends
the signal on to every rank's process, on every node (dapo.cluster.watch).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

import torch

from dapo.checkpoint import files as checkpoint_files
from dapo.runtime import parallel, watchdog
from dapo.runtime.starting import EXIT_CODE, SIGNALS, Stopped

REPEAT_S = 5.0  # a second signal this soon after the first is the same stop delivered twice
# True where the process ends with the run (`dapo train`, a Ray rank): once the training loop is over (stopped or
# finished) the signals stay ignored, so that a repeat of the signal (a scheduler's and a launcher's) or a late one
# cannot turn the exit code (75, or 0 for a finished run) into a death by signal on the way out; elsewhere (a
# caller's process, a test) the handlers in place before the run come back
PROCESS_ENDS_WITH_RUN = False
# the phases a single process leaves at once: before the update they only read the weights
ABANDON = ("generate", "reward", "old_logprob")


class Stop(BaseException):
    """Raised in the training loop where it stops for a signal; a BaseException, as KeyboardInterrupt, so that
    no ``except Exception`` on the way (a library's, the step's own) takes it for a failure."""

    def __init__(self, abandoned: str | None):
        super().__init__(abandoned)
        self.abandoned = abandoned  # the phase left unfinished, None: between steps


class Signals:
    """The run's signal handlers and what they have seen; ``check`` at the step's boundaries. ``saver`` (a
    ``dapo.checkpoint.saver.Saver``) takes the snapshot before each step and writes the checkpoint on the way out."""

    def __init__(self, grace_s: float, dist: parallel.Dist, saver):
        self.grace_s, self.dist, self.saver = grace_s, dist, saver
        self.run_dir = saver.cfg.run_dir
        self.completed = 0  # the steps completed when the last boundary was checked
        self.signum: int | None = None
        self.t0: float | None = None
        self.delivered: float | None = None  # when this process itself got its first signal
        self.snapshot: dict | None = None  # the small trainer state at the end of the last completed step
        self.phase = "between steps"  # where the signal landed
        self.installed: dict = {}
        self.timer: threading.Timer | None = None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a signal"

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # Python handles signals on the main thread only (a caller's thread, a Ray actor's)
        for sig in SIGNALS:
            self.installed[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        for sig, old in self.installed.items():
            signal.signal(sig, signal.SIG_IGN if PROCESS_ENDS_WITH_RUN else old)
        self.installed = {}
        if self.timer is not None:
            self.timer.cancel()

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.delivered is not None:
            if now - self.delivered < REPEAT_S:
                return  # the same stop delivered twice (the scheduler's and the launcher's)
            self._exit(f"a second {signal.Signals(signum).name}: stopped at once, without a new checkpoint")
        self.delivered = now
        if self.signum is not None:
            return  # already stopping for another rank's signal: this is the launcher's forwarding of the same
        stack = watchdog.PHASES.here().stack
        innermost = stack[-1].path.split(" > ")[-1] if stack else None
        self._note(signum, stack[-1].path if stack else "between steps")
        if innermost in ABANDON and not self.dist.sharded:
            raise Stop(innermost)

    def _note(self, signum: int, phase: str) -> None:
        """The signal (this rank's, or another rank's seen at a boundary) and where it found the rank; the grace
        period starts."""
        self.signum, self.t0, self.phase = signum, time.monotonic(), phase
        self.timer = threading.Timer(self.grace_s, self._too_late)
        self.timer.daemon = True
        self.timer.start()

    def check(self, where: str, completed: int) -> None:
        """A boundary of the step (``where``: "step", before it; "collect", "old_logprob", after them), with
        ``completed`` steps done: raise Stop when any rank has had a signal; before a step, keep the snapshot a stop
        in it would save."""
        self.completed = completed
        seen = int(parallel.all_reduce(torch.tensor(float(self.signum or 0)), self.dist, "max").item())
        if seen:
            if self.signum is None:  # another rank's signal
                self._note(seen, "between steps" if where == "step" else f"{where} (a signal to another rank)")
            raise Stop(None if where == "step" else where)
        if where == "step":
            self.snapshot = self.saver.snapshot(completed)

    def _too_late(self) -> None:
        last = checkpoint_files.latest_checkpoint(self.run_dir)
        self._exit(
            f"stopped by {self.name}: no checkpoint within run.preempt_grace_s={self.grace_s:g} (the signal came in "
            f"{self.phase}); start the run again to resume from " + (str(last) if last else "the start")
        )

    def _exit(self, line: str) -> None:
        if self.dist.is_main:
            print(line, file=sys.stderr, flush=True)
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(EXIT_CODE)

    def finish(self, stop: Stop) -> Stopped:
        """Write the checkpoint of the last completed step (or wait for the one in flight); the line to exit with."""
        snapshot = (
            self.snapshot if stop.abandoned else None
        )  # an abandoned step changed the prompt order, counters, RNG
        step = snapshot["step"] if snapshot else self.completed
        self.saver.wait()  # a write in flight (its step's) is completed first
        last = checkpoint_files.latest_checkpoint(self.run_dir)
        had = last is not None and checkpoint_files.step_of(last) == step
        if step > 0 and not had:
            self.saver.save(step, snapshot)
            self.saver.wait()
            last = checkpoint_files.latest_checkpoint(self.run_dir)
        self.timer.cancel()
        seconds = time.monotonic() - self.t0
        where = (
            f"in {self.phase}, abandoned"
            if stop.abandoned
            else ("between steps" if self.phase == "between steps" else f"in {self.phase}, finished")
        )
        if step == 0:
            done = "no step completed since the start, nothing to save"
        else:
            done = f"checkpoint {last} {'already there' if had else 'written'}, {seconds:.1f} s after the signal"
        return Stopped(
            f"stopped by {self.name} at step {step} ({where}): {done}; start the run again to resume "
            f"(exit code {EXIT_CODE})",
            main=self.dist.is_main,
        )


@contextlib.contextmanager
def on_signals(saver, *, grace_s: float, dist: parallel.Dist):
    """Around the training steps: SIGTERM, SIGUSR1 and SIGINT stop the run with a checkpoint (``Stopped``); yields
    the ``Signals``, whose ``check`` the loop calls at each boundary of a step."""
    sig = Signals(grace_s, dist, saver)
    sig.install()
    try:
        yield sig
    except Stop as stop:
        raise sig.finish(stop) from None
    finally:
        sig.restore()
