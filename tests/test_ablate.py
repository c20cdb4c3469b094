"""The ablation study: each row adds exactly one technique; `dapo ablate` trains, reports and resumes."""

import json
import math
from pathlib import Path

import pytest

from dapo import ablate
from dapo.config import ConfigError, load_config, to_dict

REPO = Path(__file__).resolve().parents[1]
ROWS = REPO / "configs" / "ablation"


def flat(cfg) -> dict:
    out = {}
    for section, values in to_dict(cfg).items():
        for k, v in values.items():
            out[f"{section}.{k}"] = v
    return out


# row -> the one key it changes and its new value (the paper's Table 1, then the KL term and overlong
# filtering go, which gives the recipe the reference runs)
EXPECTED = {
    "2_overlong_filtering": ("algo.overlong_filtering", True),
    "3_clip_higher": ("algo.eps_high", 0.28),
    "4_soft_overlong": ("algo.soft_overlong_punishment", True),
    "5_token_loss": ("algo.loss_agg", "token-mean"),
    "6_dynamic_sampling": ("algo.dynamic_sampling", True),
    "7_no_kl": ("algo.kl_coef", 0.0),
    "8_no_overlong_filtering": ("algo.overlong_filtering", False),
}
# the technique switches: what the last row must share with the DAPO preset on any base
SWITCHES = (
    "eps_low",
    "eps_high",
    "loss_agg",
    "kl_coef",
    "kl_kind",
    "dual_clip",
    "correct_reward",
    "wrong_reward",
    "soft_overlong_punishment",
    "overlong_penalty_factor",
    "overlong_filtering",
    "truncated_in_group_stats",
    "dynamic_sampling",
    "filter_metric",
    "scale_adv_by_std",
    "held_over_max_groups",
    "rollout_is_cap",
)
DAPO = REPO / "configs" / "dapo_qwen2.5_32b.yaml"


@pytest.mark.parametrize("base", ["configs/ablation/base.yaml", "configs/dapo_qwen2.5_32b.yaml"])
def test_each_row_adds_exactly_one_technique(base):
    rows = ablate.find_rows(ROWS)
    assert [r.stem for r in rows] == ["1_grpo", *EXPECTED]
    cfgs = [flat(load_config([REPO / base, r])) for r in rows]
    first = cfgs[0]
    # naive GRPO: symmetric clip, sample-level loss, KL loss, hard truncation penalty, no filtering or resampling
    assert (first["algo.eps_low"], first["algo.eps_high"], first["algo.loss_agg"]) == (0.2, 0.2, "seq-mean-token-mean")
    assert first["algo.kl_coef"] == 0.001 and first["algo.kl_kind"] == "k3" and first["algo.dual_clip"] == 10.0
    assert not (
        first["algo.soft_overlong_punishment"] or first["algo.overlong_filtering"] or first["algo.dynamic_sampling"]
    )
    for row, prev, cur in zip(rows[1:], cfgs, cfgs[1:]):
        diff = {k: (prev[k], cur[k]) for k in cur if cur[k] != prev[k]}
        key, value = EXPECTED[row.stem]
        assert diff == {key: (prev[key], value)}, row.stem
        assert (ROWS / row.name).read_text().count("base:") == 1  # each row inherits the previous one


@pytest.mark.parametrize("base", ["configs/ablation/base.yaml", "configs/dapo_qwen2.5_32b.yaml"])
def test_the_last_row_is_the_dapo_preset(base):
    last = load_config([REPO / base, ablate.find_rows(ROWS)[-1]]).algo
    dapo = load_config(DAPO).algo
    assert {k: getattr(last, k) for k in SWITCHES} == {k: getattr(dapo, k) for k in SWITCHES}
    assert (last.eps_high, last.loss_agg, last.kl_coef, last.overlong_filtering, last.dynamic_sampling) == (
        0.28,
        "token-mean",
        0.0,
        False,
        True,
    )
    if base.endswith("32b.yaml"):  # on the paper's scale, the whole algorithm section
        assert last == dapo


def test_naive_grpo_has_one_definition():
    baseline = load_config(REPO / "configs" / "grpo_baseline.yaml")
    assert baseline.algo == load_config([DAPO, ROWS / "1_grpo.yaml"]).algo
    assert baseline.train == load_config(DAPO).train  # the paper preset's scale
    assert "algo:" not in (REPO / "configs" / "grpo_baseline.yaml").read_text()


