"""Dynamic sampling with a stub engine and a stub reward: refill, held-over surplus groups, cap behaviour."""

import warnings
from dataclasses import dataclass

import pytest
import torch

from dapo.algorithm.batch import RolloutBatch
from dapo.algorithm.step import with_old_logp
from dapo.collect.dynamic_sampling import DynamicSampling, GenerationCapError
from dapo.collect.scoring import Scored
from dapo.config import AlgoConfig
from dapo.rollout.base import Generation, SamplingParams


@dataclass(frozen=True)
class Ex:
    uid: str
    ground_truth: str
    data_source: str = "stub"


class ListOrder:
    def __init__(self, examples):
        self.examples, self.pos = examples, 0

    def next(self, n):
        out = [self.examples[(self.pos + i) % len(self.examples)] for i in range(n)]
        self.pos += n
        return out


class EchoEngine:
    """Answers every prompt G times; prompt ids are [k] for example k."""

    def __init__(self):
        self.calls = []

    def generate(self, prompt_ids, params):
        self.calls.append(len(prompt_ids))
        rows = [p for p in prompt_ids for _ in range(params.n)]
        responses = [[p[0], j] for p in prompt_ids for j in range(params.n)]
        return Generation(
            rows, responses, torch.zeros(len(rows), dtype=torch.bool), [f"{r[0]}:{r[1]}" for r in responses]
        )


def stub_scorer(pattern):
    """Reward by the example's ground truth: 'mixed' groups have one right answer, 'all'/'none' don't vary."""

    def score(texts, gts, sources, lengths, truncated):
        acc = torch.tensor([float(g == "all" or (g == "mixed" and t.endswith(":0"))) for t, g in zip(texts, gts)])
        return Scored(acc, acc * 2 - 1, torch.zeros_like(acc), ["x"] * len(texts))

    return score


def run(examples, *, num_prompts, held_over=(), max_held_over=0, **algo):
    cfg = AlgoConfig(held_over_max_groups=max_held_over, **algo)
    engine = EchoEngine()
    sampling = DynamicSampling(
        engine=engine,
        prompts=ListOrder(examples),
        scorer=stub_scorer(None),
        encode=lambda ex: [int(ex.uid)],
        sampling=SamplingParams(n=4),
        algo=cfg,
    )
    given = list(held_over)
    batch, stats, after = sampling.fill_batch(num_prompts, given, round_seed=lambda k: k)
    assert given == list(held_over)  # the caller's list is left as it was: what is held over after comes back
    return batch, stats, after, engine


def test_refills_until_batch_is_full_and_keeps_prompt_major_groups():
    kinds = ["mixed", "all", "none", "mixed"]  # half the prompts are informative
    examples = [Ex(str(i), kinds[i % 4]) for i in range(100)]
    batch, stats, held_over, engine = run(examples, num_prompts=5, max_gen_rounds=None)
    assert batch.num_groups == 5 and len(batch) == 20
    # each round asks for exactly the missing prompts: 5 (0, 3, 4 kept), then 2
    assert engine.calls[:2] == [5, 2]
    assert stats.rounds == len(engine.calls) >= 2
    assert stats.groups_dropped == stats.prompts_generated - stats.groups_kept - len(held_over)
    assert stats.groups_all_correct + stats.groups_all_wrong == stats.groups_dropped
    # every kept group is informative and contiguous
    acc = batch.acc.view(-1, 4)
    assert ((acc.sum(1) > 0) & (acc.sum(1) < 4)).all()
    assert all(len(set(batch.example_uids[i * 4 : (i + 1) * 4])) == 1 for i in range(5))


def test_surplus_groups_are_discarded_by_default_as_the_reference_does():
    examples = [Ex(str(i), "mixed") for i in range(100)]
    batch, stats, held_over, _ = run(examples, num_prompts=3, max_gen_rounds=None, oversample=2.0)
    assert batch.num_groups == 3 and held_over == []  # generated 6 informative groups, trained the first 3
    assert batch.example_uids[::4] == ["0", "1", "2"] and stats.groups_kept == 3
    assert AlgoConfig().held_over_max_groups == 0


def test_surplus_groups_are_held_over_and_used_first():
    examples = [Ex(str(i), "mixed") for i in range(100)]
    cfg = dict(max_gen_rounds=None, oversample=2.0, max_held_over=2)
    batch, stats, held_over, _ = run(examples, num_prompts=3, **cfg)
    assert batch.num_groups == 3 and len(held_over) == 2  # generated 6, kept all, held over the newest 2
    assert batch.example_uids[::4] == ["0", "1", "2"]
    assert [b.example_uids[0] for b in held_over] == ["4", "5"]  # the oldest surplus group went first
    batch2, stats2, held_over2, engine2 = run(examples, num_prompts=1, held_over=held_over, **cfg)
    assert stats2.groups_from_held_over == 1 and stats2.rounds == 0 and engine2.calls == []
    assert batch2.example_uids[::4] == ["4"] and [b.example_uids[0] for b in held_over2] == ["5"]


