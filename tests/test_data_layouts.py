"""The layouts people bring, read from real rows: GSM8K's as the Hub stores it, MATH's, open-r1's and NuminaMath's
solutions ending in \\boxed{}, TRL's prompt with answer, solution or a chat list; files as they come (.json holding
JSON Lines or one array, gzipped JSON, a folder of shards); every bad row at once; data.columns."""

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo.command_line import user_error
from dapo.config import ConfigError, load_config
from dapo.data.files import BadRows, DataError, load_examples, read_data, rows_read, source_origin
from dapo.data.layouts import AFTER_HASHES, AS_WRITTEN, BOXED
from dapo.data.prompts import apply_template

REPO = Path(__file__).resolve().parent.parent
GSM8K = [json.loads(line) for line in (REPO / "data" / "gsm8k" / "train.jsonl").read_text().splitlines()[:20]]
MATH500 = [json.loads(line) for line in (REPO / "data" / "math500" / "test.jsonl").read_text().splitlines()[:5]]
# open-r1 / NuminaMath: a MATH problem with its whole worked solution, the answer in its last \boxed{}
OPEN_R1 = [
    {
        "problem": "What is the sum of the interior angles of a convex hexagon, in degrees?",
        "solution": "A convex polygon with $n$ sides splits into $n-2$ triangles, so its angles sum to "
        "$(n-2) \\cdot 180^\\circ$. For a hexagon, $n = 6$: $4 \\cdot 180^\\circ = 720^\\circ$.\n\n"
        "The answer is $\\boxed{720}$.",
    },
    {
        "problem": "Compute $\\frac{1}{2} + \\frac{1}{3}$.",
        "solution": "Over the common denominator 6, $\\frac{1}{2} = \\frac{3}{6}$ and $\\frac{1}{3} = \\frac{2}{6}$, "
        "so the sum is $\\boxed{\\frac{5}{6}}$.",
    },
    {
        "problem": "Simplify $\\sqrt{50}$.",
        "solution": "First $\\sqrt{50} = \\sqrt{25}\\,\\sqrt{2}$ (we check $\\boxed{25 \\cdot 2 = 50}$ on the way).\n"
        "Since $\\sqrt{25} = 5$, this is $\\boxed{5\\sqrt{2}}$.",
    },
]


def hashes(row: dict) -> str:
    return row["answer"].rsplit("####", 1)[1].strip().replace(",", "")


def write_jsonl(path: Path, rows: list) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_gsm8k_as_the_hub_stores_it_is_named_by_its_folder_and_read_after_the_hashes(tmp_path):
    shard = tmp_path / "gsm8k" / "main" / "train-00000-of-00001.parquet"
    shard.parent.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(GSM8K), shard)
    pq.write_table(pa.Table.from_pylist(GSM8K[:4]), shard.parent / "test-00000-of-00001.parquet")
    read = read_data(shard, template="raw")
    assert [ex.ground_truth for ex in read.examples] == [hashes(r) for r in GSM8K]
    assert read.examples[0].ground_truth == "72" and read.examples[0].prompt == GSM8K[0]["question"]
    assert read.layout == "GSM8K's (question, answer after '####')" and read.read_as == AFTER_HASHES
    assert read.named == ("folder's name", "gsm8k") and {ex.data_source for ex in read.examples} == {"gsm8k"}
    # the folder of shards: the split asked for, by the files' names
    assert len(read_data(shard.parent, split="train").examples) == 20
    test = read_data(shard.parent, split="test")
    assert [ex.ground_truth for ex in test.examples] == ["72", "10", "5", "42"] and test.named[1] == "gsm8k"
    with pytest.raises(DataError, match=r"main: holds the splits test, train, not validation; give one file"):
        read_data(shard.parent, split="validation")
    # as a benchmark it is gsm8k too, its test split where it is given the folder
    from dapo.evaluation import load_benchmark

    for given in (shard.parent / "test-00000-of-00001.parquet", shard.parent):
        bench, examples = load_benchmark(str(given), template="raw")
        assert bench.name == "gsm8k" and [ex.ground_truth for ex in examples] == ["72", "10", "5", "42"]


