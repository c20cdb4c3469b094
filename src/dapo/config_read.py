"""Reading presets and dotted overrides into the typed config tree (``dapo.config``): YAML whose plain scalars
stay text until the setting's type says how to read them, ``base:`` chains, ``key=value`` overrides, and the
shipped presets by name. Then checking it (``dapo.config.validate``): what each setting declares (its type's
choices, a finite number, its ``Rule``), then the rules between settings, one group per concern, in a fixed
order. The first bad setting raises a ConfigError that names the key and the fix."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import operator
import os
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml

from dapo.resources import SHARE


@dataclass(frozen=True)
class Rule:
    """What one setting accepts beyond its type, and what its error message says."""

    gt: float | None = None  # bounds of a number: > gt, >= ge, < lt, <= le
    ge: float | None = None
    lt: float | None = None
    le: float | None = None
    unit: str = ""  # said after the bound: "must be > 0 seconds"
    null: str = ""  # what null (unset) means, for a setting that may be null: "must be > 0, or null (no cap)"
    why: str = ""  # said after the range: "must be in (0, 1); the paper uses 0.2"
    check: Callable[[typing.Any], bool] | None = None  # a rule bounds cannot say ...
    must: str = ""  # ... and what it wants: "run.name='a/b': must be one plain directory name ..."

    def broken(self, key: str, value) -> str | None:
        """The one-line error for ``value``, or None where it is fine."""
        if self.check is not None and not self.check(value):
            return f"{key}={value!r}: {self.must}"
        if all(OPS[op](value, b) for op, b in self.bounds()):
            return None
        return f"{key}={value!r}: must be {self.allowed()}"

    def bounds(self) -> list[tuple[str, float]]:
        return [
            (op, b) for op, b in ((">", self.gt), (">=", self.ge), ("<", self.lt), ("<=", self.le)) if b is not None
        ]

    def allowed(self) -> str:
        """The bounds as an error says them: "in (0, 1] seconds, or null (no cap); the paper uses 0.2"."""
        bounds = self.bounds()
        if len(bounds) == 2:  # an interval: (0, 1]
            (lo, a), (hi, b) = bounds
            text = f"in {'(' if lo == '>' else '['}{a:g}, {b:g}{')' if hi == '<' else ']'}"
        else:
            text = f"{bounds[0][0]} {bounds[0][1]:g}"
        unit, null = f" {self.unit}" if self.unit else "", f", or null ({self.null})" if self.null else ""
        return f"{text}{unit}{null}" + (f"; {self.why}" if self.why else "")


OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}


class ConfigError(ValueError):
    """A bad config value; the message names the key and the fix."""


def resolve_type(tp):
    """(base type, allows None) for the annotations of the config tree (dapo.config)."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return resolve_type(args[0])[0], True
    return tp, False


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
    try:
        read = yaml.safe_load(value)
    except yaml.YAMLError:
        return str(value)
    return str(value) if isinstance(read, (list, dict)) else read


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


def merge(obj, overrides: dict, prefix: str = ""):
    hints = typing.get_type_hints(type(obj))
    names = {f.name for f in dataclasses.fields(obj)}
    for key, value in overrides.items():
        full = f"{prefix}{key}"
        if full in REPLACED:
            raise ConfigError(f"{full}: no longer a setting; {REPLACED[full]}")
        if key not in names:
            raise ConfigError(f"{full}: unknown key; valid keys here: {', '.join(sorted(names))}")
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


# the cap of the importance weight a run generating ahead (rollout.max_staleness > 0) takes when none is given:
# its responses come from older weights, so an uncorrected run would train off-policy without saying so
ASYNC_IS_CAP = 2.0


def fill_defaults(cfg, given: set[str]) -> None:
    """Defaults that depend on other settings, filled where the key was not given (an explicit null stays null,
    and is refused where it cannot work); the resolved config, config.yaml, shows what was filled."""
    if cfg.rollout.max_staleness and cfg.algo.rollout_is_cap is None and "algo.rollout_is_cap" not in given:
        cfg.algo.rollout_is_cap = ASYNC_IS_CAP


def dotted_keys(nested: dict, prefix: str = "") -> set[str]:
    """The settings a preset or the overrides give, by dotted name."""
    keys = set()
    for key, value in nested.items():
        keys |= dotted_keys(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}"}
    return keys


# ---- checking ------------------------------------------------------------------------------------
def _check(cond: bool, msg: str):
    if not cond:
        raise ConfigError(msg)


def _or_list(items) -> str:
    items = [str(i) for i in items]
    return items[0] if len(items) == 1 else f"{', '.join(items[:-1])} or {items[-1]}"


