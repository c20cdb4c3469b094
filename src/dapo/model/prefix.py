"""A shared prompt prefix (``train.share_prompt_prefix``): each distinct prompt of a micro-batch runs
through the decoder once, and the responses that follow it attend to that one copy of its keys and
values, instead of every row recomputing its prompt.

The decoder runs through Hugging Face's KV-cache interface. The prompt pass records each layer's
keys and values (after rotary embedding); they are gathered to the rows (one copy per row, so
autograd sums the gradients of all of a prompt's responses into its single pass); the response
passes then run with them as ``past_key_values``, a 2D attention mask over [prompt + its padding |
response] and position ids that continue from each row's true prompt length. Transformers builds the
causal mask from the cache's length, so padding inside the cached part is masked like any other.
Rows of a micro-batch go to response passes of similar width (``micro_batch.response_passes``), so a
group's short responses are not padded to its longest.

``micro_batch.shared_prompt_passes`` builds those tensors; this module runs them through the decoder
(``prompt_then_responses``) and says which models it can run them for (``unsupported``).

Both caches return the same states however often a layer runs, so activation checkpointing, which runs
each layer again in backward, recomputes exactly what the forward computed; transformers keeps such a
cache under checkpointing when the layer says it may (``_can_checkpoint_with_cache``).
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from dapo.algorithm.batch import RolloutBatch
from dapo.model.loading import decoder_layers, decoder_of
from dapo.model.micro_batch import SharedPrompts, make_micro_batch

# the attention implementations whose masks, with padding inside the cached prompt, are checked against the
# unshared pass (tests/test_prefix.py)
SUPPORTED_ATTENTION = ("eager", "sdpa")


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


# what the families name a decoder layer's attention over an encoder's output (BART, Whisper: "encoder_attn";
# BERT-like decoders: "crossattention")
CROSS_ATTENTION = ("encoder_attn", "crossattention", "cross_attention")

# rotary scalings whose frequencies depend on the length of the pass itself: the prompt pass and a response
# pass would rotate with different frequencies from the one pass over the whole sequence
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def _rope_types(config) -> set[str]:
    """Every rope type a config names (``rope_parameters``, or the older ``rope_scaling``; per layer type or not)."""
    found = set()
    for key in ("rope_parameters", "rope_scaling"):
        value = getattr(config, key, None)
        if not isinstance(value, dict):
            continue
        per_layer_type = [v for v in value.values() if isinstance(v, dict)]
        for params in per_layer_type or [value]:
            if kind := params.get("rope_type", params.get("type")):
                found.add(str(kind))
    return found


def unsupported(lm, max_seq_tokens: int | None = None) -> str | None:
    """Why ``lm`` cannot share prompts (a clause for an error message), or None when it can.
    ``max_seq_tokens``: the longest prompt + response of the run, which a sliding window must hold."""
    attention = getattr(lm.config, "_attn_implementation", None)
    if attention not in SUPPORTED_ATTENTION:
        return f"attention implementation {attention!r} (supported: {', '.join(SUPPORTED_ATTENTION)})"
    text_config = lm.config.get_text_config(decoder=True)
    decoder = decoder_of(lm)
    takes = inspect.signature(decoder.forward).parameters
    if "past_key_values" not in takes:
        return "a decoder that takes no past_key_values (a cache of its own kind, or none)"
    if "position_ids" not in takes:
        # learned or ALiBi positions counted from the cache's length, which includes a shorter prompt's padding
        return "a decoder that takes no position_ids (its positions would count the padding of shorter prompts)"
    if any(name.rsplit(".", 1)[-1] in CROSS_ATTENTION for name, _ in decoder.named_modules()):
        return "cross-attention layers (an encoder-decoder's decoder)"
    if getattr(text_config, "num_kv_shared_layers", 0):
        shared = text_config.num_kv_shared_layers
        return f"num_kv_shared_layers={shared} (layers that read other layers' cached keys and values)"
    if rope := sorted(_rope_types(text_config) & set(LENGTH_DEPENDENT_ROPE)):
        return (
            f"rope_type {rope[0]!r}, whose frequencies depend on each pass's length "
            "(prompt and response passes would differ)"
        )
    layers = DynamicCache(config=lm.config).layers
    kinds = {type(layer).__name__ for layer in layers}
    windowed = {DynamicSlidingWindowLayer.__name__}
    if kinds - {DynamicLayer.__name__} - windowed:
        # linear-attention, recurrent, indexed or hybrid layers keep other states than a full prefix
        others = ", ".join(sorted(kinds - {DynamicLayer.__name__} - windowed))
        return f"a cache with {others} layers (only attention shares a prompt)"
    windows = [layer.sliding_window for layer in layers if type(layer) is DynamicSlidingWindowLayer]
    if windows and (max_seq_tokens is None or max_seq_tokens > min(windows)):
        # within its window, sliding-window (or chunked) attention is full attention, which the prefix reproduces
        longest = "not known" if max_seq_tokens is None else max_seq_tokens
        return (
            f"sliding-window attention over {min(windows)} tokens, shorter than the longest sequence "
            f"(data.max_prompt_tokens + rollout.max_response_tokens = {longest})"
        )
    for layer in decoder_layers(decoder):
        checkpoint = getattr(layer, "_gradient_checkpointing_func", None)
        if (
            getattr(layer, "gradient_checkpointing", False)
            and getattr(checkpoint, "keywords", {}).get("use_reentrant") is not False
        ):
            # reentrant checkpointing passes gradients only to a layer's positional inputs, not to the cache
            return (
                "reentrant activation checkpointing (the cached prompt would get no gradient; use use_reentrant=False)"
            )
    return _probe(lm, decoder)


# the probe's largest difference from the unshared pass, relative to the largest hidden value, by weight dtype
PROBE_RTOL = {torch.float32: 1e-4, torch.bfloat16: 5e-2}


def _probe(lm, decoder) -> str | None:
    """Why two prompts of different lengths, shared, give other hidden states than one right-padded pass over
    each whole sequence, or None: what the checks above cannot see (a cache indexed past the layer count, a
    recurrent state kept outside the cache, positions counted from the cache's length) shows here."""
    # the probe's rows as the trainer lays them out, padded and shared (texts, uids and answers unused)
    prompts, responses = [[3, 4, 5, 6], [7, 8]], [[9, 10, 11], [12, 13, 14]]
    probe = RolloutBatch.of_responses(prompts, responses, group_size=2)
    weight = next(lm.parameters())
    padded = make_micro_batch(probe, [0, 1], 0, weight.device)
    shared = make_micro_batch(probe, [0, 1], 0, weight.device, share_prompts=True)
    was_training = lm.training
    lm.train(False)
    try:
        with torch.no_grad():
            whole = decoder(input_ids=padded.input_ids, attention_mask=padded.attention_mask).last_hidden_state
            whole = whole.flatten(0, 1)[padded.token_index].float()
            try:
                with torch.enable_grad():  # some forwards fail only under autograd (in-place writes into views)
                    parts = prompt_then_responses(decoder, shared.shared)[shared.token_index].float()
                    trainable = [p for p in decoder.parameters() if p.requires_grad][:1]
                    if trainable and parts.requires_grad:
                        torch.autograd.grad(parts.sum(), trainable, allow_unused=True)  # into no .grad
                parts = parts.detach()
            except Exception as err:  # noqa: BLE001 - any failure of the shared passes is a refusal at start
                first = str(err).splitlines()[0] if str(err) else ""
                return f"a decoder whose shared-prefix pass fails ({type(err).__name__}: {first[:120]})"
    finally:
        lm.train(was_training)
    off = float((parts - whole).abs().max() / whole.abs().max().clamp(min=1e-12))
    if off > PROBE_RTOL.get(weight.dtype, 1e-4):
        return (
            f"a decoder whose shared-prefix pass differs from one pass over each sequence ({off:.2g} of the largest "
            "hidden value on a probe)"
        )
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


def _embed_once(decoder, ids: list[torch.Tensor]) -> list[torch.Tensor]:
    """The input embeddings of every pass of a micro-batch, from one lookup: the embedding's backward
    builds a dense (V, H) gradient per call (113 MB for a 49k vocabulary at hidden 576, filled with
    zeros each time), so one call per micro-batch instead of one per pass."""
    flat = decoder.get_input_embeddings()(torch.cat([t.flatten() for t in ids]))
    return [e.view(*t.shape, -1) for e, t in zip(flat.split([t.numel() for t in ids]), ids)]


def prompt_then_responses(decoder, shared: SharedPrompts) -> torch.Tensor:
    """The decoder's last hidden states over the prompts, then over each response pass in turn, flattened:
    (U * P + sum of b * W, H)."""
    layers = decoder_layers(decoder)
    embeds = _embed_once(decoder, [shared.input_ids] + [part.input_ids for part in shared.responses])
    with _cache_kept_under_checkpointing(layers):
        recorder = Cache(layers=[_RecordingLayer() for _ in layers])
        hidden = [
            decoder(
                inputs_embeds=embeds[0], attention_mask=shared.attention_mask, past_key_values=recorder
            ).last_hidden_state
        ]  # (U, P, H)
        if any(layer.keys is None for layer in recorder.layers):
            raise RuntimeError(
                "train.share_prompt_prefix=true: the decoder kept no keys and values from the prompt "
                "pass (a model that does not use transformers' cache); set train.share_prompt_prefix=false"
            )
        for k, part in enumerate(shared.responses):
            prefix = Cache(
                layers=[
                    _PrefixLayer(
                        layer.keys.index_select(0, part.prompt_of_row), layer.values.index_select(0, part.prompt_of_row)
                    )
                    for layer in recorder.layers
                ]
            )
            hidden.append(
                decoder(
                    inputs_embeds=embeds[1 + k],
                    attention_mask=part.attention_mask,
                    position_ids=part.position_ids,
                    past_key_values=prefix,
                ).last_hidden_state
            )  # (b, W, H)
            if not all(layer.used for layer in prefix.layers):
                raise RuntimeError(
                    "train.share_prompt_prefix=true: the response pass did not attend to the cached "
                    "prompt (the decoder dropped its past_key_values); set train.share_prompt_prefix=false"
                )
    return torch.cat([h.flatten(0, 1) for h in hidden])
