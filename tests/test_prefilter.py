"""algo.prefilter: the skip rule on synthetic histories, its steering, the sampler's exact resume, and the switch off
changing nothing."""

import copy
import io
import math
import random

import pytest
import torch

from dapo.config import ConfigError, load_config
from dapo.data import Example, PromptSampler
from dapo.prefilter import START_EXPLORE, Prefilter


def examples(n):
    return [Example(str(i), f"q{i}", str(i), "stub") for i in range(n)]


def with_history(accs, **kw):
    """A one-prompt record that has seen these group accuracies, in order."""
    pf = Prefilter(1, **{"seed": 0, **kw})
    for acc in accs:
        pf.observe(0, acc)
    return pf


def test_a_prompt_always_all_correct_is_skipped_at_the_expected_rate_and_never_for_certain():
    for k, expected_keep in [(1, 0.5), (2, 0.25), (3, 0.125), (4, 0.0625), (5, 0.05), (9, 0.05)]:
        pf = with_history([1.0] * k)
        assert pf.streak[0] == k
        assert pf.keep_probability(0) == pytest.approx(expected_keep)  # 0.5 ** k, not below the floor 0.05
        # draws: each decided by a hash of (seed, prompt, draw number); count the skips over many draws
        draws, kept = 20_000, 0
        for _ in range(draws):  # each draw decided by a hash of (seed, prompt, draw number)
            kept += pf.keep(0)
        sd = math.sqrt(expected_keep * (1 - expected_keep) / draws)
        assert abs(kept / draws - expected_keep) < 5 * sd, (k, kept / draws)
        assert kept > 0  # never retired: at the floor, 1 in 20 draws is still generated


def test_a_prompt_that_just_had_an_informative_group_or_none_yet_is_never_skipped():
    fresh = Prefilter(1, seed=3)
    assert fresh.keep_probability(0) == 1.0
    for history in ([1.0, 1.0, 1.0, 0.5], [0.0] * 6 + [0.25], [0.0, 1.0, 0.75]):
        pf = with_history(history, seed=3)
        assert pf.streak[0] == 0 and pf.keep_probability(0) == 1.0
        assert all(pf.keep(0) for _ in range(500)) and pf.skipped[0] == 0


def test_with_the_level_rule_a_last_group_near_one_side_counts_as_a_fractional_run():
    """algo.prefilter_level: after an informative group at accuracy a the keep probability is base ** (a^G + (1-a)^G):
    7/8 right at G = 8 is 0.5 ** 0.3436 = 0.788 (skipped as all-correct), 1/2 right 0.5 ** 0.0078 = 0.9946; without
    the switch both are always generated, and a run of all-correct groups follows the usual rule."""
    g = 8
    for acc, expected in [(7 / 8, 0.5 ** ((7 / 8) ** 8 + (1 / 8) ** 8)), (0.5, 0.5 ** (2 * 0.5**8))]:
        assert with_history([acc], group_size=g, level=True).keep_probability(0) == pytest.approx(expected)
        assert with_history([acc], group_size=g).keep_probability(0) == 1.0
    assert with_history([7 / 8], group_size=g, level=True).keep_probability(0) == pytest.approx(0.7880, abs=1e-4)
    assert with_history([7 / 8, 1.0], group_size=g, level=True).keep_probability(0) == 0.5
    pf = with_history([1 / 8], group_size=g, level=True, floor=0.05)
    pf.explore["all_wrong"] = 0.05  # at the floor: (7/8)^8 of a run, still never below the floor
    assert pf.keep_probability(0) == pytest.approx(max(0.05, 0.05 ** ((7 / 8) ** 8 + (1 / 8) ** 8)))
    skipped = sum(not pf.keep(0) for _ in range(2000))
    assert pf.take_counts().all_wrong == skipped > 0  # counted by the side it leans to


def test_streaks_count_one_kind_in_a_row_and_a_flip_starts_over():
    assert with_history([0.0, 0.0, 0.0]).streak[0] == -3
    assert with_history([0.0, 0.0, 1.0]).streak[0] == 1  # all-wrong then all-correct: no run of either yet
    assert with_history([1.0, 1.0, 0.0]).streak[0] == -1
    pf = with_history([0.5, 0.0, 1.0, 1.0, 1.0])
    assert pf.recent[0] == [0.0, 1.0, 1.0, 1.0]  # the last 4 group accuracies
    assert pf.generated[0] == 5


