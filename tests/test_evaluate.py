"""Evaluation statistics against hand-computed values, and `dapo eval` end to end."""

import json
import math
from pathlib import Path

import pytest

from dapo.evaluation import bootstrap_ci, majority_accuracy, pass_at_k

REPO = Path(__file__).resolve().parents[1]


def test_pass_at_k_unbiased_estimator():
    # n=4 samples, c=1 correct: pass@1 = 1/4, pass@2 = 1 - C(3,2)/C(4,2) = 1 - 3/6
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 1, 4) == 1.0
    assert pass_at_k(4, 0, 4) == 0.0
    # n=32, c=8, k=4: 1 - C(24,4)/C(32,4)
    assert pass_at_k(32, 8, 4) == pytest.approx(1 - math.comb(24, 4) / math.comb(32, 4))
    assert pass_at_k(5, 4, 2) == 1.0  # fewer than k wrong samples: always passes
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 4)


def test_majority_vote_with_ties():
    assert majority_accuracy(["5", "5", "7"], [True, True, False]) == 1.0
    assert majority_accuracy(["5", "7", "7"], [True, False, False]) == 0.0
    # a tie between a right and a wrong answer scores the chance of picking the right one
    assert majority_accuracy(["5", "7"], [True, False]) == 0.5
    assert majority_accuracy(["5", "7", "9", "9", "5", "7"], [True, False, False, False, True, False]) == pytest.approx(
        1 / 3
    )
    # invalid predictions do not vote
    assert majority_accuracy(["[INVALID]", "[INVALID]", "5"], [False, False, True]) == 1.0
    assert majority_accuracy(["[INVALID]"], [False]) == 0.0


def test_bootstrap_interval_is_deterministic_under_a_seed():
    values = [((i * 37) % 101) / 100 for i in range(40)]
    a = bootstrap_ci(values, seed=3)
    assert a == bootstrap_ci(values, seed=3)
    assert a != bootstrap_ci(values, seed=4)
    lo, hi = a
    assert lo <= sum(values) / len(values) <= hi and 0.0 <= lo < hi <= 1.0
    assert bootstrap_ci([0.5] * 10, seed=0) == (0.5, 0.5)


def test_dapo_eval_end_to_end(tiny_model_dir, tmp_path, capsys):
    from dapo.cli import main

    bench = tmp_path / "mini.jsonl"
    rows = [{"problem": "2+3=", "answer": "5"}, {"problem": "4*2=", "answer": "8"}, {"problem": "9-1=", "answer": "8"}]
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out"
    code = main(
        [
            "eval",
            "--model",
            str(tiny_model_dir),
            f"eval.benchmarks=[{bench}]",
            "eval.n=4",
            "data.template=raw",
            "reward.grader=arith",
            "eval.max_response_tokens=8",
            "reward.num_workers=1",
            "--out",
            str(out),
            "model.device=cpu",
        ]
    )
    assert code == 0
    summary = json.loads((out / "eval.json").read_text())["mini"]
    assert summary["n"] == 4 and summary["num_problems"] == 3
    assert set(summary["pass_at"]) == {"1", "2", "4"}
    assert summary["pass_at"]["1"] == pytest.approx(summary["avg"])
    assert 0 <= summary["truncated_frac"] <= 1 and summary["mean_length"] <= 8
    problems = [json.loads(line) for line in (out / "mini.problems.jsonl").read_text().splitlines()]
    assert [p["ground_truth"] for p in problems] == ["5", "8", "8"]
    assert "| mini | 3 | 4 |" in (out / "eval.md").read_text()
    # every sample, one JSON line each, in problem-major order, with the verdicts the report counted
    path = out / "mini.responses.jsonl"
    printed = capsys.readouterr().out
    assert f"responses: {path}  (12 samples, one JSON line each)" in printed
    samples = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(samples) == 12
    assert set(samples[0]) == {
        "id",
        "sample",
        "prompt",
        "response",
        "extracted_answer",
        "ground_truth",
        "grader",
        "correct",
        "ungraded",
        "length_tokens",
        "truncated",
    }
    assert {s["grader"] for s in samples} == {"arith"}
    # which template and grader, and why: on the console before the samples, in eval.json and in eval.md
    said = (
        f"eval {bench}: layout plain (problem, answer), template raw (data.template), grader arith "
        "(reward.grader=arith)"
    )
    assert summary["grading"] == said and f"- {said}" in (out / "eval.md").read_text()
    assert not any(s["ungraded"] for s in samples) and summary["ungraded"] == 0
    assert [s["id"] for s in samples] == [p["id"] for p in problems for _ in range(4)]
    assert [s["sample"] for s in samples] == [0, 1, 2, 3] * 3
    assert [s["ground_truth"] for s in samples] == ["5"] * 4 + ["8"] * 8
    assert [sum(s["correct"] for s in samples[4 * i : 4 * i + 4]) for i in range(3)] == [
        p["num_correct"] for p in problems
    ]
    assert sum(s["correct"] for s in samples) / 12 == pytest.approx(summary["avg"])
    assert sum(s["length_tokens"] for s in samples) / 12 == pytest.approx(summary["mean_length"])
    assert sum(s["truncated"] for s in samples) / 12 == pytest.approx(summary["truncated_frac"])
    assert all(s["truncated"] == (s["length_tokens"] == 8) or not s["truncated"] for s in samples)
    # the prompt as the model saw it (this tokenizer has no chat template: the problem text as it is)
    assert [s["prompt"] for s in samples[::4]] == ["2+3=", "4*2=", "9-1="]
    assert printed.index(said) < printed.index("| mini | 3 | 4 |")
    # the response is the decoded sample and the extracted answer is what the arith grader reads from it
    from dapo.rewards.graders import grade

    for s in samples:
        g = grade(s["response"], s["ground_truth"], "arith")
        assert (g.pred, g.acc) == (s["extracted_answer"], s["correct"])


