"""What of a training run a checkpoint holds, and writing it: the policy (weights, AdamW state, schedule), the
collection's state (prompt order, round counters, held-over groups, the batches collected ahead:
``dapo.collect.base.CollectionState``), the step and the RNG. A snapshot taken before each step lets a stop save the
run as it was before a step it abandons."""

from __future__ import annotations

import copy

from dapo.checkpoint.save import rng_state, save_checkpoint
from dapo.checkpoint.writer import CheckpointWriter
from dapo.config import Config, dump_yaml


class Saver:
    """Checkpoints of one run: ``policy`` (``trainer_state``, ``sharded_state``, ``model``, ``tokenizer``) and
    ``collector`` (a ``dapo.collect.base.Collector``: ``snapshot``, ``checkpoint_state``) as they are, written by
    ``writer`` (in the background with run.async_checkpoint)."""

    def __init__(self, cfg: Config, dist, policy, collector, writer: CheckpointWriter):
        self.cfg, self.dist, self.policy, self.collector, self.writer = cfg, dist, policy, collector, writer

    def snapshot(self, step: int) -> dict:
        """The state a step changes before its update (the collection's, the RNG), as after ``step`` steps, copied."""
        return copy.deepcopy({"collection": self.collector.snapshot(), "step": step, "rng": rng_state()})

    def save(self, step: int, snapshot: dict | None = None) -> None:
        """Checkpoint the run as it is after ``step`` steps, or as ``snapshot`` (from ``snapshot``) has it."""
        state = dict(snapshot) if snapshot is not None else {"collection": self.collector.snapshot(), "step": step}
        collection = self.collector.checkpoint_state(state.pop("collection"), state["step"])
        trainer_state = {
            "policy": self.policy.trainer_state(),
            collection.KEY: collection.to_state(),
            **state,
            "world_size": self.dist.world_size,
        }
        save_checkpoint(
            self.cfg.run_dir,
            state["step"],
            model=self.policy.model,
            tokenizer=self.policy.tokenizer,
            trainer_state=trainer_state,
            config_yaml=dump_yaml(self.cfg),
            keep=self.cfg.run.keep_checkpoints,
            shards=self.policy.sharded_state(),
            dist=self.dist,
            writer=self.writer,
        )

    def wait(self) -> dict:
        """Wait for the checkpoint being written (raising its error); the last write's duration, if new."""
        self.writer.wait()
        write_s = self.writer.take_write_s()
        return {} if write_s is None else {"perf/checkpoint_write_s": write_s}
