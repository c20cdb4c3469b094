"""The trainer's log-probs are those of the model's own forward, whatever it does after its LM head
(Granite's division, Cohere's scale, Gemma 2's soft cap); what it cannot reproduce, it refuses at start.
Also: dropout off in every pass unless model.keep_dropout, float16 refused, the shared prompt prefix's
rope and sliding-window rules."""

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    CohereConfig,
    Gemma2Config,
    GraniteConfig,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    Qwen2Config,
)

from conftest import make_policy, small_config
from dapo.config import ConfigError
from dapo.model import tiny as tiny_tokenizers
from dapo.model.loading import load_model_and_tokenizer
from dapo.model.logits import LogitTransform, UnsupportedModel, find_logit_transform
from dapo.model.logprobs import HeadLogProbs, ResponseLogProbs, token_logprobs
from dapo.model.micro_batch import make_micro_batch
from dapo.model.prefix import unsupported
from test_prefix import ROWS, synthetic_batch

COMMON = dict(
    vocab_size=258,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=1,
)
TEMPERATURE = 0.7


def tiny(config, attention="eager"):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attention).eval()


# the families whose forward changes the head's output, with the transform their config asks for
TRANSFORMED = {
    "granite": (GraniteConfig(**COMMON, logits_scaling=8.0), LogitTransform(scale=0.125)),
    "cohere": (CohereConfig(**COMMON, logit_scale=0.0625), LogitTransform(scale=0.0625)),
    "gemma2": (
        Gemma2Config(**COMMON, head_dim=16, final_logit_softcapping=3.0, sliding_window=256),
        LogitTransform(softcap=3.0),
    ),
    "llama": (LlamaConfig(**COMMON), LogitTransform()),
}


def own_forward_logprobs(lm, batch, rows, temperature):
    """(B, T) log-probs of the response tokens from log_softmax of the model's own forward logits."""
    seqs = [batch.prompt_ids[i] + batch.response_ids[i] for i in rows]
    ids = torch.zeros(len(rows), max(map(len, seqs)), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, seq in enumerate(seqs):
        ids[b, : len(seq)], mask[b, : len(seq)] = torch.tensor(seq), 1
    logp_all = torch.log_softmax(lm(input_ids=ids, attention_mask=mask).logits.float() / temperature, dim=-1)
    out = torch.zeros(len(rows), max(len(batch.response_ids[i]) for i in rows))
    for b, i in enumerate(rows):
        p, r = len(batch.prompt_ids[i]), len(batch.response_ids[i])
        targets = torch.tensor(batch.response_ids[i])[:, None]
        out[b, :r] = logp_all[b, p - 1 : p + r - 1].gather(-1, targets).squeeze(-1)
    return out


@pytest.mark.parametrize("family", list(TRANSFORMED))
def test_transform_is_read_off_the_model(family):
    config, expected = TRANSFORMED[family]
    assert find_logit_transform(tiny(config)) == expected


@pytest.mark.parametrize("family", list(TRANSFORMED))
@pytest.mark.parametrize("fused", [True, False], ids=["fused_head", "checkpointed_head"])
@pytest.mark.parametrize("shared", [False, True], ids=["unshared", "shared_prefix"])
def test_log_probs_and_gradient_are_the_models_own(family, fused, shared):
    lm = tiny(TRANSFORMED[family][0])
    batch = synthetic_batch()
    mb = make_micro_batch(batch, ROWS, 0, "cpu", share_prompts=shared)
    logprob_pass = ResponseLogProbs(lm, fused_head=fused)
    assert logprob_pass.fused_head is fused
    logp, _ = token_logprobs(logprob_pass, mb, temperature=TEMPERATURE, chunk_tokens=37)  # chunks end mid-row
    ref = own_forward_logprobs(lm, batch, ROWS, TEMPERATURE)
    assert (logp - ref).abs().max().item() < 1e-5
    weights = torch.randn(logp.shape, generator=torch.Generator().manual_seed(1))
    params = [p for p in lm.parameters()]
    grads = torch.autograd.grad((logp * weights).sum(), params, allow_unused=True)
    ref_grads = torch.autograd.grad((ref * weights).sum(), params, allow_unused=True)
    for g, r in zip(grads, ref_grads):
        if r is None:
            continue
        # float32 sums in another order: relative to the largest entry of that parameter's gradient
        assert (g - r).abs().max().item() <= 1e-5 * max(1.0, r.abs().max().item())


def test_the_transform_matters_on_these_models():
    """Without the transform the trainer would be far off: the differences the transform removes."""
    for family in ("granite", "cohere", "gemma2"):
        lm = tiny(TRANSFORMED[family][0])
        batch = synthetic_batch()
        mb = make_micro_batch(batch, ROWS, 0, "cpu")
        with torch.no_grad():
            plain, _ = token_logprobs(ResponseLogProbs(lm, LogitTransform()), mb, temperature=TEMPERATURE)
            ref = own_forward_logprobs(lm, batch, ROWS, TEMPERATURE)
        assert (plain - ref).abs().max().item() > 1e-3, family


@pytest.mark.parametrize(
    "transform", [LogitTransform(scale=0.125), LogitTransform(softcap=2.0), LogitTransform(scale=3.0, softcap=5.0)]
)
def test_head_log_probs_backward_is_autograds(transform):
    """HeadLogProbs' hand-written backward (soft cap included) against autograd through the plain formula, across
    chunks (float64 inputs; HeadLogProbs keeps its log-probs and log-sum-exp in float32)."""
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(11, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    weight = (torch.randn(19, 8, dtype=torch.float64, generator=gen) * 2).requires_grad_()
    targets = torch.randint(0, 19, (11,), generator=gen)

    def fused(h, weight):
        return HeadLogProbs.apply(h, weight, targets, 0.9, 4, False, transform)[0]

    def plain(h, weight):
        logits = transform(h @ weight.t()) / 0.9
        return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)

    torch.testing.assert_close(fused(h, weight), plain(h, weight).float(), rtol=1e-6, atol=1e-6)
    g = torch.randn(11, dtype=torch.float64, generator=gen)
    got = torch.autograd.grad((fused(h, weight) * g).sum(), (h, weight))
    want = torch.autograd.grad((plain(h, weight) * g).sum(), (h, weight))
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b.to(a.dtype), rtol=1e-5, atol=1e-6)


