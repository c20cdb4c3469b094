"""Data files into ``Example``s: math problems read from ``.jsonl`` and ``.parquet`` files, or given in Python as rows.

Three row layouts are read:

* DAPO layout: ``prompt`` (a chat list ``[{role, content}]`` or a string),
  ``reward_model.ground_truth``, optional ``data_source`` and ``extra_info.index``;
* plain: ``problem`` and ``answer`` (optional ``id``);
* GSM8K: ``question`` and ``answer``, whose ground truth is the number after ``####``.

The layout is decided once per file from its first row; every row is then checked against it,
and a bad row raises ``DataError`` naming the file, the 1-based row number and the field. Data
files come from elsewhere: a row longer than ``max_row_chars`` is refused before it is parsed,
and so are JSON nested too deep or numbers too long for Python to read, and NUL characters.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from dapo.config.schema import DEFAULT_MAX_ROW_CHARS
from dapo.config.shipped import shipped
from dapo.data.prompts import Example, Message, apply_template, check_template

# File names that say which split a file is, not which data set; the folder names the data set.
_GENERIC_STEMS = {"train", "test", "val", "valid", "validation", "dev", "eval", "data"}


class DataError(ValueError):
    """A data file that cannot be turned into examples; the message names the file, row and field."""


def load_examples(
    path: str | os.PathLike,
    *,
    template: str = "dapo",
    data_source: str | None = None,
    dedup: bool = True,
    limit: int | None = None,
    max_row_chars: int = DEFAULT_MAX_ROW_CHARS,
) -> list[Example]:
    """Read a ``.jsonl`` or ``.parquet`` file of math problems into ``Example``s.

    ``template`` is applied to each problem's (user) text; ``data_source`` overrides the rows'
    own (default: the row's ``data_source`` field, else the folder name for files named like
    ``test.jsonl``, else the file's stem). With ``dedup``, rows whose final prompt equals an
    earlier row's are dropped. ``limit`` keeps the first ``limit`` examples after de-duplication.
    A row of more than ``max_row_chars`` characters (its JSON line, or its parquet text) is an error.
    """
    check_template(template)
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    path = shipped(path)  # data/...: the package's copy when the current directory has none
    name = str(path)
    if not path.is_file():
        raise DataError(f"{name}: no such file; check the path (data files live under data/)")
    default_source = data_source or _default_source(path)
    out = _examples(
        _iter_rows(path, max_row_chars),
        lambda row_no: f"{name}: row {row_no}",
        template=template,
        default_source=default_source,
        data_source=data_source,
        dedup=dedup,
        limit=limit,
    )
    if not out:
        raise DataError(f"{name}: no examples in the file; it needs at least one row")
    return out


def examples_from_rows(
    rows: Sequence[dict],
    *,
    name: str = "rows",
    template: str = "dapo",
    data_source: str | None = None,
    dedup: bool = True,
    max_row_chars: int = DEFAULT_MAX_ROW_CHARS,
) -> list[Example]:
    """Rows given in Python, as a list of dicts in any layout a file may have (``{"problem", "answer"}``
    most simply), into ``Example``s. A bad row raises ``DataError`` naming ``name[index]`` (0-based)
    and the field. ``data_source`` (default: the rows' own, else ``name``) picks the grader under
    reward.grader=auto."""
    check_template(template)
    if isinstance(rows, (str, bytes, dict)) or not isinstance(rows, Sequence):
        raise DataError(
            f"{name}: expected a list of dicts such as {{'problem': ..., 'answer': ...}}, got {type(rows).__name__}"
        )

    def numbered() -> Iterator[tuple[int, Any]]:
        for i, row in enumerate(rows):
            if _text_chars(row) > max_row_chars:
                raise _too_long(f"{name}[{i}]", max_row_chars)
            yield i + 1, row

    out = _examples(
        numbered(),
        lambda row_no: f"{name}[{row_no - 1}]",
        template=template,
        default_source=data_source or name,
        data_source=data_source,
        dedup=dedup,
    )
    if not out:
        raise DataError(f"{name}: no rows; give at least one {{'problem': ..., 'answer': ...}}")
    return out


def _examples(
    rows: Iterable[tuple[int, Any]],
    where_of,
    *,
    template: str,
    default_source: str,
    data_source: str | None,
    dedup: bool,
    limit: int | None = None,
) -> list[Example]:
    """Numbered rows into Examples, the layout decided by the first row; ``where_of(row_no)`` names a row."""
    layout = None
    seen: set = set()
    out: list[Example] = []
    for row_no, row in rows:
        where = where_of(row_no)
        if not isinstance(row, dict):
            raise DataError(f"{where}: expected a JSON object with the problem's fields, got {type(row).__name__}")
        if layout is None:
            layout = _detect_layout(row, where)
        ex = _parse_row(layout, row, row_no, where, template, default_source, data_source)
        if dedup:
            key = ex.prompt
            if key in seen:
                continue
            seen.add(key)
        out.append(ex)
        if limit is not None and len(out) >= limit:
            break
    return out


def _default_source(path: Path) -> str:
    return source_origin(path)[1]


def source_origin(path: Path) -> tuple[str, str]:
    """Where the data source of a file's rows without their own comes from, and that name: ("file's name",
    "gsm8k_x") for gsm8k_x.jsonl, ("folder's name", "gsm8k") for gsm8k/test.jsonl (its name says the split)."""
    stem = path.name.split(".")[0]
    if stem.lower() in _GENERIC_STEMS and path.parent.name:
        return "folder's name", path.parent.resolve().name
    return "file's name", stem


def _iter_rows(path: Path, max_row_chars: int) -> Iterator[tuple[int, Any]]:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        yield from _iter_jsonl(path, max_row_chars)
    elif suffix == ".parquet":
        yield from _iter_parquet(path, max_row_chars)
    else:
        raise DataError(f"{path}: unsupported file type {suffix or '(none)'!r}; use a .jsonl or .parquet file")


def _too_long(where: str, max_row_chars: int) -> DataError:
    return DataError(
        f"{where}: longer than data.max_row_chars={max_row_chars:,} characters; "
        "shorten or drop the row, or raise data.max_row_chars"
    )


def _iter_jsonl(path: Path, max_row_chars: int) -> Iterator[tuple[int, Any]]:
    try:
        fh = open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror}); check the path and permissions") from e
    with fh:
        try:
            row_no = 0
            # read at most one character past the limit (and the line end): a huge line is never held whole
            while line := fh.readline(max_row_chars + 2):
                row_no += 1
                if len(line.rstrip("\r\n")) > max_row_chars:
                    raise _too_long(f"{path}: row {row_no}", max_row_chars)
                if not line.strip():
                    continue
                try:
                    # parsed without its line end, so that a line cut short is at fault just past its last
                    # character (with it, json puts the fault at "line 2, column 1")
                    row = json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as e:
                    raise DataError(
                        f"{path}: row {row_no}: not valid JSON ({e.msg} at line {row_no + e.lineno - 1}, "
                        f"column {e.colno}); each line must be one JSON object"
                    ) from None
                except RecursionError:
                    raise DataError(
                        f"{path}: row {row_no}: JSON nested too deeply to read; a row is one object of "
                        "strings and numbers"
                    ) from None
                except ValueError:  # int('9' * 5000): Python reads at most sys.get_int_max_str_digits() digits
                    raise DataError(
                        f"{path}: row {row_no}: a number with more than {sys.get_int_max_str_digits()} digits; "
                        "write it as a string"
                    ) from None
                yield row_no, row
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e.reason}); save the file as UTF-8") from None


def _text_chars(value: Any) -> int:
    """Characters of text in a row read from parquet (strings in lists and structs included)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_chars(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(_text_chars(v) for v in value)
    return 0


def _iter_parquet(path: Path, max_row_chars: int) -> Iterator[tuple[int, Any]]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as e:  # pyarrow raises several unrelated types for a bad file
        raise DataError(f"{path}: not a readable parquet file ({e}); re-export it") from None
    row_no = 0
    for batch in pf.iter_batches(batch_size=4096):
        for row in batch.to_pylist():
            row_no += 1
            if _text_chars(row) > max_row_chars:
                raise _too_long(f"{path}: row {row_no}", max_row_chars)
            yield row_no, row


def _detect_layout(row: dict, where: str) -> str:
    if "prompt" in row or "reward_model" in row:
        return "dapo"
    if "problem" in row:
        return "plain"
    if "question" in row:
        return "gsm8k"
    raise DataError(
        f"{where}: cannot tell the layout from fields {sorted(row)}; a row needs 'prompt' and "
        "'reward_model.ground_truth' (DAPO), 'problem' and 'answer', or 'question' and "
        "'answer' (GSM8K)"
    )


_LAYOUT_HINT = {
    "dapo": "each row needs 'prompt' (string or [{role, content}]) and 'reward_model.ground_truth'",
    "plain": "each row needs 'problem' and 'answer'",
    "gsm8k": "each row needs 'question' and an 'answer' ending in '#### <number>'",
}


def _field(row: dict, dotted: str, where: str, layout: str) -> Any:
    cur: Any = row
    for part in dotted.split("."):
        if not isinstance(cur, dict) or part not in cur or cur[part] is None:
            raise DataError(f"{where}: field '{dotted}' is missing; {_LAYOUT_HINT[layout]}")
        cur = cur[part]
    return cur


def _answer_text(row: dict, field: str, where: str, layout: str) -> str:
    value = _field(row, field, where, layout)
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if isinstance(value, float) and math.isfinite(value):
        # JSON writers turn 27 into 27.0; the answer a model writes is "27".
        return str(int(value)) if value.is_integer() else repr(value)
    if isinstance(value, str):
        if not value.strip():
            raise DataError(f"{where}: field '{field}' is empty; {_LAYOUT_HINT[layout]}")
        return _no_nul(value.strip(), field, where)
    raise DataError(
        f"{where}: field '{field}' must be a string or a number, got {type(value).__name__}; {_LAYOUT_HINT[layout]}"
    )


def _text(value: Any, field: str, where: str, layout: str) -> str:
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field '{field}' must be a string, got {type(value).__name__}; {_LAYOUT_HINT[layout]}"
        )
    if not value.strip():
        raise DataError(f"{where}: field '{field}' is empty; {_LAYOUT_HINT[layout]}")
    return _no_nul(value, field, where)


def _no_nul(value: str, field: str, where: str) -> str:
    # no text or answer holds a NUL; graders that normalise answers would drop it and call "2\0" equal to "2"
    if "\0" in value:
        raise DataError(f"{where}: field '{field}' contains a NUL character (\\x00); remove it from the file")
    return value


def _chat(value: Any, where: str, template: str) -> tuple:
    if not isinstance(value, (list, tuple)) or not value:
        raise DataError(
            f"{where}: field 'prompt' must be a string or a non-empty list of "
            f"{{role, content}} messages, got {type(value).__name__}; {_LAYOUT_HINT['dapo']}"
        )
    messages = []
    for i, m in enumerate(value):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise DataError(
                f"{where}: field 'prompt[{i}]' must be a {{role, content}} message with string "
                f"values; {_LAYOUT_HINT['dapo']}"
            )
        role = _no_nul(m["role"], f"prompt[{i}].role", where)
        messages.append((role, _no_nul(m["content"], f"prompt[{i}].content", where)))
    users = [i for i, (role, _) in enumerate(messages) if role == "user"]
    if not users:
        raise DataError(f"{where}: field 'prompt' has no 'user' message; {_LAYOUT_HINT['dapo']}")
    # The problem is the (last) user turn; system turns and earlier history pass through.
    last = users[-1]
    role, content = messages[last]
    if not content.strip():
        raise DataError(f"{where}: field 'prompt[{last}].content' is empty; {_LAYOUT_HINT['dapo']}")
    messages[last] = (role, apply_template(content, template))
    return tuple(Message(r, c) for r, c in messages)


def _parse_row(
    layout: str,
    row: dict,
    row_no: int,
    where: str,
    template: str,
    default_source: str,
    source_override: str | None,
) -> Example:
    uid = str(row_no - 1)
    row_source = None
    if layout == "dapo":
        raw_prompt = _field(row, "prompt", where, layout)
        if isinstance(raw_prompt, str):
            prompt: str | tuple = apply_template(_text(raw_prompt, "prompt", where, layout), template)
        else:
            prompt = _chat(raw_prompt, where, template)
        truth = _answer_text(row, "reward_model.ground_truth", where, layout)
        extra = row.get("extra_info")
        if isinstance(extra, dict) and extra.get("index") is not None:
            uid = str(extra["index"])
        row_source = row.get("data_source")
        if row_source is not None and not isinstance(row_source, str):
            raise DataError(
                f"{where}: field 'data_source' must be a string, got {type(row_source).__name__}; "
                "drop it or give the data set's name"
            )
        if row_source is not None:
            _no_nul(row_source, "data_source", where)
    elif layout == "plain":
        problem = _text(_field(row, "problem", where, layout), "problem", where, layout)
        prompt = apply_template(problem, template)
        truth = _answer_text(row, "answer", where, layout)
        if row.get("id") is not None:
            uid = str(row["id"])
    else:  # gsm8k
        question = _text(_field(row, "question", where, layout), "question", where, layout)
        prompt = apply_template(question, template)
        answer = _text(_field(row, "answer", where, layout), "answer", where, layout)
        if "####" not in answer:
            raise DataError(f"{where}: field 'answer' has no '#### <number>' final line; {_LAYOUT_HINT[layout]}")
        truth = answer.rsplit("####", 1)[1].strip().replace(",", "")
        if not truth:
            raise DataError(f"{where}: field 'answer' has nothing after '####'; {_LAYOUT_HINT[layout]}")
    source = source_override or row_source or default_source
    return Example(uid=uid, prompt=prompt, ground_truth=truth, data_source=source)
