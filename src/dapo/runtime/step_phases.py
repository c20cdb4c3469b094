"""A training step's blocks (collect, old log-probs, update, ...) and what runs around each: ``StepPhases`` enters
the hooks of every block (the memory recorder, the timer, the watchdog), ``Timer`` is the one that times them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable


class Timer:
    """``with timer("update"): ...`` adds the block's wall time to ``timer.seconds["update"]`` and the CPU time this
    process spent meanwhile, every thread's, to ``timer.cpu_seconds["update"]``: a busy machine stretches the first,
    hardly the second."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self.cpu_seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str):
        t0, c0 = time.perf_counter(), time.process_time()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - t0
            self.cpu_seconds[phase] = self.cpu_seconds.get(phase, 0.0) + time.process_time() - c0


class StepPhases:
    """The step's blocks: ``with phase("update"): ...`` enters each hook's own context for the block, ``hook(name)``,
    in the order given (the memory recorder, the timer, the watchdog). A block may go by another name for one hook:
    ``phase("checkpoint", watchdog="checkpoint_wait")``."""

    def __init__(self, **hooks: Callable[[str], contextlib.AbstractContextManager]):
        self.hooks = hooks

    @contextlib.contextmanager
    def __call__(self, name: str, **renamed: str):
        with contextlib.ExitStack() as stack:
            for key, hook in self.hooks.items():
                stack.enter_context(hook(renamed.get(key, name)))
            yield
