"""Dynamic sampling with a stub engine and a stub reward: refill, surplus buffer, cap behaviour."""

import warnings
from dataclasses import dataclass

import pytest
import torch

from dapo.config import AlgoConfig
from dapo.dynamic_sampling import GenerationCapError, Scored, collect_batch
from dapo.rollout.base import Generation, SamplingParams


@dataclass(frozen=True)
class Ex:
    uid: str
    ground_truth: str
    data_source: str = "stub"


class ListSampler:
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
        return Generation(rows, responses, torch.zeros(len(rows), dtype=torch.bool), [f"{r[0]}:{r[1]}" for r in responses])


def stub_scorer(pattern):
    """Reward by the example's ground truth: 'mixed' groups have one right answer, 'all'/'none' don't vary."""

    def score(texts, gts, sources, lengths, truncated):
        acc = torch.tensor([float(g == "all" or (g == "mixed" and t.endswith(":0"))) for t, g in zip(texts, gts)])
        return Scored(acc, acc * 2 - 1, torch.zeros_like(acc), ["x"] * len(texts))

    return score


def run(examples, *, num_prompts, buffer=None, **algo):
    cfg = AlgoConfig(**algo)
    engine = EchoEngine()
    buffer = [] if buffer is None else buffer
    batch, stats = collect_batch(
        engine=engine, sampler=ListSampler(examples), scorer=stub_scorer(None), encode=lambda ex: [int(ex.uid)],
        buffer=buffer, num_prompts=num_prompts, sampling=SamplingParams(n=4), algo_cfg=cfg, round_seed=lambda k: k,
    )
    return batch, stats, buffer, engine


def test_refills_until_batch_is_full_and_keeps_prompt_major_groups():
    kinds = ["mixed", "all", "none", "mixed"]  # half the prompts are informative
    examples = [Ex(str(i), kinds[i % 4]) for i in range(100)]
    batch, stats, buffer, engine = run(examples, num_prompts=5, max_gen_rounds=0)
    assert batch.num_groups == 5 and len(batch) == 20
    # each round asks for exactly the missing prompts: 5 (0, 3, 4 kept), then 2
    assert engine.calls[:2] == [5, 2]
    assert stats.rounds == len(engine.calls) >= 2
    assert stats.groups_dropped == stats.prompts_generated - stats.groups_kept - len(buffer)
    assert stats.groups_all_correct + stats.groups_all_wrong == stats.groups_dropped
    # every kept group is informative and contiguous
    acc = batch.acc.view(-1, 4)
    assert ((acc.sum(1) > 0) & (acc.sum(1) < 4)).all()
    assert all(len(set(batch.example_uids[i * 4:(i + 1) * 4])) == 1 for i in range(5))


def test_surplus_groups_go_to_the_buffer_and_are_used_first():
    examples = [Ex(str(i), "mixed") for i in range(100)]
    cfg = dict(max_gen_rounds=0, oversample=2.0)
    batch, stats, buffer, _ = run(examples, num_prompts=3, **cfg)
    assert batch.num_groups == 3 and len(buffer) == 3  # generated 6, kept all
    assert batch.example_uids[::4] == ["0", "1", "2"]
    batch2, stats2, buffer2, engine2 = run(examples, num_prompts=3, buffer=buffer, **cfg)
    assert stats2.groups_from_buffer == 3 and stats2.rounds == 0 and engine2.calls == []
    assert batch2.example_uids[::4] == ["3", "4", "5"]


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
    batch, stats, buffer, engine = run(examples, num_prompts=6, dynamic_sampling=False)
    assert stats.rounds == 1 and batch.num_groups == 6 and not buffer and stats.groups_dropped == 0