@pytest.mark.parametrize(
    "name, folder",
    [
        ("train-00000-of-00004.parquet", "gsm8k/main"),
        ("train-00003-of-00004-5f8a1c2e.parquet", "gsm8k/data"),  # the Hub's older export, a hash at the end
        ("0000.parquet", "gsm8k/default/train"),  # the Hub's parquet conversion
        ("test.jsonl", "gsm8k"),
    ],
)
def test_a_shard_or_split_takes_its_name_from_the_first_folder_that_is_not_a_split_or_config(tmp_path, name, folder):
    path = tmp_path / folder / name
    path.parent.mkdir(parents=True)
    assert source_origin(path) == ("folder's name", "gsm8k")
    assert source_origin(tmp_path / "gsm8k_mine.parquet") == ("file's name", "gsm8k_mine")


def test_math_rows_take_their_answer_column_not_the_solution():
    read = read_data(REPO / "data" / "math500" / "test.jsonl", template="raw")
    first = read.examples[:5]
    assert [ex.ground_truth for ex in first] == [r["answer"] for r in MATH500]
    assert first[0].ground_truth == "\\left( 3, \\frac{\\pi}{2} \\right)" and first[0].prompt == MATH500[0]["problem"]
    assert read.layout == "plain (problem, answer)" and read.read_as == AS_WRITTEN and len(read.examples) == 500


def test_open_r1_rows_take_the_last_boxed_answer_of_their_solution(tmp_path):
    read = read_data(write_jsonl(tmp_path / "openr1.jsonl", OPEN_R1), template="raw")
    assert [ex.ground_truth for ex in read.examples] == ["720", "\\frac{5}{6}", "5\\sqrt{2}"]
    assert read.layout == "NuminaMath's (problem, solution's last \\boxed{})" and read.read_as == BOXED
    # the same problems asked as questions, one solved GSM8K's way
    rows = [{"question": r["problem"], "solution": r["solution"]} for r in OPEN_R1[:2]]
    rows.append({"question": GSM8K[1]["question"], "solution": GSM8K[1]["answer"]})
    asked = read_data(write_jsonl(tmp_path / "asked.jsonl", rows))
    assert [ex.ground_truth for ex in asked.examples] == ["720", "\\frac{5}{6}", "10"]


def test_a_solution_without_an_answer_in_it_is_a_bad_row(tmp_path):
    worked = {"problem": "What is 6 * 7?", "solution": "Six sevens are 42.\nSo it is forty-two."}
    path = write_jsonl(tmp_path / "open.jsonl", [OPEN_R1[0], worked])
    with pytest.raises(DataError) as err:
        read_data(path)
    assert str(err.value) == (
        f"{path}: row 2: field 'solution' has no \\boxed{{}} answer and no '####' line, and is more than a bare "
        "answer; each row needs 'problem' and a 'solution' ending in \\boxed{<answer>}, or give the answer in a "
        "column of its own (data.columns=[COLUMN=answer])"
    )


def test_trl_layouts_prompt_with_answer_solution_or_ground_truth_and_a_chat_list(tmp_path):
    answers = ["720", "\\frac{5}{6}", "5\\sqrt{2}"]
    trl_answer = [{"prompt": r["problem"], "answer": a} for r, a in zip(OPEN_R1, answers)]
    trl_solution = [{"prompt": r["problem"], "solution": r["solution"]} for r in OPEN_R1]
    bare = [{"prompt": r["problem"], "solution": a} for r, a in zip(OPEN_R1, answers)]  # trl-lib's DeepMath-103K
    truth = [{"prompt": r["problem"], "ground_truth": a} for r, a in zip(OPEN_R1, answers)]
    for rows, layout in [
        (trl_answer, "TRL's (prompt, answer)"),
        (trl_solution, "TRL's (prompt, solution's last \\boxed{})"),
        (bare, "TRL's (prompt, solution)"),
        (truth, "TRL's (prompt, ground_truth)"),
    ]:
        read = read_data(write_jsonl(tmp_path / "trl.jsonl", rows))
        assert read.layout == layout and [ex.ground_truth for ex in read.examples] == answers
        assert read.examples[1].prompt == apply_template(OPEN_R1[1]["problem"], "dapo")
    system = {"role": "system", "content": "You are a careful mathematician."}
    chat = [{"prompt": [system, {"role": "user", "content": r["question"]}], "answer": hashes(r)} for r in GSM8K[:3]]
    for read in (read_data(write_jsonl(tmp_path / "chat.jsonl", chat)), rows_read(chat, name="train_data")):
        assert [ex.ground_truth for ex in read.examples] == [
            "72",
            "10",
            "5",
        ] and read.layout == "TRL's (prompt, answer)"
        assert read.examples[0].messages() == [
            system,
            {"role": "user", "content": apply_template(GSM8K[0]["question"], "dapo")},
        ]


