import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from dapo.data.files import DataError, load_examples
from dapo.data.prompt_order import PromptOrder
from dapo.data.prompts import DAPO_PROMPT_PREFIX, DAPO_PROMPT_SUFFIX, Example, Message, apply_template, render_prompt

REPO = Path(__file__).resolve().parent.parent
AIME_DAPO = REPO / "data" / "aime2024" / "aime-2024.dapo.parquet"
DAPO_17K = REPO / "data" / "dapo_math_17k" / "dapo_math_17k.parquet"


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def dapo_row(problem, truth, index, templated=False):
    content = apply_template(problem, "dapo") if templated else problem
    return {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": content}],
        "ability": "MATH",
        "reward_model": {"ground_truth": truth, "style": "rule"},
        "extra_info": {"index": index, "raw_problem": problem},
    }


# --- template -------------------------------------------------------------------------------


def test_template_text_is_the_dapo_one():
    wrapped = apply_template("What is 2+2?", "dapo")
    assert wrapped == (
        "Solve the following math problem step by step. The last line of your response should be "
        "of the form Answer: $Answer (without quotes) where $Answer is the answer to the problem."
        '\n\nWhat is 2+2?\n\nRemember to put your answer on its own line after "Answer:".'
    )
    assert wrapped.startswith(DAPO_PROMPT_PREFIX) and wrapped.endswith(DAPO_PROMPT_SUFFIX)


def test_template_applied_once_and_raw_unchanged():
    once = apply_template("Find x.", "dapo")
    assert apply_template(once, "dapo") == once
    assert apply_template("Find x.", "raw") == "Find x."
    with pytest.raises(ValueError, match=r"unknown prompt template 'chatml'.*dapo.*raw"):
        apply_template("Find x.", "chatml")


# --- layouts ---------------------------------------------------------------------------------


def test_dapo_layout_parquet_chat_prompt_templates_only_when_missing(tmp_path):
    rows = [
        dapo_row("Bare problem one.", "12", 7),
        dapo_row("Already wrapped.", "5", 8, templated=True),
    ]
    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    ex = load_examples(path)
    assert [e.uid for e in ex] == ["7", "8"]
    assert [e.ground_truth for e in ex] == ["12", "5"]
    assert {e.data_source for e in ex} == {"math_dapo"}
    for e, problem in zip(ex, ["Bare problem one.", "Already wrapped."]):
        assert isinstance(e.prompt, tuple) and len(e.prompt) == 1
        assert e.prompt[0] == {"role": "user", "content": apply_template(problem, "dapo")}
        assert e.text().count("Solve the following math problem") == 1
    hash(ex[0])  # messages are frozen, so examples work as dict keys and set members


def test_dapo_layout_string_prompt_jsonl_and_raw_template(tmp_path):
    path = write_jsonl(
        tmp_path / "x.jsonl",
        [{"prompt": "Compute 3*3.", "reward_model": {"ground_truth": 9}, "data_source": "toy"}],
    )
    (e,) = load_examples(path, template="raw")
    assert e == Example(uid="0", prompt="Compute 3*3.", ground_truth="9", data_source="toy")
    (e,) = load_examples(path, data_source="override")
    assert e.data_source == "override" and e.prompt == apply_template("Compute 3*3.", "dapo")


def test_plain_layout_ids_numbers_and_default_source(tmp_path):
    folder = tmp_path / "amc2023"
    folder.mkdir()
    path = write_jsonl(
        folder / "test.jsonl",
        [
            {"id": 41, "problem": "P one", "answer": 27.0},
            {"id": 42, "problem": "P two", "answer": "025"},
            {"problem": "P three", "answer": 0.5},
        ],
    )
    ex = load_examples(path, template="raw")
    assert [(e.uid, e.prompt, e.ground_truth) for e in ex] == [
        ("41", "P one", "27"),
        ("42", "P two", "025"),
        ("2", "P three", "0.5"),
    ]
    assert {e.data_source for e in ex} == {"amc2023"}


