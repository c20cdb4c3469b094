"""Hugging Face datasets as data: a dataset id read offline from a Hugging Face cache laid out here as `hf download
--repo-type dataset` lays it out (datasets--ORG--NAME/{refs, snapshots/<commit>, blobs}), a save_to_disk folder, and
a datasets.Dataset given to the Python API. Nothing downloads: HF_HUB_OFFLINE=1 throughout."""

import hashlib
import io
import json
import os
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import SMALL_OVERRIDES
from dapo import run_setup
from dapo.config import load_config
from dapo.data.files import DataError, read_data, rows_read
from dapo.evaluation import load_benchmark

datasets = pytest.importorskip("datasets")

REPO = Path(__file__).resolve().parent.parent
GSM8K = [json.loads(line) for line in (REPO / "data" / "gsm8k" / "train.jsonl").read_text().splitlines()[:10]]
GSM8K_TRUTHS = [row["answer"].rsplit("####", 1)[1].strip().replace(",", "") for row in GSM8K]
# open-r1's layout: a problem and its worked solution, the answer in the solution's last \boxed{}
OPEN_R1 = [
    {
        "problem": "Compute $\\frac{1}{2} + \\frac{1}{3}$.",
        "solution": "Over 6: $\\frac{3}{6} + \\frac{2}{6} = \\boxed{\\frac{5}{6}}$.",
    },
    {"problem": "Simplify $\\sqrt{50}$.", "solution": "$\\sqrt{50} = \\sqrt{25}\\sqrt{2} = \\boxed{5\\sqrt{2}}$"},
    {"problem": "What is $7 \\cdot 8$?", "solution": "Seven eights are $\\boxed{56}$."},
]  # fmt: skip
# the dataset card's YAML: the config main and its two splits, as openai/gsm8k's README declares them
CARD = """---
configs:
- config_name: main
  data_files:
  - split: train
    path: main/train-*
  - split: test
    path: main/test-*
---
# GSM8K
"""


def parquet_bytes(rows: list[dict]) -> bytes:
    buf = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), buf)
    return buf.getvalue()


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> Path:
    """openai/gsm8k (config main: 8 train rows, 2 test rows) as `hf download --repo-type dataset` caches it."""
    cache = tmp_path_factory.mktemp("hf-home") / "hub"
    repo = cache / "datasets--openai--gsm8k"
    snapshot = repo / "snapshots" / hashlib.sha1(b"gsm8k").hexdigest()
    files = {
        "README.md": CARD.encode(),
        "main/train-00000-of-00001.parquet": parquet_bytes(GSM8K[:8]),
        "main/test-00000-of-00001.parquet": parquet_bytes(GSM8K[8:]),
    }
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        (snapshot / name).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / name).symlink_to(os.path.relpath(blob, (snapshot / name).parent))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(snapshot.name)
    return cache


@pytest.fixture
def offline(hub_cache, tmp_path, monkeypatch):
    """HF_HUB_OFFLINE=1 and the caches at the one built here (and an empty datasets cache), in the environment and in
    the constants huggingface_hub and datasets read from it when first imported."""
    from huggingface_hub import constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hub_cache))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")
    return hub_cache


def test_a_dataset_id_reads_offline_from_the_hugging_face_cache(offline):
    train = read_data("openai/gsm8k:main:train", template="raw")
    assert [ex.ground_truth for ex in train.examples] == GSM8K_TRUTHS[:8]
    assert train.examples[0].prompt == GSM8K[0]["question"] and train.examples[0].ground_truth == "72"
    assert train.layout == "GSM8K's (question, answer after '####')" and train.named == ("dataset id", "openai/gsm8k")
    assert {ex.data_source for ex in train.examples} == {"openai/gsm8k"}
    # without a split in the id, the role's: train for training, test for evaluation
    assert [ex.ground_truth for ex in read_data("openai/gsm8k:main").examples] == GSM8K_TRUTHS[:8]
    bench, examples = load_benchmark("openai/gsm8k:main", template="raw")
    assert bench.name == "gsm8k" and [ex.ground_truth for ex in examples] == GSM8K_TRUTHS[8:]


def test_a_dataset_id_in_the_data_settings_names_its_layout_and_grader_at_start(offline):
    cfg = load_config("configs/demo.yaml", ["data.train_files=[openai/gsm8k:main:train]", "eval.benchmarks=[arith]"])
    train_sets = run_setup.setup_train_sets(cfg, None)
    assert len(train_sets[0].examples) == 8
    assert run_setup.data_lines(cfg, train_sets, [], None) == [
        "data openai/gsm8k:main:train: layout GSM8K's (question, answer after '####'), template dapo (data.template), "
        "grader gsm8k (from the dataset id 'openai/gsm8k'; set reward.grader to change it)"
    ]


