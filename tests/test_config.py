"""Config errors fail at start and name the key."""

import copy
import dataclasses
import typing
from pathlib import Path

import pytest
import torch

from dapo.config import ConfigError, config_from_dict, dump_yaml, load_config, settings, validate
from dapo.config import schema as config_module

PRESETS = sorted(str(p) for p in Path("configs").glob("*.yaml")) + [
    ["configs/ablation/base.yaml", str(p)] for p in sorted(Path("configs/ablation").glob("[0-9]_*.yaml"))
]


def _fields(predicate):
    """(dotted key, annotation) of every setting whose resolved annotation satisfies ``predicate``."""
    out = []
    for section in dataclasses.fields(config_module.Config):
        hints = typing.get_type_hints(
            section.type if isinstance(section.type, type) else getattr(config_module, section.type)
        )
        out += [(f"{section.name}.{name}", tp) for name, tp in hints.items() if predicate(tp)]
    return out


LITERAL_FIELDS = _fields(lambda tp: typing.get_origin(tp) is typing.Literal)
OPTIONAL_FIELDS = _fields(lambda tp: type(None) in typing.get_args(tp))


def test_presets_load():
    cfg = load_config("configs/dapo_qwen2.5_32b.yaml")
    assert (cfg.algo.eps_low, cfg.algo.eps_high) == (0.2, 0.28)
    assert cfg.train.prompts_per_step // cfg.train.mini_batch_prompts == 16  # 16 updates per rollout step
    assert cfg.rollout.group_size == 16 and cfg.rollout.max_response_tokens == 20480
    assert cfg.algo.overlong_buffer_tokens == 4096 and cfg.algo.kl_coef == 0.0
    assert (cfg.eval.n, cfg.eval.top_p, cfg.train.lr, cfg.train.warmup_steps) == (32, 0.7, 1e-6, 20)
    assert cfg.rollout.tensor_parallel_size == 4  # the reference's gen_tp: 1/4 of the bf16 weights per GPU
    assert cfg.algo.held_over_max_groups == 0 and cfg.algo.rollout_is_cap is None and cfg.reward.grader == "dapo"
    assert load_config("configs/dapo_qwen2.5_7b.yaml").rollout.tensor_parallel_size == 1
    grpo = load_config("configs/grpo_baseline.yaml")  # inherits the paper preset through `base:`
    assert grpo.algo.eps_high == 0.2 and grpo.algo.loss_agg == "seq-mean-token-mean" and grpo.algo.kl_coef > 0
    assert not grpo.algo.dynamic_sampling and not grpo.algo.soft_overlong_punishment
    assert grpo.train.prompts_per_step == 512


def test_dotted_overrides_and_types():
    cfg = load_config(
        "configs/demo.yaml",
        [
            "algo.eps_high=0.3",
            "train.total_steps=3",
            "algo.dual_clip=null",
            "eval.benchmarks=[arith,aime2024]",
            "algo.dynamic_sampling=false",
        ],
    )
    assert cfg.algo.eps_high == 0.3 and cfg.train.total_steps == 3 and cfg.algo.dual_clip is None
    assert cfg.eval.benchmarks == ["arith", "aime2024"] and cfg.algo.dynamic_sampling is False


