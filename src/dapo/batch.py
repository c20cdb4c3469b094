"""Typed records that move rollouts through the step, instead of string-keyed dicts."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from functools import cached_property

import torch


@dataclass
class RolloutBatch:
    """N = P * G sampled responses in prompt-major order, plus what the step computes for them.

    Token ids are kept as per-row lists so batches from different generation rounds concatenate
    without re-padding; tensors are padded per micro-batch, to that micro-batch's longest row.
    """

    group_size: int
    prompt_ids: list[list[int]]
    response_ids: list[list[int]]  # includes the EOS token when the response stopped by itself
    truncated: torch.Tensor  # (N,) bool: hit max_response_tokens without stopping
    texts: list[str]  # decoded responses, for grading and for reading
    example_uids: list[str]
    ground_truths: list[str]
    acc: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # (N,) float 0/1: raw correctness
    reward: torch.Tensor = field(default_factory=lambda: torch.zeros(0))  # (N,) shaped reward
    overlong_penalty: torch.Tensor = field(
        default_factory=lambda: torch.zeros(0)
    )  # (N,) <= 0: the soft overlong part of it
    preds: list[str] = field(default_factory=list)
    rollout_logp: list[list[float]] = field(
        default_factory=list
    )  # per token, as the rollout engine sampled it (vllm); empty if not reported
    # per response token 1 where a tool wrote it (multi-turn rows): context the model reads, never trained on,
    # so it is 0 in response_mask; empty when no row called a tool
    tool_mask: list[list[int]] = field(default_factory=list)
    # per row: a turn neither called the tool nor answered (tools.filter_void_turns masks such rows); empty when
    # no row called a tool
    void_turn: list[bool] = field(default_factory=list)
    # per token, under the weights that sampled the row, for groups held over in the surplus buffer: their
    # behaviour policy, so their old_logp (None for a row sampled this step, whose old_logp is recomputed)
    behaviour_logp: list[list[float] | None] = field(default_factory=list)
    # per row: the weights version that sampled it (rollout.max_staleness > 0: the policy after that many updates);
    # empty in the synchronous loop, where every row is sampled by the weights it trains
    policy_version: list[int] = field(default_factory=list)
    trainable: torch.Tensor | None = None  # (N,) bool: False rows are masked out (overlong filtering)
    adv: torch.Tensor | None = None  # (N,)
    old_logp: torch.Tensor | None = None  # (N, T) under the policy before this step's updates
    ref_logp: torch.Tensor | None = None  # (N, T) under the initial policy (KL baselines only)
    entropy: torch.Tensor | None = None  # (N, T)
    is_weights: torch.Tensor | None = (
        None  # (N, T) truncated importance-sampling weights (with algo.rollout_is_cap set)
    )

    def __len__(self) -> int:
        return len(self.response_ids)

    @property
    def num_groups(self) -> int:
        return len(self) // self.group_size

    @cached_property
    def response_lengths(self) -> torch.Tensor:
        # computed once: every micro-batch of the update slices it (token ids never change after sampling)
        return torch.tensor([len(r) for r in self.response_ids], dtype=torch.long)  # (N,)

    @property
    def max_response_len(self) -> int:
        return max((len(r) for r in self.response_ids), default=0)

    def response_mask(self, rows: torch.Tensor | None = None, width: int | None = None) -> torch.Tensor:
        """(n, width) float mask: 1 on response tokens that are trained on."""
        mask = self.written_mask(rows, width)
        if self.trainable is not None:
            keep = self.trainable if rows is None else self.trainable[rows]
            mask = mask * keep[:, None].float()
        return mask

    def written_mask(self, rows: torch.Tensor | None = None, width: int | None = None) -> torch.Tensor:
        """(n, width) float mask: 1 on the response tokens the model wrote (not padding, not a tool's output)."""
        lengths = self.response_lengths if rows is None else self.response_lengths[rows]
        width = int(lengths.max()) if width is None else width
        mask = (torch.arange(width)[None, :] < lengths[:, None]).float()  # (n, width)
        if self.tool_mask:
            picked = self.tool_mask if rows is None else [self.tool_mask[i] for i in rows.tolist()]
            for i, tool in enumerate(picked):
                if any(tool):
                    mask[i, : len(tool)] *= 1.0 - torch.tensor(tool[:width], dtype=mask.dtype)
        return mask

    def select_rows(self, rows: list[int]) -> RolloutBatch:
        index = torch.tensor(rows, dtype=torch.long)
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "group_size":
                out[f.name] = value
            elif isinstance(value, list):
                out[f.name] = [value[i] for i in rows] if value else []
            elif isinstance(value, torch.Tensor):
                out[f.name] = value[index] if value.numel() else value
            else:
                out[f.name] = None
        return RolloutBatch(**out)

    def select_groups(self, groups: list[int]) -> RolloutBatch:
        g = self.group_size
        return self.select_rows([i * g + j for i in groups for j in range(g)])

    @staticmethod
    def concat(batches: list[RolloutBatch]) -> RolloutBatch:
        batches = [b for b in batches if len(b)]
        if not batches:
            raise ValueError("nothing to concatenate")
        out = {}
        for f in fields(RolloutBatch):
            values = [getattr(b, f.name) for b in batches]
            if f.name == "group_size":
                out[f.name] = values[0]
            elif f.name in ("rollout_logp", "policy_version") and not all(values):
                out[f.name] = []  # rows without them would misalign the rest
            elif f.name == "tool_mask":  # rows of a batch without tools: no tool token
                out[f.name] = (
                    [m for b, v in zip(batches, values) for m in (v or [[0] * len(r) for r in b.response_ids])]
                    if any(values)
                    else []
                )
            elif f.name == "void_turn":
                out[f.name] = (
                    [x for b, v in zip(batches, values) for x in (v or [False] * len(b))] if any(values) else []
                )
            elif f.name == "behaviour_logp":
                out[f.name] = (
                    [x for b, v in zip(batches, values) for x in (v or [None] * len(b))] if any(values) else []
                )
            elif isinstance(values[0], list):
                out[f.name] = [x for v in values for x in v]
            elif isinstance(values[0], torch.Tensor) and f.name not in PER_STEP:
                out[f.name] = torch.cat(values)
            else:
                out[f.name] = None  # per-token tensors are recomputed for the combined batch
        return RolloutBatch(**out)

    def state(self) -> dict:
        """Plain types and tensors only, for torch.save(weights_only=True) in checkpoints."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in PER_STEP}

    @staticmethod
    def from_state(state: dict) -> RolloutBatch:
        state = dict(state)
        if "overlong" in state:  # checkpoints written before the field was named for what it holds
            state["overlong_penalty"] = state.pop("overlong")
        return RolloutBatch(**state)

    def padded_logp(self, per_row: list[list[float] | None], width: int) -> torch.Tensor:
        """Per-row token log-probs as an (N, width) tensor, 0 past each row's end (and on a None row)."""
        out = torch.zeros(len(self), width)
        for i, lp in enumerate(per_row):
            if lp:
                out[i, : len(lp)] = torch.tensor(lp[:width])
        return out

    def behaviour_old_logp(self, recomputed: torch.Tensor) -> torch.Tensor:
        """old_logp (N, T): ``recomputed`` (under the current weights, which sampled this step's rows),
        except on rows held over from an earlier step, whose behaviour policy is the one that sampled
        them: the clip must bound the step from that policy (PPO's trust region), not from a ratio
        restarted at 1."""
        if not any(lp is not None for lp in self.behaviour_logp):
            return recomputed
        stale = torch.tensor([lp is not None for lp in self.behaviour_logp])  # (N,)
        held = self.padded_logp(self.behaviour_logp, recomputed.shape[1])  # (N, T)
        return torch.where(stale[:, None], held, recomputed)


PER_STEP = ("old_logp", "ref_logp", "entropy", "is_weights")  # computed for the step's whole batch, never carried over


def pad_rows(rows: list[list[int]], pad_id: int, width: int | None = None) -> torch.Tensor:
    """Right-pad lists of ids into an (n, width) long tensor."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r[:width], dtype=torch.long)
    return out


def plan_micro_batches(
    lengths: list[int], max_tokens: int, *, packed: bool = False, max_rows: int | None = None
) -> list[list[int]]:
    """Split rows into micro-batches whose cost stays within ``max_tokens``, with costs balanced.

    The cost of a micro-batch is what the forward pass computes: rows x its longest row when rows
    are padded, the sum of lengths when they are packed. Rows are sorted by length so each padded
    micro-batch is cut to its own longest row and padding stays small. The number of micro-batches
    is the fewest the budget allows; the cut points then minimise the largest cost, so no
    micro-batch is left nearly empty. A row longer than the budget goes alone.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if not order:
        return []

    def cut(cap: int) -> list[list[int]]:
        chunks, cur, cost = [], [], 0
        for i in order:  # descending: the first row of a chunk is its longest
            new_cost = cost + lengths[i] if packed else (len(cur) + 1) * lengths[cur[0] if cur else i]
            if cur and (new_cost > cap or (max_rows and len(cur) >= max_rows)):
                chunks.append(cur)
                cur, new_cost = [], lengths[i]
            cur.append(i)
            cost = new_cost
        return chunks + [cur]

    return cut(smallest_cap(cut, max(lengths), max(max_tokens, max(lengths)), fewest=len(cut(max_tokens))))


def smallest_cap(cut, lo: int, hi: int, *, fewest: int) -> int:
    """The smallest cost cap in [lo, hi] for which ``cut(cap)`` needs no more than ``fewest``
    micro-batches: the same number of passes, with the largest one as small as it can be."""
    while lo < hi:
        mid = (lo + hi) // 2
        if len(cut(mid)) <= fewest:
            hi = mid
        else:
            lo = mid + 1
    return lo


# What one more response pass costs beyond its tokens (a decoder call's launches, mask, cache gathers), in
# tokens: a pass of its own is worth it when it saves more padding than this
RESPONSE_PASS_OVERHEAD_TOKENS = 64


def response_passes(widths: list[int], *, split: bool = True) -> list[list[int]]:
    """Positions of ``widths`` (the tokens each row feeds after its shared prompt) in response passes,
    widest first, each pass padded to its own widest row. ``split``: the passes that minimise the
    tokens computed plus ``RESPONSE_PASS_OVERHEAD_TOKENS`` per pass (so rows of 90 and 30 tokens do not
    share one padded to 90); otherwise one pass."""
    order = sorted(range(len(widths)), key=lambda i: -widths[i])
    if not split or not order:
        return [order] if order else []
    # cut points only between different widths: cutting between equal ones never saves padding
    starts = [k for k in range(len(order)) if k == 0 or widths[order[k]] != widths[order[k - 1]]] + [len(order)]
    best, prev = [0] + [math.inf] * (len(starts) - 1), [0] * len(starts)
    for j in range(1, len(starts)):  # best[j]: the cheapest passes over the first j runs of equal width
        for i in range(j):
            c = best[i] + (starts[j] - starts[i]) * widths[order[starts[i]]] + RESPONSE_PASS_OVERHEAD_TOKENS
            if c < best[j]:
                best[j], prev[j] = c, i
    passes, j = [], len(starts) - 1
    while j:
        passes.append(order[starts[prev[j]] : starts[j]])
        j = prev[j]
    return passes[::-1]


def shared_prompt_cost(
    prompt_of: list[int], prompt_lengths: list[int], widths: list[int], rows: list[int], *, split: bool = True
) -> int:
    """Tokens a shared-prompt micro-batch of ``rows`` computes: its distinct prompts, padded to the
    longest, then its response passes, each padded to its widest row."""
    longest = {prompt_of[i]: prompt_lengths[i] for i in rows}
    fed = [widths[i] for i in rows]
    return len(longest) * max(longest.values()) + sum(len(p) * fed[p[0]] for p in response_passes(fed, split=split))


def plan_shared_prompt_micro_batches(
    prompt_of: list[int],
    prompt_lengths: list[int],
    widths: list[int],
    max_tokens: int,
    *,
    max_rows: int | None = None,
    split_responses: bool = True,
) -> list[list[int]]:
    """Split rows into micro-batches that compute each distinct prompt once (``train.share_prompt_prefix``).

    ``prompt_of[i]`` names row i's prompt (rows naming the same one share it), ``prompt_lengths[i]`` is
    that prompt's length and ``widths[i]`` the tokens row i feeds after it. A micro-batch's cost is
    what its passes compute (``shared_prompt_cost``): distinct prompts x the longest, plus its
    response passes (``response_passes``; one with ``split_responses`` off), each padded to its widest
    row. The rows of a prompt stay together; a prompt whose rows alone exceed the budget (or
    ``max_rows``) is split into parts that each still share it, widest rows first. Parts are then
    filled into the fewest micro-batches the budget allows, widest first, with the largest cost made
    as small as that count allows, as ``plan_micro_batches`` does for unshared rows. A single row over
    the budget goes alone.
    """

    def cost(rows: list[int]) -> int:
        return shared_prompt_cost(prompt_of, prompt_lengths, widths, rows, split=split_responses)

    by_prompt: dict[int, list[int]] = {}
    for i, key in enumerate(prompt_of):
        by_prompt.setdefault(key, []).append(i)
    parts: list[list[int]] = []  # rows sharing one prompt, widest first
    for rows in by_prompt.values():
        rows = sorted(rows, key=lambda i: -widths[i])
        if cost(rows) <= max_tokens and not (max_rows and len(rows) > max_rows):
            parts.append(rows)  # (checked whole: with split passes a row more can cost fewer tokens)
            continue
        part: list[int] = []
        for i in rows:
            if part and (cost(part + [i]) > max_tokens or (max_rows and len(part) >= max_rows)):
                parts.append(part)
                part = []
            part.append(i)
        parts.append(part)
    alone = [cost(part) for part in parts]
    oversized = [part for part, c in zip(parts, alone) if c > max_tokens]  # single rows: a pass each
    fitting = sorted(
        (part for part, c in zip(parts, alone) if c <= max_tokens),
        key=lambda part: (-widths[part[0]], -prompt_lengths[part[0]]),
    )
    if not fitting:
        return oversized
    span_cost: dict[tuple[int, int], int] = {}  # a micro-batch is a run of consecutive parts: cost each run once

    def cut(cap: int) -> list[list[int]]:
        spans, start = [], 0
        for end in range(1, len(fitting)):
            span = (start, end + 1)
            if span not in span_cost:
                span_cost[span] = cost([i for part in fitting[start : end + 1] for i in part])
            rows = sum(len(part) for part in fitting[start : end + 1])
            if span_cost[span] > cap or (max_rows and rows > max_rows):
                spans.append((start, end))
                start = end
        spans.append((start, len(fitting)))
        return [[i for part in fitting[a:b] for i in part] for a, b in spans]

    lo = max(c for c in alone if c <= max_tokens)
    return oversized + cut(smallest_cap(cut, lo, max_tokens, fewest=len(cut(max_tokens))))