def _spelled(value) -> str:
    """A list value as a dotted override spells it (a,b)."""
    return ",".join(map(str, value)) if isinstance(value, list) else repr(value)


# values a user may well try that are not choices, with why and what to use instead
REFUSED_CHOICES = {
    "model.dtype": {
        # float16's 5 exponent bits underflow most small gradients to 0 without a loss scaler, which dapo does not have
        "float16": "training in float16 needs loss scaling, which dapo does not do (most small gradients underflow "
        "to 0); use model.dtype=bfloat16 (the same memory, float32's range) or float32",
    },
}


def check_fields(cfg, fields) -> None:
    """What each setting's declaration says (``fields``: dapo.config.settings()): a Literal setting holds one
    of its choices; no float setting takes inf or nan (each bounds something: a time limit, the gradient norm,
    a clip; inf would switch it off without saying so, and nan fails every comparison but !=); and its Rule.
    The settings that can be switched off say how (null)."""
    for key, tp, rule in fields:
        value = functools.reduce(getattr, key.split("."), cfg)
        base, optional = resolve_type(tp)
        if value is None and optional:
            continue
        is_list = typing.get_origin(base) is list
        item_tp = typing.get_args(base)[0] if is_list else base
        if typing.get_origin(item_tp) is Literal:
            choices = typing.get_args(item_tp)
            if is_list:
                bad = [v for v in value if v not in choices]
                _check(not bad, bad and f"{key}={_spelled(value)}: {bad[0]!r} is not one of {', '.join(choices)}")
            else:
                refused = REFUSED_CHOICES.get(key, {})
                _check(value not in refused, f"{key}={value}: {refused.get(value)}")
                _check(value in choices, f"{key}={value!r}: choose {_or_list(choices)}")
        for v in value if isinstance(value, list) else [value]:
            _check(
                not isinstance(v, float) or math.isfinite(v),
                f"{key}={value}: must be a finite number (inf or nan would switch its limit off)",
            )
        if rule is not None:
            error = rule.broken(key, value)
            _check(error is None, error)


def _dependent_switches(cfg) -> None:
    a, r = cfg.algo, cfg.rollout
    _check(
        a.buffer_logp == "trainer" or r.backend == "vllm",
        f"algo.buffer_logp=engine: rollout.backend={r.backend} reports no log-probs; use "
        "rollout.backend=vllm or trainer",
    )
    _check(
        not cfg.tools.filter_void_turns or cfg.tools.python,
        "tools.filter_void_turns=true: filters multi-turn responses, so it needs tools.python=true",
    )
    n, G = a.screen_samples, r.group_size
    _check(
        not n or (2 <= n < G and a.dynamic_sampling),
        f"algo.screen_samples={n}: screening drops a prompt whose first n responses agree, so n is 0 (off) or "
        f"from 2 to rollout.group_size - 1 = {G - 1}, with algo.dynamic_sampling=true",
    )
    _check(
        not a.screen_audit or n,
        f"algo.screen_audit={a.screen_audit:g}: audits the prompts screening drops; set algo.screen_samples too",
    )


def _importance_sampling(cfg) -> None:
    a = cfg.algo
    _check(
        a.rollout_is_mode == "token_truncate" or a.rollout_is_cap is not None,
        f"algo.rollout_is_mode={a.rollout_is_mode}: corrects nothing without algo.rollout_is_cap; set the cap "
        "(e.g. algo.rollout_is_cap=2) or leave the mode at token_truncate",
    )
    _check(
        a.rollout_is_mode != "sequence_mask" or a.rollout_is_cap is None or a.rollout_is_cap > 1.0,
        f"algo.rollout_is_cap={a.rollout_is_cap}: algo.rollout_is_mode=sequence_mask keeps responses whose ratio is "
        "in [1/cap, cap]; a cap of 1 masks every one, use > 1",
    )


def _async_rollout(cfg) -> None:
    """rollout.max_staleness > 0 (responses up to k updates old) and the rollout ranks."""
    a, r = cfg.algo, cfg.rollout
    k = r.max_staleness
    if k:
        why = f"rollout.max_staleness={k}: "
        _check(
            a.rollout_is_cap is not None,
            why + "responses sampled by older weights need the importance weight to the engine's log-probs; set "
            "algo.rollout_is_cap (left out, it is 2)",
        )
        _check(
            a.old_logp == "recompute",
            why + "the clip is anchored at the trainer's weights at the step's start (recomputed log-probs); "
            "use algo.old_logp=recompute",
        )
        _check(
            a.buffer_max_groups == 0,
            why + f"algo.buffer_max_groups={a.buffer_max_groups} would train held-over groups one version older "
            "than the bound; set algo.buffer_max_groups=0",
        )
    _check(
        r.ranks == 0 or k > 0,
        f"rollout.ranks={r.ranks}: rollout ranks generate the next steps while the others train; set "
        "rollout.max_staleness (1 or 2), or rollout.ranks=0 for the synchronous loop",
    )
    _check(
        r.ranks == 0 or r.tensor_parallel_size == 1,
        f"rollout.ranks={r.ranks}: each rollout rank holds a whole engine; rollout.tensor_parallel_size="
        f"{r.tensor_parallel_size} across rollout ranks is not supported, use 1",
    )