@pytest.mark.parametrize(
    "override, key",
    [
        ("algo.eps_hgh=0.3", "algo.eps_hgh"),  # unknown key
        ("trainer.lr=1", "trainer"),  # unknown section
        ("train.total_steps=ten", "train.total_steps"),  # wrong type
        ("algo.dynamic_sampling=maybe", "algo.dynamic_sampling"),
        ("algo.eps_low=1.5", "algo.eps_low"),  # out of range
        ("algo.overlong_buffer_tokens=100", "algo.overlong_buffer_tokens"),  # buffer longer than max length
        ("train.mini_batch_prompts=5", "train.prompts_per_step"),  # does not divide
        ("algo.loss_agg=mean", "algo.loss_agg"),
        ("rollout.backend=sglang", "rollout.backend"),
        ("rollout.group_size=1", "rollout.group_size"),
        ("rollout.tensor_parallel_size=0", "rollout.tensor_parallel_size"),
        ("rollout.kv_cache_gib=-1", "rollout.kv_cache_gib"),
        ("rollout.gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization"),
        ("algo.held_over_max_groups=-1", "algo.held_over_max_groups"),
        ("algo.held_over_logp_source=engine", "algo.held_over_logp_source"),  # the hf engine reports no log-probs
        ("algo.rollout_is_cap=0.5", "algo.rollout_is_cap"),  # below 1
        ("algo.rollout_is_cap=2", "algo.rollout_is_cap"),  # needs vllm's log-probs
        ("algo.truncated_in_group_stats=false", "algo.truncated_in_group_stats"),  # without overlong filtering
        ("algo.old_logp_source=engine", "algo.old_logp_source"),  # the hf engine reports no log-probs
        ("algo.old_logp_source=latest", "algo.old_logp_source"),
        ("reward.grader=minerva", "reward.grader"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config("configs/demo.yaml", [override])
    assert key in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("algo: [1, 2]\n")
    with pytest.raises(ConfigError, match="algo"):
        load_config(bad)
    with pytest.raises(ConfigError, match="key=value"):
        load_config(None, ["algo.eps_high"])
    bad.write_text("base: 3\n")
    with pytest.raises(ConfigError, match="base: expected a preset path or a list"):
        load_config(bad)


def test_a_preset_on_several_bases_applies_them_in_order(tmp_path):
    (tmp_path / "a.yaml").write_text("algo:\n  eps_high: 0.3\n  kl_coef: 0.1\n")
    (tmp_path / "b.yaml").write_text("algo:\n  kl_coef: 0.2\n")
    (tmp_path / "c.yaml").write_text("base: [a.yaml, b.yaml]\ntrain:\n  total_steps: 7\n")
    cfg = load_config(tmp_path / "c.yaml")
    assert (cfg.algo.eps_high, cfg.algo.kl_coef, cfg.train.total_steps) == (0.3, 0.2, 7)


@pytest.mark.parametrize("name", ["..", ".", "", "/tmp/x", "a/b", "../x", "a\\b", "x\0y"])
def test_run_name_is_one_plain_directory_name(name, tmp_path):
    with pytest.raises(ConfigError, match=r"run.name=.*must be one plain directory name"):
        config_from_dict({"run": {"dir": str(tmp_path / "sub"), "name": name}})
    if "\0" not in name:  # YAML refuses a NUL before the check sees it
        with pytest.raises(ConfigError, match=r"run.name=.*must be one plain directory name"):
            load_config("configs/demo.yaml", [f"run.dir={tmp_path / 'sub'}", f"run.name={name}"])


def test_an_override_yaml_cannot_read_is_a_config_error():
    with pytest.raises(ConfigError, match=r"override 'run.name=x\\x00y': not a valid value"):
        load_config("configs/demo.yaml", ["run.name=x\0y"])


def test_overwrite_needs_a_fresh_start():
    with pytest.raises(ConfigError, match="run.overwrite=true .* set run.resume=false"):
        load_config("configs/demo.yaml", ["run.overwrite=true"])
    assert load_config("configs/demo.yaml", ["run.overwrite=true", "run.resume=false"]).run.overwrite


@pytest.mark.parametrize(
    "override, key",
    [
        ("reward.timeout_s=inf", "reward.timeout_s"),  # grading without a time limit
        ("reward.timeout_s=nan", "reward.timeout_s"),
        ("train.grad_clip=.inf", "train.grad_clip"),  # no gradient clipping
        ("algo.dual_clip=inf", "algo.dual_clip"),  # null is how dual-clip is switched off
        ("algo.overlong_penalty_factor=inf", "algo.overlong_penalty_factor"),
        ("train.betas=[0.9,nan]", "train.betas"),
        ("train.weight_decay=nan", "train.weight_decay"),
        ("data.max_prompt_tokens=0", "data.max_prompt_tokens"),  # ids[-0:] keeps every token
    ],
)
def test_settings_that_would_switch_a_limit_off_are_refused(override, key):
    with pytest.raises(ConfigError) as err:
        load_config("configs/demo.yaml", [override])
    assert str(err.value).startswith(key) and "\n" not in str(err.value)


def test_every_choice_setting_is_found_by_its_type():
    keys = {key for key, _ in LITERAL_FIELDS}
    assert {
        "algo.loss_agg",
        "reward.grader",
        "model.dtype",
        "data.template",
        "rollout.backend",
        "algo.kl_kind",
        "algo.filter_metric",
        "algo.on_max_gen_rounds",
        "algo.held_over_logp_source",
        "train.pack_sequences",
        "model.device",
        "data.task_difficulty",
    } <= keys


@pytest.mark.parametrize("key, tp", LITERAL_FIELDS, ids=[k for k, _ in LITERAL_FIELDS])
def test_a_choice_setting_refuses_other_values_and_lists_its_choices(key, tp):
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"{key}=no-such-choice"])
    msg = str(err.value)
    assert msg.startswith(f"{key}='no-such-choice': choose ") and "\n" not in msg
    assert all(choice in msg for choice in typing.get_args(tp))
    for choice in typing.get_args(tp):  # and takes each of its choices
        section, name = key.split(".")
        extra = (
            ["rollout.backend=vllm"]
            if (key, choice) in (("algo.held_over_logp_source", "engine"), ("algo.old_logp_source", "engine"))
            else []
        )
        if key == "algo.rollout_is_mode" and choice != "token_truncate":  # a sequence mode needs the cap it uses
            extra = ["rollout.backend=vllm", "algo.rollout_is_cap=2"]
        if key == "teacher.signal" and choice == "full":  # a teacher to run
            extra = ["teacher.path=assets/arith-base", "teacher.coef=1"]
        assert getattr(getattr(load_config(None, [f"{key}={choice}", *extra]), section), name) == choice


def test_a_choice_setting_built_in_code_is_checked_too():
    cfg = config_module.Config()
    cfg.algo.loss_agg = "mean"
    with pytest.raises(
        ConfigError, match="algo.loss_agg='mean': choose token-mean, seq-mean-token-mean or seq-mean-token-sum-norm"
    ):
        validate(cfg)


@pytest.mark.parametrize("raw, expected", [("true", "true"), ("false", "false"), ("True", "true"), ("auto", "auto")])
def test_pack_sequences_takes_yaml_booleans_as_their_spelling(raw, expected, tmp_path):
    assert load_config(None, [f"train.pack_sequences={raw}"]).train.pack_sequences == expected
    preset = tmp_path / "p.yaml"
    preset.write_text(f"train:\n  pack_sequences: {raw}\n")
    assert load_config(preset).train.pack_sequences == expected


@pytest.mark.parametrize("preset", PRESETS, ids=str)
def test_validate_leaves_the_config_as_it_is(preset):
    cfg = load_config(preset)
    before = copy.deepcopy(cfg)
    validate(cfg)
    assert cfg == before
    cfg.train.pack_sequences = "TRUE"  # no longer lower-cased in place: refused
    with pytest.raises(ConfigError, match="train.pack_sequences='TRUE': choose auto, true or false"):
        validate(cfg)
    assert cfg.train.pack_sequences == "TRUE"


def test_unset_settings_round_trip_through_the_saved_config(tmp_path):
    keys = [key for key, _ in OPTIONAL_FIELDS]
    assert {
        "rollout.top_k",
        "rollout.kv_cache_gib",
        "algo.max_gen_rounds",
        "algo.rollout_is_cap",
        "train.micro_batch_size",
        "eval.every_steps",
        "eval.num_problems",
        "eval.max_response_tokens",
        "eval.n",
        "eval.temperature",
        "eval.top_p",
        "run.save_every",
        "algo.dual_clip",
    } <= set(keys)
    unset = load_config("configs/demo.yaml", [f"{key}=null" for key in keys])
    saved = tmp_path / "config.yaml"
    saved.write_text(dump_yaml(unset))
    again = load_config(saved)
    assert again == unset and all(getattr(getattr(again, k.split(".")[0]), k.split(".")[1]) is None for k in keys)
    set_ = load_config("configs/demo.yaml", ["rollout.top_k=5", "rollout.kv_cache_gib=0.5", "eval.every_steps=3"])
    saved.write_text(dump_yaml(set_))
    assert load_config(saved) == set_


@pytest.mark.parametrize(
    "key",
    [
        "rollout.top_k",
        "rollout.kv_cache_gib",
        "algo.max_gen_rounds",
        "train.micro_batch_size",
        "eval.every_steps",
        "eval.num_problems",
        "eval.max_response_tokens",
        "eval.n",
        "run.save_every",
    ],
)
def test_zero_is_not_a_way_to_say_unset(key):
    with pytest.raises(ConfigError) as err:
        load_config("configs/demo.yaml", [f"{key}=0"])
    assert str(err.value).startswith(f"{key}=0") and ": must be > 0, or null (" in str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "overrides, fix",
    [
        (["algo.old_logp_source=engine", "rollout.backend=vllm", "model.dtype=bfloat16"], "use float32"),
        (["algo.old_logp_source=engine", "rollout.backend=vllm", "rollout.top_p=0.7"], "use top_p 1.0"),
        (["algo.old_logp_source=engine", "rollout.backend=vllm", "rollout.top_k=20"], "use top_p 1.0"),
        (["algo.old_logp_source=engine", "rollout.backend=vllm", "algo.rollout_is_cap=2"], "use recompute"),
    ],
)
def test_old_logp_sources_refuse_what_would_make_them_inexact(overrides, fix):
    with pytest.raises(ConfigError) as err:
        load_config("configs/demo.yaml", overrides)
    assert str(err.value).startswith("algo.old_logp_source=") and fix in str(err.value) and "\n" not in str(err.value)
    auto = load_config("configs/demo.yaml", ["algo.old_logp_source=engine", "rollout.backend=auto"])
    assert auto.algo.old_logp_source == "engine"
    assert config_module.AlgoConfig().old_logp_source == "recompute"  # the reference
    # the key's earlier name is read as it: presets and saved configs that still say algo.old_logp keep working
    old_name = load_config("configs/demo.yaml", ["algo.old_logp=engine", "rollout.backend=auto"])
    assert old_name.algo.old_logp_source == "engine"