def test_each_generated_group_is_counted_by_what_the_record_knew_of_its_prompt():
    pf = Prefilter(1, seed=0, group_size=8)
    # the state each is drawn in: unseen, correct_run_1, after_mixed, after_one_wrong, correct_run_1, _2, _3plus,
    # _3plus, after_one_right, wrong_run_1
    for acc in (1.0, 0.5, 7 / 8, 1.0, 1.0, 1.0, 1.0, 1 / 8, 0.0, 0.0):
        pf.observe(0, acc)
    c = pf.take_counts()
    groups = {k: n for k, n in c.groups.items() if n}
    assert groups == {
        "unseen": 1,
        "correct_run_1": 2,
        "after_mixed": 1,
        "after_one_wrong": 1,
        "correct_run_2": 1,
        "correct_run_3plus": 2,
        "after_one_right": 1,
        "wrong_run_1": 1,
    }
    informative = {k: n for k, n in c.informative.items() if n}
    assert informative == {"correct_run_1": 1, "after_mixed": 1, "correct_run_3plus": 1}
    assert pf.take_counts().groups["unseen"] == 0  # taken: the next step starts from zero
    with_reward = Prefilter(1, seed=0)
    with_reward.observe(0, 1.0, informative=True)  # kept by filter_metric=reward: informative, not a run
    with_reward.observe(0, 1.0, informative=False)
    assert with_reward.take_counts().groups["after_mixed"] == 1


def test_skips_are_counted_by_kind():
    pf = Prefilter(2, seed=1)
    for _ in range(3):
        pf.observe(0, 1.0)
        pf.observe(1, 0.0)
    for _ in range(200):
        pf.keep(0), pf.keep(1)
    counts = pf.take_counts()
    assert counts.all_correct == pf.skipped[0] > 0 and counts.all_wrong == pf.skipped[1] > 0
    assert pf.take_counts().all_correct == 0  # taken: the next step starts from zero


def test_steering_moves_the_wasted_kind_down_and_both_up_once_the_target_is_met():
    pf = Prefilter(1, seed=0, target=0.8, floor=0.05, step_size=0.1)
    pf.steer(informative=6, all_correct=3, all_wrong=1)  # 60% informative, below 80%: 3/4 of the waste all-correct
    assert pf.explore["all_correct"] == pytest.approx(START_EXPLORE - 0.075)
    assert pf.explore["all_wrong"] == pytest.approx(START_EXPLORE - 0.025)
    pf.steer(informative=9, all_correct=1, all_wrong=0)  # 90%: met, explore more
    assert pf.explore["all_correct"] == pytest.approx(START_EXPLORE + 0.025)
    assert pf.explore["all_wrong"] == pytest.approx(START_EXPLORE + 0.075)
    for _ in range(50):
        pf.steer(informative=0, all_correct=5, all_wrong=5)
    assert pf.explore == {"all_correct": 0.05, "all_wrong": 0.05}  # held at the floor
    for _ in range(50):
        pf.steer(informative=5, all_correct=0, all_wrong=0)
    assert pf.explore == {"all_correct": 1.0, "all_wrong": 1.0}  # at 1 nothing is skipped after one bad group...
    assert with_history([1.0], floor=0.05).keep_probability(0) == START_EXPLORE  # (a fresh record starts at 0.5)
    pf.steer(informative=0, all_correct=0, all_wrong=0)  # a step that generated nothing moves nothing
    assert pf.explore == {"all_correct": 1.0, "all_wrong": 1.0} and pf.steps == 103


def simulate(sampler, steps, *, per_step=6, start=0):
    """A stand-in for the loop: draw, 'generate', observe, end the step. Prompts 0 mod 3 always come back
    all-correct, 1 mod 3 all-wrong, 2 mod 3 mixed (all-correct one step in 5). Every drawn uid and the skips,
    per step."""
    drawn, skips = [], []
    for step in range(start, start + steps):
        exs = sampler.next(per_step)
        accs = [[1.0, 0.0, 0.5 if step % 5 else 1.0][int(e.uid) % 3] for e in exs]
        sampler.observe(accs)
        informative = sum(0 < a < 1 for a in accs)
        counts = sampler.end_step(informative=informative, all_correct=accs.count(1.0), all_wrong=accs.count(0.0))
        drawn.append([e.uid for e in exs])
        skips.append((counts.all_correct, counts.all_wrong))
    return drawn, skips


