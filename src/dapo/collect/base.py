"""The one interface through which the loop gets each step's batch, however it is collected: in this process when
the step asks (``InProcessCollector``), ahead of the trainer in a rollout process or on rollout ranks
(``dapo.collect.ahead``), with or without screening. The loop calls ``take`` once a step and ``publish`` once its
weights are final; it never asks which kind of collector it holds. Groups held over for a later step flow with
these calls: ``take`` hands them out beside the step's batch, and ``publish`` takes them back with their old
log-probs, which only the trainer can give (the weights that sampled them are its own until the update)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from dapo.algorithm.batch import RolloutBatch
from dapo.collect.stats import CollectStats


@dataclass
class StepBatch:
    """What a step's collection hands the loop."""

    batch: RolloutBatch | None  # P informative groups, or None when the collection kept none
    stats: CollectStats  # what it took
    metrics: dict  # what it logs: sampling/*, screening's, async/* when collected ahead
    # the groups held over for a later step (algo.held_over_max_groups): the step gives each new one its old
    # log-probs before its update, and hands them all back to ``publish``
    held_over: list[RolloutBatch] = field(default_factory=list)


@dataclass
class CollectionState:
    """What a checkpoint holds of a run's collection, under one key: the prompt order, the generation rounds done
    and the keep-rate estimate (which size the next rounds), the groups held over, and, collecting ahead, the
    batches collected and not yet trained."""

    prompt_order: dict  # PromptOrder.state_dict() ({} where another rank's is the one saved)
    gen_rounds: int = 0
    keep_rate: float = 1.0
    held_over: list[dict] = field(default_factory=list)  # RolloutBatch.state() of each group
    ahead: dict | None = None  # rollout.max_staleness > 0: max_staleness, the collection's state, the in-flight steps

    KEY = "collection"  # its key in the trainer state

    def to_state(self) -> dict:
        """Plain types and tensors only (the trainer state is read with weights_only=True)."""
        return {k: v for k, v in vars(self).items() if k != "ahead" or v is not None}

    @classmethod
    def from_trainer_state(cls, saved: dict) -> CollectionState:
        """The collection's state in a checkpoint's trainer state; one written before it had a key of its own
        (its fields among the trainer state's, the prompt order as "sampler", the held-over groups as "buffer"),
        read onto the same values. The old layout is read until release 0.3."""
        if cls.KEY in saved:
            return cls(**saved[cls.KEY])
        return cls(saved["sampler"], saved["gen_rounds"], saved["keep_rate"], saved["buffer"], saved.get("async"))


class Collector(Protocol):
    """How a run collects its steps' batches. The checkpoint side: ``snapshot`` copies the collection's state as
    the steps so far left it (cheaply, before every step, so a stop may save the state before an abandoned step),
    ``checkpoint_state`` turns a snapshot into what a checkpoint after ``step`` holds, ``load_state`` reads it
    back."""

    def start(self, step: int, weights) -> None:
        """Collection may begin after step ``step``, whose weights (an iterable of named tensors) are ``weights``."""

    def take(self, step: int) -> StepBatch:
        """Step ``step``'s batch."""

    def publish(self, step: int, weights, held_over: list[RolloutBatch] = ()) -> None:
        """Step ``step`` is done; ``weights`` are the policy's after it (version ``step``); ``held_over``: the
        groups ``take`` handed out as held over, each with its old log-probs."""

    def snapshot(self) -> CollectionState: ...

    def checkpoint_state(self, snapshot: CollectionState, step: int) -> CollectionState: ...

    def load_state(self, saved: CollectionState) -> None: ...

    def close(self) -> None: ...