def test_a_kept_surplus_of_zero_groups_is_a_count():
    # held_over_max_groups is not an unset-able setting: 0 holds over no surplus group (the reference's behaviour)
    assert config_module.AlgoConfig().held_over_max_groups == 0
    assert load_config(None, ["algo.held_over_max_groups=0"]).algo.held_over_max_groups == 0


def test_code_that_acts_on_a_choice_knows_exactly_its_choices():
    from dapo import cli
    from dapo.algorithm import losses
    from dapo.data import prompts
    from dapo.data.arith import DIFFICULTIES
    from dapo.model.loading import DTYPES
    from dapo.rewards.graders import GRADERS

    assert tuple(DTYPES) == typing.get_args(config_module.Dtype)
    assert set(GRADERS) | {"auto"} == set(typing.get_args(config_module.Grader))
    assert set(DIFFICULTIES) == set(typing.get_args(config_module.TaskDifficulty))
    for mode in typing.get_args(config_module.LossAgg):  # the losses take every choice the config offers
        assert losses.aggregate(torch.ones(1, 2), torch.ones(1, 2), mode, norm_length=2).item() == 1.0
    for kind in typing.get_args(config_module.KlKind):
        assert losses.kl_penalty(torch.zeros(1), torch.zeros(1), kind).item() == 0.0
    assert prompts._templates() == typing.get_args(config_module.Template)
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command").choices["import-model"]
    assert tuple(next(a for a in sub._actions if a.dest == "dtype").choices) == typing.get_args(config_module.Dtype)


