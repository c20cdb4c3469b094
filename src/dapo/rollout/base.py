"""The rollout-engine interface. Backends: ``hf`` (transformers generate) and ``vllm``."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields, replace
from typing import Protocol

import torch


@dataclass
class SamplingParams:
    n: int = 1  # samples per prompt
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int | None = None  # None (or 0): no top-k
    max_new_tokens: int = 64
    seed: int = 0
    stop: tuple[str, ...] = ()  # a row stops after the token that completes one of these texts (multi-turn tools)


@dataclass
class ToolLog:
    """What one multi-turn response did with its tool."""

    turns: int = 1  # stretches of the model's own writing
    calls: int = 0
    errors: int = 0  # calls whose code failed (an exception, a limit), time-outs included
    timeouts: int = 0
    seconds: float = 0.0  # wall time of its calls
    tool_tokens: int = 0  # response tokens the tool wrote
    void_turns: int = 0  # turns that ended at a closed block that was not code (neither a call nor the end)

    def add(self, other: ToolLog) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass
class Generation:
    """len(prompts) * n rows in prompt-major order: rows i*n .. i*n+n-1 answer prompt i."""

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]  # ends with the EOS token when the sample stopped by itself
    truncated: torch.Tensor  # (rows,) bool: stopped by the max_new_tokens limit
    texts: list[str]  # responses decoded without special tokens
    logprobs: list[list[float]] | None = None  # per response token: the log-prob it was sampled with (vllm)
    # multi-turn rows (dapo.rollout.multi_turn): per response token 1 where a tool wrote it (context, not trained
    # on), and each row's tool record; None for single-turn generation
    tool_mask: list[list[int]] | None = None
    tool_logs: list[ToolLog] | None = None

    @property
    def num_tokens(self) -> int:
        return sum(len(r) for r in self.response_ids)


class RolloutEngine(Protocol):
    backend: str  # "hf" or "vllm": what the run's saved config records

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Generation:
        """Sample params.n responses for every prompt; reproducible for a given params.seed."""

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load the trainer's new weights (a no-op for an engine that shares the trainer's model)."""

    def sleep(self) -> None:
        """Free generation memory while the trainer runs (no-op where unsupported)."""

    def wake(self) -> None:
        """Undo sleep() before generating."""


def eos_token_ids(model, tokenizer) -> set[int]:
    """The ids that end a response: the model's generation_config.eos_token_id (one id or a list,
    as several instruct models ship it), else the tokenizer's EOS. Every engine stops on these."""
    config = getattr(model, "generation_config", None)
    eos = config.eos_token_id if config is not None else None
    eos = eos if eos is not None else tokenizer.eos_token_id
    return set(eos) if isinstance(eos, (list, tuple)) else {eos}


def split_response(tokens: list[int], eos_ids: set[int], max_new_tokens: int) -> tuple[list[int], bool]:
    """Cut generated ids after the first EOS; (ids incl. EOS, truncated?)."""
    for i, tok in enumerate(tokens):
        if tok in eos_ids:
            return tokens[: i + 1], False
    return tokens[:max_new_tokens], len(tokens) >= max_new_tokens


def concat_generations(parts: list[Generation]) -> Generation:
    """Generations of consecutive shares of the prompts as one, in prompt order."""
    with_logprobs = all(g.logprobs is not None or not g.response_ids for g in parts)
    with_tools = any(g.tool_mask is not None for g in parts)
    return Generation(
        prompt_ids=[x for g in parts for x in g.prompt_ids],
        response_ids=[x for g in parts for x in g.response_ids],
        truncated=torch.cat([g.truncated for g in parts]) if parts else torch.zeros(0, dtype=torch.bool),
        texts=[x for g in parts for x in g.texts],
        logprobs=[x for g in parts for x in (g.logprobs or [])] if with_logprobs else None,
        tool_mask=[x for g in parts for x in (g.tool_mask or [])] if with_tools else None,
        tool_logs=[x for g in parts for x in (g.tool_logs or [])] if with_tools else None,
    )


class Sleepless:
    """``sleep``/``wake`` that free nothing: an engine whose memory is its own (a process or rank apart from the
    trainer), or whose model is the trainer's itself (hf)."""

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass


class Wrapper:
    """An engine around another one (``self.engine``): its backend, weight updates, sleep and wake are the
    wrapped engine's."""

    engine: RolloutEngine

    @property
    def backend(self) -> str:
        return self.engine.backend

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.engine.update_weights(named_tensors)

    def sleep(self) -> None:
        self.engine.sleep()

    def wake(self) -> None:
        self.engine.wake()


class ShardedRollout(Wrapper):
    """Data-parallel sampling under FSDP: each engine samples a contiguous share of the prompts and
    every rank gets the whole Generation, in prompt order. ``generate`` is collective: every rank
    calls it with the same prompts.

    ``tensor_parallel_size = k``: one engine spans k consecutive ranks (vLLM tensor parallelism), so
    there are world_size / k shares; the ranks of one engine pass it the same prompts and seed and
    get the same samples, of which the gather keeps the engine's first rank's copy."""

    def __init__(self, engine: RolloutEngine, d, tensor_parallel_size: int = 1):
        self.engine, self.d, self.k = engine, d, tensor_parallel_size

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Generation:
        from dapo.runtime import parallel

        w, r = self.d.world_size // self.k, self.d.rank // self.k  # engines; this rank's engine
        lo, hi = len(prompt_ids) * r // w, len(prompt_ids) * (r + 1) // w
        mine = Generation([], [], torch.zeros(0, dtype=torch.bool), [])
        if hi > lo:  # each engine its own seed: shares must not repeat each other's samples
            mine = self.engine.generate(prompt_ids[lo:hi], replace(params, seed=params.seed * w + r))
        parts = parallel.all_gather_object(mine if self.d.rank % self.k == 0 else None, self.d)[:: self.k]
        return concat_generations(parts)
