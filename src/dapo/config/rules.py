"""Checking a config: what each setting declares (its type's choices, a finite number, its ``Rule``), then the
rules between settings, one group per concern, in a fixed order; and the defaults that depend on other settings.
The first bad setting raises a ConfigError that names the key and the fix."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from collections.abc import Callable
from typing import Literal

from dapo.config.schema import Config, ConfigError, Rule, resolve_type

# the cap of the importance weight a run generating ahead (rollout.max_staleness > 0) takes when none is given
ASYNC_IS_CAP = 2.0


@dataclasses.dataclass(frozen=True)
class FilledDefault:
    """A default that depends on another setting, filled where the key was not given (fill_defaults)."""

    key: str
    value: typing.Any
    keys: tuple[str, ...]  # the settings ``when`` reads
    when: Callable[[Config], bool]
    says: str  # when, for a user, Markdown: the reference shows "`key` is `value` <says>"


# a run generating ahead (rollout.max_staleness > 0) samples from older weights: left uncorrected it would train
# off-policy without saying so
FILLED_DEFAULTS = (
    FilledDefault(
        "algo.rollout_is_cap",
        ASYNC_IS_CAP,
        ("rollout.max_staleness",),
        lambda cfg: cfg.rollout.max_staleness > 0,
        "with `rollout.max_staleness` > 0 and not given",
    ),
)


def fill_defaults(cfg, given: set[str]) -> None:
    """Defaults that depend on other settings (FILLED_DEFAULTS), filled where the key was not given (an explicit
    null stays null, and is refused where it cannot work); the resolved config, config.yaml, shows what was
    filled."""
    for filled in FILLED_DEFAULTS:
        section, _, name = filled.key.rpartition(".")
        holder = functools.reduce(getattr, section.split("."), cfg)
        if filled.key not in given and getattr(holder, name) is None and filled.when(cfg):
            setattr(holder, name, filled.value)


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


@dataclasses.dataclass(frozen=True)
class RuleBetween:
    """A rule between settings, declared once: the settings it involves, what it says to a user (the configuration
    reference prints it beside each of them), the check, and the one-line error naming the key and the fix."""

    keys: tuple[str, ...]  # the settings involved; the error names the first
    says: str  # the rule for a user, Markdown (`code` spans): what the reference's Allowed column shows
    holds: Callable[[Config], bool]
    error: Callable[[Config], str]  # called only where the rule is broken


# the rules between settings, grouped by concern; their order says which error a config with several faults gets
RULES = (
    # ---- switches that need another
    RuleBetween(
        ("algo.held_over_logp_source", "rollout.backend"),
        "`algo.held_over_logp_source=engine` needs `rollout.backend=vllm`",
        lambda cfg: cfg.algo.held_over_logp_source == "recompute" or cfg.rollout.backend == "vllm",
        lambda cfg: (
            f"algo.held_over_logp_source=engine: rollout.backend={cfg.rollout.backend} reports no log-probs; use "
            "rollout.backend=vllm or algo.held_over_logp_source=recompute"
        ),
    ),
    RuleBetween(  # the CPU limit is the verdict a busy machine does not change; the wall clock only a backstop
        ("tools.timeout_s", "tools.cpu_s", "tools.python"),
        "`tools.timeout_s` is at least `tools.cpu_s` where `tools.python=true`",
        lambda cfg: not cfg.tools.python or cfg.tools.timeout_s >= cfg.tools.cpu_s,
        lambda cfg: (
            f"tools.timeout_s={cfg.tools.timeout_s:g} is below tools.cpu_s={cfg.tools.cpu_s}: the wall clock would end "
            "calls that are within their CPU time whenever the machine is busy; set tools.timeout_s to a few times "
            "tools.cpu_s, or lower tools.cpu_s"
        ),
    ),
    RuleBetween(
        ("tools.filter_void_turns", "tools.python"),
        "`tools.filter_void_turns=true` needs `tools.python=true`",
        lambda cfg: not cfg.tools.filter_void_turns or cfg.tools.python,
        lambda cfg: "tools.filter_void_turns=true: filters multi-turn responses, so it needs tools.python=true",
    ),
    RuleBetween(
        ("algo.screen_samples", "rollout.group_size", "algo.dynamic_sampling"),
        "`algo.screen_samples` is 0 (off) or from 2 to `rollout.group_size` - 1, with `algo.dynamic_sampling=true`",
        lambda cfg: (
            not cfg.algo.screen_samples
            or (2 <= cfg.algo.screen_samples < cfg.rollout.group_size and cfg.algo.dynamic_sampling)
        ),
        lambda cfg: (
            f"algo.screen_samples={cfg.algo.screen_samples}: screening drops a prompt whose first n responses "
            f"agree, so n is 0 (off) or from 2 to rollout.group_size - 1 = {cfg.rollout.group_size - 1}, with "
            "algo.dynamic_sampling=true"
        ),
    ),
    RuleBetween(
        ("algo.screen_audit", "algo.screen_samples"),
        "`algo.screen_audit` > 0 needs `algo.screen_samples` > 0",
        lambda cfg: not cfg.algo.screen_audit or cfg.algo.screen_samples,
        lambda cfg: (
            f"algo.screen_audit={cfg.algo.screen_audit:g}: audits the prompts screening drops; set "
            "algo.screen_samples too"
        ),
    ),
    # ---- importance sampling
    RuleBetween(
        ("algo.rollout_is_mode", "algo.rollout_is_cap"),
        "`algo.rollout_is_mode` other than `token_truncate` needs `algo.rollout_is_cap`",
        lambda cfg: cfg.algo.rollout_is_mode == "token_truncate" or cfg.algo.rollout_is_cap is not None,
        lambda cfg: (
            f"algo.rollout_is_mode={cfg.algo.rollout_is_mode}: corrects nothing without algo.rollout_is_cap; "
            "set the cap (e.g. algo.rollout_is_cap=2) or leave the mode at token_truncate"
        ),
    ),
    RuleBetween(
        ("algo.rollout_is_cap", "algo.rollout_is_mode"),
        "with `algo.rollout_is_mode=sequence_mask`, `algo.rollout_is_cap` > 1",
        lambda cfg: (
            cfg.algo.rollout_is_mode != "sequence_mask"
            or cfg.algo.rollout_is_cap is None
            or cfg.algo.rollout_is_cap > 1.0
        ),
        lambda cfg: (
            f"algo.rollout_is_cap={cfg.algo.rollout_is_cap}: algo.rollout_is_mode=sequence_mask keeps "
            "responses whose ratio is in [1/cap, cap]; a cap of 1 masks every one, use > 1"
        ),
    ),
    # ---- generating ahead (rollout.max_staleness > 0: responses up to k updates old) and the rollout ranks
    RuleBetween(
        ("rollout.max_staleness", "algo.rollout_is_cap"),
        "`rollout.max_staleness` > 0 needs `algo.rollout_is_cap` (not null)",
        lambda cfg: not cfg.rollout.max_staleness or cfg.algo.rollout_is_cap is not None,
        lambda cfg: (
            f"rollout.max_staleness={cfg.rollout.max_staleness}: responses sampled by older weights need the "
            f"importance weight to the engine's log-probs; set algo.rollout_is_cap (left out, it is {ASYNC_IS_CAP:g})"
        ),
    ),
    RuleBetween(
        ("rollout.max_staleness", "algo.old_logp_source"),
        "`rollout.max_staleness` > 0 needs `algo.old_logp_source=recompute`",
        lambda cfg: not cfg.rollout.max_staleness or cfg.algo.old_logp_source == "recompute",
        lambda cfg: (
            f"rollout.max_staleness={cfg.rollout.max_staleness}: the clip is anchored at the trainer's weights "
            "at the step's start (recomputed log-probs); use algo.old_logp_source=recompute"
        ),
    ),
    RuleBetween(
        ("rollout.max_staleness", "algo.held_over_max_groups"),
        "`rollout.max_staleness` > 0 needs `algo.held_over_max_groups=0`",
        lambda cfg: not cfg.rollout.max_staleness or cfg.algo.held_over_max_groups == 0,
        lambda cfg: (
            f"rollout.max_staleness={cfg.rollout.max_staleness}: algo.held_over_max_groups="
            f"{cfg.algo.held_over_max_groups} would train held-over groups one version older than the bound; set "
            "algo.held_over_max_groups=0"
        ),
    ),
    RuleBetween(
        ("rollout.ranks", "rollout.max_staleness"),
        "`rollout.ranks` > 0 needs `rollout.max_staleness` > 0",
        lambda cfg: cfg.rollout.ranks == 0 or cfg.rollout.max_staleness > 0,
        lambda cfg: (
            f"rollout.ranks={cfg.rollout.ranks}: rollout ranks generate the next steps while the others "
            "train; set rollout.max_staleness (1 or 2), or rollout.ranks=0 for the synchronous loop"
        ),
    ),
    RuleBetween(
        ("rollout.ranks", "rollout.tensor_parallel_size"),
        "`rollout.ranks` > 0 needs `rollout.tensor_parallel_size=1`",
        lambda cfg: cfg.rollout.ranks == 0 or cfg.rollout.tensor_parallel_size == 1,
        lambda cfg: (
            f"rollout.ranks={cfg.rollout.ranks}: each rollout rank holds a whole engine; "
            f"rollout.tensor_parallel_size={cfg.rollout.tensor_parallel_size} across rollout ranks is not supported, "
            "use 1"
        ),
    ),
    # ---- what uses the engine's sampling log-probs: algo.rollout_is_cap, algo.old_logp_source=engine
    RuleBetween(
        ("algo.rollout_is_cap", "rollout.backend", "rollout.max_staleness"),
        "`algo.rollout_is_cap` needs the engine's log-probs: `rollout.backend=vllm` or `rollout.max_staleness` > 0",
        lambda cfg: cfg.algo.rollout_is_cap is None or cfg.rollout.backend == "vllm" or cfg.rollout.max_staleness > 0,
        lambda cfg: (
            f"algo.rollout_is_cap={cfg.algo.rollout_is_cap}: needs the engine's log-probs; "
            f"rollout.backend={cfg.rollout.backend} has none (use vllm, or rollout.max_staleness > 0: its engine "
            "reports them)"
        ),
    ),
    RuleBetween(
        ("algo.old_logp_source", "rollout.backend"),
        "`algo.old_logp_source=engine` needs `rollout.backend=vllm` (or `auto` with vLLM installed)",
        lambda cfg: cfg.algo.old_logp_source != "engine" or cfg.rollout.backend in ("vllm", "auto"),
        lambda cfg: (
            f"algo.old_logp_source=engine: rollout.backend={cfg.rollout.backend} reports no log-probs; use "
            "rollout.backend=vllm"
        ),
    ),
    RuleBetween(
        ("algo.old_logp_source", "model.dtype"),
        "`algo.old_logp_source=engine` needs `model.dtype=float32`",
        lambda cfg: cfg.algo.old_logp_source != "engine" or cfg.model.dtype == "float32",
        lambda cfg: (
            f"algo.old_logp_source=engine: model.dtype={cfg.model.dtype} makes vLLM's log-probs differ from "
            "the trainer's; use float32"
        ),
    ),
    RuleBetween(
        ("algo.old_logp_source", "rollout.top_p", "rollout.top_k"),
        "`algo.old_logp_source=engine` needs `rollout.top_p=1.0` and `rollout.top_k=null`",
        lambda cfg: cfg.algo.old_logp_source != "engine" or (cfg.rollout.top_p == 1.0 and cfg.rollout.top_k is None),
        lambda cfg: (
            "algo.old_logp_source=engine: vLLM's log-probs are of the top-p/top-k truncated distribution "
            f"(rollout.top_p={cfg.rollout.top_p}, rollout.top_k={cfg.rollout.top_k}), the trainer's of the full one; "
            "use top_p 1.0 and no top_k, or recompute"
        ),
    ),
    RuleBetween(
        ("algo.old_logp_source", "algo.rollout_is_cap"),
        "`algo.rollout_is_cap` needs `algo.old_logp_source=recompute`",
        lambda cfg: cfg.algo.old_logp_source == "recompute" or cfg.algo.rollout_is_cap is None,
        lambda cfg: (
            f"algo.old_logp_source={cfg.algo.old_logp_source}: algo.rollout_is_cap weighs by "
            "pi_old / pi_rollout from the recomputed pass; use recompute"
        ),
    ),
    # ---- rewards and their shaping
    RuleBetween(
        ("algo.truncated_in_group_stats", "algo.overlong_filtering"),
        "`algo.truncated_in_group_stats=false` needs `algo.overlong_filtering=true`",
        lambda cfg: cfg.algo.truncated_in_group_stats or cfg.algo.overlong_filtering,
        lambda cfg: (
            "algo.truncated_in_group_stats=false only applies with algo.overlong_filtering=true (masked "
            "rows need no advantage)"
        ),
    ),
    RuleBetween(
        ("algo.correct_reward", "algo.wrong_reward"),
        "`algo.correct_reward` > `algo.wrong_reward`",
        lambda cfg: cfg.algo.correct_reward > cfg.algo.wrong_reward,
        lambda cfg: "algo.correct_reward must be greater than algo.wrong_reward",
    ),
    RuleBetween(
        ("reward.grader", "reward.function"),
        "with `reward.function` set, `reward.grader` stays `auto`: the function grades every response",
        lambda cfg: cfg.reward.function is None or cfg.reward.grader == "auto",
        lambda cfg: (
            f"reward.grader={cfg.reward.grader}: reward.function={cfg.reward.function} grades every response, so no "
            "grader would run; leave reward.grader out (auto), or set reward.function=null to grade with it"
        ),
    ),
    RuleBetween(
        ("algo.overlong_buffer_tokens", "rollout.max_response_tokens", "algo.soft_overlong_punishment"),
        "with `algo.soft_overlong_punishment=true`, `algo.overlong_buffer_tokens` is in "
        "(0, `rollout.max_response_tokens`]",
        lambda cfg: (
            not cfg.algo.soft_overlong_punishment
            or 0 < cfg.algo.overlong_buffer_tokens <= cfg.rollout.max_response_tokens
        ),
        lambda cfg: (
            f"algo.overlong_buffer_tokens={cfg.algo.overlong_buffer_tokens}: must be in "
            f"(0, rollout.max_response_tokens={cfg.rollout.max_response_tokens}]; the buffer cannot be longer than the "
            "maximum length"
        ),
    ),
    # ---- the teacher (on-policy distillation)
    RuleBetween(
        ("teacher.coef", "teacher.path"),
        "`teacher.coef` > 0 needs `teacher.path` (with `teacher.coef=0` no teacher loads, whatever the path)",
        lambda cfg: cfg.teacher.coef == 0 or cfg.teacher.path is not None,
        lambda cfg: (
            f"teacher.coef={cfg.teacher.coef:g}: the teacher's term needs a teacher; set teacher.path to a model "
            "directory or Hub id with the student's tokenizer, or teacher.coef=0"
        ),
    ),
    RuleBetween(
        ("teacher.reward_advantage", "teacher.coef"),
        "`teacher.reward_advantage=false` needs `teacher.coef` > 0",
        lambda cfg: cfg.teacher.reward_advantage or cfg.teacher.coef > 0,
        lambda cfg: (
            "teacher.reward_advantage=false leaves the teacher's term as the only advantage, and teacher.coef=0 turns "
            "it off, so nothing would be learned; set teacher.coef and teacher.path, or teacher.reward_advantage=true"
        ),
    ),
    RuleBetween(
        ("teacher.signal", "teacher.coef"),
        "`teacher.signal=full` needs `teacher.coef` > 0",
        lambda cfg: cfg.teacher.signal == "sampled" or cfg.teacher.coef > 0,
        lambda cfg: (
            "teacher.signal=full: teacher.coef=0 turns the teacher off, so its KL would never be computed; set "
            "teacher.coef and teacher.path, or leave teacher.signal=sampled"
        ),
    ),
    RuleBetween(
        ("algo.screen_samples", "teacher.reward_advantage"),
        "with `teacher.reward_advantage=false` (pure distillation), `algo.screen_samples=0`",
        lambda cfg: cfg.teacher.reward_advantage or not cfg.algo.screen_samples,
        lambda cfg: (
            f"algo.screen_samples={cfg.algo.screen_samples}: screening drops prompts whose first responses agree, "
            "and pure distillation (teacher.reward_advantage=false) trains on every group; set algo.screen_samples=0"
        ),
    ),
    # ---- batches
    RuleBetween(
        ("train.prompts_per_step", "train.mini_batch_prompts"),
        "`train.mini_batch_prompts` divides `train.prompts_per_step`",
        lambda cfg: cfg.train.prompts_per_step % cfg.train.mini_batch_prompts == 0,
        lambda cfg: (
            f"train.prompts_per_step={cfg.train.prompts_per_step} is not divisible by "
            f"train.mini_batch_prompts={cfg.train.mini_batch_prompts}; pick a divisor so every optimizer update sees "
            "the same number of prompts"
        ),
    ),
    RuleBetween(
        ("train.share_prompt_prefix", "train.pack_sequences"),
        "`train.share_prompt_prefix=true` needs `train.pack_sequences` `auto` or `false`",
        lambda cfg: not (cfg.train.share_prompt_prefix and cfg.train.pack_sequences == "true"),
        lambda cfg: (
            "train.share_prompt_prefix=true shares a prompt across padded rows; packed rows "
            "(train.pack_sequences=true) have none: set train.pack_sequences=auto or false, or "
            "train.share_prompt_prefix=false"
        ),
    ),
    RuleBetween(  # the prompts' cache is indexed by layer: torch.compile specialises on it, a graph per layer
        ("train.kernels", "train.share_prompt_prefix"),
        "`train.share_prompt_prefix=true` excludes `compile` from `train.kernels`",
        lambda cfg: not (cfg.train.share_prompt_prefix and "compile" in cfg.train.kernels),
        lambda cfg: (
            "train.kernels=[compile] with train.share_prompt_prefix=true would compile one graph per decoder "
            "layer (the shared prompts' cache is indexed by the layer) and run the layers past torch's recompile limit "
            "eagerly: set train.share_prompt_prefix=false, or leave compile out of train.kernels"
        ),
    ),
    # ---- the run directory
    RuleBetween(
        ("run.overwrite", "run.resume"),
        "`run.overwrite=true` needs `run.resume=false`",
        lambda cfg: not (cfg.run.overwrite and cfg.run.resume),
        lambda cfg: "run.overwrite=true moves an earlier run aside to start afresh: set run.resume=false with it",
    ),
)


def rules_of(key: str) -> list[RuleBetween]:
    """The rules between settings that involve ``key``, in checking order."""
    return [rule for rule in RULES if key in rule.keys]


@functools.cache
def settings(cls: type | None = None, prefix: str = "") -> tuple[tuple[str, typing.Any, Rule | None], ...]:
    """(dotted key, annotation, rule) of every setting under ``cls`` (the whole Config), in declaration order."""
    out: list = []
    hints = typing.get_type_hints(Config if cls is None else cls)
    for f in dataclasses.fields(Config if cls is None else cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += settings(hints[f.name], f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", hints[f.name], f.metadata.get("rule")))
    return tuple(out)


def validate(cfg: Config) -> None:
    """Raise ConfigError for the first bad setting; the config is left as it is. Each setting's own range is
    declared on it (``field``); the rules between settings are ``RULES``."""
    check_fields(cfg, settings())
    for rule in RULES:
        if not rule.holds(cfg):
            raise ConfigError(rule.error(cfg))