def _settings(cfg, bench_name, **kw):
    from dapo.evaluation import BENCHMARKS, sampling_settings

    return sampling_settings(BENCHMARKS[bench_name], cfg, **kw)


def test_dapo_eval_without_a_preset_is_aime_2024_as_the_paper_samples_it():
    from dapo.cli import eval_config

    cfg = eval_config(None, None, [])
    assert cfg.eval.benchmarks == ["aime2024"] and cfg.rollout.backend == "hf" and cfg.reward.grader == "auto"
    assert _settings(cfg, "aime2024") == {"n": 32, "temperature": 1.0, "top_p": 0.7, "max_new_tokens": 20480}
    cfg = eval_config(
        None,
        None,
        [
            "eval.n=4",
            "eval.max_response_tokens=512",
            "eval.benchmarks=[aime2024,math500]",
            "reward.num_workers=1",
            "model.dtype=bfloat16",
        ],
    )
    assert _settings(cfg, "aime2024") == {"n": 4, "temperature": 1.0, "top_p": 0.7, "max_new_tokens": 512}
    assert cfg.eval.benchmarks == ["aime2024", "math500"] and cfg.reward.num_workers == 1
    assert cfg.model.dtype == "bfloat16"


def test_dapo_eval_reads_the_run_then_the_preset_then_the_overrides(tmp_path):
    from dapo.cli import eval_config

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(dump_yaml(load_config("configs/demo.yaml", ["eval.n=6", "data.template=raw"])))
    cfg = eval_config(None, run, [])
    assert cfg.eval.benchmarks == ["arith"] and cfg.eval.n == 6 and cfg.data.template == "raw"
    assert _settings(cfg, "arith") == {"n": 6, "temperature": 1.0, "top_p": 1.0, "max_new_tokens": 48}
    cfg = eval_config("configs/smollm2_135m.yaml", run, ["eval.temperature=0.5"])
    assert cfg.eval.benchmarks == ["word"] and cfg.eval.n == 4 and cfg.eval.temperature == 0.5
    assert cfg.data.template == "raw"  # the run's, which the preset leaves alone
    assert eval_config("demo.yaml", None, []).eval.benchmarks == ["arith"]  # a preset by name, as for train
    with pytest.raises(ConfigError, match="eval.n=0"):
        eval_config(None, run, ["eval.n=0"])