def test_a_run_directory_of_another_config_is_refused(tmp_path):
    base_run, runs = ablate.plan(REPO / "configs/ablation/base.yaml", ablate.find_rows(ROWS, ["1"]), [0], tmp_path, [])
    run = runs[0]
    run.dir.mkdir(parents=True)
    (run.dir / "ablation_config.yaml").write_text(
        ablate.dump_yaml(run.cfg).replace("total_steps: 40", "total_steps: 80")
    )
    assert not ablate.conflicts(run)  # a longer (or shorter) study continues the run from its checkpoint
    (run.dir / "ablation_config.yaml").write_text(ablate.dump_yaml(run.cfg).replace("kl_coef: 0.001", "kl_coef: 0.04"))
    assert ablate.conflicts(run)  # an old definition of the row would be resumed and reported as the new one
    with pytest.raises(ConfigError, match="another config"):
        ablate.run_all(base_run, runs, jobs=1)


def test_rows_hold_only_technique_switches_so_the_base_keeps_its_scale():
    for row in ablate.find_rows(ROWS):
        for base in ("configs/ablation/base.yaml", "configs/dapo_qwen2.5_32b.yaml"):
            on_row, alone = flat(load_config([REPO / base, row])), flat(load_config(REPO / base))
            assert {k.split(".")[0] for k in on_row if on_row[k] != alone[k]} <= {"algo"}, (row.stem, base)
    big = load_config([REPO / "configs/dapo_qwen2.5_32b.yaml", ROWS / "8_no_overlong_filtering.yaml"])
    assert (big.train.prompts_per_step, big.rollout.max_response_tokens, big.eval.n) == (512, 20480, 32)


def test_row_selection_by_number_or_name():
    assert [p.stem for p in ablate.find_rows(ROWS, ["1", "6_dynamic_sampling"])] == ["1_grpo", "6_dynamic_sampling"]
    with pytest.raises(ConfigError, match="--rows 9: no such row"):
        ablate.find_rows(ROWS, ["9"])


def test_mean_and_t_interval_over_seeds():
    m, lo, hi = ablate.mean_ci([0.1, 0.2, 0.3])
    half = 4.303 * 0.1 / math.sqrt(3)  # t(0.975, df=2) * sd / sqrt(n)
    assert m == pytest.approx(0.2) and lo == pytest.approx(0.2 - half) and hi == pytest.approx(0.2 + half)
    m, lo, hi = ablate.mean_ci([0.4])
    assert m == 0.4 and math.isnan(lo) and math.isnan(hi)


def tiny_overrides(tiny_model_dir):
    return [
        f"model.path={tiny_model_dir}",
        "train.prompts_per_step=4",
        "train.mini_batch_prompts=2",
        "train.micro_batch_size=16",
        "rollout.group_size=4",
        "rollout.max_response_tokens=16",
        "algo.overlong_buffer_tokens=4",
        "algo.max_gen_rounds=2",
        "eval.num_problems=4",
        "eval.n=2",
        "eval.every_steps=1",
        "train.warmup_steps=0",
        "data.task_train_size=200",
        # an untrained model is never right: keep groups whose (length-shaped) rewards differ
        "algo.filter_metric=reward",
    ]


def smoke_args(out, tiny_model_dir, steps=2):
    return [
        "--out",
        str(out),
        "--rows",
        "1",
        "6",
        "--seeds",
        "1",
        "--jobs",
        "2",
        "--steps",
        str(steps),
        *tiny_overrides(tiny_model_dir),
    ]


