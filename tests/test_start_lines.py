"""The line a run starts with for each of its data sets: the prompt template and the grader in force, and why."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from conftest import SMALL_OVERRIDES  # noqa: E402
from dapo import cli, run_setup  # noqa: E402
from dapo.config import load_config  # noqa: E402

ROWS = [{"problem": "1+1=", "answer": "2"}, {"problem": "2+3=", "answer": "5"}]


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def lines_of(*overrides: str, reward_fn=None) -> list[str]:
    cfg = load_config("configs/demo.yaml", list(overrides))
    train_sets = run_setup.setup_train_sets(cfg, None)
    return run_setup.data_lines(cfg, train_sets, run_setup.setup_eval_sets(cfg, None), reward_fn)


def test_each_file_says_its_template_and_the_grader_its_name_picked(tmp_path):
    gsm = write_rows(tmp_path / "gsm8k_x.jsonl", ROWS)
    mine = write_rows(tmp_path / "mine.jsonl", ROWS)
    split = write_rows(tmp_path / "math500" / "test.jsonl", ROWS)  # a split's name: the folder names the data set
    assert lines_of(f"data.train_files=[{gsm},{mine},{split}]", "data.template=raw", f"eval.benchmarks=[{mine}]") == [
        f"data {gsm}: layout plain (problem, answer), template raw (data.template), grader gsm8k (from the file's "
        "name 'gsm8k_x'; set reward.grader to change it)",
        f"data {mine}: layout plain (problem, answer), template raw (data.template), grader dapo (reward.grader=auto: "
        "the file's name 'mine' names no known data set; set reward.grader to change it)",
        f"data {split}: layout plain (problem, answer), template raw (data.template), grader math (from the folder's "
        "name 'math500'; set reward.grader to change it)",
        f"eval {mine}: layout plain (problem, answer), template raw (data.template), grader dapo (reward.grader=auto: "
        "the file's name 'mine' names no known data set; set reward.grader to change it)",
    ]


def test_rows_with_their_own_data_source_are_counted_by_source(tmp_path):
    dapo_rows = [
        {"prompt": f"{i}+1=", "reward_model": {"ground_truth": str(i + 1)}, "data_source": source}
        for i, source in enumerate(["math_dapo", "math_dapo", "math_dapo", "my_set"])
    ]
    no_source = {"prompt": "9+1=", "reward_model": {"ground_truth": "10"}}  # the file's name stands for it
    mixed = write_rows(tmp_path / "mixed.jsonl", [*dapo_rows, no_source])
    one = write_rows(tmp_path / "one.jsonl", dapo_rows[:2])
    assert lines_of(f"data.train_files=[{mixed},{one}]", "eval.benchmarks=[aime2024]") == [
        f"data {mixed}: layout DAPO's (prompt, reward_model.ground_truth), template dapo (data.template), graders by "
        "each row's data_source: math_dapo -> dapo (3 rows), "
        "my_set -> dapo (1 row, no known data set), mixed -> dapo (1 row, no known data set, the file's name) "
        "(reward.grader=auto; set reward.grader to change it)",
        f"data {one}: layout DAPO's (prompt, reward_model.ground_truth), template dapo (data.template), grader dapo "
        "(from the rows' data_source 'math_dapo'; set reward.grader to change it)",
        "eval aime2024: layout DAPO's (prompt, reward_model.ground_truth), template dapo (data.template), grader dapo "
        "(from the benchmark's name 'aime2024'; set reward.grader to change it)",
    ]


def test_an_explicit_grader_a_reward_function_and_the_built_in_task(tmp_path):
    mine = write_rows(tmp_path / "mine.jsonl", ROWS)
    assert lines_of(f"data.train_files=[{mine}]", "reward.grader=math") == [
        f"data {mine}: layout plain (problem, answer), template dapo (data.template), grader math (reward.grader=math)",
        "eval arith: built-in arith task, grader math (reward.grader=math)",
    ]
    assert lines_of() == [
        "data: built-in arith task, grader arith (reward.grader=auto)",
        "eval arith: built-in arith task, grader arith (reward.grader=auto)",
    ]
    assert lines_of(reward_fn=len) == [
        "data: built-in arith task, grader: your reward function",
        "eval arith: built-in arith task, grader: your reward function",
    ]


def test_dapo_train_prints_the_lines_at_start(tiny_model_dir, tmp_path, capsys):
    mine = write_rows(tmp_path / "mine.jsonl", ROWS * 2)
    code = cli.main(
        ["train", "configs/demo.yaml", f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'runs'}",
         *SMALL_OVERRIDES, "train.total_steps=1", f"data.train_files=[{mine}]"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0
    start = out.split("step 1")[0]  # before the first step's lines, whole (not wrapped at the terminal's width)
    assert (
        f"data {mine}: layout plain (problem, answer), template dapo (data.template), grader dapo (reward.grader=auto: "
        "the file's name 'mine' names no known data set; set reward.grader to change it)\n"
        "eval arith: built-in arith task, grader arith (reward.grader=auto)\n"
    ) in start


def test_a_python_callers_rows_are_named_as_given():
    from dapo.api import _benchmark, _examples

    cfg = load_config("configs/demo.yaml", ["data.template=raw"])
    train_sets = run_setup.setup_train_sets(cfg, _examples(ROWS, "train_data", cfg))
    assert run_setup.data_lines(cfg, train_sets, [_benchmark(ROWS, cfg)], None) == [
        "data given to dapo.train: layout plain (problem, answer), template raw (data.template), grader dapo "
        "(reward.grader=auto: the data source 'train_data' names no known data set; set reward.grader to change it)",
        "eval eval_data (given to dapo.train): layout plain (problem, answer), template raw (data.template), grader "
        "dapo (reward.grader=auto: the data source 'eval_data' names no known data set; set reward.grader to change "
        "it)",
    ]