def one_group(uid, lengths, rollout_logp=None):
    return RolloutBatch.of_responses(
        [[1]] * len(lengths),
        [[7] * n for n in lengths],
        group_size=len(lengths),
        example_uids=[uid] * len(lengths),
        rollout_logp=rollout_logp or [],
    )


def test_held_over_groups_get_the_sampling_policys_log_probs_once():
    calls = []

    def logprobs(batch):  # stands in for Policy.compute_logprobs: row r, token t -> -(r + 1) - t / 10
        calls.append(batch.example_uids[:: batch.group_size])
        T = batch.max_response_len
        return -(torch.arange(len(batch))[:, None] + 1.0) - torch.arange(T)[None, :] / 10, None

    old = one_group("a", [1, 1])
    old.held_over_old_logp = [[-9.0], [-8.0]]  # held over at an earlier step: left as it is
    held_over = [old, one_group("b", [2, 1]), one_group("c", [3, 2])]
    given = with_old_logp(held_over, logprobs, source="recompute")
    assert calls == [["b", "c"]]  # one pass over the new groups only
    assert given[0] is old and not held_over[1].held_over_old_logp  # new records: the collection's are unchanged
    assert given[1].held_over_old_logp == [pytest.approx([-1.0, -1.1]), pytest.approx([-2.0])]
    assert given[2].held_over_old_logp == [pytest.approx([-3.0, -3.1, -3.2]), pytest.approx([-4.0, -4.1])]
    # from the engine: vLLM's own log-probs of its samples
    eng = with_old_logp([one_group("d", [2, 1], rollout_logp=[[-0.5, -0.25], [-2.0]])], logprobs, source="engine")
    assert eng[0].held_over_old_logp == [[-0.5, -0.25], [-2.0]] and len(calls) == 1
    with pytest.raises(ValueError, match="held_over_logp_source=engine"):
        with_old_logp([one_group("e", [1, 1])], logprobs, source="engine")


def test_held_over_rows_take_their_behaviour_log_probs_as_old_logp():
    held = one_group("a", [2, 1])
    held.held_over_old_logp = [[-0.5, -0.7], [-0.2]]
    fresh = one_group("b", [1, 3])
    batch = RolloutBatch.concat([fresh, held])  # the step's batch: new groups and a held-over one
    assert batch.held_over_old_logp == [None, None, [-0.5, -0.7], [-0.2]]
    recomputed = torch.full((4, 3), -1.0)  # under the current weights
    old = batch.old_logp_with_held_over(recomputed)
    expected = torch.tensor([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [-0.5, -0.7, 0.0], [-0.2, 0.0, 0.0]])
    assert torch.equal(old, expected)
    assert torch.equal(fresh.old_logp_with_held_over(recomputed[:2]), recomputed[:2])  # nothing held over: unchanged
    # a checkpoint keeps them
    restored = RolloutBatch.from_state(held.state())
    assert restored.held_over_old_logp == [[-0.5, -0.7], [-0.2]]


def test_cap_trains_on_what_it_has_with_a_warning():
    examples = [Ex(str(i), "mixed" if i == 0 else "all") for i in range(100)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        batch, stats, _, _ = run(examples, num_prompts=4, max_gen_rounds=2)
    assert stats.cap_hit and stats.rounds == 2 and batch.num_groups == 1
    assert any("max_gen_rounds" in str(w.message) for w in caught)


def test_cap_can_fail_instead():
    examples = [Ex(str(i), "all") for i in range(10)]
    with pytest.raises(GenerationCapError, match="max_gen_rounds"):
        run(examples, num_prompts=2, max_gen_rounds=3, on_max_gen_rounds="fail")


def test_nothing_informative_returns_none():
    batch, stats, _, _ = run([Ex("0", "none")], num_prompts=2, max_gen_rounds=1)
    assert batch is None and stats.cap_hit


def test_without_dynamic_sampling_one_round_keeps_everything():
    examples = [Ex(str(i), ["mixed", "all", "none"][i % 3]) for i in range(30)]
    batch, stats, held_over, engine = run(examples, num_prompts=6, dynamic_sampling=False)
    assert stats.rounds == 1 and batch.num_groups == 6 and not held_over and stats.groups_dropped == 0