def test_ablate_smoke_report_figures_and_resume(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "study"
    assert ablate.main(smoke_args(out, tiny_model_dir)) == 0
    report = (out / "report.md").read_text()
    assert "| naive GRPO |" in report and "| + dynamic sampling (the paper's DAPO row) |" in report
    assert "| base model (step 0) |" in report
    summary = json.loads((out / "report.json").read_text())
    assert [r["row"] for r in summary["rows"]] == ["1_grpo", "6_dynamic_sampling"]
    assert all(r["seeds"] == [0] and len(r["acc_per_seed"]) == 1 for r in summary["rows"])
    # every row starts from the same evaluation of the initial model, logged once at step 0
    base_rows = [json.loads(line) for line in (out / "base_model" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in base_rows] == [0]
    for row in ("1_grpo", "6_dynamic_sampling"):
        metrics = [json.loads(line) for line in (out / row / "seed0" / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in metrics] == [1, 2]
        for key in (
            "actor/up_clipped_prob_max",
            "actor/up_clipped_prob_mean",
            "actor/token_prob_mean",
            "sampling/all_correct_frac",
            "sampling/all_wrong_frac",
            "sampling/samples_generated",
        ):
            assert key in metrics[-1], key
        assert 0.0 <= metrics[-1]["sampling/all_correct_frac"] + metrics[-1]["sampling/all_wrong_frac"] <= 1.0
    grpo = load_config(out / "1_grpo" / "seed0" / "ablation_config.yaml")
    assert grpo.algo.kl_coef == 0.001 and grpo.train.total_steps == 2 and grpo.train.seed == 0
    pngs = {p.name for p in (out / "figures").glob("*.png")}
    assert {
        "accuracy.png",
        "entropy.png",
        "response_length.png",
        "clipfrac_high.png",
        "up_clipped_prob_max.png",
        "all_correct_frac.png",
        "all_wrong_frac.png",
        "accuracy_vs_samples.png",
    } <= pngs

    # a second call finds every run finished and trains nothing
    logs = {p: p.read_text() for p in out.glob("*/seed0/train.log")}
    capsys.readouterr()
    assert ablate.main(smoke_args(out, tiny_model_dir)) == 0
    assert "0 runs to do (3 already finished)" in capsys.readouterr().out
    assert {p: p.read_text() for p in out.glob("*/seed0/train.log")} == logs

    # a longer study continues each run from its last checkpoint instead of starting again
    base_run, runs = ablate.plan(
        REPO / "configs/ablation/base.yaml",
        ablate.find_rows(ROWS, ["1"]),
        [0],
        out,
        tiny_overrides(tiny_model_dir),
        steps=3,
    )
    assert base_run.row == "base_model" and ablate.is_done(base_run) and not ablate.is_done(runs[0])
    ablate.execute(runs[0], threads=2)
    metrics = [json.loads(line) for line in (out / "1_grpo" / "seed0" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [1, 2, 3]
    assert "resumed from" in (out / "1_grpo" / "seed0" / "train.log").read_text()


def test_summary_of_hand_written_runs(tmp_path):
    """Final, last-three and all-evaluation accuracies, per seed then over seeds, from known curves."""
    base_run, runs = ablate.plan(
        REPO / "configs/ablation/base.yaml", ablate.find_rows(ROWS, ["1"]), [0, 1], tmp_path, []
    )
    base_run.dir.joinpath("base_model").mkdir(parents=True)
    base_run.dir.joinpath("base_model", "metrics.jsonl").write_text(json.dumps({"step": 0, "eval/arith/avg@4": 0.25}))
    curves = {0: [0.40, 0.50, 0.60, 0.70], 1: [0.30, 0.50, 0.50, 0.50]}  # evaluations at steps 10..40
    for run in runs:
        run.dir.mkdir(parents=True)
        lines = []
        for step in range(1, 41):
            row = {"step": step, "actor/entropy": 0.1 * run.seed + step / 100, "sampling/samples_generated": 256.0}
            if step % 10 == 0:
                row["eval/arith/avg@4"] = curves[run.seed][step // 10 - 1]
            lines.append(json.dumps(row))
        (run.dir / "metrics.jsonl").write_text("\n".join(lines))
        (run.dir / "done.json").write_text(json.dumps({"config": ablate.dump_yaml(run.cfg), "wall_s": 100.0}))
    [s] = ablate.summarize(ablate.collect(tmp_path, runs), runs)
    assert s["acc_per_seed"] == [0.70, 0.50] and s["acc_mean"] == pytest.approx(0.60)
    assert s["acc_last3_per_seed"] == pytest.approx([0.60, 0.50]) and s["acc_last3_mean"] == pytest.approx(0.55)
    half = 12.706 * math.sqrt(0.005) / math.sqrt(2)  # t(0.975, df=1) * sd([0.6, 0.5]) / sqrt(2)
    assert s["acc_last3_ci95"] == pytest.approx([0.55 - half, 0.55 + half])
    assert s["acc_all_evals_mean"] == pytest.approx((0.55 + 0.45) / 2)  # the step-0 base model is not counted
    assert s["entropy_last5"] == pytest.approx((0.38 + 0.48) / 2)  # steps 36-40 of each seed, then over seeds
    assert s["samples_generated"] == pytest.approx(40 * 256.0)
