"""The collectors a run chooses from, chosen once when it is built: in this process when the step asks (the
synchronous loop, the paper's), or ahead of the trainer (``rollout.max_staleness`` > 0: a rollout process, or
rollout ranks). Either way each step's batch is ``DynamicSampling``'s, with or without screening."""

from __future__ import annotations

import copy
from collections.abc import Callable

from dapo.algorithm.batch import RolloutBatch
from dapo.collect.ahead import FollowingRank, GeneratingAhead
from dapo.collect.base import CollectionState, Collector, StepBatch
from dapo.collect.dynamic_sampling import DynamicSampling
from dapo.collect.stats import RoundCounters, collection_metrics
from dapo.config import Config, ConfigError


class InProcessCollector:
    """Collects each step's batch when the step asks, in this process, with the weights the trainer holds: the
    prompt order, the groups held over for the next step and the round counters are its state."""

    def __init__(self, sampling: DynamicSampling, cfg: Config):
        self.sampling, self.cfg = sampling, cfg
        self.counters = RoundCounters()
        self.held_over: list[RolloutBatch] = []  # surplus groups (algo.held_over_max_groups), used first next step

    def start(self, step: int, weights) -> None:
        pass  # nothing runs between the steps

    def take(self, step: int) -> StepBatch:
        r, a = self.cfg.rollout, self.cfg.algo
        batch, stats, held_over = self.sampling.fill_batch(
            self.cfg.train.prompts_per_step,
            self.held_over,
            round_seed=self.counters.round_seed(r.seed),
            keep_rate_estimate=self.counters.keep_rate if a.adaptive_oversample else 1.0,
        )
        self.counters.observe(stats)
        metrics = collection_metrics(
            stats,
            held_over=len(held_over),
            gen_rounds_total=self.counters.gen_rounds,
            group_size=r.group_size,
            screen_samples=a.screen_samples,
        )
        return StepBatch(batch, stats, metrics, held_over)

    def publish(self, step: int, weights, held_over: list[RolloutBatch] = ()) -> None:
        self.held_over = list(held_over)  # its engine is the loop's, which the loop has given the new weights

    def snapshot(self) -> CollectionState:
        return copy.deepcopy(
            CollectionState(
                self.sampling.prompts.state_dict(),
                self.counters.gen_rounds,
                self.counters.keep_rate,
                [b.state() for b in self.held_over],
            )
        )

    def checkpoint_state(self, snapshot: CollectionState, step: int) -> CollectionState:
        return snapshot

    def load_state(self, saved: CollectionState) -> None:
        self.sampling.prompts.load_state_dict(saved.prompt_order)
        self.counters = RoundCounters(saved.gen_rounds, saved.keep_rate)
        self.held_over = [RolloutBatch.from_state(s) for s in saved.held_over]
        ahead = saved.ahead
        if ahead is not None and ahead["in_flight"]:
            raise ConfigError(
                f"the checkpoint holds batches collected ahead at rollout.max_staleness={ahead['max_staleness']}; "
                "resume with that setting"
            )

    def close(self) -> None:
        pass


def build_collector(
    cfg: Config, dist, engine, dynamic_sampling: Callable[..., DynamicSampling], ahead_engines: Callable[[], tuple]
) -> Collector:
    """The run's collector: in process on ``engine`` (the synchronous loop), or with ``rollout.max_staleness`` > 0
    the same collection ahead of the trainer on the engines ``ahead_engines()`` starts (``dapo.rollout.build``: the
    transport to a rollout process or to rollout ranks, and the engine that samples through it). A training rank
    other than 0 beside rollout ranks follows rank 0's collection. ``dynamic_sampling(engine, local)`` makes the
    ``DynamicSampling`` on an engine (``local``: grading with this rank's pool alone, as the collection ahead does
    on trainer rank 0)."""
    k = cfg.rollout.max_staleness
    if not k:
        return InProcessCollector(dynamic_sampling(engine, local=False), cfg)
    if cfg.rollout.ranks and not dist.is_main:
        return FollowingRank(cfg, dist)
    if dist.sharded and not cfg.rollout.ranks:
        raise ConfigError(
            f"rollout.max_staleness={k} with {dist.world_size} training ranks: give the rollout ranks of its own, "
            f"rollout.ranks=1 or more (the job's last ranks generate, the others train), or use "
            "rollout.max_staleness=0"
        )
    remote, sampling_engine = ahead_engines()
    return GeneratingAhead(cfg, remote, dynamic_sampling(sampling_engine, local=True), dist)
