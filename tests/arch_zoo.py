"""Tiny random models of every family transformers' AutoModelForCausalLM builds (tests/test_arch_matrix.py).

``tiny_config(model_type)`` is the family's own config class at its defaults, shrunk: hidden 64, 2 layers,
4 heads, the tiny tokenizer's 258-token vocabulary, 4 experts (2 per token) for a mixture of experts, and,
for hybrids, a layer pattern holding each kind of layer the family has. ``NOT_BUILT`` names the families
that cannot be built here as a decoder-only causal LM, with the reason.
"""

from __future__ import annotations

import torch

# the sizes every family gets, where its config has the setting (names as transformers spells them)
TINY = dict(
    vocab_size=258,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=128,
    head_dim=16,
    max_position_embeddings=256,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=1,
    # mixtures of experts
    num_experts=4,
    num_local_experts=4,
    n_routed_experts=4,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    shared_expert_intermediate_size=32,
    n_shared_experts=1,
    n_group=1,
    topk_group=1,
    # multi-head latent attention (DeepSeek V2/V3 and their kin)
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=16,
    qk_nope_head_dim=16,
    v_head_dim=16,
    # sliding windows wider than every test sequence: the shared prefix is allowed (prefix.unsupported)
    sliding_window=64,
    # the encoder-decoder families' decoders, alone (their ForCausalLM is the decoder stack)
    d_model=64,
    decoder_layers=2,
    encoder_layers=1,
    decoder_attention_heads=4,
    encoder_attention_heads=4,
    decoder_ffn_dim=128,
    encoder_ffn_dim=128,
    # state-space and recurrent layers
    state_size=8,
    ssm_state_size=8,
    mamba_d_state=8,
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_head_dim=16,
    mamba_expand=2,
    mamba_n_groups=1,
    n_groups=1,
    rotary_dim=8,
    partial_rotary_factor=0.5,
    # Gemma 3n and 4's per-layer input embeddings
    vocab_size_per_layer_input=258,
    hidden_size_per_layer_input=8,
    # BERT-like families are causal LMs only as decoders
    is_decoder=True,
)

# per family: settings on top of TINY (a layer pattern with every kind of layer; what a family names otherwise)
MLA = dict(num_key_value_heads=4)  # multi-head latent attention: as many key/value heads as query heads
DROP = object()  # an OVERRIDES value: leave TINY's setting out (the family's default stands)
INDEXER = dict(
    indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=16, indexer_compress_ratio=4
)  # sparse attention
HYBRID = ["linear_attention", "full_attention"]  # a linear-attention or state-space layer, then attention
OVERRIDES: dict[str, dict] = {
    **{
        family: MLA
        for family in (
            "axk1",
            "axk2",
            "deepseek_v2",
            "deepseek_v3",
            "deepseek_v32",
            "glm4_moe_lite",
            "glm_moe_dsa",
            "kimi_linear",
            "longcat_flash",
            "minicpm3",
            "youtu",
        )
    },
    "bamba": dict(attn_layer_indices=[1]),
    "dbrx": dict(
        d_model=64,
        n_heads=4,
        n_layers=2,
        max_seq_len=256,
        attn_config={"kv_n_heads": 2, "rope_theta": 10000.0, "clip_qkv": 8.0},
        ffn_config={"ffn_hidden_size": 64, "moe_num_experts": 4, "moe_top_k": 2},
    ),
    "falcon_h1": dict(mamba_d_ssm=128),
    "gemma3n_text": dict(
        num_hidden_layers=4, layer_types=["sliding_attention", "full_attention"] * 2, num_kv_shared_layers=2
    ),
    "gemma4_text": dict(layer_types=["sliding_attention", "full_attention"], head_dim=DROP),
    "gemma4_unified_text": dict(layer_types=["sliding_attention", "full_attention"], head_dim=DROP),
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "granitemoehybrid": dict(layer_types=HYBRID),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    "kimi_linear": dict(layer_types=HYBRID),
    "lfm2": dict(full_attn_idxs=[1]),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "mamba2": dict(num_heads=8, head_dim=16, expand=2),
    "minimax": dict(layer_types=HYBRID),
    "olmo_hybrid": dict(layer_types=HYBRID),
    "prophetnet": dict(num_hidden_layers=DROP, num_decoder_layers=2, num_encoder_layers=1),
    "qwen3_next": dict(layer_types=HYBRID),
    "qwen3_5": dict(text_config={"layer_types": HYBRID}),
    "qwen3_5_moe": dict(text_config={"layer_types": HYBRID}),
    "qwen4_exp": dict(text_config={"layer_types": ["linear_attention", "indexed_attention"], **INDEXER}),
    "qwen3_5_text": dict(layer_types=HYBRID),
    "qwen3_5_moe_text": dict(layer_types=HYBRID),
    "qwen4_exp_text": dict(layer_types=["linear_attention", "indexed_attention"], **INDEXER),
    "cohere_compass_text": dict(layer_types=["sliding_attention", "full_attention"]),
    "roc_bert": dict(pronunciation_vocab_size=32, shape_vocab_size=32),
    "zamba": dict(layers_block_type=["hybrid", "hybrid"], head_dim=DROP),  # its hybrid layers share one transformer
    "zamba2": dict(layers_block_type=["linear_attention", "hybrid"], head_dim=DROP),
    "zaya": dict(num_experts_per_tok=1),
}