def _engine_log_probs(cfg) -> None:
    """What uses the engine's sampling log-probs: algo.rollout_is_cap, algo.old_logp=engine."""
    a, r = cfg.algo, cfg.rollout
    _check(
        a.rollout_is_cap is None or r.backend == "vllm" or r.max_staleness > 0,
        f"algo.rollout_is_cap={a.rollout_is_cap}: needs the engine's log-probs; "
        f"rollout.backend={r.backend} has none (use vllm, or rollout.max_staleness > 0: its engine reports them)",
    )
    _check(
        a.old_logp != "engine" or r.backend in ("vllm", "auto"),
        f"algo.old_logp=engine: rollout.backend={r.backend} reports no log-probs; use rollout.backend=vllm",
    )
    _check(
        a.old_logp != "engine" or cfg.model.dtype == "float32",
        f"algo.old_logp=engine: model.dtype={cfg.model.dtype} makes vLLM's log-probs differ from the "
        "trainer's; use float32",
    )
    _check(
        a.old_logp != "engine" or (r.top_p == 1.0 and r.top_k is None),
        "algo.old_logp=engine: vLLM's log-probs are of the top-p/top-k truncated distribution "
        f"(rollout.top_p={r.top_p}, "
        f"rollout.top_k={r.top_k}), the trainer's of the full one; use top_p 1.0 and no top_k, or recompute",
    )
    _check(
        a.old_logp == "recompute" or a.rollout_is_cap is None,
        f"algo.old_logp={a.old_logp}: algo.rollout_is_cap weighs by pi_old / pi_rollout from the "
        "recomputed pass; use recompute",
    )


def _rewards(cfg) -> None:
    a, r = cfg.algo, cfg.rollout
    _check(
        a.truncated_in_group_stats or a.overlong_filtering,
        "algo.truncated_in_group_stats=false only applies with algo.overlong_filtering=true (masked "
        "rows need no advantage)",
    )
    _check(a.correct_reward > a.wrong_reward, "algo.correct_reward must be greater than algo.wrong_reward")
    _check(
        not a.soft_overlong_punishment or 0 < a.overlong_buffer_tokens <= r.max_response_tokens,
        f"algo.overlong_buffer_tokens={a.overlong_buffer_tokens}: must be in (0, rollout.max_response_tokens="
        f"{r.max_response_tokens}]; the buffer cannot be longer than the maximum length",
    )


def _batches(cfg) -> None:
    t = cfg.train
    _check(
        t.prompts_per_step % t.mini_batch_prompts == 0,
        f"train.prompts_per_step={t.prompts_per_step} is not divisible by train.mini_batch_prompts="
        f"{t.mini_batch_prompts}; pick a divisor so every optimizer update sees the same number of prompts",
    )
    _check(
        not (t.share_prompt_prefix and t.pack_sequences == "true"),
        "train.share_prompt_prefix=true shares a prompt across padded rows; packed rows (train.pack_sequences=true) "
        "have none: set train.pack_sequences=auto or false, or train.share_prompt_prefix=false",
    )
    _check(  # the prompts' cache is indexed by layer: torch.compile specialises on it, a graph per layer
        not (t.share_prompt_prefix and "compile" in t.kernels),
        "train.kernels=[compile] with train.share_prompt_prefix=true would compile one graph per decoder layer (the "
        "shared prompts' cache is indexed by the layer) and run the layers past torch's recompile limit eagerly: "
        "set train.share_prompt_prefix=false, or leave compile out of train.kernels",
    )


def _run_dir(cfg) -> None:
    _check(
        not (cfg.run.overwrite and cfg.run.resume),
        "run.overwrite=true moves an earlier run aside to start afresh: set run.resume=false with it",
    )


# the rules between settings, one concern a group; their order says which error a config with several faults gets
RULES = (_dependent_switches, _importance_sampling, _async_rollout, _engine_log_probs, _rewards, _batches, _run_dir)