def test_json_lines_a_json_array_and_gzipped_json_read_as_the_jsonl(tmp_path):
    want = load_examples(write_jsonl(tmp_path / "gsm.jsonl", GSM8K))
    (tmp_path / "lines.json").write_text("".join(json.dumps(r) + "\n" for r in GSM8K))  # Dataset.to_json's
    (tmp_path / "array.json").write_text(json.dumps(GSM8K, indent=2))
    for name, text in [
        ("lines.jsonl.gz", "".join(json.dumps(r) + "\n" for r in GSM8K)),
        ("array.json.gz", json.dumps(GSM8K)),
    ]:
        with gzip.open(tmp_path / name, "wt", encoding="utf-8") as f:
            f.write(text)
    for name in ("lines.json", "array.json", "lines.jsonl.gz", "array.json.gz"):
        assert load_examples(tmp_path / name, data_source="gsm") == want, name
    (tmp_path / "broken.jsonl.gz").write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"broken.jsonl.gz: not a readable gzip file \(.*\); compress it again$"):
        load_examples(tmp_path / "broken.jsonl.gz")
    (tmp_path / "cut.json").write_text(json.dumps(GSM8K[:2])[:-5])
    with pytest.raises(
        DataError, match=r"cut.json: not valid JSON \(.*\); the file must be one JSON array of objects$"
    ):
        load_examples(tmp_path / "cut.json")


def test_a_folder_holding_only_folders_names_them(tmp_path):
    for config in ("main", "socratic"):
        write_jsonl(tmp_path / "gsm8k" / config / "train.jsonl", GSM8K[:2])
    with pytest.raises(DataError) as err:
        read_data(tmp_path / "gsm8k")
    assert str(err.value) == (
        f"{tmp_path / 'gsm8k'}: a folder holding no data files itself; give one of its folders: "
        f"{tmp_path / 'gsm8k' / 'main'}, {tmp_path / 'gsm8k' / 'socratic'}"
    )


def bad_file(tmp_path: Path, bad_rows: dict[int, dict]) -> Path:
    rows = [dict(r) for r in GSM8K[:12]] + [dict(r) for r in GSM8K[:20]] * (len(bad_rows) > 3)
    for row_no, row in bad_rows.items():
        rows[row_no - 1] = row
    return write_jsonl(tmp_path / "mine.jsonl", rows)


THREE_BAD = {
    4: {"question": GSM8K[3]["question"]},  # the answer column lost
    7: {"question": GSM8K[6]["question"], "answer": "She has 5 left."},  # no '####' line
    10: {"question": 17, "answer": GSM8K[9]["answer"]},  # a number where the question goes
}


def test_every_bad_row_is_named_at_once_with_how_many_there_are(tmp_path):
    path = bad_file(tmp_path, THREE_BAD)
    with pytest.raises(BadRows) as err:
        read_data(path)
    needs = "each row needs 'question' and an 'answer' ending in '#### <number>'"
    assert err.value.lines == [
        f"row 4: field 'answer' is missing; {needs}",
        f"row 7: field 'answer' has no '#### <number>' final line; {needs}",
        f"row 10: field 'question' must be a string, got int; {needs}",
    ]
    assert user_error(err.value) == "\n  ".join(
        [f"error: {path}: 3 bad rows of 12; fix them, or set data.on_bad_row=skip to leave them out", *err.value.lines]
    )
    skipped = read_data(path, on_bad_row="skip")
    assert len(skipped.examples) == 9 and skipped.skipped == 3 and skipped.rows == 12
    assert [ex.uid for ex in skipped.examples][2:5] == ["2", "4", "5"]  # rows 3, 5 and 6 kept


