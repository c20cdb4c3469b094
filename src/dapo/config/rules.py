"""Checking a config: what each setting declares (its type's choices, a finite number, its ``Rule``), then the
rules between settings, one group per concern, in a fixed order; and the defaults that depend on other settings.
The first bad setting raises a ConfigError that names the key and the fix."""

from __future__ import annotations

import dataclasses
import functools
import math
import typing
from typing import Literal

from dapo.config.schema import Config, ConfigError, Rule, resolve_type

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
            a.old_logp_source == "recompute",
            why + "the clip is anchored at the trainer's weights at the step's start (recomputed log-probs); "
            "use algo.old_logp_source=recompute",
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
    """What uses the engine's sampling log-probs: algo.rollout_is_cap, algo.old_logp_source=engine."""
    a, r = cfg.algo, cfg.rollout
    _check(
        a.rollout_is_cap is None or r.backend == "vllm" or r.max_staleness > 0,
        f"algo.rollout_is_cap={a.rollout_is_cap}: needs the engine's log-probs; "
        f"rollout.backend={r.backend} has none (use vllm, or rollout.max_staleness > 0: its engine reports them)",
    )
    _check(
        a.old_logp_source != "engine" or r.backend in ("vllm", "auto"),
        f"algo.old_logp_source=engine: rollout.backend={r.backend} reports no log-probs; use rollout.backend=vllm",
    )
    _check(
        a.old_logp_source != "engine" or cfg.model.dtype == "float32",
        f"algo.old_logp_source=engine: model.dtype={cfg.model.dtype} makes vLLM's log-probs differ from the "
        "trainer's; use float32",
    )
    _check(
        a.old_logp_source != "engine" or (r.top_p == 1.0 and r.top_k is None),
        "algo.old_logp_source=engine: vLLM's log-probs are of the top-p/top-k truncated distribution "
        f"(rollout.top_p={r.top_p}, "
        f"rollout.top_k={r.top_k}), the trainer's of the full one; use top_p 1.0 and no top_k, or recompute",
    )
    _check(
        a.old_logp_source == "recompute" or a.rollout_is_cap is None,
        f"algo.old_logp_source={a.old_logp_source}: algo.rollout_is_cap weighs by pi_old / pi_rollout from the "
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
    declared on it (``field``); the rules between settings are ``dapo.config.RULES``."""
    check_fields(cfg, settings())
    for rules in RULES:
        rules(cfg)
