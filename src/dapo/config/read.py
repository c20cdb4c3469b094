"""Reading presets and dotted overrides into the typed config tree: YAML whose plain scalars stay text until the
setting's type says how to read them, ``base:`` chains, ``key=value`` overrides, the shipped presets by name, and
the resolved config written back as YAML.

    cfg = load_config("configs/demo.yaml", ["algo.eps_high=0.28", "rollout.backend=hf"])
    cfg = load_config(["configs/ablation/base.yaml", "configs/ablation/3_clip_higher.yaml"])  # layered

A value is read as its setting's type: ``run.name=off`` is the text "off", ``algo.dynamic_sampling=off`` is
false, ``train.lr=abc`` is refused.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import os
import typing
import warnings
from pathlib import Path
from typing import Literal

import yaml

from dapo.config.rules import dotted_keys, fill_defaults, validate
from dapo.config.schema import Config, ConfigError, resolve_type
from dapo.config.shipped import SHARE


class _Plain(str):
    """A plain (unquoted) YAML scalar as written, until its setting's type says how to read it."""


class _TextLoader(yaml.SafeLoader):
    """YAML whose plain scalars stay text: ``name: off`` is 'off' until ``_read`` knows the setting is a
    bool (then false); quoted scalars, lists and mappings load as usual."""

    yaml_implicit_resolvers: typing.ClassVar[dict] = {}


_TextLoader.add_constructor(
    "tag:yaml.org,2002:str", lambda loader, node: (_Plain if node.style is None else str)(loader.construct_scalar(node))
)


def _as_yaml(value):
    """What plain YAML reads from ``value``: a _Plain resolved (off -> False, 3 -> 3, null -> None), lists too."""
    if isinstance(value, list):
        return [_as_yaml(v) for v in value]
    if not isinstance(value, _Plain):
        return value
    return _plain_scalar(str(value))


@functools.lru_cache(maxsize=4096)
def _plain_scalar(text: str):
    """Plain YAML's reading of one scalar's text (a list or mapping stays text); cached: a config reads the same few
    spellings (true, 1, null) dozens of times, and the suite loads configs by the thousand."""
    try:
        read = yaml.safe_load(text)
    except yaml.YAMLError:
        return text
    return text if isinstance(read, (list, dict)) else read


def _number(value) -> int | float | None:
    """A value read as a number; booleans are not numbers here."""
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, str):
        for parse in (int, float):
            with contextlib.suppress(ValueError):
                return parse(value)
    return None


BOOLS = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}


def _read(key: str, value, tp):
    """``value`` (from a preset, an override or Python) as the setting's type ``tp``; a ConfigError naming
    the key, the type and the value where it is not one."""
    base, optional = resolve_type(tp)
    origin = typing.get_origin(base)
    value = None if isinstance(value, _Plain) and _as_yaml(value) is None else value
    if value is None:
        if optional:
            return None
        raise ConfigError(f"{key}: null is not allowed; give a {getattr(base, '__name__', base)}")
    if origin is list:
        (item_tp,) = typing.get_args(base)
        if isinstance(value, str):  # an override's a,b (or a quoted [a,b])
            value = (
                yaml.load(value, _TextLoader) if value.startswith("[") else [_Plain(v) for v in value.split(",") if v]
            )
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {_as_yaml(value)!r}")
        return [_read(f"{key}[{i}]", v, item_tp) for i, v in enumerate(value)]
    if origin is Literal:  # a choice spelt as a YAML boolean (true, False, yes) is its lower-case spelling
        as_yaml = _as_yaml(value)
        return str(as_yaml).lower() if isinstance(as_yaml, bool) else str(value) if isinstance(value, str) else value
    if base is str:  # the text as written: run.name=off is 'off'
        if isinstance(value, (str, os.PathLike)):
            return str(value)
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    if base is bool:
        if isinstance(value, bool) or (isinstance(value, str) and value.lower() in BOOLS):
            return BOOLS.get(str(value).lower(), value)
        raise ConfigError(f"{key}: expected true or false, got {_as_yaml(value)!r}")
    if base in (int, float):
        number = _number(_as_yaml(value))
        if number is not None and (base is float or float(number).is_integer()):
            return base(number)
        raise ConfigError(f"{key}: expected {'an integer' if base is int else 'a number'}, got {_as_yaml(value)!r}")
    raise ConfigError(f"{key}: unsupported type {base}")


# keys of earlier versions -> what replaced them (a preset or override still naming one is told the fix)
_PREFILTER_REMOVED = (
    "the prompt pre-filter was removed: it never reached dynamic sampling's held-out accuracy "
    "(docs/objectives.md); delete this key, or use algo.screen_samples=n to spend n responses on a prompt "
    "before its whole group"
)
REPLACED = {
    "run.tensorboard": "run.loggers lists the loggers: leave tensorboard out to write none, e.g. run.loggers=console",
    **{
        f"algo.{key}": _PREFILTER_REMOVED
        for key in ("prefilter", "prefilter_target", "prefilter_floor", "prefilter_step", "prefilter_level")
    },
}


# keys of earlier versions read as the setting that took their name (presets and saved configs keep working), each
# with one line naming the new key; read until release 0.3. Values the new key spells otherwise: old -> new.
RENAMED = {
    "algo.old_logp": ("algo.old_logp_source", {}),
    "algo.buffer_max_groups": ("algo.held_over_max_groups", {}),
    "algo.buffer_logp": ("algo.held_over_logp_source", {"trainer": "recompute"}),
}