def test_past_ten_bad_rows_the_rest_are_counted(tmp_path):
    bad = {row_no: {"question": f"q{row_no}"} for row_no in range(1, 16)}
    with pytest.raises(BadRows) as err:
        read_data(bad_file(tmp_path, bad))
    assert len(err.value.lines) == 11 and err.value.lines[-1] == "... and 5 more"
    assert err.value.header.endswith(": 15 bad rows of 32; fix them, or set data.on_bad_row=skip to leave them out")
    # rows read before the first with a layout are checked against it once it is known, in their order
    needs = "each row needs 'question' and an 'answer' ending in '#### <number>'"
    assert err.value.lines[:10] == [f"row {n}: field 'answer' is missing; {needs}" for n in range(1, 11)]


def test_a_row_in_no_layout_names_the_layouts_and_the_nearest_with_the_columns_to_rename(tmp_path):
    alpaca = [{"instruction": r["question"], "output": hashes(r)} for r in GSM8K[:3]]
    path = write_jsonl(tmp_path / "alpaca.jsonl", alpaca)
    with pytest.raises(DataError) as err:
        read_data(path)
    message = str(err.value)
    assert message.startswith(
        f"{path}: row 1: cannot tell the layout from fields ['instruction', 'output']; dapo reads"
    )
    assert "NuminaMath's and open-r1's solution ending in \\boxed{}" in message
    assert message.endswith("nearest: plain (problem, answer); rename its columns, e.g. "
                            "data.columns=[instruction=problem,output=answer]")  # fmt: skip
    renamed = read_data(path, columns=["instruction=problem", "output=answer"])
    assert [ex.ground_truth for ex in renamed.examples] == ["72", "10", "5"]
    assert renamed.layout == "plain (problem <- instruction, answer <- output)"
    completions = [{"prompt": r["question"], "completion": r["answer"]} for r in GSM8K[:2]]
    with pytest.raises(DataError, match=r"nearest: TRL's \(prompt, answer\), but no answer column; rename its answer "
                       r"column, e.g. data.columns=\[completion=answer\]$"):  # fmt: skip
        read_data(write_jsonl(tmp_path / "completions.jsonl", completions))


def test_data_columns_is_checked_and_reaches_the_loader(tmp_path, tiny_model_dir):
    from conftest import small_config
    from dapo.data.train_sets import load_train_sets

    with pytest.raises(ConfigError, match=r"data.columns=\['instruction=task'\]: give THEIRS=OURS items, OURS one of "):
        load_config("configs/demo.yaml", ["data.columns=[instruction=task]"])
    path = write_jsonl(tmp_path / "alpaca.jsonl", [{"instruction": r["question"], "output": hashes(r)} for r in GSM8K])
    cfg = small_config(
        tmp_path, tiny_model_dir, f"data.train_files=[{path}]", "data.columns=[instruction=problem,output=answer]"
    )
    ((_, read),) = load_train_sets(cfg.data)
    assert len(read.examples) == 20 and read.layout == "plain (problem <- instruction, answer <- output)"


def test_a_missing_path_under_a_folder_that_is_here_is_a_path_not_a_dataset_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    with pytest.raises(DataError) as err:
        read_data("data/gsm8k_mine")
    assert str(err.value) == (
        "data/gsm8k_mine: no such file or folder, and not a Hugging Face dataset id (ORG/NAME[:CONFIG[:SPLIT]]); "
        "check the path (data files live under data/)"
    )
    from dapo.data import hub

    assert hub.is_dataset_id("openai/gsm8k:main:train") and not hub.is_dataset_id("data/gsm8k_mine")
    assert not hub.is_dataset_id("openai/gsm8k.jsonl")
