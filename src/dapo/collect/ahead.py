"""Collect the next steps' batches while the trainer updates on this one (``rollout.max_staleness`` = k > 0).

The schedule: the batch of step t is collected (generated, graded, filtered and refilled by dynamic sampling, as
in the synchronous loop) with the weights of version max(0, t - 1 - k), where version v is the policy after v
updates and step t updates version t - 1. So every response of step t is exactly min(k, t - 1) versions older
than the weights it trains, and k = 0 would be the synchronous loop. Admission holds the bound: collecting step t
waits until version t - 1 - k exists; nothing is dropped for being stale. Because the version follows from the
step alone, not from which side was faster, the run samples the same tokens however the two sides' timings go,
and a resumed run samples what an uninterrupted one would.

A thread of the trainer's process runs the collection (``AheadThread``; its generation is in the rollout process,
``dapo.rollout.remote``, or on rollout ranks, ``dapo.rollout.ranks``; grading in the grading pool's workers), one
step after the other, at most k + 1 steps ahead of the trainer. ``GeneratingAhead`` is the loop's collector around
it (``dapo.collect.base.Collector``); ``FollowingRank``, that of the training ranks beside rank 0 with rollout
ranks. After each step the thread copies its state (prompt order, round count, keep-rate estimate), so that a
checkpoint after step s holds the state at the end of step s + k's collection together with the batches of steps
s + 1 .. s + k, collected and not yet trained: what is in flight is kept, not regenerated.
"""

from __future__ import annotations

import copy
import dataclasses
import threading
import time
import typing
from collections.abc import Callable
from dataclasses import dataclass

from dapo.algorithm.batch import RolloutBatch
from dapo.collect.base import CollectionState, StepBatch
from dapo.collect.stats import CollectStats, RoundCounters, collection_metrics
from dapo.config import ConfigError
from dapo.runtime import parallel, watchdog


@dataclass
class Collected:
    """One step's batch as the collecting thread left it."""

    step: int
    version: int  # the weights version it was sampled with
    batch: object  # RolloutBatch or None
    stats: object  # CollectStats
    state: dict  # the collection state after this step (prompt order, rounds, keep rate)
    waited_s: float  # how long the collecting thread waited for the weights version (the engine on the trainer)
    seconds: float  # how long the collection itself took


