"""Config errors fail at start and name the key."""

import pytest

from dapo.config import ConfigError, config_from_dict, load_config


def test_presets_load():
    cfg = load_config("configs/dapo_qwen2.5_32b.yaml")
    assert (cfg.algo.eps_low, cfg.algo.eps_high) == (0.2, 0.28)
    assert cfg.train.prompts_per_step // cfg.train.mini_batch_prompts == 16  # 16 updates per rollout step
    assert cfg.rollout.group_size == 16 and cfg.rollout.max_response_tokens == 20480
    assert cfg.algo.overlong_buffer_tokens == 4096 and cfg.algo.kl_coef == 0.0
    assert (cfg.eval.n, cfg.eval.top_p, cfg.train.lr, cfg.train.warmup_steps) == (32, 0.7, 1e-6, 20)
    assert cfg.rollout.tensor_parallel_size == 4  # the reference's gen_tp: 1/4 of the bf16 weights per GPU
    assert cfg.algo.buffer_max_groups == 0 and cfg.algo.rollout_is_cap == 0.0 and cfg.reward.grader == "dapo"
    assert load_config("configs/dapo_qwen2.5_7b.yaml").rollout.tensor_parallel_size == 1
    grpo = load_config("configs/grpo_baseline.yaml")  # inherits the paper preset through `base:`
    assert grpo.algo.eps_high == 0.2 and grpo.algo.loss_agg == "seq-mean-token-mean" and grpo.algo.kl_coef > 0
    assert not grpo.algo.dynamic_sampling and not grpo.algo.soft_overlong_punishment
    assert grpo.train.prompts_per_step == 512


def test_dotted_overrides_and_types():
    cfg = load_config("configs/demo.yaml", ["algo.eps_high=0.3", "train.total_steps=3", "algo.dual_clip=null",
                                            "eval.benchmarks=[arith,aime2024]", "algo.dynamic_sampling=false"])
    assert cfg.algo.eps_high == 0.3 and cfg.train.total_steps == 3 and cfg.algo.dual_clip is None
    assert cfg.eval.benchmarks == ["arith", "aime2024"] and cfg.algo.dynamic_sampling is False


@pytest.mark.parametrize("override, key", [
    ("algo.eps_hgh=0.3", "algo.eps_hgh"),                  # unknown key
    ("trainer.lr=1", "trainer"),                           # unknown section
    ("train.total_steps=ten", "train.total_steps"),        # wrong type
    ("algo.dynamic_sampling=maybe", "algo.dynamic_sampling"),
    ("algo.eps_low=1.5", "algo.eps_low"),                  # out of range
    ("algo.overlong_buffer_tokens=100", "algo.overlong_buffer_tokens"),  # buffer longer than max length
    ("train.mini_batch_prompts=5", "train.prompts_per_step"),            # does not divide
    ("algo.loss_agg=mean", "algo.loss_agg"),
    ("rollout.backend=sglang", "rollout.backend"),
    ("rollout.group_size=1", "rollout.group_size"),
    ("rollout.tensor_parallel_size=0", "rollout.tensor_parallel_size"),
    ("rollout.kv_cache_gib=-1", "rollout.kv_cache_gib"),
    ("rollout.gpu_memory_utilization=1.5", "rollout.gpu_memory_utilization"),
    ("algo.buffer_max_groups=-1", "algo.buffer_max_groups"),
    ("algo.buffer_logp=engine", "algo.buffer_logp"),            # the hf engine reports no log-probs
    ("algo.rollout_is_cap=0.5", "algo.rollout_is_cap"),          # below 1
    ("algo.rollout_is_cap=2", "algo.rollout_is_cap"),            # needs vllm's log-probs
    ("algo.truncated_in_group_stats=false", "algo.truncated_in_group_stats"),  # without overlong filtering
    ("reward.grader=minerva", "reward.grader"),
])
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


@pytest.mark.parametrize("override, key", [
    ("reward.timeout_s=inf", "reward.timeout_s"),  # grading without a time limit
    ("reward.timeout_s=nan", "reward.timeout_s"),
    ("train.grad_clip=.inf", "train.grad_clip"),  # no gradient clipping
    ("algo.dual_clip=inf", "algo.dual_clip"),  # null is how dual-clip is switched off
    ("algo.overlong_penalty_factor=inf", "algo.overlong_penalty_factor"),
    ("train.betas=[0.9,nan]", "train.betas"),
    ("train.weight_decay=nan", "train.weight_decay"),
    ("data.max_prompt_tokens=0", "data.max_prompt_tokens"),  # ids[-0:] keeps every token
])
def test_settings_that_would_switch_a_limit_off_are_refused(override, key):
    with pytest.raises(ConfigError) as err:
        load_config("configs/demo.yaml", [override])
    assert str(err.value).startswith(key) and "\n" not in str(err.value)
