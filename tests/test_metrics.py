"""The step's metrics on a hand-made batch, and verl's names for the same quantities beside them."""

import math
import re
from pathlib import Path

import pytest
import torch

from dapo.algorithm.batch import RolloutBatch
from dapo.collect.stats import CollectStats, sampling_metrics
from dapo.reporting.metrics import step_metrics
from dapo.reporting.run_log import VERL_NAMES, VERL_SUMS, with_verl_names

REPO = Path(__file__).resolve().parents[1]


def hand_made_batch():
    # 2 groups of 2: response lengths 3, 5 | 5, 2 (limit 5: the second and third are at it), prompts 4, 4 | 6, 6
    batch = RolloutBatch.of_responses(
        [[1] * 4, [1] * 4, [2] * 6, [2] * 6],
        [[5] * 3, [5] * 5, [6] * 5, [6] * 2],
        group_size=2,
        truncated=torch.tensor([False, True, False, False]),  # the third ended with EOS at the limit
        example_uids=["a", "a", "b", "b"],
        acc=torch.tensor([1.0, 0.0, 0.0, 1.0]),
        reward=torch.tensor([1.0, -2.0, -1.0, 1.0]),
        overlong_penalty=torch.tensor([0.0, -1.0, 0.0, 0.0]),
    )
    batch.adv = torch.tensor([0.5, -0.5, -1.0, 1.0])
    batch.old_logp = torch.zeros(4, 5)
    batch.entropy = torch.ones(4, 5)
    return batch


def test_step_metrics_hand_computed_with_verl_names():
    cstats = CollectStats(rounds=3)
    m = {
        **sampling_metrics(cstats, held_over=0, gen_rounds_total=3),
        **step_metrics(
            hand_made_batch(),
            cstats,
            {"clipfrac_high": 0.02, "clipfrac_low": 0.03},
            {"old_logprob": 1.0, "update": 1.0},
            max_prompt_tokens=6,
            max_response_tokens=5,
        ),
    }
    row = {k: float(v) for k, v in with_verl_names(m).items()}
    assert row["response_length/mean"] == row["rollout/response_length_mean"] == pytest.approx(15 / 4)
    assert (row["response_length/max"], row["response_length/min"]) == (5.0, 2.0)
    assert row["response_length/clip_ratio"] == pytest.approx(0.5)  # at the limit, with or without EOS
    assert row["rollout/truncated_frac"] == pytest.approx(0.25)  # stopped by the limit
    assert row["prompt_length/mean"] == pytest.approx(5.0) and row["prompt_length/clip_ratio"] == pytest.approx(0.5)
    assert row["critic/score/mean"] == pytest.approx(-0.25) and row["critic/score/min"] == -2.0
    # token-level advantages: 0.5 x 3, -0.5 x 5, -1 x 5, 1 x 2 over 15 tokens
    assert row["critic/advantages/mean"] == pytest.approx((1.5 - 2.5 - 5 + 2) / 15)
    assert (row["critic/advantages/max"], row["critic/advantages/min"]) == (1.0, -1.0)
    assert row["actor/pg_clipfrac"] == pytest.approx(0.05)  # both sides, as verl counts
    assert row["actor/entropy"] == 1.0 and row["train/num_gen_batches"] == 3.0


def test_eval_accuracy_under_verls_name():
    row = with_verl_names({"eval/aime2024/avg@32": 0.5, "eval/aime2024/maj@32": 0.6, "eval/aime2024/pass@32": 0.8})
    assert row["val-core/aime2024/acc/mean@32"] == 0.5
    assert not any(k.startswith("val-core") and ("maj" in k or "best" in k) for k in row)  # verl bootstraps those


def test_every_verl_name_is_in_the_documented_table():
    table = (REPO / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"^\| `([^`]+)` \| `([^`]+)`", table, flags=re.M))
    expected = {(v, ours) for v, ours in VERL_NAMES.items()}
    expected |= {(v, " + ".join(parts)) for v, parts in VERL_SUMS.items()}
    assert expected <= documented, sorted(expected - documented)


