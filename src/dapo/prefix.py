"""A shared prompt prefix (``train.share_prompt_prefix``): each distinct prompt of a micro-batch runs
through the decoder once, and the responses that follow it attend to that one copy of its keys and
values, instead of every row recomputing its prompt.

The decoder runs twice through Hugging Face's KV-cache interface. The prompt pass records each
layer's keys and values (after rotary embedding); they are gathered to the rows (one copy per row,
so autograd sums the gradients of all of a prompt's responses into its single pass); the response
pass then runs with them as ``past_key_values``, a 2D attention mask over [prompt + its padding |
response] and position ids that continue from each row's true prompt length. Transformers builds the
causal mask from the cache's length, so padding inside the cached part is masked like any other.

Both caches return the same states however often a layer runs, so activation checkpointing, which runs
each layer again in backward, recomputes exactly what the forward computed; transformers keeps such a
cache under checkpointing when the layer says it may (``_can_checkpoint_with_cache``).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer

SUPPORTED_ATTENTION = ("eager", "sdpa")  # checked against the unshared pass; masks with holes in the cached part


@dataclass
class SharedPrompts:
    """The distinct prompts of a micro-batch, right-padded, and which one each row continues."""

    input_ids: torch.Tensor  # (U, P): U distinct prompts, P the longest
    attention_mask: torch.Tensor  # (U, P)
    of_row: torch.Tensor  # (B,) long: the prompt of each row


class _RecordingLayer(DynamicLayer):
    """The prompt pass's cache layer: keeps the states it is given and attends over them alone.
    Replacing rather than appending makes a second run of the layer record the same states."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.keys, self.values, self.is_initialized = key_states, value_states, True
        return key_states, value_states

    def get_seq_length(self) -> int:
        return 0  # nothing comes before the prompt


class _PrefixLayer(DynamicLayer):
    """The response pass's cache layer: the prompt's states, which every run of the layer prepends to
    its own without storing them."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.is_initialized = keys, values, True
        self.dtype, self.device = keys.dtype, keys.device
        self.used = False

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self.used = True
        return torch.cat([self.keys, key_states], dim=-2), torch.cat([self.values, value_states], dim=-2)


def unsupported(lm) -> str | None:
    """Why ``lm`` cannot share prompts (a clause for an error message), or None when it can."""
    attention = getattr(lm.config, "_attn_implementation", None)
    if attention not in SUPPORTED_ATTENTION:
        return f"attention implementation {attention!r} (supported: {', '.join(SUPPORTED_ATTENTION)})"
    kinds = {type(layer).__name__ for layer in DynamicCache(config=lm.config).layers}
    if kinds - {DynamicLayer.__name__}:
        # sliding-window, chunked, linear-attention or hybrid layers keep other states than a full prefix
        return f"a cache with {', '.join(sorted(kinds - {DynamicLayer.__name__}))} layers (only full attention shares a prompt)"
    return None


@contextmanager
def _cache_kept_under_checkpointing(layers):
    """Gradient-checkpointed layers drop a cache unless they are told it reads the same states on the
    second run, which both caches here do."""
    flag = "_can_checkpoint_with_cache"
    before = [layer.__dict__.get(flag) for layer in layers]
    for layer in layers:
        setattr(layer, flag, True)
    try:
        yield
    finally:
        for layer, value in zip(layers, before):
            if value is None:
                delattr(layer, flag)
            else:
                setattr(layer, flag, value)


def prompt_then_responses(decoder, prompts: SharedPrompts, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                          position_ids: torch.Tensor) -> torch.Tensor:
    """The decoder's last hidden states over the prompts, then over the responses that follow them:
    (U * P + B * W, H), the prompts' (U, P) positions flattened first, then the responses' (B, W).

    ``input_ids`` (B, W) are the response tokens each row feeds, ``attention_mask`` (B, P + W) covers
    its prompt (with that prompt's padding masked) and them, ``position_ids`` (B, W) continue from the
    row's prompt length.
    """
    layers = list(decoder.layers)
    with _cache_kept_under_checkpointing(layers):
        recorder = Cache(layers=[_RecordingLayer() for _ in layers])
        prompt_hidden = decoder(input_ids=prompts.input_ids, attention_mask=prompts.attention_mask,
                                past_key_values=recorder).last_hidden_state  # (U, P, H)
        if any(layer.keys is None for layer in recorder.layers):
            raise RuntimeError("train.share_prompt_prefix=true: the decoder kept no keys and values from the prompt "
                               "pass (a model that does not use transformers' cache); set train.share_prompt_prefix=false")
        prefix = Cache(layers=[_PrefixLayer(layer.keys.index_select(0, prompts.of_row),
                                            layer.values.index_select(0, prompts.of_row)) for layer in recorder.layers])
        response_hidden = decoder(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                  past_key_values=prefix).last_hidden_state  # (B, W, H)
    if not all(layer.used for layer in prefix.layers):
        raise RuntimeError("train.share_prompt_prefix=true: the response pass did not attend to the cached prompt "
                           "(the decoder dropped its past_key_values); set train.share_prompt_prefix=false")
    return torch.cat([prompt_hidden.flatten(0, 1), response_hidden.flatten(0, 1)])
