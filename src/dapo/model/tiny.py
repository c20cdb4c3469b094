"""A tiny character-level tokenizer and Qwen2 model, built locally so nothing is downloaded.

The tokenizer has one token per byte (so one per character for ASCII text) and no merges: every
string round-trips exactly through encode/decode. The model is an ordinary ``Qwen2ForCausalLM``,
so the trainer and the rollout code treat it exactly like a real Hugging Face checkpoint.
"""

from __future__ import annotations

import os

import torch
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM
from transformers.convert_slow_tokenizer import bytes_to_unicode
from transformers.models.qwen2.tokenization_qwen2 import Qwen2Tokenizer

PAD_TOKEN = "<pad>"
EOS_TOKEN = "<eos>"
SPECIAL_TOKENS = (PAD_TOKEN, EOS_TOKEN)
MODEL_MAX_LENGTH = 512


def build_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level tokenizer without merges: ``<pad>``=0, ``<eos>``=1, then byte ``b`` has id ``b + 2``.

    It is a ``Qwen2Tokenizer`` (a ``tokenizers``-backed fast tokenizer) on purpose: for a
    checkpoint whose config says ``model_type: qwen2``, ``AutoTokenizer`` in transformers 5
    always rebuilds a ``Qwen2Tokenizer`` from the saved vocab and merges, replacing any custom
    pre-tokenizer or decoder. Building the same object here means the tokenizer used while
    training and the one loaded from disk behave identically.
    """
    byte_to_symbol = bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update((byte_to_symbol[b], len(SPECIAL_TOKENS) + b) for b in range(256))
    return Qwen2Tokenizer(
        vocab=vocab,
        merges=[],
        # Every byte has a token, so nothing is ever unknown.
        unk_token=None,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
        # Decoding must give back the exact text; the default clean-up rewrites " ." and the like.
        clean_up_tokenization_spaces=False,
        model_max_length=MODEL_MAX_LENGTH,
    )


def build_model(
    tokenizer,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    intermediate_size: int | None = None,
    max_position_embeddings: int = MODEL_MAX_LENGTH,
    seed: int | None = None,
) -> Qwen2ForCausalLM:
    """A freshly initialised ``Qwen2ForCausalLM`` sized for ``tokenizer``, with tied embeddings.

    ``intermediate_size`` defaults to ``4 * hidden_size``. ``seed`` fixes the initial weights
    without disturbing the caller's global torch RNG stream.
    """
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")
    if tokenizer.pad_token_id is None or tokenizer.eos_token_id is None:
        raise ValueError("tokenizer needs both a pad and an eos token; build it with build_tokenizer()")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size or 4 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        max_position_embeddings=max_position_embeddings,
        max_window_layers=num_layers,
        tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        use_sliding_window=False,
        sliding_window=None,
    )
    with torch.random.fork_rng(devices=[], enabled=seed is not None):  # a seed leaves the caller's stream alone
        if seed is not None:
            torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model


def save(model, tokenizer, path: str | os.PathLike) -> None:
    """Write a Hugging Face directory loadable with ``AutoModelForCausalLM``/``AutoTokenizer``."""
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


__all__ = [
    "EOS_TOKEN",
    "MODEL_MAX_LENGTH",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "build_model",
    "build_tokenizer",
    "save",
]