def test_gsm8k_layout_takes_number_after_hashes(tmp_path):
    path = write_jsonl(
        tmp_path / "gsm.jsonl",
        [
            {"question": "Q1", "answer": "3 + 4 = <<3+4=7>>7\n#### 7"},
            {"question": "Q2", "answer": "big\n#### 1,234"},
        ],
    )
    ex = load_examples(path)
    assert [e.ground_truth for e in ex] == ["7", "1234"]
    assert ex[0].prompt == apply_template("Q1", "dapo")
    assert ex[0].data_source == "gsm"


def test_dedup_limit_and_no_dedup(tmp_path):
    rows = [dapo_row(f"Problem {i % 3}", str(i % 3), i % 3) for i in range(12)]
    path = tmp_path / "rep.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    ex = load_examples(path)
    assert [e.uid for e in ex] == ["0", "1", "2"]
    assert len(load_examples(path, dedup=False)) == 12
    assert [e.uid for e in load_examples(path, limit=2)] == ["0", "1"]
    with pytest.raises(ValueError, match="limit"):
        load_examples(path, limit=0)


def test_dedup_compares_final_prompt_text(tmp_path):
    # The same problem bare and pre-wrapped becomes the same final prompt: one example.
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [{"problem": "Same.", "answer": "1"}, {"problem": apply_template("Same.", "dapo"), "answer": "1"}],
    )
    assert len(load_examples(path)) == 1
    assert len(load_examples(path, template="raw")) == 2


# --- errors ----------------------------------------------------------------------------------


def test_missing_field_names_file_row_field_and_fix(tmp_path):
    rows = [dapo_row("ok", "1", 0), {"prompt": [{"role": "user", "content": "q"}], "reward_model": {}}]
    path = write_jsonl(tmp_path / "x.jsonl", rows)
    with pytest.raises(DataError) as info:
        load_examples(path)
    msg = str(info.value)
    assert msg.startswith(f"{path}: row 2: field 'reward_model.ground_truth' is missing; ")
    assert "each row needs" in msg and "\n" not in msg


