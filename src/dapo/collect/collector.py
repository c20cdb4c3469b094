"""The collectors a run chooses from, chosen once when it is built: in this process when the step asks (the
synchronous loop, the paper's), or ahead of the trainer (``rollout.max_staleness`` > 0: a rollout process, or
rollout ranks). Either way each round is ``BatchCollector``'s, with or without screening."""

from __future__ import annotations

import copy
from collections.abc import Callable

from dapo.algorithm.batch import RolloutBatch
from dapo.collect.ahead import start_generating_ahead
from dapo.collect.base import Collector, StepBatch
from dapo.collect.dynamic_sampling import BatchCollector
from dapo.collect.stats import RoundCounters, collection_metrics
from dapo.config import Config, ConfigError


class InProcessCollector:
    """Collects each step's batch when the step asks, in this process, with the weights the trainer holds: the
    prompt sampler, the groups held over for the next step and the round counters are its state."""

    def __init__(self, collector: BatchCollector, cfg: Config):
        self.collector, self.sampler = collector, collector.sampler
        self.cfg = cfg
        self.counters = RoundCounters()
        self.held_over: list[RolloutBatch] = []  # surplus kept groups (algo.buffer_max_groups), used first next step

    def start(self, step: int, weights) -> None:
        pass  # nothing runs between the steps

    def take(self, step: int) -> StepBatch:
        r, a = self.cfg.rollout, self.cfg.algo
        batch, stats = self.collector.collect(
            self.cfg.train.prompts_per_step,
            self.held_over,
            round_seed=self.counters.round_seed(r.seed),
            keep_rate_estimate=self.counters.keep_rate if a.adaptive_oversample else 1.0,
        )
        self.counters.observe(stats)
        metrics = collection_metrics(
            stats,
            held_over=len(self.held_over),
            gen_rounds_total=self.counters.gen_rounds,
            group_size=r.group_size,
            screen_samples=a.screen_samples,
        )
        return StepBatch(batch, stats, metrics)

    def publish(self, step: int, weights) -> None:
        pass  # its engine is the loop's, which the loop has given the new weights

    def snapshot(self) -> dict:
        state = {
            "sampler": self.sampler.state_dict(),
            "gen_rounds": self.counters.gen_rounds,
            "keep_rate": self.counters.keep_rate,
            "buffer": [b.state() for b in self.held_over],
        }
        return copy.deepcopy(state)

    def checkpoint_state(self, snapshot: dict, step: int) -> dict:
        return snapshot

    def load_state_dict(self, saved: dict) -> None:
        self.sampler.load_state_dict(saved["sampler"])
        self.counters = RoundCounters(saved["gen_rounds"], saved["keep_rate"])
        self.held_over = [RolloutBatch.from_state(s) for s in saved["buffer"]]
        ahead = saved.get("async")
        if ahead is not None and ahead["in_flight"]:
            raise ConfigError(
                f"the checkpoint holds batches collected ahead at rollout.max_staleness={ahead['max_staleness']}; "
                "resume with that setting"
            )

    def close(self) -> None:
        pass


def build_collector(
    cfg: Config, dist, engine, batch_collector: Callable[..., BatchCollector], *, tokenizer, device, max_model_len: int,
    tool_env,
) -> Collector:  # fmt: skip
    """The run's collector: in process on ``engine`` (the synchronous loop), or with ``rollout.max_staleness`` > 0
    the same collection ahead of the trainer, its engine in a rollout process or on rollout ranks.
    ``batch_collector(engine, local)`` makes the ``BatchCollector`` on an engine (``local``: grading with this
    rank's pool alone, as the collection ahead does on trainer rank 0)."""
    if not cfg.rollout.max_staleness:
        return InProcessCollector(batch_collector(engine, local=False), cfg)
    return start_generating_ahead(
        cfg, dist, tokenizer, device, max_model_len=max_model_len, tool_env=tool_env,
        batch_collector=lambda remote: batch_collector(remote, local=True),
    )  # fmt: skip
