"""A broken model directory stops `dapo train` and `dapo eval --model` in one line naming model.path, what is
missing or wrong and the fix, with exit code 2 (before, the libraries failed in a traceback, or in generate)."""

import json
import shutil

import pytest

from conftest import SMALL_OVERRIDES
from dapo import cli

FIX_CONFIG = "copy the model's config.json again from where the model came from"


def broken_copy(tiny_model_dir, root, *, drop=(), config=None, model_type=None):
    """The tiny model directory without the files ``drop``, with ``config`` as its config.json when given, or with
    its config's ``model_type`` changed."""
    path = root / "model"
    shutil.copytree(tiny_model_dir, path)
    for name in drop:
        (path / name).unlink()
    if config is not None:
        (path / "config.json").write_text(config)
    if model_type is not None:
        settings = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(settings | {"model_type": model_type}))
    return path


CASES = {
    "no tokenizer files": (
        {"drop": ("tokenizer.json", "tokenizer_config.json")},
        "model.path='{path}' has no tokenizer (tokenizer files in it: none); copy the model's tokenizer files "
        "(tokenizer.json and tokenizer_config.json, or the vocabulary files its tokenizer reads) into it from where "
        "the model came from",
    ),
    "no tokenizer files, a Llama config": (  # Llama's tokenizer class fails in its conversion, not with one token
        {"drop": ("tokenizer.json", "tokenizer_config.json"), "model_type": "llama"},
        "model.path='{path}' has no tokenizer (tokenizer files in it: none); copy the model's tokenizer files "
        "(tokenizer.json and tokenizer_config.json, or the vocabulary files its tokenizer reads) into it from where "
        "the model came from",
    ),
    "a tokenizer config without its vocabulary": (
        {"drop": ("tokenizer.json",)},
        "model.path='{path}' has no tokenizer (tokenizer files in it: tokenizer_config.json); copy the model's "
        "tokenizer files (tokenizer.json and tokenizer_config.json, or the vocabulary files its tokenizer reads) into "
        "it from where the model came from",
    ),
    "no weights": (
        {"drop": ("model.safetensors",)},
        "model.path='{path}' has no weights (no *.safetensors or pytorch_model*.bin file in it); copy the model's "
        "weight files into it",
    ),
    "an empty config.json": (
        {"config": ""},
        "model.path='{path}': its config.json is empty; " + FIX_CONFIG,
    ),
    "a config.json that is not JSON": (
        {"config": '{"model_type": "qwen2",'},
        "model.path='{path}': its config.json is not valid JSON (Expecting property name enclosed in double quotes "
        "at line 1, column 24); " + FIX_CONFIG,
    ),
    "a config.json without model_type": (
        {"config": json.dumps({"hidden_size": 32})},
        "model.path='{path}': its config.json has no model_type, so the model's architecture is unknown; " + FIX_CONFIG,
    ),
    "a config.json that is a list": (
        {"config": "[]"},
        "model.path='{path}': its config.json holds a JSON list, not an object of settings; " + FIX_CONFIG,
    ),
    "a model_type transformers does not know": (
        {"config": json.dumps({"model_type": "qwen99"})},
        "model.path='{path}': its config.json names model_type 'qwen99', an architecture transformers {version} "
        "does not know; install a transformers that does (pip install -U transformers), or check the model_type",
    ),
    "no config.json": (
        {"drop": ("config.json",)},
        "model.path='{path}' is not a Hugging Face model directory (no config.json in it); give the directory that "
        "holds the model's config.json, weights and tokenizer",
    ),
}


def expected(case: str, path) -> str:
    import transformers

    return "error: " + CASES[case][1].format(path=path, version=transformers.__version__) + "\n"


@pytest.mark.parametrize("case", CASES)
def test_dapo_train_stops_on_a_broken_model_directory_in_one_line(case, tiny_model_dir, tmp_path, capsys):
    path = broken_copy(tiny_model_dir, tmp_path, **CASES[case][0])
    runs = tmp_path / "runs"
    code = cli.main(["train", "configs/demo.yaml", f"model.path={path}", f"run.dir={runs}", *SMALL_OVERRIDES])
    assert (code, capsys.readouterr().err) == (2, expected(case, path))
    assert not runs.exists()


@pytest.mark.parametrize("case", ["no tokenizer files", "no weights", "an empty config.json"])
def test_dapo_eval_stops_on_a_broken_model_directory_in_one_line(case, tiny_model_dir, tmp_path, capsys):
    path = broken_copy(tiny_model_dir, tmp_path, **CASES[case][0])
    code = cli.main(["eval", "--model", str(path), "eval.benchmarks=[arith]", f"--out={tmp_path / 'eval'}"])
    assert (code, capsys.readouterr().err) == (2, expected(case, path))


def test_a_model_file_or_a_gguf_beside_no_config_says_what_to_give(tiny_model_dir, tmp_path, capsys):
    path = broken_copy(tiny_model_dir, tmp_path)
    weights = path / "model.safetensors"
    assert cli.main(["train", "configs/demo.yaml", f"model.path={weights}", *SMALL_OVERRIDES]) == 2
    assert capsys.readouterr().err == (
        f"error: model.path='{weights}' is a file, not a model directory; give the directory that holds the model's "
        "config.json, weights and tokenizer\n"
    )
    gguf = tmp_path / "q.gguf"
    gguf.write_bytes(b"GGUF")
    assert cli.main(["train", "configs/demo.yaml", f"model.path={gguf}", *SMALL_OVERRIDES]) == 2
    assert capsys.readouterr().err == (
        f"error: model.path='{gguf}' is a file, not a model directory; convert it with `dapo import-model {gguf} "
        "OUT_DIR` and give OUT_DIR\n"
    )
    (path / "config.json").unlink()
    shutil.move(gguf, path / "q.gguf")
    assert cli.main(["train", "configs/demo.yaml", f"model.path={path}", *SMALL_OVERRIDES]) == 2
    assert capsys.readouterr().err == (
        f"error: model.path='{path}' is not a Hugging Face model directory (no config.json in it); give the "
        "directory that holds the model's config.json, weights and tokenizer; or convert q.gguf with `dapo "
        "import-model` and give its OUT_DIR\n"
    )
