"""Multi-turn rollout with a Python tool, around any rollout engine (HF generate or vLLM).

A response is generated in turns. A turn ends after one of the environment's stop texts (the Python tool's: a closed
fenced block); the environment then says what to append (the Python tool: the output block of the ```python block's
run in the sandbox), and the next turn continues from there. The whole exchange is one response row.

Token in, token out: the engine's sampled ids are kept as sampled (a turn is cut after the token that closed the
block: a prefix of a sample is a sample), only the appended output block is encoded, and the next turn's prompt is
the prompt ids plus the response ids so far, never a re-encoded text. ``Generation.tool_mask`` marks the tool's
tokens: context for the next turns, never trained on.

Budget: ``max_new_tokens`` is the whole response's, tool tokens included. They sit in the context the model
writes into and in the rows the trainer computes, so they count towards ``rollout.max_response_tokens`` and the
overlong shaping alike: a response that spends its budget on long tool output is as long as one that spends it
writing (``docs/fidelity.md``).
"""

from __future__ import annotations

import concurrent.futures
import time
from dataclasses import dataclass, field, replace

import torch

from dapo.rollout.base import Generation, RolloutEngine, SamplingParams, ToolLog, Wrapper
from dapo.tools import DONE, Environment, ToolResult, output_block

_TAIL_TOKENS = 8  # response tokens before a turn's new ones that a closing fence may have started in


@dataclass
class _Row:
    prompt: list[int]
    ids: list[int] = field(default_factory=list)
    tool: list[int] = field(default_factory=list)  # 1 where the tool wrote the token
    logp: list[float] = field(default_factory=list)
    log: ToolLog = field(default_factory=lambda: ToolLog(turns=0))
    done: bool = False
    truncated: bool = False