@pytest.mark.parametrize("preset", PRESETS, ids=str)
def test_evaluation_during_training_samples_as_the_preset_says(preset):
    """Unset eval.* take the benchmark's own setting; the shipped presets set what differs from it, so
    their in-training evaluation is sampled as before (and never beyond the rollout engine's lengths)."""
    cfg = load_config(preset)
    for name in cfg.eval.benchmarks:
        got = _settings(cfg, name, in_training=True)
        expected = {
            "n": cfg.eval.n or 4,
            "temperature": 1.0 if cfg.eval.temperature is None else cfg.eval.temperature,
            "top_p": 1.0 if cfg.eval.top_p is None else cfg.eval.top_p,
            "max_new_tokens": cfg.eval.max_response_tokens or cfg.rollout.max_response_tokens,
        }
        assert got == expected


def test_shipped_presets_and_files_resolve_from_any_directory(tmp_path, monkeypatch):
    from dapo.config import PRESET_DIR, preset_names, resolve_preset
    from dapo.config.shipped import SHARE, shipped

    monkeypatch.chdir(tmp_path)
    for given, found in [
        ("demo", "demo.yaml"),
        ("demo.yaml", "demo.yaml"),
        ("configs/demo.yaml", "demo.yaml"),
        ("ablation/base", "ablation/base.yaml"),
        ("configs/ablation/base.yaml", "ablation/base.yaml"),
        ("elsewhere/smollm2_135m.yaml", "smollm2_135m.yaml"),
    ]:
        assert resolve_preset(given) == PRESET_DIR / found, given
    assert resolve_preset("nothing") == Path("nothing")
    assert {"demo", "smollm2_135m", "ablation/base", "ablation/1_grpo"} <= set(preset_names())
    assert load_config("demo").run.name == "demo"
    with pytest.raises(
        ConfigError,
        match=r"^config file nothing does not exist; give a YAML file or a shipped "
        r"preset's name \(ablation/1_grpo, .*demo, .*smollm2_135m.*\)$",
    ):
        load_config("nothing")
    # a shipped file is read from the package when the current directory has none, and from there when it has
    assert shipped("assets/arith-base") == SHARE / "assets/arith-base"
    root = Path(__file__).resolve().parents[1]
    assert shipped("data/aime2025/test.jsonl").read_bytes() == (root / "data/aime2025/test.jsonl").read_bytes()
    assert shipped("other/arith-base") == Path("other/arith-base")
    (tmp_path / "assets" / "arith-base").mkdir(parents=True)
    assert shipped("assets/arith-base") == Path("assets/arith-base")


# ---- a value is read as its setting's type --------------------------------------------------------
@pytest.mark.parametrize("text", ["off", "on", "yes", "no", "true", "null_run", "123", "1e3", "0x10"])
def test_a_string_setting_keeps_the_text_as_written(text, tmp_path):
    assert load_config("configs/demo.yaml", [f"run.name={text}"]).run.name == text
    preset = tmp_path / "p.yaml"
    preset.write_text(f"run:\n  name: {text}\n  dir: {text}\n")
    cfg = load_config(preset)
    assert (cfg.run.name, cfg.run.dir) == (text, text)
    assert load_config(None, [f"eval.benchmarks=[{text},arith]"]).eval.benchmarks == [text, "arith"]


