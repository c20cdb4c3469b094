"""The ablation study's looping base model: its warm-start data and the shipped weights."""

import importlib.util
import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo.rewards.numeric import grade_arith
from dapo.tasks import arith

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("make_base_model", REPO / "scripts" / "make_base_model.py")
make_base_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_base_model)


def test_ramble_repeats_the_result_line_before_the_answer():
    solution = arith.solution("7*5-2=")  # "35-2\n33\nAnswer: 33"
    assert make_base_model.ramble(solution, random.Random(0), 0.0) == solution
    looped = make_base_model.ramble(solution, random.Random(3), 0.9)
    lines = looped.split("\n")
    assert lines[0] == "35-2" and lines[-1] == "Answer: 33"
    assert set(lines[1:-1]) == {"33"} and len(lines) > 4  # only the result line repeats
    assert grade_arith(looped, "33")[:2] == (1.0, True)  # the repeats cost nothing but length
    # with the same seed the number of repeats follows the geometric law of the rate
    counts = [make_base_model.ramble(solution, random.Random(s), 0.7).count("\n") - 2 for s in range(4000)]
    assert abs(sum(counts) / len(counts) - 0.7 / 0.3) < 0.15


def test_shipped_loop_base_runs_past_the_limit_before_answering():
    path = REPO / "assets" / "arith-loop-base"
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    examples = arith.make_examples("test", 40, seed=0, difficulty="demo")
    enc = tok([e.prompt for e in examples], return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(0)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=32, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             num_return_sequences=4, pad_token_id=tok.pad_token_id)
    truncated, correct, truncated_right = 0, 0, 0
    for i, ids in enumerate(out[:, enc.input_ids.shape[1]:].tolist()):
        ended = tok.eos_token_id in ids
        text = tok.decode(ids[: ids.index(tok.eos_token_id)] if ended else ids, skip_special_tokens=True)
        truncated += not ended
        correct += ended and grade_arith(text, examples[i // 4].ground_truth)[1]
        # a loop that hits the limit has not written its answer, or only the start of it
        truncated_right += not ended and grade_arith(text, examples[i // 4].ground_truth)[1]
    # 160 samples: about 16% truncated and 26% right at this scale (base_model_eval.json: 25.9%)
    assert 10 <= truncated <= 45 and 20 <= correct <= 65, (truncated, correct)
    assert truncated_right <= 1
