"""The ablation study's looping base model: its warm-start data and the shipped weights."""

import importlib.util
import random
from pathlib import Path

from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo.data import arith
from dapo.rewards.numeric import grade_arith
from dapo.rollout.base import SamplingParams
from dapo.rollout.hf import HFRolloutEngine

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
    engine = HFRolloutEngine(model, tok)  # the training rollout path: its stop-vs-length flags
    examples = arith.make_examples("test", 40, seed=0, difficulty="demo")
    prompt_ids = [tok(e.prompt, add_special_tokens=False)["input_ids"] for e in examples]
    gen = engine.generate(prompt_ids, SamplingParams(n=4, temperature=1.0, max_new_tokens=32, seed=0))
    right = [grade_arith(text, examples[i // 4].ground_truth)[1] for i, text in enumerate(gen.texts)]
    truncated = gen.truncated.tolist()
    # 160 samples: about 16% truncated and 26% right at this scale (base_model_eval.json: 25.9%)
    assert 10 <= sum(truncated) <= 45 and 20 <= sum(right) <= 65, (sum(truncated), sum(right))
    # a loop that hits the limit has not written its answer, or only the start of it
    assert sum(r and t for r, t in zip(right, truncated)) <= 1
