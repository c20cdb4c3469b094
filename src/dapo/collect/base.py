"""The one interface through which the loop gets each step's batch, however it is collected: in this process when
the step asks (``InProcessCollector``), ahead of the trainer in a rollout process or on rollout ranks
(``dapo.collect.ahead``), with or without screening. The loop calls ``take`` once a step and ``publish`` once its
weights are final; it never asks which kind of collector it holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from dapo.algorithm.batch import RolloutBatch
from dapo.collect.stats import CollectStats


@dataclass
class StepBatch:
    """What a step's collection hands the loop."""

    batch: RolloutBatch | None  # P informative groups, or None when the collection kept none
    stats: CollectStats  # what it took
    metrics: dict  # what it logs: sampling/*, screening's, async/* when collected ahead


class Collector(Protocol):
    """How a run collects its steps' batches. The checkpoint side: ``snapshot`` copies the collection's state as
    the steps so far left it (cheaply, before every step, so a stop may save the state before an abandoned step),
    ``checkpoint_state`` turns a snapshot into what a checkpoint after ``step`` holds, ``load_state_dict`` reads it
    back."""

    held_over: list[RolloutBatch]  # groups kept for a later step: they get their old log-probs before the update

    def start(self, step: int, weights) -> None:
        """Collection may begin after step ``step``, whose weights (an iterable of named tensors) are ``weights``."""

    def take(self, step: int) -> StepBatch:
        """Step ``step``'s batch."""

    def publish(self, step: int, weights) -> None:
        """Step ``step`` is done; ``weights`` are the policy's after it (version ``step``)."""

    def snapshot(self) -> dict: ...

    def checkpoint_state(self, snapshot: dict, step: int) -> dict: ...

    def load_state_dict(self, saved: dict) -> None: ...

    def close(self) -> None: ...
