"""Data into ``Example``s: math problems read from files (``.jsonl``, ``.json``, ``.parquet``, gzipped JSON), a folder
of them, a Hugging Face dataset (``dapo.data.hub``), or rows given in Python.

The row layouts are ``dapo.data.layouts``'s. Every row is checked: a file with bad rows stops the run at load with
one line per bad row (the first ``SHOWN_BAD_ROWS``) and how many there are, or with data.on_bad_row=skip loads
without them. Data files come from elsewhere: a row longer than ``max_row_chars`` is refused before it is parsed,
and so are JSON nested too deep or numbers too long for Python to read, and NUL characters.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import sys
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dapo.config.schema import DEFAULT_MAX_ROW_CHARS
from dapo.config.shipped import shipped
from dapo.data import hub
from dapo.data.layouts import AS_WRITTEN, DataError, Layout, describe, detect, no_layout, read_row, renamed
from dapo.data.prompts import Example, check_template

__all__ = ["BadRows", "DataError", "DataRead", "examples_from_rows", "load_examples", "read_data", "source_origin"]

SHOWN_BAD_ROWS = 10  # a file's bad rows named one line each; the rest are counted
SUFFIXES = (".jsonl", ".json", ".parquet", ".jsonl.gz", ".json.gz")
# file and folder names that say which split (or which part) of a data set a file is, not which data set
_SPLITS = {"train", "test", "val", "valid", "validation", "dev", "eval", "data"}
_GENERIC_FOLDERS = _SPLITS | {"main", "default", "plain_text"}
# a shard: train-00000-of-00004 (the Hub's), train-00000-of-00004-1a2b3c (older exports), 0000 (the parquet export's)
_SHARD = re.compile(r"^(?:[a-z_]+-)?\d{5}-of-\d{5}(?:-[0-9a-f]+)?$|^\d{1,5}$")


class BadRows(DataError):
    """Rows that fit no layout or break one: the first ``SHOWN_BAD_ROWS`` of them one line each (``lines``), and
    how many there are."""

    def __init__(self, name: str, bad: list[str], rows: int):
        self.lines = [line.removeprefix(f"{name}: ") for line in bad[:SHOWN_BAD_ROWS]]
        if len(bad) > SHOWN_BAD_ROWS:
            self.lines.append(f"... and {len(bad) - SHOWN_BAD_ROWS:,} more")
        self.header = (
            f"{name}: {len(bad):,} bad rows of {rows:,}; fix them, or set data.on_bad_row=skip to leave them out"
        )
        super().__init__(bad[0] if len(bad) == 1 else "\n  ".join([self.header, *self.lines]))


@dataclass(frozen=True)
class DataRead:
    """A data set as read: its examples, its layout and columns, where the name its rows are graded by comes from,
    and the bad rows left out (data.on_bad_row=skip)."""

    examples: list[Example]
    layout: str  # as the start line names it: "GSM8K's (question, answer after '####')"
    read_as: str  # how most ground truths were read: layouts.AS_WRITTEN, AFTER_HASHES or BOXED
    # where the data source of rows without their own comes from, and that name: ("folder's name", "gsm8k");
    # None: rows given in Python without a name of their own
    named: tuple[str, str] | None
    rows: int  # rows read
    skipped: int = 0  # bad rows left out


def read_data(
    source: str | os.PathLike,
    *,
    template: str = "dapo",
    data_source: str | None = None,
    dedup: bool = True,
    limit: int | None = None,
    max_row_chars: int = DEFAULT_MAX_ROW_CHARS,
    columns: Sequence[str] = (),
    on_bad_row: str = "stop",
    split: str = "train",
) -> DataRead:
    """Read a data file, a folder of them or a Hugging Face dataset id (``ORG/NAME[:CONFIG[:SPLIT]]``) into
    ``Example``s, with how it was read.

    ``template`` is applied to each problem's (user) text; ``data_source`` overrides the rows' own (default: the
    row's ``data_source`` field, else the name ``source_origin`` gives). ``columns``: data.columns' renames
    (``THEIRS=OURS``). With ``dedup``, rows whose final prompt equals an earlier row's are dropped; ``limit`` keeps
    the first ``limit`` examples after de-duplication (rows past them are not read). ``on_bad_row``: stop (raise
    ``BadRows``) or skip. ``split``: the split a folder of shards or a dataset gives when it has several.
    """
    check_template(template)
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise ValueError(f"limit must be a positive integer or None, got {limit!r}")
    path = shipped(source)  # data/...: the package's copy when the current directory has none
    name = str(source) if hub.is_dataset_id(str(source)) and not path.exists() else str(path)
    rows, named = _rows_of(path, name, split, max_row_chars)
    read = _read(
        rows, lambda row_no: f"{name}: row {row_no}", name=name, template=template, columns=columns,
        dedup=dedup, limit=limit, on_bad_row=on_bad_row,
    )  # fmt: skip
    if not read.examples:
        raise DataError(f"{name}: no examples in the file; it needs at least one row")
    default_source = data_source or named[1]
    examples = [replace(ex, data_source=data_source or ex.data_source or default_source) for ex in read.examples]
    return replace(read, examples=examples, named=named)


def load_examples(path: str | os.PathLike, **kwargs) -> list[Example]:
    """The examples of ``read_data(path, **kwargs)``."""
    return read_data(path, **kwargs).examples


def rows_read(
    rows: Sequence[dict],
    *,
    name: str = "rows",
    template: str = "dapo",
    data_source: str | None = None,
    dedup: bool = True,
    max_row_chars: int = DEFAULT_MAX_ROW_CHARS,
    columns: Sequence[str] = (),
    on_bad_row: str = "stop",
) -> DataRead:
    """Rows given in Python, a list of dicts in any layout a file may have (``{"problem", "answer"}`` most simply) or
    a ``datasets.Dataset``, read as ``read_data`` reads a file. A bad row is named ``name[index]`` (0-based).
    ``data_source`` (default: the rows' own, else a Dataset's name, else ``name``) picks the grader under
    reward.grader=auto."""
    check_template(template)
    named = None
    if hub.is_dataset(rows):
        named = hub.dataset_named(rows)
        rows = hub.dataset_rows(rows, name)
    elif isinstance(rows, (str, bytes, dict)) or not isinstance(rows, Sequence):
        raise DataError(
            f"{name}: expected a list of dicts such as {{'problem': ..., 'answer': ...}} or a datasets.Dataset, "
            f"got {type(rows).__name__}"
        )

    def numbered() -> Iterator[tuple[int, Any]]:
        for i, row in enumerate(rows):
            too_long = _text_chars(row) > max_row_chars
            yield i + 1, _too_long(f"{name}[{i}]", max_row_chars) if too_long else row

    read = _read(
        numbered(), lambda row_no: f"{name}[{row_no - 1}]", name=name, template=template, columns=columns,
        dedup=dedup, on_bad_row=on_bad_row,
    )  # fmt: skip
    if not read.examples:
        raise DataError(f"{name}: no rows; give at least one {{'problem': ..., 'answer': ...}}")
    default_source = data_source or (named[1] if named else name)
    examples = [replace(ex, data_source=data_source or ex.data_source or default_source) for ex in read.examples]
    return replace(read, examples=examples, named=named)


def examples_from_rows(rows: Sequence[dict], **kwargs) -> list[Example]:
    """The examples of ``rows_read(rows, **kwargs)``."""
    return rows_read(rows, **kwargs).examples


def _read(rows, where_of, *, name, template, columns, dedup, on_bad_row, limit=None) -> DataRead:
    """Numbered rows (a row, or the DataError its reading raised) into a DataRead without its name; the layout is
    the first row's that has one. Bad rows are gathered, then raised together (``BadRows``) unless skipped."""
    from dapo.data.layouts import renames_of

    renames = renames_of(columns)
    layout: Layout | None = None
    waiting: list[tuple[int, dict]] = []  # rows before the first with a layout
    bad: list[str] = []
    seen: set = set()
    out: list[Example] = []
    read_as: Counter = Counter()
    total = 0

    def take(row_no: int, row: dict) -> bool:  # True when the limit is reached
        try:
            ex, how = read_row(layout, row, row_no, where_of(row_no), template)
        except DataError as err:
            bad.append(str(err))
            return False
        read_as[how] += 1
        if not dedup or ex.prompt not in seen:
            seen.add(ex.prompt)
            out.append(ex)
        return limit is not None and len(out) >= limit

    for row_no, row in rows:
        total += 1
        if isinstance(row, DataError):
            bad.append(str(row))
        elif not isinstance(row, dict):
            got = type(row).__name__
            bad.append(f"{where_of(row_no)}: expected a JSON object with the problem's fields, got {got}")
        elif layout is None and (found := detect(row := renamed(row, renames))) is None:
            waiting.append((row_no, row))
        elif layout is None:
            layout = found
            if any(take(n, r) for n, r in [*waiting, (row_no, row)]):
                break
        elif take(row_no, renamed(row, renames)):
            break
    if layout is None and waiting:  # no row has a layout: the first row's error says which is nearest
        raise no_layout(waiting[0][1], where_of(waiting[0][0]), renames)
    bad.sort(key=_row_number)  # rows read before the layout was known come back in order
    if bad and (on_bad_row != "skip" or not out):
        raise BadRows(name, bad, total)
    how = read_as.most_common(1)[0][0] if read_as else AS_WRITTEN
    text = describe(layout, how, renames) if layout is not None else "none"
    return DataRead(out, text, how, None, total, skipped=len(bad))


def _row_number(line: str) -> int:
    found = re.search(r"(?:: row |\[)(\d+)", line)
    return int(found.group(1)) if found else 0


def source_origin(path: Path) -> tuple[str, str]:
    """Where the data source of a file's rows without their own comes from, and that name: ("file's name",
    "gsm8k_x") for gsm8k_x.jsonl; ("folder's name", "gsm8k") for gsm8k/test.jsonl and for the Hub's
    gsm8k/main/train-00000-of-00001.parquet, whose names say the split, the shard and the config."""
    stem = path.name.split(".")[0]
    if path.is_dir():
        stem = ""  # a folder of shards: its own name, unless that is generic too
        folder = path.resolve()
    elif stem.lower() in _SPLITS or _SHARD.match(stem.lower()):
        folder = path.resolve().parent
    else:
        return "file's name", stem
    while folder.name.lower() in _GENERIC_FOLDERS and folder.parent != folder:
        folder = folder.parent
    return "folder's name", folder.name or stem


def _rows_of(path: Path, name: str, split: str, max_row_chars: int) -> tuple[Iterable, tuple[str, str]]:
    """The numbered rows of a file, a folder of them, a saved dataset or a dataset id, and what names them."""
    if path.is_dir():
        if hub.is_saved_dataset(path):
            rows, dataset_name = hub.saved_rows(path, split)
            return _numbered(rows, name, max_row_chars), dataset_name or source_origin(path)
        return _shard_rows(path, split, max_row_chars), source_origin(path)
    if path.is_file():
        return _iter_rows(path, max_row_chars), source_origin(path)
    if hub.is_dataset_id(name):
        rows = hub.hub_rows(name, split)
        return _numbered(rows, name, max_row_chars), ("dataset id", hub.dataset_id(name))
    raise DataError(
        f"{name}: no such file or folder, and not a Hugging Face dataset id (ORG/NAME[:CONFIG[:SPLIT]]); check the "
        "path (data files live under data/)"
    )


def _numbered(rows: Iterable[dict], name: str, max_row_chars: int) -> Iterator[tuple[int, Any]]:
    for row_no, row in enumerate(rows, 1):
        yield row_no, _too_long(f"{name}: row {row_no}", max_row_chars) if _text_chars(row) > max_row_chars else row


def _suffix(path: Path) -> str:
    name = path.name.lower()
    return next((s for s in sorted(SUFFIXES, key=len, reverse=True) if name.endswith(s)), path.suffix.lower())


def _shard_rows(folder: Path, split: str, max_row_chars: int) -> Iterator[tuple[int, Any]]:
    """The rows of a folder's data files in name order, numbered across them; where the files are named by split
    (train-00000-of-00002.parquet, test.jsonl) only ``split``'s, or the one split there is."""
    files = sorted(p for p in folder.iterdir() if p.is_file() and _suffix(p) in SUFFIXES)
    if not files:
        holding = [p for p in folder.iterdir() if p.is_dir() and any(_suffix(f) in SUFFIXES for f in p.iterdir())]
        inner = sorted(map(str, holding))
        where = f"; give one of its folders: {', '.join(inner)}" if inner else f" ({', '.join(SUFFIXES)})"
        raise DataError(f"{folder}: a folder holding no data files itself{where}")
    by_split: dict[str, list[Path]] = {}
    for f in files:
        by_split.setdefault(re.split(r"[-.]", f.name, maxsplit=1)[0].lower(), []).append(f)
    if set(by_split) <= _SPLITS | {"validation"} and len(by_split) > 1:
        if split not in by_split:
            raise DataError(f"{folder}: holds the splits {', '.join(sorted(by_split))}, not {split}; give one file")
        files = by_split[split]
    row_no = 0
    for f in files:
        for _, row in _iter_rows(f, max_row_chars):
            row_no += 1
            yield row_no, row  # a row its file could not give names that file and its row there


def _iter_rows(path: Path, max_row_chars: int) -> Iterator[tuple[int, Any]]:
    suffix = _suffix(path)
    if suffix in (".jsonl", ".jsonl.gz", ".json", ".json.gz"):
        yield from _iter_json(path, max_row_chars)
    elif suffix == ".parquet":
        yield from _iter_parquet(path, max_row_chars)
    else:
        raise DataError(
            f"{path}: unsupported file type {suffix or '(none)'!r}; use a .jsonl, .json or .parquet file "
            "(.jsonl.gz and .json.gz too), a folder of them, or a Hugging Face dataset"
        )


def _too_long(where: str, max_row_chars: int) -> DataError:
    return DataError(
        f"{where}: longer than data.max_row_chars={max_row_chars:,} characters; "
        "shorten or drop the row, or raise data.max_row_chars"
    )


def _open_text(path: Path):
    try:
        if path.name.lower().endswith(".gz"):
            return gzip.open(path, "rt", encoding="utf-8")
        return open(path, encoding="utf-8")
    except OSError as e:
        raise DataError(f"{path}: cannot be read ({e.strerror}); check the path and permissions") from e


def _iter_json(path: Path, max_row_chars: int) -> Iterator[tuple[int, Any]]:
    """JSON Lines, or (a .json file whose first character opens a list) one JSON array of rows."""
    with _open_text(path) as fh:
        try:
            head = fh.read(1)
            while head.isspace():
                head = fh.read(1)
            if head == "[" and ".json" in path.name.lower() and ".jsonl" not in path.name.lower():
                rows = _loads(head + fh.read(), f"{path}", "the file must be one JSON array of objects")
                if isinstance(rows, DataError):
                    raise rows
                yield from _numbered(rows, str(path), max_row_chars)
                return
            yield from _json_lines(fh, head, path, max_row_chars)
        except UnicodeDecodeError as e:
            raise DataError(f"{path}: not UTF-8 text ({e.reason}); save the file as UTF-8") from None
        except (OSError, EOFError) as e:  # gzip.BadGzipFile, a file cut short
            raise DataError(f"{path}: not a readable gzip file ({e}); compress it again") from None


def _json_lines(fh, head: str, path: Path, max_row_chars: int) -> Iterator[tuple[int, Any]]:
    row_no = 0
    # read at most one character past the limit (and the line end): a huge line is never held whole
    while line := head + fh.readline(max_row_chars + 2):
        head = ""
        row_no += 1
        if len(line.rstrip("\r\n")) > max_row_chars:
            while line and not line.endswith("\n"):  # the rest of the line, read and let go
                line = fh.readline(max_row_chars + 2)
            yield row_no, _too_long(f"{path}: row {row_no}", max_row_chars)
            continue
        if not line.strip():
            continue
        # parsed without its line end, so that a line cut short is at fault just past its last character (with
        # it, json puts the fault at "line 2, column 1")
        yield row_no, _loads(line.rstrip("\r\n"), f"{path}: row {row_no}", "each line must be one JSON object", row_no)


def _loads(text: str, where: str, fix: str, line_no: int = 1) -> Any:
    """``text`` parsed, or the DataError that says why it cannot be."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        at = f"line {line_no + e.lineno - 1}, column {e.colno}"
        return DataError(f"{where}: not valid JSON ({e.msg} at {at}); {fix}")
    except RecursionError:
        return DataError(f"{where}: JSON nested too deeply to read; a row is one object of strings and numbers")
    except ValueError:  # int('9' * 5000): Python reads at most sys.get_int_max_str_digits() digits
        digits = sys.get_int_max_str_digits()
        return DataError(f"{where}: a number with more than {digits} digits; write it as a string")


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
    yield from _numbered((row for batch in pf.iter_batches(batch_size=4096) for row in batch.to_pylist()),
                         str(path), max_row_chars)  # fmt: skip