@pytest.mark.parametrize(
    "key, raw, shown, kind",
    [
        ("train.lr", "abc", "'abc'", "a number"),
        ("train.lr", "[1]", "[1]", "a number"),
        ("train.total_steps", "2.5", "2.5", "an integer"),
        ("algo.dynamic_sampling", "maybe", "'maybe'", "true or false"),
        ("run.name", "[a]", "['a']", "a string"),
    ],
)
def test_a_value_of_the_wrong_type_is_refused_in_one_line(key, raw, shown, kind, tmp_path):
    expected = f"{key}: expected {kind}, got {shown}"
    with pytest.raises(ConfigError) as err:
        load_config("configs/demo.yaml", [f"{key}={raw}"])
    assert str(err.value) == expected
    section, name = key.split(".")
    preset = tmp_path / "p.yaml"
    preset.write_text(f"{section}:\n  {name}: {raw}\n")
    with pytest.raises(ConfigError) as err:
        load_config(preset)
    assert str(err.value) == expected


@pytest.mark.parametrize(
    "raw, expected",
    [("true", True), ("false", False), ("True", True), ("FALSE", False), ("yes", True), ("no", False)]
    + [("on", True), ("off", False), ("1", True), ("0", False)],
)
def test_a_bool_setting_takes_true_false_and_their_yaml_spellings(raw, expected, tmp_path):
    assert load_config(None, [f"algo.dynamic_sampling={raw}"]).algo.dynamic_sampling is expected
    preset = tmp_path / "p.yaml"
    preset.write_text(f"algo:\n  dynamic_sampling: {raw}\n")
    assert load_config(preset).algo.dynamic_sampling is expected
    preset.write_text(f"algo:\n  dynamic_sampling: '{raw}'\n")  # quoted, as before
    assert load_config(preset).algo.dynamic_sampling is expected


BOUNDED = [(key, rule) for key, _, rule in settings() if rule is not None and rule.check is None]


@pytest.mark.parametrize("key, rule", BOUNDED, ids=[k for k, _ in BOUNDED])
def test_a_declared_range_is_refused_with_the_key_and_the_range(key, rule):
    """Every setting with declared bounds refuses a value just past each bound, naming the key and the range."""
    outside = [rule.gt, None if rule.ge is None else rule.ge - 1, rule.lt, None if rule.le is None else rule.le + 1]
    for value in [v for v in outside if v is not None]:
        with pytest.raises(ConfigError) as err:
            load_config("configs/demo.yaml", [f"{key}={value}"])
        msg = str(err.value)
        assert msg.startswith(f"{key}=") and ": must be " in msg and "\n" not in msg, msg
        bound = next(b for b in (rule.gt, rule.ge, rule.lt, rule.le) if b is not None)
        assert f"{bound:g}" in msg and (rule.null == "" or f"or null ({rule.null})" in msg)


def test_the_range_message_reads_as_declared():
    with pytest.raises(ConfigError, match=r"^rollout.top_p=1.5: must be in \(0, 1\]$"):
        load_config(None, ["rollout.top_p=1.5"])
    with pytest.raises(ConfigError, match=r"^rollout.top_k=-2: must be > 0, or null \(no top-k\)$"):
        load_config(None, ["rollout.top_k=-2"])
    with pytest.raises(ConfigError, match=r"^algo.eps_high=11.0: must be in \(0, 10\]; the paper uses 0.28$"):
        load_config(None, ["algo.eps_high=11"])
    rule = config_module.Rule(ge=0, lt=1, unit="tokens", why="why")
    assert rule.broken("a.b", 1) == "a.b=1: must be in [0, 1) tokens; why" and rule.broken("a.b", 0) is None


def test_keys_of_earlier_versions_are_read_with_one_line_naming_the_new_key():
    with pytest.warns(UserWarning) as caught:
        cfg = load_config("configs/demo.yaml", ["algo.buffer_max_groups=3", "algo.buffer_logp=trainer"])
    assert cfg.algo.held_over_max_groups == 3 and cfg.algo.held_over_logp_source == "recompute"
    assert [str(w.message) for w in caught] == [
        "algo.buffer_max_groups is now algo.held_over_max_groups (read as algo.held_over_max_groups=3); rename it: "
        "the old name is read until 0.3",
        "algo.buffer_logp is now algo.held_over_logp_source (read as algo.held_over_logp_source=recompute); rename "
        "it: the old name is read until 0.3",
    ]
