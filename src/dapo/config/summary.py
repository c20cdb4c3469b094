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
    "data.train_files": "training data: files, folders, Hub dataset ids ([]: the built-in task)",
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
# what `dapo eval --help` lists instead: the settings an evaluation reads
EVAL_SETTINGS = {
    "eval.benchmarks": "benchmarks: names, data files or Hub dataset ids",
    "eval.num_problems": "the first N problems of each (null: all)",
    "eval.n": "samples per problem (null: the benchmark's own)",
    "eval.temperature": "sampling temperature (null: the benchmark's own)",
    "eval.top_p": "nucleus sampling (null: the benchmark's own)",
    "eval.max_response_tokens": "longest response (null: the benchmark's own)",
    "eval.seed": "seed of the sampling and the intervals",
    "data.template": "prompt template",
    "data.max_prompt_tokens": "longest prompt, in tokens (capped to the model)",
    "data.overlong_prompts": "a prompt longer than that",
    "reward.grader": "answer grader",
    "reward.function": "your own reward, MODULE:FUNCTION",
    "rollout.backend": "generation engine",
    "model.dtype": "dtype of the weights",
    "model.device": "where the model runs",
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


HEADING = "most-used settings, with their defaults (a preset may change them; any setting is key=value):"


def settings_summary(first: dict | None = None, defaults: Config | None = None, heading: str = HEADING) -> str:
    """The settings a new user changes first (``first``: FIRST_SETTINGS), each with its default (``defaults``:
    Config()'s) and its choices, then where every setting is described and the sections of the config tree."""
    types = {key: tp for key, tp, _ in settings()}
    defaults = defaults or Config()
    lines = [heading]
    for key, words in (first or FIRST_SETTINGS).items():
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
