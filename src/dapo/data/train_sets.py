"""The training problems a run's data settings name: its data files (or datasets), or the built-in task."""

from __future__ import annotations

from dapo.data.files import DataRead, read_data
from dapo.data.layouts import AS_WRITTEN
from dapo.data.prompts import Example


def read_settings(data_cfg) -> dict:
    """How data.* says every data file is read (``read_data``'s keywords): the template, the row limit, the column
    renames and what a bad row does."""
    d = data_cfg
    return {"template": d.template, "max_row_chars": d.max_row_chars, "columns": d.columns, "on_bad_row": d.on_bad_row}


def load_train_examples(data_cfg) -> list[Example]:
    """The training problems a ``DataConfig`` names: its files, or the built-in task."""
    return [ex for _, read in load_train_sets(data_cfg) for ex in read.examples]


def load_train_sets(data_cfg) -> list[tuple[str | None, DataRead]]:
    """The training problems a ``DataConfig`` names, set by set: (the file, folder or dataset id, how it was read)
    for each of data.train_files, or (None, the built-in task's)."""
    if data_cfg.train_files:
        return [(path, read_data(path, split="train", **read_settings(data_cfg))) for path in data_cfg.train_files]
    examples = _builtin_examples(data_cfg)
    return [(None, DataRead(examples, "built-in arith task", AS_WRITTEN, None, len(examples)))]


def _builtin_examples(data_cfg) -> list[Example]:
    if data_cfg.task != "arith":
        raise ValueError(f"data.task={data_cfg.task!r}: the built-in task is arith; or give data.train_files")
    from dapo.data import arith

    return arith.make_examples(
        "train", data_cfg.task_train_size, seed=data_cfg.seed, difficulty=data_cfg.task_difficulty
    )
