"""Rollout engines: the interface (``base``), the backends (``hf``, ``vllm``), multi-turn tool use (``multi_turn``),
the rollout process and rollout ranks ahead of the trainer (``remote``, ``ranks``), and ``build``, the one module
that chooses a backend and turns the config into a ready engine."""

from dapo.rollout.base import Generation, RolloutEngine, SamplingParams, ShardedRollout

__all__ = ["Generation", "RolloutEngine", "SamplingParams", "ShardedRollout"]