def new_sampler(n=30, seed=7):
    return PromptSampler(examples(n), seed=seed, prefilter=Prefilter(n, seed=seed, target=0.9))


def test_the_sampler_skips_prompts_whose_groups_kept_coming_back_uninformative():
    sampler = new_sampler()
    drawn, skips = simulate(sampler, 40)
    late = [uid for step in drawn[20:] for uid in step]
    # uids 0 mod 3 are always all-correct and 1 mod 3 always all-wrong: once seen they are mostly skipped
    uninformative = sum(int(u) % 3 != 2 for u in late) / len(late)
    assert uninformative < 0.35, uninformative  # without the prefilter two thirds of the draws
    assert sum(a + w for a, w in skips) > 100
    pf = sampler.prefilter
    assert all(pf.generated[i] >= 2 for i in range(30))  # the floor: every prompt still generated now and then
    assert pf.last_step[2] >= 30 and pf.steps == 40


def test_a_resumed_sampler_draws_and_skips_exactly_the_prompts_an_uninterrupted_one_does():
    whole = new_sampler()
    want_drawn, want_skips = simulate(whole, 30)
    first = new_sampler()
    simulate(first, 11)
    saved = io.BytesIO()
    torch.save(copy.deepcopy(first.state_dict()), saved)  # as a checkpoint holds it
    saved.seek(0)
    resumed = new_sampler()
    resumed.load_state_dict(torch.load(saved, weights_only=False))
    got_drawn, got_skips = simulate(resumed, 19, start=11)
    assert got_drawn == want_drawn[11:] and got_skips == want_skips[11:]
    assert resumed.state_dict() == whole.state_dict()


def test_with_the_switch_off_the_sampler_draws_the_seeded_permutations_as_before():
    exs = examples(10)
    sampler = PromptSampler(exs, seed=5)
    got = [e.uid for e in sampler.next(7) + sampler.next(9) + sampler.next(4)]
    want = []
    for epoch in range(2):
        order = list(range(10))
        random.Random(f"dapo-sampler:5:{epoch}").shuffle(order)
        want += [str(i) for i in order]
    assert got == want
    sampler.observe([1.0] * 4)  # no record to keep: nothing happens, and nothing is saved
    assert sampler.end_step(informative=0, all_correct=4, all_wrong=0).all_correct == 0
    assert "prefilter" not in sampler.state_dict()


def test_at_a_floor_of_one_the_record_is_kept_and_nothing_is_skipped():
    """algo.prefilter_floor=1 (what benchmarks/prefilter.py --record runs): the draws of the switch off, however
    uninformative the groups, and every generated group counted in its record's state."""
    exs = examples(10)
    off, recording = PromptSampler(exs, seed=5), PromptSampler(exs, seed=5, prefilter=Prefilter(10, seed=5, floor=1.0))
    for n in (7, 9, 4, 10):
        assert [e.uid for e in recording.next(n)] == [e.uid for e in off.next(n)]
        recording.observe([1.0] * n)  # all-correct every time: runs of 1, 2, 3 and more
        counts = recording.end_step(informative=0, all_correct=n, all_wrong=0)
        assert counts.all_correct == 0 and sum(counts.groups.values()) == n
    assert recording.prefilter.streak == [3] * 10 and sum(recording.prefilter.skipped) == 0


def test_observe_refuses_accuracies_that_do_not_match_the_draw():
    sampler = new_sampler()
    sampler.next(3)
    with pytest.raises(ValueError, match="3 prompts drawn"):
        sampler.observe([1.0, 0.0])


def test_a_prefilter_state_of_another_data_set_is_refused_in_one_line():
    state = new_sampler(30).state_dict()
    state["num_examples"] = 20
    with pytest.raises(ValueError, match="saved for 30 prompts but this data set has 20"):
        new_sampler(20).prefilter.load_state_dict(state["prefilter"])


