"""The HF rollout engine on a tiny model: order, seeds, the length flag, weight updates."""

import torch

from dapo.policy import load_model_and_tokenizer
from dapo.rollout import SamplingParams, make_rollout
from dapo.config import RolloutConfig


def engine_for(model_dir):
    model, tok = load_model_and_tokenizer(model_dir)
    return make_rollout(RolloutConfig(backend="hf"), model, tok), tok


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
