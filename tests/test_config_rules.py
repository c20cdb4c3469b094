"""The rules between settings (declared once, each with an example that breaks it), the defaults that depend on
other settings, and the keys a preset or the command line may not name: removed ones, and misspelt ones."""

import dataclasses
from pathlib import Path

import pytest

from dapo.config import ConfigError, load_config, settings, validate
from dapo.config import schema as config_module


@pytest.mark.parametrize("key", ["algo.prefilter", "algo.prefilter_floor", "algo.prefilter_level"])
def test_a_removed_setting_says_it_was_removed_and_what_to_use(key, tmp_path):
    """The prompt pre-filter was removed: a command line or a preset still naming one of its keys is told so."""
    with pytest.raises(
        ConfigError,
        match=rf"^{key}: no longer a setting; the prompt pre-filter was removed: .*"
        r"algo\.screen_samples=n",
    ):
        load_config("configs/demo.yaml", [f"{key}=true"])
    preset = tmp_path / "old.yaml"
    preset.write_text(f"base: {Path('configs/demo.yaml').resolve()}\nalgo:\n  {key.split('.')[1]}: true\n")
    with pytest.raises(ConfigError, match=rf"^{key}: no longer a setting"):
        load_config(preset)


# a config that breaks each rule between settings (and no earlier one), by the rule's settings
BREAKS_RULE = {
    ("algo.held_over_logp_source", "rollout.backend"): ["algo.held_over_logp_source=engine"],
    ("tools.timeout_s", "tools.cpu_s", "tools.python"): ["tools.python=true", "tools.timeout_s=4"],
    ("tools.filter_void_turns", "tools.python"): ["tools.filter_void_turns=true"],
    ("algo.screen_samples", "rollout.group_size", "algo.dynamic_sampling"): ["algo.screen_samples=8"],
    ("algo.screen_audit", "algo.screen_samples"): ["algo.screen_audit=0.1"],
    ("algo.rollout_is_mode", "algo.rollout_is_cap"): ["algo.rollout_is_mode=token_mask"],
    ("algo.rollout_is_cap", "algo.rollout_is_mode"): [
        "algo.rollout_is_mode=sequence_mask",
        "algo.rollout_is_cap=1",
        "rollout.backend=vllm",
    ],
    ("rollout.max_staleness", "algo.rollout_is_cap"): ["rollout.max_staleness=1", "algo.rollout_is_cap=null"],
    ("rollout.max_staleness", "algo.old_logp_source"): [
        "rollout.max_staleness=1",
        "algo.old_logp_source=engine",
        "rollout.backend=vllm",
    ],
    ("rollout.max_staleness", "algo.held_over_max_groups"): ["rollout.max_staleness=2", "algo.held_over_max_groups=4"],
    ("rollout.ranks", "rollout.max_staleness"): ["rollout.ranks=1"],
    ("rollout.ranks", "rollout.tensor_parallel_size"): [
        "rollout.ranks=1",
        "rollout.max_staleness=1",
        "rollout.tensor_parallel_size=2",
    ],
    ("algo.rollout_is_cap", "rollout.backend", "rollout.max_staleness"): ["algo.rollout_is_cap=2"],
    ("algo.old_logp_source", "rollout.backend"): ["algo.old_logp_source=engine"],
    ("algo.old_logp_source", "model.dtype"): [
        "algo.old_logp_source=engine",
        "rollout.backend=vllm",
        "model.dtype=bfloat16",
    ],
    ("algo.old_logp_source", "rollout.top_p", "rollout.top_k"): [
        "algo.old_logp_source=engine",
        "rollout.backend=vllm",
        "rollout.top_k=20",
    ],
    ("algo.old_logp_source", "algo.rollout_is_cap"): [
        "algo.old_logp_source=engine",
        "rollout.backend=vllm",
        "algo.rollout_is_cap=2",
    ],
    ("algo.truncated_in_group_stats", "algo.overlong_filtering"): ["algo.truncated_in_group_stats=false"],
    ("algo.correct_reward", "algo.wrong_reward"): ["algo.correct_reward=0", "algo.wrong_reward=0"],
    ("reward.grader", "reward.function"): ["reward.grader=math", "reward.function=my_rewards:reward"],
    ("algo.overlong_buffer_tokens", "rollout.max_response_tokens", "algo.soft_overlong_punishment"): [
        "algo.overlong_buffer_tokens=49"
    ],
    ("teacher.coef", "teacher.path"): ["teacher.coef=1"],
    ("teacher.reward_advantage", "teacher.coef"): ["teacher.reward_advantage=false"],
    ("teacher.signal", "teacher.coef"): ["teacher.signal=full"],
    ("algo.screen_samples", "teacher.reward_advantage"): [
        "teacher.path=assets/arith-base",
        "teacher.coef=1",
        "teacher.reward_advantage=false",
        "algo.screen_samples=4",
    ],
    ("train.prompts_per_step", "train.mini_batch_prompts"): ["train.mini_batch_prompts=5"],
    ("train.share_prompt_prefix", "train.pack_sequences"): [
        "train.share_prompt_prefix=true",
        "train.pack_sequences=true",
    ],
    ("train.kernels", "train.share_prompt_prefix"): ["train.share_prompt_prefix=true", "train.kernels=[compile]"],
    ("run.overwrite", "run.resume"): ["run.overwrite=true"],
}


