"""The peak memory of each phase of a step: ``perf/peak_rss_<phase>_gb`` and, on CUDA,
``perf/peak_cuda_<phase>_gb``.

Resident set (Linux): sampled from /proc/self/statm by a background thread while a phase is open,
and once as each phase opens and closes. The kernel's own high-water mark (VmHWM) cannot serve: it
can only be reset for the whole process, and that would also reset what getrusage and
/usr/bin/time report. A phase's peak is its largest sample, so a spike shorter than the interval
can be missed. CUDA: the caching allocator's exact peak of allocated memory, reset as each phase
opens. A phase that encloses others ("step") gets the largest peak of its own and of theirs.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time

GIB = 2**30


class PhaseMemory:
    """``with memory.phase(name): ...`` (or ``enter(name)`` / ``exit(name)``) around each phase (the loop's
    ``StepPhases`` does it); ``take()`` returns the peaks since the last ``take()`` in GiB and starts afresh.
    One per process; ``close()`` stops its thread."""

    def __init__(self, *, interval_s: float = 0.02, cuda: bool = False):
        self.interval_s = interval_s
        self.cuda = cuda
        self._open: list[str] = []  # the phases open now, outermost first
        self._rss: dict[str, int] = {}
        self._cuda: dict[str, int] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        try:
            self._statm = open("/proc/self/statm", "rb", buffering=0)  # noqa: SIM115 - read for the object's life
        except OSError:  # not Linux: no resident-set figures
            self._statm = None
        self._thread = None
        if self._statm is not None:
            self._thread = threading.Thread(target=self._sample_while_open, name="dapo-phase-memory", daemon=True)
            self._thread.start()

    def rss_bytes(self) -> int | None:
        if self._statm is None:
            return None
        self._statm.seek(0)
        return int(self._statm.read().split()[1]) * self._page  # statm's second field: resident pages

    def _fold_rss(self) -> None:
        rss = self.rss_bytes()
        if rss is not None:
            for phase in self._open:
                self._rss[phase] = max(self._rss.get(phase, 0), rss)

    def _fold_cuda(self) -> None:
        import torch

        peak = torch.cuda.max_memory_allocated()
        for phase in self._open:
            self._cuda[phase] = max(self._cuda.get(phase, 0), peak)

    def _sample_while_open(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:  # close() sets _closed and the wake-up under this lock: neither is lost to clear()
                if self._closed:
                    return
                if not self._open:
                    self._wake.clear()  # nothing open: sleep until a phase opens
                    continue
                self._fold_rss()
            time.sleep(self.interval_s)

    def enter(self, phase: str) -> None:
        with self._lock:
            if self.cuda:
                import torch

                self._fold_cuda()  # what the enclosing phases reached up to here, before the reset
                torch.cuda.reset_peak_memory_stats()
            self._open.append(phase)
            self._fold_rss()
            self._wake.set()

    def exit(self, phase: str) -> None:
        with self._lock:
            self._fold_rss()
            if self.cuda:
                self._fold_cuda()
            self._open.remove(phase)

    @contextlib.contextmanager
    def phase(self, name: str):
        self.enter(name)
        try:
            yield
        finally:
            self.exit(name)

    def take(self) -> dict[str, float]:
        """``{"perf/peak_rss_<phase>_gb": ..., "perf/peak_cuda_<phase>_gb": ...}`` since the last call."""
        with self._lock:
            out = {f"perf/peak_rss_{p}_gb": b / GIB for p, b in self._rss.items()}
            out |= {f"perf/peak_cuda_{p}_gb": b / GIB for p, b in self._cuda.items()}
            self._rss, self._cuda = {}, {}
        return out

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._wake.set()
        if self._thread is not None:
            self._thread.join()
        if self._statm is not None:
            self._statm.close()
