"""The driver's watch over running ranks: a signal to it forwarded to every rank on every node, and a rank's worker
lost mid-run turned into one line naming it, with the other ranks ended."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time


def _signaller_class():
    import ray

    @ray.remote(num_cpus=0)
    class Signaller:
        """On a node that holds ranks: sends a signal to their processes (one already gone is passed over)."""

        def send(self, pids: list[int], signum: int) -> None:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signum)

    return Signaller


class Forwarder:
    """The driver's SIGTERM, SIGUSR1 and SIGINT, sent on to every rank's process by a small actor on each node
    that holds ranks (pinned there, no CPU asked), started with the ranks so that the signal is on its way in
    milliseconds: a driver can signal no process on another machine, and the rank's own actor cannot take the
    call (an actor that answers calls beside its training would train off the main thread, where Python runs no
    signal handler). Each signal the driver gets is forwarded once (a second one, as for a single run, ends the
    ranks at once)."""

    MARGIN_S = 15.0  # past run.preempt_grace_s the ranks exit by themselves; this much later the driver stops

    def __init__(self, ranks: list[tuple[str, int]], grace_s: float):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        self.grace_s = grace_s
        self.nodes: dict[str, list[int]] = {}  # node id: the pids of its ranks
        for node, pid in ranks:
            self.nodes.setdefault(node, []).append(pid)
        signaller = _signaller_class()
        self.signallers = {
            node: signaller.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False)).remote()
            for node in self.nodes
        }
        self.pending: list[int] = []
        self.signum: int | None = None
        self.t0: float | None = None
        self.sent: list = []  # the calls' references, kept until the job ends

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else "a signal"

    @contextlib.contextmanager
    def installed(self):
        from dapo.runtime.starting import SIGNALS

        if threading.current_thread() is not threading.main_thread():
            yield self  # signals reach the main thread only: a caller's thread leaves them to the main one
            return
        old = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}
        try:
            yield self
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

    def _handle(self, signum, frame) -> None:
        self.pending.append(signum)  # forwarded from the wait loop: no Ray call inside a signal handler
        if self.signum is None:
            self.signum, self.t0 = signum, time.monotonic()

    def forward(self) -> None:
        while self.pending:
            signum = self.pending.pop(0)
            for node, pids in self.nodes.items():
                self.sent.append(self.signallers[node].send.remote(pids, signum))

    def close(self) -> None:
        import ray

        for actor in self.signallers.values():
            ray.kill(actor)

    def overdue(self) -> bool:
        return self.t0 is not None and time.monotonic() - self.t0 > self.grace_s + self.MARGIN_S

    def stopped(self, why: str, run_dir):
        """The driver's line when the ranks did not all stop with theirs."""
        from dapo.runtime.starting import EXIT_CODE, Stopped

        resume = resume_point(run_dir)
        return Stopped(
            f"stopped by {self.name}: {why}; launch it again to resume from {resume} (exit code {EXIT_CODE})"
        )


def resume_point(run_dir) -> str:
    """Where a new launch resumes: the run's last checkpoint, or the start. Imported here, on the way out: the
    checkpoint package loads torch, which the driver otherwise never needs."""
    from dapo.checkpoint import latest_checkpoint

    last = latest_checkpoint(run_dir)
    return str(last) if last else "the start (no checkpoint yet)"


class WorkerLostError(RuntimeError):
    """A rank's Ray worker process died mid-run; the message names it and where the run resumes."""


# after one rank fails, how long the others are given to show that a worker died first (a rank whose peer
# died fails in its next collective, which can be before Ray has reported the death)
LOST_WORKER_GRACE_S = 30.0


POLL_S = 0.2  # how often the driver looks for a signal to forward while it waits for the ranks


def wait_for_ranks(runs: list, workers: list[str], run_dir, actors: list, forward: Forwarder | None = None) -> list:
    """Every rank's result. When a rank's worker process dies (killed, out of memory, its node lost) the job
    stops at once with one line naming it, instead of the other ranks waiting in their collectives; the
    other ranks are then ended too, so that a new launch starts clean and resumes. A signal to the driver is
    forwarded to every rank (``forward``); the ranks that stop for it raise ``preemption.Stopped``, and rank 0's
    line is the driver's."""
    import ray
    from ray.exceptions import RayActorError

    from dapo.runtime.starting import Stopped

    pending, failed, stops = list(runs), None, {}
    while pending:
        if forward is not None:
            forward.forward()
        wait = (POLL_S if forward is not None else None) if failed is None else LOST_WORKER_GRACE_S
        done, pending = ray.wait(pending, num_returns=1, timeout=wait)
        if not done:
            if failed is None:  # only polling
                if forward is not None and forward.overdue():
                    for actor in actors:
                        ray.kill(actor)
                    raise forward.stopped(
                        f"the ranks did not stop within run.preempt_grace_s={forward.grace_s:g} s and "
                        f"{forward.MARGIN_S:g} s more; they were ended without a new checkpoint",
                        run_dir,
                    )
                continue
            break  # the grace ran out: no worker was lost, the first failure stands
        try:
            ray.get(done[0])
        except RayActorError as err:  # the actor's process is gone
            for actor in actors:
                ray.kill(actor)
            if forward is not None and forward.signum is not None:  # it ended itself: past the grace, a 2nd signal
                raise forward.stopped(
                    f"the worker of {workers[runs.index(done[0])]} exited before a checkpoint was written (past "
                    f"run.preempt_grace_s={forward.grace_s:g} s, at a second signal, or still starting)",
                    run_dir,
                ) from None
            first = (str(err).strip().splitlines() or [type(err).__name__])[0]
            why = first.split(". ")[0][:200]  # Ray's first sentence; the rest says what it may or may not have done
            raise WorkerLostError(
                f"launch-ray: the worker of {workers[runs.index(done[0])]} died mid-run ({type(err).__name__}: {why}); "
                f"the job is stopped; launch it again to resume from {resume_point(run_dir)}"
            ) from None
        except Exception as err:  # a rank's own error: wait a little for a lost worker that caused it
            cause = getattr(err, "cause", err)  # ray.get raises a rank's exception wrapped in a RayTaskError
            if isinstance(cause, Stopped):
                stops[runs.index(done[0])] = cause
            failed = failed or err
    if failed is not None:
        for actor in actors:
            ray.kill(actor)
        if stops and isinstance(getattr(failed, "cause", failed), Stopped):
            raise Stopped(str(stops[min(stops)])) from None  # rank 0's line (every rank's is the same)
        raise failed
    return ray.get(runs)