def test_every_rule_between_settings_is_declared_with_real_settings_and_an_example_that_breaks_it():
    from dapo.config.rules import RULES

    keys = {key for key, _, _ in settings()}
    assert [rule.keys for rule in RULES] == list(BREAKS_RULE)  # a new rule gets an example here, in checking order
    for rule in RULES:
        assert set(rule.keys) <= keys and len(rule.keys) >= 2, rule.keys
        assert all(f"`{key}" in rule.says for key in rule.keys), rule.says  # the statement names every setting
        assert rule.holds(load_config(None, [])), rule.keys  # the defaults keep every rule


@pytest.mark.parametrize("keys", list(BREAKS_RULE), ids=lambda keys: keys[0])
def test_each_rule_between_settings_refuses_with_its_own_message_naming_its_first_setting(keys, monkeypatch):
    from dapo.config import read
    from dapo.config.rules import RULES

    monkeypatch.setattr(read, "validate", lambda cfg: None)  # the config as read, to check it here
    cfg = load_config(None, BREAKS_RULE[keys])
    broken = [rule for rule in RULES if not rule.holds(cfg)]
    assert [rule.keys for rule in broken][:1] == [keys]
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert str(err.value) == broken[0].error(cfg) and str(err.value).startswith(keys[0]), str(err.value)
    assert "\n" not in str(err.value)


def test_a_run_generating_ahead_fills_the_importance_cap_unless_given():
    from dapo.config import ASYNC_IS_CAP

    assert load_config(None, ["rollout.max_staleness=1"]).algo.rollout_is_cap == ASYNC_IS_CAP == 2.0
    assert load_config(None, ["rollout.max_staleness=1", "algo.rollout_is_cap=3"]).algo.rollout_is_cap == 3.0
    assert load_config(None, []).algo.rollout_is_cap is None
    left_out = r"^rollout\.max_staleness=1: .*set algo\.rollout_is_cap \(left out, it is 2\)$"
    with pytest.raises(ConfigError, match=left_out):
        load_config(None, ["rollout.max_staleness=1", "algo.rollout_is_cap=null"])


ALGO_KEYS = ", ".join(sorted(f.name for f in dataclasses.fields(config_module.AlgoConfig)))
SECTIONS = "algo, data, eval, model, reward, rollout, run, teacher, tools, train"


@pytest.mark.parametrize(
    "override, yaml_text, message",
    [
        ("algo.eps_hihg=0.3", "algo:\n  eps_hihg: 0.3\n",
         f"algo.eps_hihg: unknown key; did you mean algo.eps_high? (valid keys here: {ALGO_KEYS})"),
        ("trainer.lr=1", "trainer:\n  lr: 1\n",
         f"trainer: unknown key; did you mean train? (valid keys here: {SECTIONS})"),
        ("algo.zzz=1", "algo:\n  zzz: 1\n", f"algo.zzz: unknown key; valid keys here: {ALGO_KEYS}"),  # none close
    ],
)  # fmt: skip
def test_a_misspelt_key_is_told_the_closest_valid_one(override, yaml_text, message, tmp_path, capsys):
    from dapo import cli

    assert cli.main(["train", "configs/demo.yaml", override]) == 2  # from the command line
    assert capsys.readouterr().err == f"error: {message}\n"
    preset = tmp_path / "mine.yaml"  # from a preset file
    preset.write_text(f"base: {Path('configs/demo.yaml').resolve()}\n{yaml_text}")
    with pytest.raises(ConfigError) as err:
        load_config(preset)
    assert str(err.value) == message
