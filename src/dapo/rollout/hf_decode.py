"""Sampling with the KV cache, finished rows dropped from the batch: what transformers ``generate`` samples, for
fewer forward rows.

``generate`` decodes every row of a batch until its longest row ends, so one response that runs to the length limit
makes the batch's short ones pay for every step after theirs (on the demo, 2.6 decode slots per generated token in
such a batch). Here rows leave the batch and their KV cache once they end, and each step's forward computes the rows
still writing.

The tokens are generate's for the same seed and settings: the same forward inputs (left padding, position ids from
the attention mask, ``logits_to_keep=1``), the same logits warpers in generate's order, and the same random draws:
``torch.multinomial`` is called on a batch as wide as the chunk, as ``generate`` calls it with its finished rows
still in, so every row draws from the stream where it would have (finished rows draw from ones and are ignored).
A smaller batch can round a matmul differently in the last bit, so a token on the edge of two may rarely differ; the
distribution sampled from is the same softmax(logits / temperature), top-k, top-p either way.

The prompts' forward computes each prompt once for the rows that sample it (the engine lays out a prompt's G rows side
by side) and copies its cache and last logits to them.

Models whose cache is not transformers' plain ``DynamicCache`` of attention layers (state-space and hybrid layers,
encoder-decoders, state kept in the modules) are left to ``generate`` (``decodes_here``).
"""

from __future__ import annotations

import inspect

import torch
from transformers import DynamicCache, StopStringCriteria
from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from dapo.model import lora
from dapo.rollout.base import SamplingParams

# compact the batch once this share of its rows has ended: each compaction copies the KV cache, as one step's append
# does, so dropping a row or two at a time would cost more copying than the forward rows it saves
COMPACT_SHARE = 0.25


def _causal_lm(model):
    return model.get_base_model() if lora.is_adapted(model) else model


def decodes_here(model) -> bool:
    """Whether this module samples for ``model``: a decoder-only LM with transformers' dynamic KV cache of attention
    layers and ``logits_to_keep`` (else the engine calls ``generate``)."""
    lm = _causal_lm(model)
    config = getattr(lm, "config", None)
    forward = inspect.signature(lm.forward).parameters
    # both names, as this loop passes them: a family without past_key_values (GPT-1, XLM) keeps no cache of this kind
    if config is None or config.is_encoder_decoder or not {"logits_to_keep", "past_key_values"} <= forward.keys():
        return False
    supports = getattr(lm, "_supports_default_dynamic_cache", None)
    if supports is None or not supports():
        return False
    # a family that keeps state in its modules beside the cache (RecurrentGemma's recurrent blocks, reset to zeros
    # when the batch changes size) would lose it when rows leave the batch or share a prefill
    if any(hasattr(module, "_setup_cache") for module in lm.modules()):
        return False
    cache = DynamicCache(config=config.get_text_config(decoder=True))
    return all(type(layer) in (DynamicLayer, DynamicSlidingWindowLayer) for layer in cache.layers)


def warpers(params: SamplingParams) -> LogitsProcessorList:
    """generate's logits warpers for these settings, in its order (temperature, top-k, top-p); none when greedy."""
    out = LogitsProcessorList()
    if params.temperature <= 0:
        return out
    if params.temperature != 1.0:
        out.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        out.append(TopKLogitsWarper(top_k=params.top_k, min_tokens_to_keep=1))
    if params.top_p < 1.0:
        out.append(TopPLogitsWarper(top_p=params.top_p, min_tokens_to_keep=1))
    return out


class _PositionMajorLayer(DynamicLayer):
    """A full-attention layer's keys and values for decoding, in a buffer with room for the response, positions
    outermost: (positions, rows, heads, head_dim). transformers' ``DynamicLayer`` concatenates each step's token
    onto a copy of the whole cache, a cache-sized copy per step and layer; here the token is written in place, and
    attention reads the first L positions as one contiguous block, viewed as (rows, heads, L, head_dim) (on the demo
    a tenth fewer CPU seconds per generated token). The values are the same, in the same order of summation."""

    def __init__(self, room: int):
        super().__init__()
        self.room, self.length = room, 0
        self.buffers: list[torch.Tensor] = []

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:  # the prefill's keys, kept as they come (a prompt's copies are made from them)
            self.lazy_initialization(key_states, value_states)
            self.keys, self.values = key_states, value_states
            return self.keys, self.values
        if not self.buffers:  # the first decoding step: one copy into the buffer, as one concatenation would be
            self.length = self.keys.shape[-2]
            for t in (self.keys, self.values):
                buffer = t.new_empty(self.length + self.room, t.shape[0], t.shape[1], t.shape[3])
                buffer[: self.length] = t.permute(2, 0, 1, 3)
                self.buffers.append(buffer)
        rows, start, new = len(key_states), self.length, key_states.shape[-2]
        self.buffers[0][start : start + new, :rows] = key_states.permute(2, 0, 1, 3)
        self.buffers[1][start : start + new, :rows] = value_states.permute(2, 0, 1, 3)
        self.length = start + new
        self._view(rows)
        return self.keys, self.values

    def _view(self, rows: int) -> None:
        self.keys, self.values = (b[: self.length, :rows].permute(1, 2, 0, 3) for b in self.buffers)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if not self.buffers:
            return super().batch_select_indices(indices)
        for buffer in self.buffers:  # the kept rows move to the buffer's first rows
            buffer[: self.length, : len(indices)] = buffer[: self.length, indices]
        self._view(len(indices))