def test_a_transform_the_trainer_cannot_reproduce_is_refused():
    from transformers import LlamaForCausalLM

    class Shifted(LlamaForCausalLM):  # a per-token bias after the head: no soft cap or scale reproduces it
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits + torch.arange(out.logits.shape[-1], dtype=out.logits.dtype) * 0.01
            return out

    torch.manual_seed(0)
    lm = Shifted(LlamaConfig(**COMMON)).eval()
    with pytest.raises(UnsupportedModel, match="cannot reproduce"):
        find_logit_transform(lm)


def test_policy_refuses_at_start_with_one_line(tmp_path, tiny_model_dir, monkeypatch):
    from dapo.model import logits

    def refuse(lm, **_):
        raise UnsupportedModel("its forward changes the logits after the LM head in a way the trainer cannot reproduce")

    monkeypatch.setattr("dapo.model.logprobs.find_logit_transform", refuse)
    assert logits.find_logit_transform is not refuse
    cfg = small_config(tmp_path, tiny_model_dir)
    with pytest.raises(ConfigError) as err:
        make_policy(cfg)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"model.path={tiny_model_dir}: its forward changes the logits")


# ---- dropout -------------------------------------------------------------------------------------


def save_with_tokenizer(lm, path):
    lm.save_pretrained(path)
    tiny_tokenizers.build_tokenizer().save_pretrained(path)
    return path


@pytest.mark.parametrize("family", ["opt", "qwen2"])
def test_dropout_is_off_in_training_mode_unless_kept(tmp_path, family):
    if family == "opt":
        config = OPTConfig(
            vocab_size=258,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            word_embed_proj_dim=32,
            max_position_embeddings=128,
            dropout=0.3,
            attention_dropout=0.3,
            pad_token_id=0,
            bos_token_id=1,
            eos_token_id=1,
        )
    else:  # a dropout that attention reads as it runs (config.attention_dropout copied to the layer)
        config = Qwen2Config(**COMMON, attention_dropout=0.3)
    path = save_with_tokenizer(tiny(config), tmp_path / family)
    ids = torch.randint(2, 258, (2, 20), generator=torch.Generator().manual_seed(0))
    lm, _ = load_model_and_tokenizer(path)
    lm.train()
    with torch.no_grad():
        a, b = lm(input_ids=ids).logits, lm(input_ids=ids).logits
        lm.eval()
        c = lm(input_ids=ids).logits
    assert torch.equal(a, b) and torch.equal(a, c)
    kept, _ = load_model_and_tokenizer(path, keep_dropout=True)
    kept.train()
    with torch.no_grad():
        assert not torch.equal(kept(input_ids=ids).logits, kept(input_ids=ids).logits)