def test_a_dataset_not_cached_a_split_not_there_and_no_datasets_library_are_one_line_each(offline, monkeypatch):
    with pytest.raises(DataError) as err:
        read_data("openai/gsm8k_other:main")
    assert str(err.value) == (
        f"openai/gsm8k_other:main: HF_HUB_OFFLINE=1 is set and neither the datasets cache "
        f"({datasets.config.HF_DATASETS_CACHE}) nor the Hugging Face cache ({offline}) holds it; load it once where "
        "there is network (python -c \"import datasets; datasets.load_dataset('openai/gsm8k_other', 'main')\", or "
        "`hf download --repo-type dataset openai/gsm8k_other`) and copy that cache here (or point HF_DATASETS_CACHE "
        "or HF_HUB_CACHE at it), or give a local file"
    )
    with pytest.raises(DataError, match=r"^openai/gsm8k:main:validation: no split 'validation'; it has train, test: "):
        read_data("openai/gsm8k:main:validation")
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed
    with pytest.raises(DataError) as err:
        read_data("openai/gsm8k:main")
    assert str(err.value) == (
        "openai/gsm8k:main: reading a Hugging Face dataset needs the datasets library: pip install 'dapo[datasets]'"
    )


def test_a_save_to_disk_folder_reads_its_split_and_is_named_by_the_folder(tmp_path):
    saved = tmp_path / "openr1_math"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(OPEN_R1), "test": datasets.Dataset.from_list(OPEN_R1[:1])}
    ).save_to_disk(str(saved))
    train = read_data(saved)
    assert [ex.ground_truth for ex in train.examples] == ["\\frac{5}{6}", "5\\sqrt{2}", "56"]
    assert train.layout == "NuminaMath's (problem, solution's last \\boxed{})"
    assert train.named == ("folder's name", "openr1_math")
    assert [ex.ground_truth for ex in read_data(saved, split="test").examples] == ["\\frac{5}{6}"]
    one = tmp_path / "one_split"
    datasets.Dataset.from_list(GSM8K).save_to_disk(str(one))
    assert [ex.ground_truth for ex in read_data(one).examples] == GSM8K_TRUTHS
    (tmp_path / "broken" / "dataset_dict.json").parent.mkdir()
    (tmp_path / "broken" / "dataset_dict.json").write_text("{}")
    with pytest.raises(DataError, match=r"broken: not a readable save_to_disk folder \(.*\); save it again$"):
        read_data(tmp_path / "broken")


def test_a_dataset_given_in_python_reads_as_a_list_of_rows_and_its_rows_choose_the_grader(tmp_path):
    chat = [
        {"prompt": [{"role": "user", "content": row["question"]}], "answer": truth}
        for row, truth in zip(GSM8K, GSM8K_TRUTHS)
    ]
    read = rows_read(datasets.Dataset.from_list(chat), name="train_data")
    assert read == rows_read(chat, name="train_data") and read.layout == "TRL's (prompt, answer)"
    hashed = rows_read(datasets.Dataset.from_list(GSM8K), name="train_data")
    assert [ex.ground_truth for ex in hashed.examples] == GSM8K_TRUTHS
    cfg = load_config("configs/demo.yaml", ["eval.benchmarks=[arith]"])
    assert run_setup.data_lines(cfg, run_setup.setup_train_sets(cfg, hashed), [], None) == [
        "data given to dapo.train: layout GSM8K's (question, answer after '####'), template dapo (data.template), "
        "grader gsm8k (reward.grader=auto: the data source 'train_data' names no known data set; its rows have "
        "GSM8K's '####' answers; set reward.grader to change it)"
    ]
    with pytest.raises(DataError, match=r"^train_data: a DatasetDict of the splits train: give one of them, e"):
        rows_read(datasets.DatasetDict({"train": datasets.Dataset.from_list(GSM8K)}), name="train_data")


def test_dapo_train_takes_a_dataset(tiny_model_dir, tmp_path, capsys):
    from dapo import train

    cfg = load_config(
        "demo",
        [f"model.path={tiny_model_dir}", f"run.dir={tmp_path}", *SMALL_OVERRIDES, "train.total_steps=1"],
    )
    rows = datasets.Dataset.from_list([{"problem": f"{a}+{a}=", "answer": str(2 * a)} for a in range(1, 5)])
    result = train(cfg, train_data=rows, eval_data=rows.select(range(2)))
    assert result.metrics["step"] == 1 and "eval/eval_data/avg@2" in result.metrics
    out = capsys.readouterr().out
    assert "data given to dapo.train: layout plain (problem, answer), template dapo (data.template)" in out
    assert "eval eval_data (given to dapo.train): layout plain (problem, answer)" in out
