"""A run stopped while it is still starting (imports, the model's load, the engines' start): before the training
loop installs its own handlers (``dapo.checkpoint.preemption``), SIGTERM, SIGUSR1 or SIGINT end the process with the
same exit code as a stop mid-training, and one line, so that a scheduler that preempts a job in its first minutes
requeues it like any other. Light on purpose: it is in place before torch and transformers are imported, and
``dapo launch-ray``'s driver, which imports neither, takes the exit code, the signals and ``Stopped`` from here."""

from __future__ import annotations

import contextlib
import signal
import threading

EXIT_CODE = 75  # EX_TEMPFAIL (sysexits.h): a temporary failure, start the job again
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)


class Stopped(Exception):
    """The run stopped for a signal, its checkpoint written (``dapo.checkpoint.preemption``): the message is the
    line to print (by rank 0 only: ``main``; every rank has the same line)."""

    exit_code = EXIT_CODE

    def __init__(self, line: str, main: bool = True):
        super().__init__(line)
        self.main = main


class StoppedStarting(BaseException):
    """Raised where a signal finds the run still starting; a BaseException, so that no ``except Exception`` on the
    way (a library's import machinery, a loader's retry) takes it for a failure of its own."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.line = (
            f"stopped by {signal.Signals(signum).name} before training began: nothing to save; start the run again "
            f"(exit code {EXIT_CODE})"
        )


def _stop(signum, frame):
    raise StoppedStarting(signum)


@contextlib.contextmanager
def stop_while_starting():
    """Around a training command: the signals raise ``StoppedStarting`` until the training loop puts its own
    handlers in place. Handlers that are still these at the end are put back as they were (the training loop's
    own stay: a process that ends with its run ignores late signals)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # Python handles signals on the main thread only
        return
    before = {sig: signal.signal(sig, _stop) for sig in SIGNALS}
    try:
        yield
    finally:
        for sig, old in before.items():
            if signal.getsignal(sig) is _stop:
                signal.signal(sig, old)


def training_ended() -> None:
    """After the training loop: a signal no longer finds the run starting (what is left, the summary, has nothing
    to save); it acts as it did before ``stop_while_starting``, a process's default."""
    for sig in SIGNALS:
        if signal.getsignal(sig) is _stop:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