def test_dapo_eval_rejects_missing_model(tmp_path, capsys):
    from dapo.cli import main

    assert main(["eval", "--model", str(tmp_path / "nothing"), "eval.benchmarks=[arith]"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "config.json" in err and err.count("\n") == 1


def test_dapo_eval_of_a_missing_run_or_one_without_checkpoints_is_one_line_and_exit_2(tmp_path, capsys):
    from dapo.cli import main

    missing = tmp_path / "nonexistent"
    assert main(["eval", "--run", str(missing)]) == 2
    assert capsys.readouterr().err == (
        f"error: --run {missing} does not exist: give the directory a training run writes "
        "(<run.dir>/<run.name>, e.g. runs/demo), or a model directory with --model DIR\n"
    )
    (tmp_path / "file").write_text("")
    assert main(["eval", "--run", str(tmp_path / "file")]) == 2
    assert capsys.readouterr().err.startswith(f"error: --run {tmp_path / 'file'} is not a directory: ")
    started = tmp_path / "started"
    (started / "checkpoints" / "step_000001").mkdir(parents=True)  # no trainer_state.pt: not a checkpoint
    assert main(["eval", "--run", str(started), "eval.n=2"]) == 2
    assert capsys.readouterr().err == (
        f"error: --run {started} has no checkpoint (looked in {started / 'checkpoints'}): a run writes one every "
        "run.save_every steps and at its end; evaluate a model directory with --model DIR instead\n"
    )
    assert main(["eval", "eval.n=2"]) == 2
    assert capsys.readouterr().err == (
        "error: dapo eval: give --model DIR (a Hugging Face model directory or Hub id) or --run RUN_DIR (a run)\n"
    )


def test_dapo_eval_of_a_run_reads_its_config_and_reports_beside_its_checkpoints(tiny_model_dir, tmp_path):
    from dapo.cli import main
    from dapo.config import dump_yaml, load_config

    run = tmp_path / "run"
    ckpt = run / "checkpoints" / "step_000002"
    ckpt.mkdir(parents=True)
    (ckpt / "model").symlink_to(tiny_model_dir, target_is_directory=True)
    (ckpt / "trainer_state.pt").write_bytes(b"")  # what marks a complete checkpoint
    saved = load_config(
        "configs/demo.yaml",
        ["eval.num_problems=3", "eval.n=2", "reward.num_workers=1", "model.device=cpu", "eval.max_response_tokens=8"],
    )
    (run / "config.yaml").write_text(dump_yaml(saved))
    assert main(["eval", "--run", str(run), "eval.n=3"]) == 0
    summary = json.loads((run / "eval" / "step_000002" / "eval.json").read_text())["arith"]
    assert summary["n"] == 3 and summary["num_problems"] == 3 and summary["mean_length"] <= 8
    assert not (ckpt / "eval").exists()  # checkpoint rotation would delete it


def test_a_data_file_as_a_benchmark_is_named_and_graded_as_training_names_its_rows(tmp_path):
    """data/gsm8k/test.jsonl held out: its name says the split, so its folder names it (as for training rows): the
    metrics are eval/gsm8k/*, and reward.grader=auto grades it as GSM8K, not with the strict "Answer:" grader."""
    from dapo.evaluation import load_benchmark
    from dapo.rewards.graders import graders_for

    bench, examples = load_benchmark(str(REPO / "data" / "gsm8k" / "test.jsonl"), num_problems=3)
    assert bench.name == "gsm8k" and {ex.data_source for ex in examples} == {"gsm8k"}
    assert graders_for([ex.data_source for ex in examples]) == ["gsm8k"] * 3
    own = tmp_path / "mine.jsonl"
    own.write_text('{"problem": "1+1", "answer": "2"}\n')
    bench, examples = load_benchmark(str(own))
    assert bench.name == "mine" and examples[0].data_source == "mine"


def test_dapo_eval_caps_the_prompt_limit_to_the_model_and_drops_longer_prompts_with_a_count(
    tiny_model_dir, tmp_path, capsys
):
    from dapo.cli import main

    bench = tmp_path / "mixed.jsonl"
    long_problem = "Add these: " + " + ".join(["1"] * 200) + " ="  # 810 characters, a token each (byte tokenizer)
    rows = [
        {"problem": "2+3=", "answer": "5"},
        {"problem": long_problem, "answer": "200"},
        {"problem": "4*2=", "answer": "8"},
    ]
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = ["eval", "--model", str(tiny_model_dir), f"eval.benchmarks=[{bench}]", "eval.n=1", "data.template=raw"]
    args += ["eval.max_response_tokens=8", "reward.num_workers=1", "model.device=cpu", "--out", str(tmp_path / "out")]
    assert main(args) == 0
    out = capsys.readouterr().out
    # the tiny model holds 512 positions, 8 of them for the response
    assert (
        "data.max_prompt_tokens=2,048 capped at 504: the model holds 512 tokens, 8 of them for the response "
        f"(eval.max_response_tokens)\neval {bench}: 1 of 3 prompts are longer than 504 tokens; left out "
        "(data.overlong_prompts=drop)\n"
    ) in out
    summary = json.loads((tmp_path / "out" / "eval.json").read_text())["mixed"]
    assert summary["num_problems"] == 2