def test_a_checkpoint_keeps_the_models_dropout_settings(tmp_path):
    import json

    from dapo import checkpoint

    config = OPTConfig(
        vocab_size=258,
        hidden_size=32,
        ffn_dim=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        word_embed_proj_dim=32,
        max_position_embeddings=128,
        dropout=0.3,
        attention_dropout=0.2,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
    )
    path = save_with_tokenizer(tiny(config), tmp_path / "opt")
    lm, tokenizer = load_model_and_tokenizer(path)
    assert lm.config.dropout == 0.0 and lm.config.attention_dropout == 0.0  # off while training
    saved = checkpoint.save_checkpoint(
        tmp_path / "run", 1, model=lm, tokenizer=tokenizer, trainer_state={}, config_yaml="", keep=1
    )
    written = json.loads((saved / "model" / "config.json").read_text())
    assert (written["dropout"], written["attention_dropout"]) == (0.3, 0.2)  # the user's model as it came
    assert lm.config.dropout == 0.0


# ---- float16, and the shared prefix's rope and window rules ---------------------------------------


def test_float16_is_refused_pointing_to_bfloat16(tmp_path, tiny_model_dir):
    with pytest.raises(ConfigError, match=r"^model\.dtype=float16: .*use model\.dtype=bfloat16"):
        small_config(tmp_path, tiny_model_dir, "model.dtype=float16")


@pytest.mark.parametrize(
    "rope",
    [
        {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0},
        {
            "rope_type": "longrope",
            "short_factor": [1.0] * 8,
            "long_factor": [2.0] * 8,
            "factor": 2.0,
            "original_max_position_embeddings": 128,
            "rope_theta": 10000.0,
        },
    ],
)
def test_length_dependent_rope_cannot_share_prompts(rope):
    lm = tiny(LlamaConfig(**COMMON, rope_parameters=rope), "sdpa")
    assert unsupported(lm, 200) == (
        f"rope_type {rope['rope_type']!r}, whose frequencies depend on each pass's length "
        "(prompt and response passes would differ)"
    )
    assert (
        unsupported(
            tiny(
                LlamaConfig(**COMMON, rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}),
                "sdpa",
            ),
            200,
        )
        is None
    )


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_sliding_window_shares_prompts_when_every_sequence_fits(family):
    window = 200  # the synthetic batch's longest prompt + response is 143 + 40
    config = (
        MistralConfig(**COMMON, sliding_window=window)
        if family == "mistral"
        else Gemma2Config(**COMMON, head_dim=16, sliding_window=window)
    )
    lm = tiny(config)
    assert unsupported(lm, window) is None
    assert unsupported(lm, window + 1) == (
        f"sliding-window attention over {window} tokens, shorter than the longest "
        f"sequence (data.max_prompt_tokens + rollout.max_response_tokens = {window + 1})"
    )
    batch = synthetic_batch()
    with torch.no_grad():
        shared, _ = token_logprobs(lm, make_micro_batch(batch, ROWS, 0, "cpu", share_prompts=True), temperature=1.0)
        ref = own_forward_logprobs(lm, batch, ROWS, 1.0)
    assert (shared - ref).abs().max().item() < 1e-5


def test_policy_refuses_a_window_shorter_than_the_run(tmp_path):
    path = save_with_tokenizer(tiny(MistralConfig(**COMMON, sliding_window=64)), tmp_path / "mistral")
    cfg = small_config(tmp_path / "run", path, "train.share_prompt_prefix=true", "data.max_prompt_tokens=60")
    from dapo.model.policy import Policy

    with pytest.raises(
        ConfigError, match=r"^train.share_prompt_prefix=true: .* sliding-window attention over 64 tokens.* = 76\)"
    ):
        Policy(cfg.model, cfg.train, temperature=1.0, device=torch.device("cpu"), max_seq_tokens=60 + 16)