def _cache(lm, room: int) -> DynamicCache:
    """transformers' dynamic cache for ``lm``, its full-attention layers holding ``room`` decoding positions past
    the prompt in place (sliding-window layers, which drop their oldest positions, stay transformers' own)."""
    cache = DynamicCache(config=lm.config.get_text_config(decoder=True))
    cache.layers = [_PositionMajorLayer(room) if type(layer) is DynamicLayer else layer for layer in cache.layers]
    return cache


class _Batch:
    """The rows still in the forward batch: their chunk indices, attention mask, next positions, whether each is
    still writing, and (for stop strings) their ids so far."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor):
        self.rows = torch.arange(input_ids.shape[0], device=input_ids.device)
        self.mask = attention_mask
        self.next_position = attention_mask.sum(-1)  # left-padded: a row's next position is its token count
        self.live = torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        self.ids = input_ids

    def keep(self, which: torch.Tensor, cache: DynamicCache) -> None:
        cache.batch_select_indices(which)
        self.rows, self.mask, self.next_position = self.rows[which], self.mask[which], self.next_position[which]
        self.live, self.ids = self.live[which], self.ids[which]


@torch.no_grad()
def sample(
    model, input_ids: torch.Tensor, attention_mask: torch.Tensor, params: SamplingParams, *, eos_ids, tokenizer=None
) -> list[list[int]]:
    """Each row's new tokens (left-padded ``input_ids``), ending with the token that ended it (an EOS, the one that
    completes a stop string) or at ``params.max_new_tokens``. Draws from torch's global generator."""
    lm = _causal_lm(model)
    width = input_ids.shape[0]
    cache = _cache(lm, params.max_new_tokens)
    process = warpers(params)
    stop = StopStringCriteria(tokenizer, list(params.stop)) if params.stop else None
    eos = torch.tensor(sorted(eos_ids), device=input_ids.device)
    # each row's tokens by step, -1 after its end: written on the device, read once at the end (a GPU waits for
    # the host only at the one count per step that decides whether to stop or compact)
    out = torch.full((width, params.max_new_tokens), -1, dtype=torch.long, device=input_ids.device)
    batch = _Batch(input_ids, attention_mask)
    logits = _prefill(model, input_ids, attention_mask, cache)
    for step in range(params.max_new_tokens):
        scores = process(batch.ids, logits[:, -1].to(copy=True, dtype=torch.float32))
        tokens = _draw(scores, batch.rows, width, greedy=params.temperature <= 0)
        if stop is not None:
            batch.ids = torch.cat([batch.ids, tokens[:, None]], dim=-1)
        out[batch.rows, step] = torch.where(batch.live, tokens, -1)
        ended = torch.isin(tokens, eos)
        if stop is not None:
            ended |= stop(batch.ids, scores)
        batch.live &= ~ended
        ended_rows = int((~batch.live).sum())
        if step + 1 == params.max_new_tokens or ended_rows == len(batch.live):
            break
        if ended_rows >= COMPACT_SHARE * len(batch.live):
            which = batch.live.nonzero().squeeze(1)
            batch.keep(which, cache)
            tokens = tokens[which]
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch.rows), 1)], dim=-1)
        logits = model(
            input_ids=tokens[:, None], attention_mask=batch.mask, position_ids=batch.next_position[:, None],
            past_key_values=cache, use_cache=True, logits_to_keep=1,
        ).logits  # fmt: skip
        batch.next_position = batch.next_position + 1
    return [[t for t in row if t >= 0] for row in out.tolist()]


def _prefill(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, cache: DynamicCache) -> torch.Tensor:
    """The prompts' forward, filling ``cache``; the last position's logits of every row. Rows that repeat the row
    before them (a prompt's G samples, which the engine lays out side by side) are computed once, and their cache
    and logits copied: on the demo the prompts are a quarter of the positions generation computes."""
    same = (input_ids[1:] == input_ids[:-1]).all(-1) & (attention_mask[1:] == attention_mask[:-1]).all(-1)
    firsts = torch.cat([same.new_ones(1), ~same]).nonzero().squeeze(1)  # each run of equal rows' first row
    ids, mask = input_ids[firsts], attention_mask[firsts]
    positions = (mask.cumsum(-1) - 1).masked_fill(mask == 0, 0)  # as generate derives them
    logits = model(
        input_ids=ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True,
        logits_to_keep=1,
    ).logits  # fmt: skip
    if len(firsts) == len(input_ids):
        return logits
    copies = torch.diff(torch.cat([firsts, firsts.new_tensor([len(input_ids)])]))
    each_row = torch.repeat_interleave(torch.arange(len(firsts), device=firsts.device), copies)
    cache.batch_select_indices(each_row)
    return logits[each_row]


def _draw(scores: torch.Tensor, rows: torch.Tensor, width: int, *, greedy: bool) -> torch.Tensor:
    """The next token of each batch row: the argmax, or one draw from softmax(scores) made as generate makes it,
    in one ``torch.multinomial`` over all ``width`` rows of the chunk (rows no longer in the batch draw from ones)."""
    if greedy:
        return scores.argmax(-1)
    probs = torch.softmax(scores, dim=-1)
    if len(rows) == width:
        return torch.multinomial(probs, num_samples=1).squeeze(1)
    full = probs.new_ones(width, probs.shape[-1])
    full[rows] = probs
    return torch.multinomial(full, num_samples=1).squeeze(1)[rows]
