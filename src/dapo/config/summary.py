"""What ``dapo COMMAND --help`` says of the settings: the ones a new user changes first, each with its default
(read from ``Config()``, never written twice) and its choices, then where every setting is described and the
sections of the config tree."""

from __future__ import annotations

import functools
import textwrap
import typing

from dapo.config.rules import settings
from dapo.config.schema import Config, resolve_type

# the settings a new user changes first, with a few words each; `--help` adds each one's default and choices,
# read from the config tree
FIRST_SETTINGS = {
    "model.path": "Hugging Face model directory (or Hub id)",
    "data.train_files": ".jsonl/.parquet training data ([]: the built-in task)",
    "data.template": "prompt template",
    "reward.grader": "answer grader",
    "rollout.backend": "generation engine",
    "rollout.group_size": "responses per prompt (G)",
    "rollout.max_response_tokens": "longest response, in tokens",
    "train.total_steps": "training steps",
    "train.prompts_per_step": "prompts per training batch",
    "train.lr": "learning rate",
    "algo.eps_low": "lower clip range (the ratio >= 1 - eps_low)",
    "algo.eps_high": "upper clip range, Clip-Higher (the ratio <= 1 + eps_high)",
    "eval.benchmarks": "held-out benchmarks (names or data files)",
    "eval.every_steps": "evaluate every N steps (null: at the end)",
    "run.name": "the run's name",
    "run.dir": "where runs live: <run.dir>/<run.name>",
}
CONFIG_REFERENCE = "docs/reference/config.md"


def spelled(value) -> str:
    """A setting's value as a key=value override spells it: null, true, [a,b]."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(spelled(v) for v in value) + "]"
    return str(value)


def settings_summary() -> str:
    """The settings a new user changes first, each with its default (Config()'s) and its choices, then where
    every setting is described and the sections of the config tree."""
    types = {key: tp for key, tp, _ in settings()}
    defaults = Config()
    lines = ["most-used settings, with their defaults (a preset may change them; any setting is key=value):"]
    for key, words in FIRST_SETTINGS.items():
        value = functools.reduce(getattr, key.split("."), defaults)
        base, _ = resolve_type(types[key])
        if typing.get_origin(base) is typing.Literal:
            words += ": " + ", ".join(typing.get_args(base))
        lines.append(f"  {f'{key}={spelled(value)}':<32} {words}")
    sections = list(dict.fromkeys(key.rsplit(".", 1)[0] for key in types))
    lines += [
        "",
        *textwrap.wrap(
            f"Every setting ({len(types)}) with its default, the values it accepts, the rules between settings and "
            f'what it does: {CONFIG_REFERENCE} ("Configuration reference" in the manual). Sections: '
            + ", ".join(sections),
            100,
        ),
    ]
    return "\n".join(lines)
