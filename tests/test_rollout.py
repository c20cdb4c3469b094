"""The HF rollout engine on a tiny model: order, seeds, the length flag, weight updates."""

from pathlib import Path

import torch

from dapo.config import RolloutConfig
from dapo.model.loading import load_model_and_tokenizer
from dapo.rollout import SamplingParams
from dapo.rollout.build import engine_on

ROOT = Path(__file__).resolve().parents[1]


def engine_for(model_dir):
    model, tok = load_model_and_tokenizer(model_dir)
    return engine_on(RolloutConfig(backend="hf"), model, tok), tok


def test_prompt_major_order_and_length_flag(tiny_model_dir):
    engine, tok = engine_for(tiny_model_dir)
    prompts = [tok("1+2=")["input_ids"], tok("12*3-4=")["input_ids"], tok("7=")["input_ids"]]
    gen = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=6, seed=1))
    assert len(gen.response_ids) == 9
    # rows i*3..i*3+2 answer prompt i, even though the engine sorts prompts by length internally
    assert gen.prompt_ids == [p for p in prompts for _ in range(3)]
    eos = tok.eos_token_id
    for resp, trunc, text in zip(gen.response_ids, gen.truncated.tolist(), gen.texts):
        assert 1 <= len(resp) <= 6
        if trunc:  # hit the limit without EOS
            assert len(resp) == 6 and eos not in resp
        else:  # stopped: ends with exactly one EOS
            assert resp[-1] == eos and eos not in resp[:-1]
        assert text == tok.decode(resp, skip_special_tokens=True)
    # a random 2-layer model rarely emits EOS within 6 tokens
    assert gen.truncated.any()


def test_same_seed_same_samples_other_seed_differs(tiny_model_dir):
    engine, tok = engine_for(tiny_model_dir)
    prompts = [tok("3+4*5=")["input_ids"]] * 2
    a = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=8, seed=7))
    b = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=8, seed=7))
    c = engine.generate(prompts, SamplingParams(n=4, max_new_tokens=8, seed=8))
    assert a.response_ids == b.response_ids
    assert a.response_ids != c.response_ids
    # generation must not disturb the caller's RNG stream
    torch.manual_seed(0)
    x = torch.rand(1)
    torch.manual_seed(0)
    engine.generate(prompts, SamplingParams(n=1, max_new_tokens=4, seed=3))
    assert torch.equal(torch.rand(1), x)


def test_greedy_is_deterministic_and_identical_across_group(tiny_model_dir):
    engine, tok = engine_for(tiny_model_dir)
    gen = engine.generate([tok("9-2=")["input_ids"]], SamplingParams(n=3, temperature=0.0, max_new_tokens=5))
    assert gen.response_ids[0] == gen.response_ids[1] == gen.response_ids[2]


def test_update_weights_changes_generations(tiny_model_dir):
    trainer_model, tok = load_model_and_tokenizer(tiny_model_dir)
    engine, _ = engine_for(tiny_model_dir)  # a separate copy, as a remote engine would hold
    prompts = [tok("5*5=")["input_ids"]]
    params = SamplingParams(n=4, temperature=0.0, max_new_tokens=6)
    before = engine.generate(prompts, params).response_ids
    with torch.no_grad():
        for p in trainer_model.parameters():
            p.add_(torch.randn_like(p) * 0.5)
    engine.update_weights(trainer_model.named_parameters())
    for (name, p), (_, q) in zip(trainer_model.named_parameters(), engine.model.named_parameters()):
        assert torch.equal(p, q), name
    assert engine.generate(prompts, params).response_ids != before


def test_samples_come_from_the_full_distribution(tiny_model_dir):
    """top_k=0 and top_p=1 mean plain sampling: neither the checkpoint's generation_config.json
    (instruct models ship top_k, top_p, repetition_penalty there) nor library defaults may leak in."""
    engine, tok = engine_for(tiny_model_dir)
    engine.model.generation_config.top_k = 3
    engine.model.generation_config.top_p = 0.5
    engine.model.generation_config.repetition_penalty = 3.0
    prompt = tok("1+1=")["input_ids"]
    gen = engine.generate(
        [prompt], SamplingParams(n=3000, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=1, seed=0)
    )
    first = torch.tensor([r[0] for r in gen.response_ids])
    with torch.no_grad():
        probs = torch.softmax(engine.model(torch.tensor([prompt])).logits[0, -1].float(), -1)  # (V,)
    # a random model spreads its mass over the whole 258-token vocabulary
    assert len(set(first.tolist())) > 150
    empirical = torch.bincount(first, minlength=probs.numel()).float() / len(first)
    assert (empirical - probs).abs().sum() < 0.35  # total variation of 3000 samples over ~258 outcomes
    limited = engine.generate([prompt], SamplingParams(n=500, top_k=5, max_new_tokens=1, seed=0))
    assert len({r[0] for r in limited.response_ids}) <= 5