def test_the_config_refuses_the_prefilter_without_dynamic_sampling_and_a_zero_floor(tmp_path):
    with pytest.raises(ConfigError, match="needs algo.dynamic_sampling=true"):
        load_config("configs/demo.yaml", ["algo.prefilter=true", "algo.dynamic_sampling=false"])
    with pytest.raises(ConfigError, match="algo.prefilter_floor"):
        load_config("configs/demo.yaml", ["algo.prefilter=true", "algo.prefilter_floor=0"])
    cfg = load_config("configs/demo.yaml", ["algo.prefilter=true"])
    assert cfg.algo.prefilter and cfg.algo.prefilter_floor == 0.05 and cfg.algo.prefilter_target == 0.9


def test_a_group_dynamic_sampling_kept_resets_the_streak_whatever_its_accuracies():
    """algo.filter_metric=reward keeps a group of equal accuracies whose shaped rewards differ: it trained."""
    pf = with_history([0.0, 0.0])
    pf.observe(0, 0.0, True)
    assert pf.streak[0] == 0 and pf.keep_probability(0) == 1.0
    pf.observe(0, 1.0, False)
    assert pf.streak[0] == 1


def test_the_collector_feeds_the_record_and_reports_the_skips():
    """The real BatchCollector and PromptSampler with the stub engine of test_dynamic_sampling: after a step in which
    every prompt was generated once, the next steps skip most all-correct and all-wrong prompts before generating."""
    from test_dynamic_sampling import EchoEngine, Ex, stub_scorer

    from dapo.config import AlgoConfig
    from dapo.dynamic_sampling import BatchCollector
    from dapo.rollout.base import SamplingParams

    kinds = ["mixed", "all", "none"]
    exs = [Ex(str(i), kinds[i % 3]) for i in range(30)]
    sampler = PromptSampler(exs, seed=0, prefilter=Prefilter(30, seed=0))
    engine = EchoEngine()
    collector = BatchCollector(
        engine=engine,
        sampler=sampler,
        scorer=stub_scorer(None),
        encode=lambda ex: [int(ex.uid)],
        sampling=SamplingParams(n=4),
        algo_cfg=AlgoConfig(max_gen_rounds=None),
    )
    first_pass = []
    while sum(first_pass) < 30:  # every prompt once: nothing known yet, nothing skipped
        _, stats = collector.collect(5, [], round_seed=lambda k: k)
        first_pass.append(stats.prompts_generated)
        assert stats.prefilter.all_correct == stats.prefilter.all_wrong == 0
    generated = skipped = 0
    for _ in range(6):
        batch, stats = collector.collect(5, [], round_seed=lambda k: k)
        assert batch.num_groups == 5
        generated += stats.prompts_generated
        skipped += stats.prefilter.all_correct + stats.prefilter.all_wrong
        assert stats.prefilter.all_correct > 0 or stats.prefilter.all_wrong > 0
    # 30 informative groups trained; without the prefilter about 90 prompts would have been generated for them
    assert generated < 60 and skipped > 30
    assert sampler.prefilter.streak[1] > 0 and sampler.prefilter.streak[2] < 0 and sampler.prefilter.streak[0] == 0


# the demo's own base model (about 30% right: groups of every kind) on 12 problems, so prompts recur from step 1
KILLED_RUN = [
    "train.total_steps=4",
    "run.save_every=1",
    "rollout.max_response_tokens=48",
    "algo.overlong_buffer_tokens=8",
    "algo.dynamic_sampling=true",
    "algo.max_gen_rounds=3",
    "algo.prefilter=true",
    "data.task_train_size=12",
]