class AheadThread:
    """Runs ``collect(step, version)`` for steps ``first``..``last`` in a thread, each once weights ``version`` are
    published; ``take(step)`` hands the trainer each step's result in order.

    ``collect(step, version) -> (batch, stats, state)`` does one step's collection with the given weights version
    and returns the collection state after it. ``published`` is the newest version the trainer has handed out."""

    def __init__(self, collect: Callable[[int, int], tuple], *, max_staleness: int, first: int, last: int,
                 published: int, ahead: list[Collected] | None = None):  # fmt: skip
        if max_staleness < 1:
            raise ValueError("AheadThread is for max_staleness >= 1 (0 is the synchronous loop)")
        self.collect_fn, self.k, self.last = collect, max_staleness, last
        self._done: dict[int, Collected] = {c.step: c for c in ahead or []}
        self._next = max([first - 1, *self._done]) + 1  # the next step to collect
        self._published = self.floor = published
        self._error: BaseException | None = None
        self._stopping = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name="dapo-collect", daemon=True)

    def version_for(self, step: int) -> int:
        """Step - 1 - k; never older than the weights it started with (a run resumed past its last collected step,
        e.g. with more train.total_steps, has no older version to sample with)."""
        return max(self.floor, step - 1 - self.k)

    def start(self) -> AheadThread:
        self._thread.start()
        return self

    def publish(self, version: int) -> None:
        """Weights ``version`` exist (the trainer has sent them to the engine): collections waiting on them go."""
        with self._cond:
            self._published = max(self._published, version)
            self._cond.notify_all()

    def take(self, step: int) -> tuple[Collected, float]:
        """Step ``step``'s collection, and how long the trainer waited for it."""
        t0 = time.perf_counter()
        with self._cond:
            while step not in self._done and self._error is None:
                self._cond.wait(1.0)
            if self._error is not None:
                raise self._error
            return self._done[step], time.perf_counter() - t0

    def release(self, step: int) -> None:
        """Step ``step`` is trained: its batch need not be kept for a checkpoint any more."""
        with self._cond:
            self._done.pop(step, None)

    def in_flight(self, step: int) -> list[Collected]:
        """For a checkpoint as of after step ``step``: the collected, untrained steps step + 1 .. step + k (one taken
        by a step that was then abandoned included), waiting for those the thread has not finished (their weights
        exist: nothing else is waited on)."""
        wanted = range(step + 1, min(step + self.k, self.last) + 1)
        with self._cond:
            while any(s not in self._done for s in wanted) and self._error is None:
                self._cond.wait(1.0)
            if self._error is not None:
                raise self._error
            return [self._done[s] for s in wanted]

    def stop(self, timeout: float = 1.0) -> None:
        """Stop collecting: the thread ends at once when waiting, or when its collection in flight returns (it
        fails once the rollout process is stopped); this waits ``timeout`` seconds for it."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread.is_alive():
            self._thread.join(timeout)

    def _loop(self) -> None:
        try:
            while self._next <= self.last:
                step, version = self._next, self.version_for(self._next)
                t0 = time.perf_counter()
                with self._cond:
                    while not self._stopping and self._published < version:
                        self._cond.wait(1.0)  # admission: the weights it must use (so at most k + 1 steps ahead)
                    if self._stopping:
                        return
                t1 = time.perf_counter()
                batch, stats, state = self.collect_fn(step, version)
                collected = Collected(step, version, batch, stats, state, t1 - t0, time.perf_counter() - t1)
                with self._cond:
                    self._done[step] = collected
                    self._next += 1
                    self._cond.notify_all()
        except BaseException as err:  # handed to the trainer at its next take
            with self._cond:
                self._error = err
                self._cond.notify_all()


class GeneratingAhead:
    """The loop's collector with ``rollout.max_staleness`` > 0: the rollout side (``remote``, the transport to a
    rollout process or to rollout ranks), the collecting thread, and the collection's own state (prompt order,
    round count, keep-rate estimate), which runs ahead of the trainer's. ``sampling`` is the ``DynamicSampling``
    that samples through ``remote`` (wrapped for tools where they are on). ``dist``: training ranks beside rank 0
    (rollout ranks) are handed each step's batch."""

    def __init__(self, cfg, remote, sampling, dist=None):
        self.cfg, self.remote, self.sampling, self.prompts = cfg, remote, sampling, sampling.prompts
        self.dist = dist
        self.k = cfg.rollout.max_staleness
        self.counters = RoundCounters()  # the steps the trainer has taken
        self.collected = RoundCounters()  # the steps the collection (ahead) has done
        self.ahead: AheadThread | None = None
        self.saved: dict | None = None  # a checkpoint's collection state and in-flight steps, until start
        self.last_state: dict | None = None  # the collection state after the last step the trainer took

    def load_state(self, saved: CollectionState) -> None:
        self.counters = RoundCounters(saved.gen_rounds, saved.keep_rate)
        self.saved = saved.ahead

    def start(self, step: int, weights) -> None:
        """Collect from step ``step`` + 1 on, the engine holding ``weights`` (version ``step``): from the
        checkpoint's collection state and in-flight steps when it was resumed from one that has them."""
        in_flight: list[Collected] = []
        saved = self.saved
        if saved is not None:
            if saved["max_staleness"] != self.k and saved["in_flight"]:
                raise ConfigError(
                    f"rollout.max_staleness={self.k}: the checkpoint holds the batches of steps collected at "
                    f"rollout.max_staleness={saved['max_staleness']}; resume with that setting"
                )
            self._restore(saved["state"])
            in_flight = [_collected_from(c) for c in saved["in_flight"]]
        else:
            self.collected = RoundCounters(self.counters.gen_rounds, self.counters.keep_rate)
        self.last_state = self._state()
        self.remote.update_weights(weights, version=step)
        self.ahead = AheadThread(
            self._collect, max_staleness=self.k, first=step + 1, last=self.cfg.train.total_steps, published=step,
            ahead=in_flight,
        ).start()  # fmt: skip

    def _collect(self, step: int, version: int):
        """One step's collection, in the collecting thread: as the synchronous loop's, with weights ``version``."""
        self.remote.use_version(version)
        a = self.cfg.algo
        batch, stats, _ = self.sampling.fill_batch(  # nothing is held over: it would be older than the bound
            self.cfg.train.prompts_per_step,
            [],
            round_seed=self.collected.round_seed(self.cfg.rollout.seed),
            keep_rate_estimate=self.collected.keep_rate if a.adaptive_oversample else 1.0,
        )
        self.collected.observe(stats)
        if batch is not None:
            batch.policy_version = [version] * len(batch)
        return batch, stats, self._state()

    def _state(self) -> dict:
        # the prompt order under its earlier name, "sampler", as checkpoints have it in flight
        state = {"sampler": self.prompts.state_dict(), **dataclasses.asdict(self.collected)}  # gen_rounds, keep_rate
        return copy.deepcopy(state)

    def _restore(self, state: dict) -> None:
        self.prompts.load_state_dict(state["sampler"])
        self.collected = RoundCounters(state["gen_rounds"], state["keep_rate"])

    def take(self, step: int) -> StepBatch:
        """Step ``step``'s batch, its collection statistics, and its metrics with the async/* ones."""
        with watchdog.phase("rollout_wait"):  # watched: a rollout process that hangs is named, its stacks dumped
            collected, waited = self.ahead.take(step)
        self.last_state = collected.state
        # each response's version (one per step here: no partial rollout), the step's own where nothing was trained
        versions = (collected.batch.policy_version if collected.batch is not None else None) or [collected.version]
        staleness = [step - 1 - v for v in versions]
        ahead = {
            "async/staleness_mean": sum(staleness) / len(staleness),
            "async/staleness_max": float(max(staleness)),
            "async/trainer_wait_s": waited,
            "async/engine_wait_s": collected.waited_s,
            "async/collect_s": collected.seconds,
        }
        taken = _taken(self.cfg, self.counters, collected.batch, collected.stats, ahead)
        if self.dist is not None and self.dist.sharded:
            parallel.broadcast_object(taken, self.dist)
        return taken

    def publish(self, step: int, weights, held_over=()) -> None:
        """Step ``step`` is trained: its weights (version ``step``) go to the engine, and the collections that
        wait on them may start."""
        self.ahead.release(step)
        self.remote.update_weights(weights, version=step)
        self.ahead.publish(step)

    def snapshot(self) -> CollectionState:
        """The trainer's side (the prompt order is the collection's, ahead: ``checkpoint_state`` adds it)."""
        return CollectionState({}, self.counters.gen_rounds, self.counters.keep_rate)

    def checkpoint_state(self, snapshot: CollectionState, step: int) -> CollectionState:
        """What a checkpoint as of after step ``step`` holds of the collection: its state at the end of the last
        in-flight step (the prompt order), and those steps' batches."""
        in_flight = self.ahead.in_flight(step)
        state = in_flight[-1].state if in_flight else self.last_state
        ahead = {"max_staleness": self.k, "state": state, "in_flight": [_collected_state(c) for c in in_flight]}
        return dataclasses.replace(snapshot, prompt_order=state["sampler"], ahead=ahead)

    def close(self) -> None:
        if self.ahead is not None:
            self.ahead.stop()
        self.remote.close()