def test_engine_gap_warning_by_dtype():
    from dapo.reporting.notes import engine_gap_warning

    assert engine_gap_warning({"rollout/logprob_abs_diff_mean": torch.tensor(4e-6)}, dtype="float32", step=3) is None
    line = engine_gap_warning({"rollout/logprob_abs_diff_mean": torch.tensor(2e-3)}, dtype="float32", step=3)
    assert (
        line.startswith(
            "step 3: the rollout engine's log-probs are 0.002 nats per token from the trainer's "
            "(a float32 run stays under 0.001)"
        )
        and "\n" not in line
    )
    # bfloat16 rounding alone gives gaps of a few hundredths: not a stale engine
    assert engine_gap_warning({"rollout/logprob_abs_diff_mean": 0.03}, dtype="bfloat16", step=3) is None
    assert engine_gap_warning({"rollout/logprob_abs_diff_mean": 0.4}, dtype="bfloat16", step=3) is not None
    assert engine_gap_warning({}, dtype="float32", step=3) is None  # no engine log-probs (hf)


def test_behaviour_drift_by_hand():
    """Two tokens: one twice as likely under the current weights as under those that sampled it (r = 2), one
    unmoved (r = 1). k3 = (2 - 1 - ln 2, 0), mean 0.1534; ESS = (2 + 1)^2 / (2 (4 + 1)) = 0.9."""
    from dapo.reporting.metrics import behaviour_drift

    old = torch.log(torch.tensor([0.5, 0.3]))
    behaviour = torch.log(torch.tensor([0.25, 0.3]))
    drift = behaviour_drift(old, behaviour)
    assert drift["async/policy_kl"].item() == pytest.approx((1 - math.log(2)) / 2, rel=1e-6)
    assert drift["rollout/is_ess"].item() == pytest.approx(0.9, rel=1e-6)
    same = behaviour_drift(old, old)
    assert same["async/policy_kl"].item() == 0.0 and same["rollout/is_ess"].item() == pytest.approx(1.0)


def test_the_drift_guard_warns_once_on_the_window_mean_and_names_what_to_change():
    from dapo.reporting.notes import DRIFT_KL_LEVEL, DRIFT_WINDOW, DriftGuard

    assert (DRIFT_KL_LEVEL, DRIFT_WINDOW) == (0.005, 5)
    guard = DriftGuard()

    def step(kl, ess=0.999, stale=1):
        return {"async/staleness_max": stale, "async/policy_kl": torch.tensor(kl), "rollout/is_ess": torch.tensor(ess)}

    said = [guard.observe(step(0.003), step=s, lr=5e-4, max_staleness=1) for s in range(1, 5)]
    # one step past the level in a window whose mean stays under it: nothing (0.003 x 4 + 0.008) / 5 = 0.004
    said.append(guard.observe(step(0.008), step=5, lr=5e-4, max_staleness=1))
    assert said == [None] * 5
    # samples drawn by the trained weights (staleness 0) neither count nor warn, however far the numerics
    assert guard.observe(step(0.5, stale=0), step=6, lr=5e-4, max_staleness=1) is None
    # the window [0.003 x 3, 0.008, 0.009]: mean 0.0052, past 0.005: said once, with the settings to change
    line = guard.observe(step(0.009), step=7, lr=5e-4, max_staleness=1)
    assert line.startswith("step 7: ") and "async/policy_kl 0.0052 nats a token" in line, line
    assert line.endswith("lower train.lr (now 0.0005) or rollout.max_staleness (now 1)"), line
    assert guard.observe(step(0.5), step=8, lr=5e-4, max_staleness=1) is None
    # the effective sample size alone: mean 0.98 under 0.985
    guard = DriftGuard()
    lines = [guard.observe(step(0.001, ess=0.98), step=s, lr=2.5e-4, max_staleness=2) for s in range(1, 6)]
    assert lines[:4] == [None] * 4 and "rollout/is_ess 0.980" in lines[4] and "(now 2)" in lines[4]