class ToolRollout(Wrapper):
    """``generate`` as the wrapped engine's, with ``max_turns`` turns and ``max_calls`` environment steps per row
    that append text. ``env``: the Python tool (``dapo.tools.PythonTool``) or a user's ``Environment``; its
    ``step`` gets ``timeout_s`` (the Python tool: its sandbox's own limit) and ``output_chars`` of text back."""

    def __init__(self, engine: RolloutEngine, tokenizer, env: Environment, *, max_turns: int, max_calls: int,
                 workers: int = 4, timeout_s: float = 5.0, output_chars: int = 512):  # fmt: skip
        self.engine, self.tokenizer, self.env = engine, tokenizer, env
        self.max_turns, self.max_calls, self.output_chars = max_turns, max_calls, output_chars
        # how long a step is waited for: a user's, timeout_s; the Python tool's sandbox ends its own calls at their
        # limit, so past it (and the moment to reap the sandbox) something is wrong with the machine, not the code
        self.timeout_s = env.timeout_s + 5.0 if hasattr(env, "timeout_s") else timeout_s
        # threads, not processes: a Python tool call is a process of its own already; a step past its time limit
        # is left to finish in the background (a thread cannot be killed), and the response goes on without it
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="dapo-tool")

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> Generation:
        rows = [_Row(p) for p in prompt_ids for _ in range(params.n)]  # prompt-major
        budget = params.max_new_tokens
        with_logprobs = True
        for turn in range(self.max_turns):
            active = [r for r in rows if not r.done]
            if not active:
                break
            last = turn == self.max_turns - 1
            stop = () if last else tuple(self.env.stop)
            if turn == 0:
                gen = self.engine.generate(prompt_ids, replace(params, stop=stop))
            else:  # one request per row, seeded apart from the first turn's and from each other turn's
                left = max(budget - len(r.ids) for r in active)
                seed = params.seed * 1_000_003 + turn
                gen = self.engine.generate([r.prompt + r.ids for r in active], replace(
                    params, n=1, max_new_tokens=left, seed=seed, stop=stop))  # fmt: skip
            with_logprobs = with_logprobs and gen.logprobs is not None
            calls = []
            for k, row in enumerate(active):
                new = gen.response_ids[k]
                logp = gen.logprobs[k] if gen.logprobs is not None else [0.0] * len(new)
                row.log.turns += 1
                cut = None if last else self._turn_end(row.ids, new)
                stopped_by_eos = cut is None and not bool(gen.truncated[k])
                new, logp = (new[:cut], logp[:cut]) if cut is not None else (new, logp)
                room = budget - len(row.ids)
                if len(new) > room:  # the budget ends inside this turn: the row is cut there, truncated
                    new, logp, cut, stopped_by_eos = new[:room], logp[:room], None, False
                row.ids += new
                row.tool += [0] * len(new)
                row.logp += logp
                if cut is None:
                    row.done, row.truncated = True, not stopped_by_eos
                    continue
                if len(row.ids) < budget:
                    calls.append(row)
            self._step(calls, budget)
            for row in rows:
                if not row.done and len(row.ids) >= budget:
                    row.done, row.truncated = True, True
        return Generation(
            prompt_ids=[r.prompt for r in rows],
            response_ids=[r.ids for r in rows],
            truncated=torch.tensor([r.truncated for r in rows], dtype=torch.bool),
            texts=self.tokenizer.batch_decode([r.ids for r in rows], skip_special_tokens=True),
            logprobs=[r.logp for r in rows] if with_logprobs else None,
            tool_mask=[r.tool for r in rows],
            tool_logs=[r.log for r in rows],
        )

    def _turn_end(self, ids: list[int], new: list[int]) -> int | None:
        """How many of ``new`` to keep: up to the token that completes a stop text, or None if none does."""
        tail = ids[-_TAIL_TOKENS:]
        start = len(self.tokenizer.decode(tail))

        def stops_within(k: int) -> bool:
            text = self.tokenizer.decode(tail + new[:k])
            return any(text.find(s, max(0, start - len(s) + 1)) >= 0 for s in self.env.stop)

        if not new or not stops_within(len(new)):
            return None
        lo, hi = 1, len(new)  # the first k whose text holds a stop: the property only turns on as k grows
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if stops_within(mid) else (mid + 1, hi)
        return lo

    def _step(self, rows: list[_Row], budget: int) -> None:
        """Ask the environment about each row whose turn just ended, in parallel; append what it gives back."""
        texts = [self.tokenizer.decode(row.ids) for row in rows]
        futures = [self.pool.submit(_timed, self.env.step, text) for text in texts]
        for row, future in zip(rows, futures):
            try:
                out, seconds = future.result(timeout=self.timeout_s)
            except concurrent.futures.TimeoutError:
                out, seconds = (
                    ToolResult(f"TimeoutError: the tool ran past {self.timeout_s:g} s", None, True, "", 0.0),
                    self.timeout_s,
                )
            except Exception as err:  # a user's environment failed on this response: the model is told, once
                out, seconds = ToolResult(f"{type(err).__name__}: {err}", 1, False, str(err), 0.0), 0.0
            if out is None:  # not a call (a closed block that was not code): the model writes on
                row.log.void_turns += 1
                continue
            if out is DONE:
                row.done = True
                continue
            if row.log.calls >= self.max_calls:  # told so, and nothing it asked for is shown
                text = output_block(
                    ToolResult(f"ToolLimit: no tool calls left ({self.max_calls} per response)", 0, False, "", 0.0)
                )
            elif isinstance(out, ToolResult):
                text = output_block(out)
                row.log.errors += out.failed
                row.log.timeouts += out.timed_out
            else:
                text = str(out)[: self.output_chars]
            if row.log.calls < self.max_calls:
                row.log.calls += 1
                row.log.seconds += seconds
            self._append(row, self.tokenizer.encode(text, add_special_tokens=False), budget)

    @staticmethod
    def _append(row: _Row, block: list[int], budget: int) -> None:
        block = block[: budget - len(row.ids)]
        row.ids += block
        row.tool += [1] * len(block)
        row.logp += [0.0] * len(block)  # never read: the tool mask keeps these out of every ratio
        row.log.tool_tokens += len(block)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _timed(step, text: str):
    t0 = time.monotonic()
    out = step(text)
    return out, time.monotonic() - t0
