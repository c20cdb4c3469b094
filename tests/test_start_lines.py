"""The line a run starts with for each of its data sets: the prompt template and the grader in force, and why."""

import json
import sys
from pathlib import Path

import pytest

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


GSM8K = [json.loads(line) for line in Path("data/gsm8k/train.jsonl").read_text().splitlines()[:12]]
MATH500 = [json.loads(line) for line in Path("data/math500/test.jsonl").read_text().splitlines()[:4]]


def test_where_the_name_says_no_data_set_the_rows_choose_the_grader(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    shard = tmp_path / "gsm8k" / "main" / "train-00000-of-00001.parquet"  # the Hub's layout: the folder names it
    shard.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(GSM8K), shard)
    hashes = write_rows(tmp_path / "school_stories.jsonl", GSM8K)  # a name of no data set, GSM8K's '####' answers
    latex = write_rows(
        tmp_path / "competition.jsonl", [{"problem": r["problem"], "answer": r["answer"]} for r in MATH500]
    )
    boxed = [{"problem": "Simplify $\\sqrt{8}$.", "solution": "$\\sqrt{8} = \\boxed{2\\sqrt{2}}$"}]
    solutions = write_rows(tmp_path / "openr1.jsonl", boxed)
    numbers = write_rows(tmp_path / "mine.jsonl", ROWS)
    files = ",".join(map(str, [shard, shard.parent, hashes, latex, solutions, numbers]))
    tail = "names no known data set;"
    assert lines_of(f"data.train_files=[{files}]", "eval.benchmarks=[arith]")[:-1] == [
        f"data {shard}: layout GSM8K's (question, answer after '####'), template dapo (data.template), grader gsm8k "
        "(from the folder's name 'gsm8k'; set reward.grader to change it)",
        f"data {shard.parent}: layout GSM8K's (question, answer after '####'), template dapo (data.template), grader "
        "gsm8k (from the folder's name 'gsm8k'; set reward.grader to change it)",
        f"data {hashes}: layout GSM8K's (question, answer after '####'), template dapo (data.template), grader gsm8k "
        f"(reward.grader=auto: the file's name 'school_stories' {tail} its rows have GSM8K's '####' answers; set "
        "reward.grader to change it)",
        f"data {latex}: layout plain (problem, answer), template dapo (data.template), grader math "
        f"(reward.grader=auto: the file's name 'competition' {tail} 2 of its 4 answers are written in LaTeX; set "
        "reward.grader to change it)",
        f"data {solutions}: layout NuminaMath's (problem, solution's last \\boxed{{}}), template dapo (data.template), "
        f"grader math (reward.grader=auto: the file's name 'openr1' {tail} its rows' answers are their solutions' "
        "last \\boxed{}; set reward.grader to change it)",
        f"data {numbers}: layout plain (problem, answer), template dapo (data.template), grader dapo "
        f"(reward.grader=auto: the file's name 'mine' {tail} set reward.grader to change it)",
    ]
    # and the pool grades each source by what its rows chose
    cfg = load_config("configs/demo.yaml", [f"data.train_files=[{files}]", "eval.benchmarks=[arith]"])
    chosen = run_setup.auto_grader(cfg, run_setup.setup_train_sets(cfg, None), [])
    assert chosen == {"school_stories": "gsm8k", "competition": "math", "openr1": "math"}


def test_bad_rows_skipped_are_counted_in_the_start_line_and_stopping_names_each(tmp_path, capsys):
    rows = [dict(r) for r in GSM8K]
    rows[3] = {"question": GSM8K[3]["question"]}  # the answer column lost
    rows[6] = {"question": GSM8K[6]["question"], "answer": "She has 5 left."}  # no '####' line
    rows[9] = {"question": 17, "answer": GSM8K[9]["answer"]}  # a number where the question goes
    path = write_rows(tmp_path / "gsm8k_mine.jsonl", rows)
    assert lines_of(f"data.train_files=[{path}]", "data.on_bad_row=skip", "eval.benchmarks=[arith]")[0] == (
        f"data {path}: layout GSM8K's (question, answer after '####'), 3 bad rows of 12 left out "
        "(data.on_bad_row=skip), template dapo (data.template), grader gsm8k (from the file's name 'gsm8k_mine'; set "
        "reward.grader to change it)"
    )
    assert cli.main(["train", "configs/demo.yaml", f"data.train_files=[{path}]", f"run.dir={tmp_path / 'r'}"]) == 2
    needs = "each row needs 'question' and an 'answer' ending in '#### <number>'"
    assert capsys.readouterr().err == (
        f"error: {path}: 3 bad rows of 12; fix them, or set data.on_bad_row=skip to leave them out\n"
        f"  row 4: field 'answer' is missing; {needs}\n"
        f"  row 7: field 'answer' has no '#### <number>' final line; {needs}\n"
        f"  row 10: field 'question' must be a string, got int; {needs}\n"
    )


def test_the_prompt_limit_is_capped_to_the_model_and_longer_prompts_are_dropped_with_a_count(
    tiny_model_dir, tmp_path, capsys
):
    # 1,610 characters, a token each under the tiny model's byte tokenizer
    long_row = {"problem": "Add these: " + " + ".join(["1"] * 400) + " =", "answer": "400"}
    rows = [*ROWS, {"problem": "3+4=", "answer": "7"}, {"problem": "6+1=", "answer": "7"}, long_row]
    path = write_rows(tmp_path / "mine.jsonl", rows)
    code = cli.main(
        ["train", "configs/demo.yaml", f"model.path={tiny_model_dir}", f"run.dir={tmp_path / 'runs'}",
         *SMALL_OVERRIDES, "train.total_steps=1", f"data.train_files=[{path}]"]
    )  # fmt: skip
    start = capsys.readouterr().out.split("step 1")[0]
    assert code == 0
    # the tiny model holds 512 positions, 16 of them kept for the response (SMALL_OVERRIDES)
    assert (
        "data.max_prompt_tokens=2,048 capped at 496: the model holds 512 tokens, 16 of them for the response "
        "(rollout.max_response_tokens)\n"
        f"data {path}: 1 of 5 prompts are longer than 496 tokens; left out (data.overlong_prompts=drop)\n"
    ) in start


def test_truncate_keeps_an_over_long_prompt_cut_and_says_so():
    from dapo.config import ConfigError
    from dapo.data.prompts import Example, fit_prompts, make_encoder, prompt_limit
    from dapo.model import tiny

    short, long = (Example(str(i), "x" * chars, "1", "mine") for i, chars in enumerate((10, 700)))
    encode = make_encoder(tiny.build_tokenizer(), 496)
    assert fit_prompts("data mine", [short, long], encode, "truncate") == (
        [short, long],
        "data mine: 1 of 2 prompts are longer than 496 tokens; their start is cut (data.overlong_prompts=truncate, "
        "as the reference; drop leaves them out)",
    )
    assert len(encode(long)) == 496 and encode(long) == encode(Example("2", "x" * 496, "1", "mine"))
    assert fit_prompts("data mine", [short], encode, "drop") == ([short], None)
    assert prompt_limit(2048, 4096, 2048, "rollout.max_response_tokens") == (2048, None)  # fits: no line
    with pytest.raises(ConfigError) as err:
        prompt_limit(2048, 512, 512, "rollout.max_response_tokens")
    assert str(err.value) == (
        "rollout.max_response_tokens=512: responses that long fill the model's context of 512 tokens and leave no "
        "room for a prompt; set rollout.max_response_tokens below 512"
    )
