"""scripts/make_base_model.py: its evaluation goes through the package's rollout engine and grader."""

import importlib.util
import json
import re
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from dapo.data import arith

REPO = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("make_base_model", REPO / "scripts" / "make_base_model.py")
make_base_model = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_base_model)


def test_greedy_accuracy_equals_plain_generate_and_a_hand_parse():
    """The script's accuracy (HF rollout engine + `arith` grader) agrees, for greedy decoding, with
    model.generate on each prompt alone and the last line read as 'Answer: <integer>'."""
    path = REPO / "assets" / "arith-base"
    model, tok = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    examples = arith.make_examples("test", 20, seed=0, difficulty="demo")
    right = 0
    with torch.no_grad():
        for e in examples:
            ids = torch.tensor([tok(e.prompt, add_special_tokens=False)["input_ids"]])
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=48)
            text = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
            m = re.fullmatch(r"Answer: (-?\d+)", text.strip().split("\n")[-1])
            right += bool(m) and int(m.group(1)) == int(e.ground_truth)
    got = make_base_model.accuracy(model, tok, examples, samples=1, do_sample=False, max_new_tokens=48, seed=0)
    assert right > 0  # a trained model: not all wrong (the shipped one is right on about 88%)
    assert got == right / len(examples)


def test_script_runs_end_to_end_with_tiny_sizes(tmp_path):
    out = tmp_path / "m"
    assert (
        make_base_model.main(
            [
                "--out",
                str(out),
                "--steps",
                "2",
                "--batch-size",
                "4",
                "--warmup",
                "1",
                "--hidden-size",
                "32",
                "--layers",
                "1",
                "--heads",
                "2",
                "--intermediate-size",
                "64",
                "--threads",
                "1",
                "--eval-problems",
                "3",
                "--eval-samples",
                "2",
                "--max-new-tokens",
                "8",
            ]
        )
        == 0
    )
    report = json.loads((out / "base_model_eval.json").read_text())
    assert report["held_out_problems"] == 3 and report["samples_per_problem"] == 2
    # 3 problems x 2 samples and 3 greedy answers: the accuracies are multiples of 1/6 and 1/3
    assert round(report["sampled_accuracy_T1"] * 6, 3) % 1 == 0 and round(report["greedy_accuracy"] * 3, 3) % 1 == 0
    assert AutoModelForCausalLM.from_pretrained(out).num_parameters() == report["parameters"]