# families that cannot be built here as a decoder-only causal LM, and why
NOT_BUILT: dict[str, str] = {
    "emu3": "from_config builds it from the composite config, but the text config it saves does not load back with "
    "AutoModelForCausalLM",
    "mllama": "from_config builds it from the composite config, but the text config it saves does not load back with "
    "AutoModelForCausalLM",
    "blt": "Byte Latent Transformer: a patcher and local encoder/decoder around the global model, "
    "not one decoder stack",
    "cohere_compass_text": "its rotary embedding asks for per-layer-type rope parameters its config does not build",
    "kimi_linear": "its attention's head counts disagree at every tiny size tried (4 against 8 in sdpa)",
    "gemma3": "Gemma3ForConditionalGeneration: a vision tower; its text model is gemma3_text",
    "gemma3n": "needs timm for its vision tower; its text model is gemma3n_text",
    "gemma4_assistant": "a draft model run on another model's hidden states, not a causal LM of its own",
    "gemma4_unified_assistant": "a draft model run on another model's hidden states, not a causal LM of its own",
    "git": "GitForCausalLM: an image encoder in front of the text decoder",
    "got_ocr2": "GotOcr2ForConditionalGeneration: a vision tower",
    "musicgen": "an audio model: input ids are (batch x codebooks)",
    "musicgen_melody": "an audio model: input ids are (batch x codebooks)",
    "phi4_multimodal": "vision and audio encoders inside its causal LM (870M parameters at the smallest)",
    "reformer": "LSH/local attention needs sequence lengths that are multiples of its chunk length",
    "xlnet": "a permutation LM: its LM head model attends both ways unless given a permutation mask",
}

# no family's tiny model is larger than this (a default left large would be slow, or fill the memory)
MAX_PARAMETERS = 6_000_000


def tiny_config(model_type: str):
    """The family's config at its defaults with TINY's sizes where it has them, then its OVERRIDES."""
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    defaults = config_class()
    settings = {k: v for k, v in TINY.items() if _settable(defaults, k)}
    text = getattr(defaults, "text_config", None)
    if text is not None and text is not defaults:  # a composite config: its text model shrunk the same way
        settings["text_config"] = {k: v for k, v in TINY.items() if _settable(text, k)}
    for key, value in OVERRIDES.get(model_type, {}).items():
        if isinstance(value, dict) and isinstance(settings.get(key), dict):
            settings[key] = {**settings[key], **value}
        elif value is DROP:
            settings.pop(key, None)
        else:
            settings[key] = value
    return config_class(**settings)


def _settable(config, name: str) -> bool:
    try:
        getattr(config, name)
    except Exception:  # noqa: BLE001 - absent, or (Gemma 4) a per-layer setting the config will not read globally
        return False
    prop = getattr(type(config), name, None)
    return not (isinstance(prop, property) and prop.fset is None)


def parameter_count(config) -> int:
    """The model's parameters, counted without allocating them."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


# the families whose tiny config was counted within MAX_PARAMETERS, with the overrides counted (the matrix builds
# each family several times; counting builds the model once more, on the meta device)
_COUNTED: set[tuple[str, str]] = set()


def build(model_type: str, seed: int = 0):
    """The family's tiny causal LM, float32, random weights fixed by ``seed``."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(model_type)
    key = (model_type, repr(OVERRIDES.get(model_type)))
    if key not in _COUNTED:
        count = parameter_count(config)
        if count > MAX_PARAMETERS:
            raise ValueError(f"{model_type}: tiny config still has {count} parameters")
        _COUNTED.add(key)
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def save(lm, path) -> None:
    """A model directory as a user brings one: weights, config, the tiny byte tokenizer."""
    from dapo.model import tiny

    lm.save_pretrained(path)
    tiny.build_tokenizer().save_pretrained(path)