def test_eos_ids_on_the_real_smollm2_tokenizer(tiny_model_dir):
    """Both engines stop on eos_token_ids(model, tokenizer): generation_config's id(s), else the
    tokenizer's EOS. SmolLM2's tokenizer: <|im_end|> = 2 is EOS and pad, <|endoftext|> = 0."""
    from pathlib import Path
    from types import SimpleNamespace

    from transformers import AutoTokenizer, GenerationConfig

    from dapo.rollout.base import eos_token_ids
    from dapo.rollout.hf import HFRolloutEngine

    smol = AutoTokenizer.from_pretrained(Path(__file__).parent / "assets" / "smollm2-tokenizer")
    im_end, endoftext = smol.convert_tokens_to_ids(["<|im_end|>", "<|endoftext|>"])
    assert (im_end, endoftext) == (2, 0) and smol.eos_token_id == smol.pad_token_id == im_end

    def model(eos):
        return SimpleNamespace(generation_config=GenerationConfig(eos_token_id=eos))

    assert eos_token_ids(model([im_end, endoftext]), smol) == {2, 0}  # a list, as instruct models ship it
    assert eos_token_ids(model((endoftext,)), smol) == {0}
    assert eos_token_ids(model(endoftext), smol) == {0}  # the model's choice wins over the tokenizer's
    assert eos_token_ids(model(None), smol) == {2}  # none set: the tokenizer's
    assert eos_token_ids(SimpleNamespace(generation_config=None), smol) == {2}
    # the HF engine takes exactly these (the vLLM engine calls the same function)
    tiny, tok = load_model_and_tokenizer(tiny_model_dir)
    tiny.generation_config.eos_token_id = [im_end, endoftext]
    assert HFRolloutEngine(tiny, smol).eos_ids == {2, 0}
    tiny.generation_config.eos_token_id = None
    assert HFRolloutEngine(tiny, smol).eos_ids == {2} and HFRolloutEngine(tiny, tok).eos_ids == {tok.eos_token_id}


def test_ended_rows_leave_the_batch_with_generates_tokens():
    """Rows that end leave the forward batch (dapo.rollout.hf_decode), and every row still gets the tokens
    transformers' generate samples for the seed: same draws, warpers and forward inputs, over chunks of prompts of
    different lengths. A stop string ends its row at the token that completes it, where generate pads the row."""
    from dapo.rollout.hf import HFRolloutEngine

    model, tok = load_model_and_tokenizer(ROOT / "assets" / "arith-base")  # answers end at different lengths
    compacting = HFRolloutEngine(model, tok, max_batch_size=10)
    plain = HFRolloutEngine(model, tok, max_batch_size=10, compacting=False)
    assert compacting.compacting and not plain.compacting
    prompts = [tok(p)["input_ids"] for p in ("1+2=", "12*3-4=", "7=", "(5+6)*7-8=")]
    for params in (
        SamplingParams(n=6, max_new_tokens=24, seed=0),
        SamplingParams(n=6, temperature=0.7, top_p=0.9, max_new_tokens=24, seed=1),
        SamplingParams(n=6, top_k=5, max_new_tokens=24, seed=2),
        SamplingParams(n=2, temperature=0.0, max_new_tokens=24),
    ):
        a, b = compacting.generate(prompts, params), plain.generate(prompts, params)
        assert a.response_ids == b.response_ids and torch.equal(a.truncated, b.truncated)
        lengths = [len(r) for r in a.response_ids]
        assert min(lengths) < 24 and max(lengths) == 24  # rows ended at different steps: the batch shrank
    params = SamplingParams(n=6, max_new_tokens=24, seed=3, stop=("3",))
    a, b = compacting.generate(prompts, params), plain.generate(prompts, params)
    assert all(y[: len(x)] == x for x, y in zip(a.response_ids, b.response_ids))
    stopped = [r for r in a.response_ids if r[-1] != tok.eos_token_id and len(r) < 24]
    assert stopped and all(tok.decode(r).endswith("3") and tok.pad_token_id not in r for r in stopped)
