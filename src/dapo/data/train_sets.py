"""The training problems a run's data settings name: its data files, or the built-in task."""

from __future__ import annotations

from dapo.data.files import load_examples
from dapo.data.prompts import Example


def load_train_examples(data_cfg) -> list[Example]:
    """The training problems a ``DataConfig`` names: its files, or the built-in task."""
    return [ex for _, examples in load_train_sets(data_cfg) for ex in examples]


def load_train_sets(data_cfg) -> list[tuple[str | None, list[Example]]]:
    """The training problems a ``DataConfig`` names, file by file: (path, its examples) for each of its files, or
    (None, the built-in task's)."""
    if data_cfg.train_files:
        return [
            (path, load_examples(path, template=data_cfg.template, max_row_chars=data_cfg.max_row_chars))
            for path in data_cfg.train_files
        ]
    return [(None, _builtin_examples(data_cfg))]


def _builtin_examples(data_cfg) -> list[Example]:
    if data_cfg.task != "arith":
        raise ValueError(f"data.task={data_cfg.task!r}: the built-in task is arith; or give data.train_files")
    from dapo.data import arith

    return arith.make_examples(
        "train", data_cfg.task_train_size, seed=data_cfg.seed, difficulty=data_cfg.task_difficulty
    )