@pytest.mark.slow
def test_a_run_killed_after_a_checkpoint_resumes_to_the_prompts_skips_and_weights_of_an_uninterrupted_one(tmp_path):
    """kill -9 (os._exit) right after checkpoint 2 of 4; the resumed run skips exactly the prompts the uninterrupted
    one skipped at steps 3 and 4, ends with the same prompt records and the same weights, tensor for tensor."""
    import subprocess
    import sys
    from pathlib import Path

    from safetensors.torch import load_file

    from dapo import checkpoint
    from dapo.log import read_metrics
    from dapo.resources import shipped

    repo = Path(__file__).resolve().parents[1]
    model = shipped("assets/arith-base").resolve()

    def drive(root, tag, kill_after):
        env = {**__import__("os").environ, "PYTHONPATH": str(repo / "src")}
        cmd = [sys.executable, str(repo / "tests" / "train_until_checkpoint.py"), str(root), str(model)]
        cmd += [str(root / "saves.txt"), tag, str(kill_after), *KILLED_RUN]
        return subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True, timeout=600)

    ref = drive(tmp_path / "a", "ref", 0)
    assert ref.returncode == 0, ref.stderr[-3000:]
    killed = drive(tmp_path / "b", "killed", 2)
    assert killed.returncode == 1, killed.stderr[-3000:]
    resumed = drive(tmp_path / "b", "resumed", 0)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout and "(step 2)" in resumed.stdout

    want_rows = {r["step"]: r for r in read_metrics(tmp_path / "a" / "t") if "sampling/skipped_all_wrong" in r}
    got_rows = {r["step"]: r for r in read_metrics(tmp_path / "b" / "t") if "sampling/skipped_all_wrong" in r}
    keys = ["sampling/skipped_all_correct", "sampling/skipped_all_wrong", "sampling/prompts_generated"]
    assert [[got_rows[s][k] for k in keys] for s in (3, 4)] == [[want_rows[s][k] for k in keys] for s in (3, 4)]
    assert sum(want_rows[s][k] for s in want_rows for k in keys[:2]) > 0  # the prefilter did skip prompts

    final = "checkpoints/step_000004"
    want, got = (checkpoint.load_trainer_state(root / "t" / final) for root in (tmp_path / "a", tmp_path / "b"))
    assert got["sampler"] == want["sampler"] and "prefilter" in want["sampler"]
    w_want, w_got = (
        load_file(str(root / "t" / final / "model" / "model.safetensors")) for root in (tmp_path / "a", tmp_path / "b")
    )
    assert [k for k in w_want if not torch.equal(w_want[k], w_got[k])] == []


def test_the_run_summary_prices_the_whole_runs_generation(tmp_path):
    """The end-of-run line adds the steps' raw counts: 5,000 tokens generated for 2,000 trained, 6 of 20 s of
    generation on dropped groups, 7 prompts skipped; without the prefilter no skip part."""
    from dapo.log import run_summary

    rows = [
        {"step": 1, "sampling/tokens_generated": 3000, "sampling/tokens_trained": 1000, "sampling/dropped_gen_s": 4.0,
         "perf/time_generate_s": 12.0, "sampling/skipped_all_correct": 0, "sampling/skipped_all_wrong": 2},
        {"step": 2, "sampling/tokens_generated": 2000, "sampling/tokens_trained": 1000, "sampling/dropped_gen_s": 2.0,
         "perf/time_generate_s": 8.0, "sampling/skipped_all_correct": 5, "sampling/skipped_all_wrong": 0},
    ]  # fmt: skip
    lines = run_summary(rows, wall_s=30, run_dir=tmp_path)
    assert (
        "generation: 2.50 tokens generated per token trained; 6 s of 20 s generating went to dropped groups (30%); "
        "the prefilter skipped 7 prompts (5 all-correct, 2 all-wrong)"
    ) in lines
    assert not any(x.startswith("prefilter record") for x in lines)  # no record counted: no line
    rows[0] |= {"prefilter/groups/unseen": 8, "prefilter/informative/unseen": 6, "prefilter/groups/correct_run_1": 0}
    rows[1] |= {"prefilter/groups/unseen": 2, "prefilter/informative/unseen": 1, "prefilter/groups/correct_run_1": 4}
    rows[1] |= {"prefilter/informative/correct_run_1": 1, "prefilter/informative/correct_run_2": 0}
    assert (
        "prefilter record: informative share of the groups generated, by the prompt's state when drawn: "
        "unseen 0.70 (10), correct_run_1 0.25 (4)"
    ) in run_summary(rows, wall_s=30, run_dir=tmp_path)
    for r in rows:
        r["sampling/skipped_all_correct"] = r["sampling/skipped_all_wrong"] = 0
    assert any(x.endswith("went to dropped groups (30%)") for x in run_summary(rows, wall_s=30, run_dir=tmp_path))