def test_bad_json_line_names_row(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text('{"problem": "a", "answer": "1"}\n\n{"problem": "b", "answer": \n')
    with pytest.raises(DataError, match=rf"^{path}: row 3: not valid JSON .*each line must be one JSON object$"):
        load_examples(path)


@pytest.mark.parametrize(
    "line, fault",
    [
        ('{"problem": "1+1", "answer": 2', "Expecting ',' delimiter at line 3, column 31"),  # cut short: past its end
        ('{"problem": "1+1", "answer" "2"}', "Expecting ':' delimiter at line 3, column 29"),
    ],
)
def test_bad_json_names_the_line_and_column_of_the_fault_in_the_file(tmp_path, line, fault):
    path = tmp_path / "x.jsonl"
    path.write_text('{"problem": "a", "answer": "1"}\n\n' + line + "\n")
    with pytest.raises(DataError) as err:
        load_examples(path)
    assert str(err.value) == f"{path}: row 3: not valid JSON ({fault}); each line must be one JSON object"


@pytest.mark.parametrize(
    "row, field",
    [
        ({"problem": 12, "answer": "1"}, "problem"),
        ({"problem": "p", "answer": ["1"]}, "answer"),
        ({"problem": "p", "answer": True}, "answer"),
        ({"question": "q", "answer": "no hashes here"}, "answer"),
    ],
)
def test_wrong_types_name_the_field(tmp_path, row, field):
    first = {"problem": "p0", "answer": "0"} if "problem" in row else {"question": "q0", "answer": "#### 0"}
    path = write_jsonl(tmp_path / "t.jsonl", [first, row])
    with pytest.raises(DataError, match=rf"^{path}: row 2: field '{field}' "):
        load_examples(path)


def test_chat_prompt_of_wrong_shape(tmp_path):
    path = write_jsonl(
        tmp_path / "c.jsonl",
        [{"prompt": [{"role": "user"}], "reward_model": {"ground_truth": "1"}}],
    )
    with pytest.raises(DataError, match=r"row 1: field 'prompt\[0\]' must be a \{role, content\} message"):
        load_examples(path)
    path = write_jsonl(tmp_path / "n.jsonl", [{"prompt": 5, "reward_model": {"ground_truth": "1"}}])
    with pytest.raises(DataError, match=r"row 1: field 'prompt' must be a string or a non-empty list"):
        load_examples(path)


def test_unknown_layout_extension_empty_and_missing_file(tmp_path):
    path = write_jsonl(tmp_path / "u.jsonl", [{"text": "hello"}])
    with pytest.raises(DataError, match=r"row 1: cannot tell the layout from fields \['text'\]"):
        load_examples(path)
    csv = tmp_path / "a.csv"
    csv.write_text("problem,answer\n")
    with pytest.raises(DataError, match=r"unsupported file type '.csv'; use a .jsonl, .json or .parquet file"):
        load_examples(csv)
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n")
    with pytest.raises(DataError, match="no examples"):
        load_examples(empty)
    with pytest.raises(DataError, match="no such file"):
        load_examples(tmp_path / "missing.jsonl")


# --- hostile rows: one-line errors, bounded cost ----------------------------------------------


def test_a_row_over_max_row_chars_is_refused_before_parsing(tmp_path):
    path = write_jsonl(
        tmp_path / "big.jsonl", [{"problem": "p", "answer": "1"}, {"problem": "x" * 5000, "answer": "2"}]
    )
    with pytest.raises(DataError) as info:
        load_examples(path, max_row_chars=4000)
    assert str(info.value) == (
        f"{path}: row 2: longer than data.max_row_chars=4,000 characters; "
        "shorten or drop the row, or raise data.max_row_chars"
    )
    assert len(load_examples(path, max_row_chars=6000)) == 2
    table = pa.table({"problem": ["p", "y" * 5000], "answer": ["1", "2"]})
    pq.write_table(table, tmp_path / "big.parquet")
    with pytest.raises(DataError, match=r"big.parquet: row 2: longer than data.max_row_chars=4,000"):
        load_examples(tmp_path / "big.parquet", max_row_chars=4000)


def test_the_row_limit_is_a_setting_that_reaches_the_loader(tmp_path, tiny_model_dir):
    from conftest import small_config
    from dapo.data.train_sets import load_train_examples

    path = write_jsonl(tmp_path / "big.jsonl", [{"problem": "x" * 3000, "answer": "1"}])
    cfg = small_config(tmp_path, tiny_model_dir, f"data.train_files=[{path}]", "data.max_row_chars=2000")
    with pytest.raises(DataError, match=r"row 1: longer than data.max_row_chars=2,000"):
        load_train_examples(cfg.data)
    assert small_config(tmp_path, tiny_model_dir).data.max_row_chars == 1_000_000


@pytest.mark.parametrize(
    "line, message",
    [
        ('{"problem": "p", "answer": ' + "[" * 100_000 + "]" * 100_000 + "}", "row 1: JSON nested too deeply to read"),
        (
            '{"problem": "p", "answer": ' + "9" * 5000 + "}",
            "row 1: a number with more than 4300 digits; write it as a string",
        ),
    ],
)
def test_json_python_cannot_read_is_a_one_line_error(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(DataError) as info:
        load_examples(path)
    assert message in str(info.value) and "\n" not in str(info.value)


@pytest.mark.parametrize(
    "row, field",
    [
        ({"problem": "p", "answer": "2\x00"}, "answer"),
        ({"problem": "what is 1+1?\x00", "answer": "2"}, "problem"),
        (
            {"prompt": [{"role": "user", "content": "q\x00"}], "reward_model": {"ground_truth": "2"}},
            "prompt[0].content",
        ),
        ({"prompt": "q", "reward_model": {"ground_truth": "2\x00"}}, "reward_model.ground_truth"),
        ({"question": "q", "answer": "so #### 2\x00"}, "answer"),
    ],
)
def test_nul_characters_are_refused(tmp_path, row, field):
    path = write_jsonl(tmp_path / "nul.jsonl", [row])
    with pytest.raises(DataError) as info:
        load_examples(path)
    assert (
        str(info.value) == f"{path}: row 1: field '{field}' contains a NUL character (\\x00); remove it from the file"
    )


def test_a_huge_prompt_is_cut_before_it_is_tokenised(tiny_model_dir):
    from dapo.data.prompts import make_encoder
    from dapo.model.loading import load_model_and_tokenizer

    _, tokenizer = load_model_and_tokenizer(tiny_model_dir)
    seen: list[int] = []

    class Recording:  # the tokenizer, noting how much text it was given
        def __getattr__(self, name):
            return getattr(tokenizer, name)

        def __call__(self, texts, **kwargs):
            seen.extend(map(len, texts))
            return tokenizer(texts, **kwargs)

    longest = max(map(len, tokenizer.get_vocab()))
    encode = make_encoder(Recording(), max_prompt_tokens=64)
    huge = Example("0", "12+7*3=? " * 2_000_000, "33", "s")  # 18 MB of text
    ids = encode(huge)
    assert len(ids) == 64 and seen == [(64 + 16) * longest]
    # the cut changes nothing: a prompt short enough to tokenise whole gives the same last tokens
    moderate = Example("1", "12+7*3=? " * 2_000, "33", "s")
    full = tokenizer(render_prompt(moderate, tokenizer), add_special_tokens=not tokenizer.chat_template)["input_ids"]
    assert encode(moderate) == full[-64:]


@pytest.mark.parametrize("which", ["tiny", "smollm2"])
def test_prompts_encoded_together_are_the_ids_of_each_encoded_alone(tiny_model_dir, which):
    """fit_prompts tokenises a data set in one batch call: the same ids, and the same cut, as one call per prompt,
    on a tokenizer without a chat template and on SmolLM2-135M-Instruct's with its own."""
    from transformers import AutoTokenizer

    from dapo.data.prompts import fit_prompts, make_encoder

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir if which == "tiny" else "tests/assets/smollm2-tokenizer")
    examples = [Example(str(i), f"What is {i} + {i * 7}? " * (1 + i % 9), str(8 * i), "s") for i in range(40)]
    alone = make_encoder(tokenizer, max_prompt_tokens=48)
    want = [(alone(ex), alone.cut(ex)) for ex in examples]
    together = make_encoder(tokenizer, max_prompt_tokens=48)
    kept, line = fit_prompts("data", examples, together, "truncate")
    assert len(together.cache) == 40 and [(together(ex), together.cut(ex)) for ex in examples] == want
    over = sum(cut for _, cut in want)
    assert 0 < over < 40 and line.startswith(f"data: {over} of 40 prompts are longer than 48 tokens")


# --- render_prompt ---------------------------------------------------------------------------


class _ChatTok:
    chat_template = "x"

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        assert add_generation_prompt is True and tokenize is False
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


class _PlainTok:
    chat_template = None


def test_render_prompt_with_and_without_chat_template():
    chat = Example("0", (Message("system", "Be brief."), Message("user", "Q?")), "1", "s")
    plain = Example("1", "7+3=", "10", "arith")
    assert render_prompt(chat, _ChatTok()) == "<system>Be brief.<user>Q?<assistant>"
    assert render_prompt(plain, _ChatTok()) == "<user>7+3=<assistant>"
    assert render_prompt(plain, _PlainTok()) == "7+3="
    assert render_prompt(chat, _PlainTok()) == "Q?"


def test_message_is_frozen():
    m = Message("user", "hi")
    with pytest.raises(TypeError):
        m["content"] = "changed"
    assert m == {"role": "user", "content": "hi"} and json.loads(json.dumps(m)) == m


# --- sampler ---------------------------------------------------------------------------------


def _examples(n):
    return [Example(str(i), f"p{i}", str(i), "t") for i in range(n)]


def test_sampler_is_deterministic_and_seed_dependent():
    ex = _examples(50)
    a = [e.uid for e in PromptOrder(ex, seed=3).next(40)]
    b = [e.uid for e in PromptOrder(ex, seed=3).next(40)]
    c = [e.uid for e in PromptOrder(ex, seed=4).next(40)]
    assert a == b and a != c
    assert a != [str(i) for i in range(40)]  # shuffled
    assert [e.uid for e in PromptOrder(ex, seed=3, shuffle=False).next(5)] == ["0", "1", "2", "3", "4"]


def test_sampler_crosses_epochs_covering_each_once_per_epoch():
    ex = _examples(7)
    s = PromptOrder(ex, seed=0)
    first = s.next(5)
    assert s.epoch == 0
    second = s.next(5)  # 2 from epoch 0, 3 from epoch 1
    assert s.epoch == 1
    epoch0 = [e.uid for e in first + second[:2]]
    assert sorted(epoch0, key=int) == [str(i) for i in range(7)]
    rest = second[2:] + s.next(4)
    assert sorted((e.uid for e in rest), key=int) == [str(i) for i in range(7)]
    assert s.epoch == 1
    big = PromptOrder(ex, seed=1).next(23)  # more than three epochs in one call
    assert len(big) == 23 and sorted(e.uid for e in big[:21]).count("0") == 3


def test_sampler_state_round_trip_continues_identically():
    ex = _examples(13)
    s = PromptOrder(ex, seed=9)
    s.next(17)
    state = json.loads(json.dumps(s.state_dict()))
    expected = [e.uid for e in s.next(30)]
    resumed = PromptOrder(ex, seed=123)
    resumed.load_state_dict(state)
    assert resumed.epoch == 1
    assert [e.uid for e in resumed.next(30)] == expected
    with pytest.raises(ValueError, match="saved for 13 examples but this data set has 12"):
        PromptOrder(_examples(12), seed=9).load_state_dict(state)


def test_sampler_rejects_empty():
    with pytest.raises(ValueError, match="at least one example"):
        PromptOrder([], seed=0)


# --- real files (skipped until data/ holds them) --------------------------------------------


@pytest.mark.skipif(not AIME_DAPO.exists(), reason="data/aime2024/aime-2024.dapo.parquet not present")
def test_real_aime_dapo_file_dedups_to_30_already_templated():
    ex = load_examples(AIME_DAPO)
    assert len(ex) == 30
    assert sorted(int(e.uid) for e in ex) == list(range(30))
    assert all(e.text().count("Solve the following math problem") == 1 for e in ex)
    assert all(e.ground_truth.isdigit() for e in ex)


@pytest.mark.skipif(not DAPO_17K.exists(), reason="data/dapo_math_17k/dapo_math_17k.parquet not present")
def test_real_dapo_17k_gets_template_and_dedups():
    ex = load_examples(DAPO_17K)
    # 17917 rows, some the same problem more than once: one example per distinct problem text
    rows = pq.read_table(DAPO_17K, columns=["prompt"]).to_pylist()
    distinct = {m["content"] for row in rows for m in row["prompt"] if m["role"] == "user"}
    assert len(ex) == len(distinct) < len(rows)
    assert all(e.text().startswith(DAPO_PROMPT_PREFIX) for e in ex[:100])
    assert {e.data_source for e in ex} == {"DAPO-17k"}
    assert all(e.ground_truth.lstrip("-").isdigit() for e in ex)