class FollowingRank:
    """The collector of a training rank other than 0 beside rollout ranks: it trains on the batches rank 0 collects,
    received step by step, and takes its part in gathering the weights rank 0 pushes (FSDP). The collection's state
    and what is in flight are rank 0's, which alone writes them into checkpoints."""

    def __init__(self, cfg, dist):
        self.cfg, self.dist, self.k = cfg, dist, cfg.rollout.max_staleness
        self.counters = RoundCounters()

    def load_state(self, saved: CollectionState) -> None:
        self.counters = RoundCounters(saved.gen_rounds, saved.keep_rate)

    def start(self, step: int, weights) -> None:
        for _ in weights:  # rank 0 pushes the first version: every rank gathers (FSDP)
            pass

    def take(self, step: int) -> StepBatch:
        with watchdog.phase("rollout_wait"):
            taken = parallel.broadcast_object(None, self.dist)
        self.counters.observe(taken.stats)
        return taken

    def publish(self, step: int, weights, held_over=()) -> None:
        for _ in weights:
            pass

    def snapshot(self) -> CollectionState:
        return CollectionState({}, self.counters.gen_rounds, self.counters.keep_rate)

    def checkpoint_state(self, snapshot: CollectionState, step: int) -> CollectionState:
        ahead = {"max_staleness": self.k, "state": {"sampler": {}}, "in_flight": []}  # rank 0's is written
        return dataclasses.replace(snapshot, ahead=ahead)

    def close(self) -> None:
        pass


def _taken(cfg, counters: RoundCounters, batch, stats: CollectStats, ahead: dict) -> StepBatch:
    """A step's batch as the trainer takes it: its rounds counted, and its metrics."""
    counters.observe(stats)
    metrics = ahead | collection_metrics(
        stats,
        held_over=0,
        gen_rounds_total=counters.gen_rounds,
        group_size=cfg.rollout.group_size,
        screen_samples=cfg.algo.screen_samples,
    )
    return StepBatch(batch, stats, metrics)


def _collected_state(c: Collected) -> dict:
    """Plain types and tensors only (the checkpoint's trainer_state is read with weights_only=True)."""
    return {**vars(c), "batch": None if c.batch is None else c.batch.state(), "stats": dataclasses.asdict(c.stats)}


def _collected_from(d: dict) -> Collected:
    # every counter record inside the statistics (the tools', screening's) back to its own type; a counter no longer
    # kept (the removed pre-filter's; groups_from_buffer, always 0 ahead of the trainer) is passed over, until 0.3
    hints = typing.get_type_hints(CollectStats)
    nested = {name: t for name, t in hints.items() if dataclasses.is_dataclass(t)}
    stats = CollectStats(**{k: nested[k](**v) if k in nested else v for k, v in d["stats"].items() if k in hints})
    batch = None if d["batch"] is None else RolloutBatch.from_state(d["batch"])
    return Collected(d["step"], d["version"], batch, stats, d["state"], d["waited_s"], d["seconds"])
