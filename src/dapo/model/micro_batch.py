"""A step's rows into micro-batches: which rows each forward pass takes (planning, by the token budget), and
each pass's tensors (building: rows right-padded, packed into one row, or each distinct prompt once).

``micro_batch_rows`` plans, ``make_micro_batch`` builds; ``dapo.model.logprobs`` runs what they give. With
``train.share_prompt_prefix`` a micro-batch is a prompt pass and response passes after it
(``shared_prompt_passes``), which ``dapo.model.prefix`` runs through the decoder's KV cache.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from dapo.algorithm.batch import RolloutBatch


# ---- planning ------------------------------------------------------------------------------------
def micro_batch_rows(
    batch: RolloutBatch,
    rows: list[int],
    max_tokens: int,
    *,
    max_rows: int | None = None,
    packed: bool = False,
    share_prompts: bool = False,
    split_responses: bool = True,
) -> list[list[int]]:
    """``rows`` of ``batch`` split by the token budget, as ``make_micro_batch`` lays them out with the same
    settings; returns lists of batch row indices."""
    prompts = [batch.prompt_ids[i] for i in rows]
    if share_prompts:
        widths = fed_widths([batch.response_ids[i] for i in rows])
        plan = plan_shared_prompt_micro_batches(
            prompt_of_rows(prompts),
            [len(p) for p in prompts],
            widths,
            max_tokens,
            max_rows=max_rows,
            split_responses=split_responses,
        )
    else:
        lengths = [len(p) + len(batch.response_ids[i]) for p, i in zip(prompts, rows)]
        plan = plan_micro_batches(lengths, max_tokens, packed=packed, max_rows=max_rows)
    return [[rows[j] for j in chunk] for chunk in plan]


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


def prompt_of_rows(prompt_ids: list[list[int]]) -> list[int]:
    """Which distinct prompt each row continues, numbered in order of first appearance."""
    distinct: dict[tuple[int, ...], int] = {}
    return [distinct.setdefault(tuple(p), len(distinct)) for p in prompt_ids]


def fed_widths(response_ids: list[list[int]]) -> list[int]:
    """The tokens each row feeds its response pass: all but the last (whose prediction is past the
    end), and at least one, since a pass over nothing is still a pass (FSDP ranks run the same ones)."""
    return [max(1, len(r) - 1) for r in response_ids]


# ---- building ------------------------------------------------------------------------------------
@dataclass
class MicroBatch:
    """One forward pass: rows right-padded to the longest (R = B), or packed into one row (R = 1), or
    (``shared``) the distinct prompts once and the responses after them.

    Only response positions reach the LM head: ``token_index`` picks, for each response token, the
    flat position in (R * L) whose hidden state predicts it (with ``shared``: in the prompt pass's
    positions, then the response passes'), and ``out_index`` where it goes in (B, T).
    """

    input_ids: torch.Tensor | None  # (R, L); None with shared prompts
    attention_mask: torch.Tensor | None  # (R, L) when padded; None when packed
    position_ids: torch.Tensor | None  # (R, L) restarting at 0 for each packed sequence; None when padded
    token_index: torch.Tensor  # (n,) flat index into R * L of the position that predicts each response token
    targets: torch.Tensor  # (n,) the response tokens
    out_index: torch.Tensor  # (n,) flat index into B * T
    num_rows: int  # B
    width: int  # T: the longest response in this micro-batch
    shared: SharedPrompts | None = None  # the prompt pass and response passes (train.share_prompt_prefix)

    @property
    def num_tokens(self) -> int:
        """Tokens the forward pass computes, padding included."""
        return self.input_ids.numel() if self.shared is None else self.shared.num_tokens


def make_micro_batch(
    batch: RolloutBatch,
    rows: list[int],
    pad_id: int,
    device,
    *,
    packed: bool = False,
    share_prompts: bool = False,
    split_responses: bool = True,
) -> MicroBatch:
    """The forward pass over ``rows``; ``share_prompts``: each distinct prompt once, the responses in
    passes of similar width (one pass without ``split_responses``)."""
    prompts, responses = [batch.prompt_ids[i] for i in rows], [batch.response_ids[i] for i in rows]
    width = max(len(r) for r in responses)
    as_long = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    targets = as_long([t for r in responses for t in r])
    out_index = as_long([t for b, r in enumerate(responses) for t in range(b * width, b * width + len(r))])
    if share_prompts:
        passes = response_passes(fed_widths(responses), split=split_responses)
        shared, token_index = shared_prompt_passes(prompts, responses, passes, pad_id, device)
        return MicroBatch(None, None, None, as_long(token_index), targets, out_index, len(rows), width, shared)
    seqs = [p + r for p, r in zip(prompts, responses)]
    row_len = max(len(s) for s in seqs)
    token_index, offset = [], 0
    for b, s in enumerate(seqs):
        p, r = len(prompts[b]), len(responses[b])
        base = offset if packed else b * row_len
        token_index += range(base + p - 1, base + p + r - 1)  # position p + t - 1 predicts response token t
        offset += len(s)
    if packed:
        input_ids = torch.tensor([[t for s in seqs for t in s]], dtype=torch.long)  # (1, sum of lengths)
        attention_mask, position_ids = None, torch.cat([torch.arange(len(s)) for s in seqs])[None, :].to(device)
    else:
        input_ids = pad_rows(seqs, pad_id)  # (B, L)
        attention_mask, position_ids = padding_mask([len(s) for s in seqs], row_len).to(device), None
    return MicroBatch(
        input_ids.to(device), attention_mask, position_ids, as_long(token_index), targets, out_index, len(rows), width
    )


def pad_rows(rows: list[list[int]], pad_id: int, width: int | None = None) -> torch.Tensor:
    """Right-pad lists of ids into an (n, width) long tensor."""
    width = max((len(r) for r in rows), default=0) if width is None else width
    out = torch.full((len(rows), width), pad_id, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r[:width], dtype=torch.long)
    return out


def padding_mask(lengths: list[int] | torch.Tensor, width: int) -> torch.Tensor:
    """(n, width) long: 1 on each row's first ``lengths[i]`` positions, 0 on its right padding."""
    return (torch.arange(width)[None, :] < torch.as_tensor(lengths)[:, None]).long()


@dataclass
class ResponsePass:
    """b rows' response tokens, after their prompts' cached states."""

    input_ids: torch.Tensor  # (b, W): each response but its last token (it predicts nothing), right-padded
    attention_mask: torch.Tensor  # (b, P + W): the row's prompt (its padding masked), then its tokens
    position_ids: torch.Tensor  # (b, W): from the row's prompt length on
    prompt_of_row: torch.Tensor  # (b,) long: which of the micro-batch's prompts each row continues


@dataclass
class SharedPrompts:
    """A micro-batch's distinct prompts, right-padded, and the response passes that follow them."""

    input_ids: torch.Tensor  # (U, P): U distinct prompts, P the longest
    attention_mask: torch.Tensor  # (U, P)
    responses: list[ResponsePass]

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel() + sum(r.input_ids.numel() for r in self.responses)


def shared_prompt_passes(
    prompt_ids: list[list[int]], response_ids: list[list[int]], passes: list[list[int]], pad_id: int, device
) -> tuple[SharedPrompts, list[int]]:
    """The passes over B rows (row b: ``prompt_ids[b]`` then ``response_ids[b]``, non-empty) with each
    distinct prompt once, the rows in ``passes`` (lists of row positions). Also, in row order, the flat
    position in the passes' hidden states (``prompt_then_responses``) that predicts each response
    token: a response's first token by its prompt's last real position, the others by the response
    pass."""
    of_row = prompt_of_rows(prompt_ids)
    prompts = list({u: p for u, p in zip(of_row, prompt_ids)}.values())  # in order of u
    width = max(len(p) for p in prompts)
    lengths = torch.tensor([len(p) for p in prompts])
    prompt_mask = padding_mask(lengths, width)  # (U, P)
    fed, widths = [r[:-1] for r in response_ids], fed_widths(response_ids)
    first_fed = [0] * len(fed)  # flat position of each row's first fed token
    offset, responses = len(prompts) * width, []
    for rows in passes:
        fed_width = max(widths[b] for b in rows)
        for k, b in enumerate(rows):
            first_fed[b] = offset + k * fed_width
        offset += len(rows) * fed_width
        of_rows = torch.tensor([of_row[b] for b in rows], dtype=torch.long)
        fed_mask = padding_mask([len(fed[b]) for b in rows], fed_width)
        responses.append(
            ResponsePass(
                input_ids=pad_rows([fed[b] for b in rows], pad_id, fed_width).to(device),
                attention_mask=torch.cat([prompt_mask[of_rows], fed_mask], dim=1).to(device),
                position_ids=(lengths[of_rows][:, None] + torch.arange(fed_width)[None, :]).to(device),
                prompt_of_row=of_rows.to(device),
            )
        )
    predictors = []
    for b, p in enumerate(prompt_ids):
        predictors.append(of_row[b] * width + len(p) - 1)
        predictors += range(first_fed[b], first_fed[b] + len(fed[b]))
    return SharedPrompts(pad_rows(prompts, pad_id).to(device), prompt_mask.to(device), responses), predictors