def _renamed(full: str, value):
    """(new key, value) for a key of an earlier version, with the line that says so."""
    new, values = RENAMED[full]
    value = values.get(value, value) if isinstance(value, str) else value
    warnings.warn(
        f"{full} is now {new} (read as {new}={value}); rename it: the old name is read until 0.3", stacklevel=4
    )
    return new, value


def _closest_keys(key, names: set[str], prefix: str) -> str:
    """The valid keys of the section, led by the one or two closest to a misspelt ``key``:
    "did you mean algo.eps_high? (valid keys here: ...)"."""
    valid = f"valid keys here: {', '.join(sorted(names))}"
    close = difflib.get_close_matches(str(key), sorted(names), n=2, cutoff=0.6)
    return f"did you mean {' or '.join(prefix + name for name in close)}? ({valid})" if close else valid


def merge(obj, overrides: dict, prefix: str = ""):
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in overrides.items():
        full = f"{prefix}{key}"
        if full in RENAMED:
            full, value = _renamed(full, value)
            key = full.rpartition(".")[2]
        if full in REPLACED:
            raise ConfigError(f"{full}: no longer a setting; {REPLACED[full]}")
        if key not in names:
            raise ConfigError(f"{full}: unknown key; {_closest_keys(key, names, prefix)}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            if not isinstance(value, dict):
                raise ConfigError(f"{full}: expected a section (mapping), got {_as_yaml(value)!r}")
            merge(current, value, prefix=f"{full}.")
        else:
            setattr(obj, key, _read(full, value, hints[key]))


def dotted_to_nested(items: list[str]) -> dict:
    nested: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r}: expected key=value, e.g. algo.eps_high=0.28")
        key, raw = item.split("=", 1)
        try:
            value = yaml.load(raw, _TextLoader) if raw != "" else ""
        except yaml.YAMLError as err:
            raise ConfigError(f"override {item!r}: not a valid value ({str(err).splitlines()[0]})") from None
        node = nested
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r}: {part} is not a section")
        node[parts[-1]] = raw if isinstance(value, (dict,)) else value
    return nested


def read_preset(path: Path, seen: tuple = ()) -> list[dict]:
    """The preset and the presets it names with ``base:`` (a path or a list, relative to it), bases first, in order."""
    if not path.exists():
        raise ConfigError(
            f"config file {path} does not exist; give a YAML file or a shipped preset's name "
            f"({', '.join(preset_names())})"
        )
    if path.resolve() in seen:
        raise ConfigError(f"{path}: 'base' presets form a cycle")
    try:
        data = yaml.load(path.read_text(), _TextLoader) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path}: not valid YAML ({str(err).splitlines()[0]})") from err
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    base = _as_yaml(data.pop("base", None))
    bases = [] if base is None else base if isinstance(base, list) else [base]
    if not all(isinstance(b, str) and b for b in bases):
        raise ConfigError(f"{path}: base: expected a preset path or a list of them, got {base!r}")
    chain = [d for b in bases for d in read_preset(path.parent / b, seen + (path.resolve(),))]
    return chain + [data]


PRESET_DIR = SHARE / "configs"  # the shipped presets: the repository's configs/, or the installed package's copy


def preset_names() -> list[str]:
    """The shipped presets, as ``load_config`` and ``dapo train`` accept them by name."""
    return sorted(str(p.relative_to(PRESET_DIR).with_suffix("")) for p in PRESET_DIR.rglob("*.yaml"))


def resolve_preset(path: str | Path) -> Path:
    """A preset path as given when it exists; else the shipped preset it names, from any directory and
    installed or not: ``configs/ablation/base.yaml``, ``ablation/base.yaml``, ``demo.yaml`` or ``demo``
    (and, as before, any path whose file name is a shipped preset's)."""
    p = Path(path).expanduser()
    if p.exists():
        return p
    inside = Path(*p.parts[1:]) if p.parts[:1] == ("configs",) and len(p.parts) > 1 else p
    for name in (inside, inside.with_name(inside.name + ".yaml"), Path(p.name)):
        if not name.is_absolute() and (PRESET_DIR / name).is_file():
            return PRESET_DIR / name
    return p


def load_config(path: str | Path | list | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the preset(s) in order (a later one overrides an earlier), then dotted overrides.
    A preset is a YAML file or a shipped preset's name (``"demo"``, see ``resolve_preset``)."""
    cfg, given = Config(), set()
    presets = [] if path is None else path if isinstance(path, (list, tuple)) else [path]
    layers = [data for preset in presets for data in read_preset(resolve_preset(preset))]
    if overrides:
        layers.append(dotted_to_nested(overrides))
    for data in layers:
        merge(cfg, data)
        given |= dotted_keys(data)
    fill_defaults(cfg, given)
    validate(cfg)
    return cfg


def config_from_dict(data: dict) -> Config:
    cfg = Config()
    merge(cfg, data)
    fill_defaults(cfg, dotted_keys(data))
    validate(cfg)
    return cfg


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)


def dump_yaml(cfg: Config) -> str:
    return yaml.safe_dump(to_dict(cfg), sort_keys=False)
