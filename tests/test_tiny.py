import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo.data import arith
from dapo.model import tiny

REPO = Path(__file__).resolve().parent.parent
BASE = REPO / "assets" / "arith-base"

TEXTS = [
    "7+3*4-2=7+12-2\n19-2\n17\nAnswer: 17",
    "  two  spaces\n\n\ttab, punctuation: ' . ,'s ",
    'Solve the following math problem step by step.\n\nRemember to put your answer on its own line after "Answer:".',
    "non-ASCII: é, 日本, ∑",
]


@pytest.fixture(scope="module")
def tokenizer():
    return tiny.build_tokenizer()


def test_tokenizer_round_trips_exactly_one_token_per_ascii_character(tokenizer):
    for text in TEXTS:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert tokenizer.decode(ids + [tokenizer.eos_token_id], skip_special_tokens=True) == text
    ascii_text = TEXTS[0]
    ids = tokenizer(ascii_text)["input_ids"]
    assert len(ids) == len(ascii_text)  # no BOS, no merges
    assert ids[:4] == [ord("7") + 2, ord("+") + 2, ord("3") + 2, ord("*") + 2]


def test_special_tokens(tokenizer):
    assert tokenizer.pad_token == "<pad>" and tokenizer.eos_token == "<eos>"
    assert tokenizer.pad_token_id == 0 and tokenizer.eos_token_id == 1
    assert tokenizer.chat_template is None
    assert len(tokenizer) == 258
    batch = tokenizer(["1+2=", "12*3+4="], padding=True)
    assert batch["input_ids"][0][:3] == [0, 0, 0]  # left padding, ready for generation
    assert batch["attention_mask"][0] == [0, 0, 0, 1, 1, 1, 1]


def test_model_shapes_and_config(tokenizer):
    model = tiny.build_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    assert model.config.tie_word_embeddings
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.config.pad_token_id == 0 and model.config.eos_token_id == 1
    assert model.generation_config.pad_token_id == 0 and model.generation_config.eos_token_id == 1
    ids = torch.tensor([[10, 11, 12, 13, 14], [20, 21, 22, 23, 24]])
    out = model(input_ids=ids, labels=ids)
    assert out.logits.shape == (2, 5, 258)
    assert 4.5 < out.loss.item() < 6.5  # about ln(258) = 5.55 before any training
    same = tiny.build_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=0)
    assert torch.equal(model.model.embed_tokens.weight, same.model.embed_tokens.weight)
    with pytest.raises(ValueError, match="divisible"):
        tiny.build_model(tokenizer, hidden_size=30, num_heads=4)


def test_save_load_round_trip(tokenizer, tmp_path):
    model = tiny.build_model(tokenizer, hidden_size=32, num_layers=2, num_heads=2, seed=1)
    tiny.save(model, tokenizer, tmp_path)
    for name in (
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ):
        assert (tmp_path / name).is_file()
    loaded_tok = AutoTokenizer.from_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for text in TEXTS:
        assert loaded_tok(text)["input_ids"] == tokenizer(text)["input_ids"]
        assert loaded_tok.decode(loaded_tok(text)["input_ids"]) == text
    assert (loaded_tok.pad_token_id, loaded_tok.eos_token_id) == (0, 1)
    ids = torch.tensor([[30, 31, 32]])
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, loaded(ids).logits)
    assert loaded.dtype == torch.float32


@pytest.mark.skipif(not (BASE / "config.json").exists(), reason="assets/arith-base not built")
def test_shipped_base_model_loads_generates_and_solves_some_problems():
    tok = AutoTokenizer.from_pretrained(BASE)
    model = AutoModelForCausalLM.from_pretrained(BASE)
    n_params = sum(p.numel() for p in model.parameters())
    assert 5e5 < n_params < 1.2e6
    assert (BASE / "model.safetensors").stat().st_size < 4.5e6
    examples = arith.make_examples("test", 48)
    enc = tok([e.prompt for e in examples], return_tensors="pt", padding=True)
    # Token-by-token decoding of a tiny model is many small ops; with other jobs on the cores,
    # extra intra-op threads spin-wait and make it many times slower, not faster.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            out = model.generate(**enc, do_sample=False, max_new_tokens=24)
    finally:
        torch.set_num_threads(threads)
    texts = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    finished = sum(t.split("\n")[-1].startswith("Answer: ") for t in texts)
    right = sum(t.split("\n")[-1] == f"Answer: {e.ground_truth}" for t, e in zip(texts, examples))
    assert finished >= 46  # the format is learnt
    assert right >= 32  # greedy decoding solves most held-out problems (about 88% when built)
    report = json.loads((BASE / "base_model_eval.json").read_text())
    assert 0.15 < report["sampled_accuracy_T1"] < report["greedy_accuracy"]
