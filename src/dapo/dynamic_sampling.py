"""Generate, score, shape and filter until the training batch holds the configured number of prompts.

DAPO sec. 3.2: a group whose G responses are all right (or all wrong) has zero advantage and
contributes no gradient, so it is dropped and more prompts are sampled. Informative groups beyond
the batch are discarded, as the reference does (``batch[:train_batch_size]``); with
``algo.buffer_max_groups`` > 0 they wait in a buffer that the next step uses first, each carrying
the log-probs of the weights that sampled it (``record_behaviour_logp``), which its loss then uses
as old_logp: a held-over group is off-policy, and the clip must bound the step from the policy that
sampled it. Unlike the reference, hitting the cap on generation rounds trains on what was kept
(``algo.on_max_gen_rounds=train``) instead of stopping the run.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from typing import Callable

import torch

from dapo import algo
from dapo.batch import RolloutBatch
from dapo.rollout.base import SamplingParams


class GenerationCapError(RuntimeError):
    pass


@dataclass
class Scored:
    acc: torch.Tensor  # (N,) float 0/1
    reward: torch.Tensor  # (N,) correctness reward + overlong shaping
    overlong: torch.Tensor  # (N,) the shaping part alone
    preds: list[str]
    timeouts: int = 0


class Scorer:
    """Turns response texts into rewards: rule reward from the grading pool, then eq. 13 shaping."""

    def __init__(self, pool, *, grader: str, algo_cfg, max_response_tokens: int):
        self.pool = pool
        self.grader = grader
        self.a = algo_cfg
        self.max_response_tokens = max_response_tokens

    def graders_for(self, data_sources: list[str]) -> list[str]:
        from dapo.rewards import grader_for

        return [grader_for(s) if self.grader == "auto" else self.grader for s in data_sources]

    def __call__(self, texts: list[str], ground_truths: list[str], data_sources: list[str], lengths, truncated) -> Scored:
        result = self.pool.score(texts, ground_truths, self.graders_for(data_sources))
        acc = torch.tensor([float(g.acc) for g in result.grades])  # (N,)
        reward = torch.where(acc > 0, self.a.correct_reward, self.a.wrong_reward)  # (N,)
        overlong = torch.zeros_like(reward)
        if self.a.soft_overlong_punishment:
            overlong = algo.overlong_penalty(
                lengths, max_response_tokens=self.max_response_tokens,
                overlong_buffer_tokens=self.a.overlong_buffer_tokens, penalty_factor=self.a.overlong_penalty_factor,
            )
        return Scored(acc, reward + overlong, overlong, [g.pred for g in result.grades],
                      result.num_timeouts + result.num_crashes)


@dataclass
class CollectStats:
    rounds: int = 0
    prompts_generated: int = 0
    samples_generated: int = 0
    tokens_generated: int = 0
    tokens_in_dropped_groups: int = 0
    groups_kept: int = 0
    groups_dropped: int = 0
    groups_all_correct: int = 0
    groups_all_wrong: int = 0
    groups_from_buffer: int = 0
    acc_sum: float = 0.0  # over every generated sample (the honest training accuracy)
    timeouts: int = 0
    cap_hit: bool = False
    seconds_generate: float = 0.0
    seconds_reward: float = 0.0
    seconds_dropped: float = 0.0  # generation time attributed to dropped groups (by token share)
    keep_rates: list[float] = field(default_factory=list)


def collect_batch(
    *,
    engine,
    sampler,
    scorer: Callable[..., Scored],
    encode: Callable[[object], list[int]],
    buffer: list[RolloutBatch],
    num_prompts: int,
    sampling: SamplingParams,
    algo_cfg,
    round_seed: Callable[[int], int],
    keep_rate_estimate: float = 1.0,
    max_buffer_groups: int = 0,
) -> tuple[RolloutBatch | None, CollectStats]:
    """Fill a batch of ``num_prompts`` informative groups; up to ``max_buffer_groups`` surplus groups
    go to ``buffer`` (0: none, the reference's behaviour).

    ``buffer`` is a list of single-group batches, consumed first and refilled in place.
    ``round_seed(k)`` gives the sampling seed of this step's k-th generation round.
    """
    a, G = algo_cfg, sampling.n
    stats = CollectStats()
    kept: list[RolloutBatch] = []
    while buffer and len(kept) < num_prompts:
        kept.append(buffer.pop(0))
        stats.groups_from_buffer += 1
    while len(kept) < num_prompts:
        if a.max_gen_rounds and stats.rounds >= a.max_gen_rounds:
            stats.cap_hit = True
            msg = (f"dynamic sampling hit algo.max_gen_rounds={a.max_gen_rounds} with {len(kept)}/{num_prompts} "
                   "prompts kept; training on those (set algo.on_max_gen_rounds=fail to stop instead)")
            if a.on_max_gen_rounds == "fail":
                raise GenerationCapError(msg.split(";")[0] + "; raise algo.max_gen_rounds or use an easier dataset")
            warnings.warn(msg, RuntimeWarning, stacklevel=2)
            break
        missing = num_prompts - len(kept)
        # over-sample in proportion to the measured keep rate so most steps need one round
        factor = a.oversample / max(keep_rate_estimate, 0.05) if a.dynamic_sampling else 1.0
        examples = sampler.next(max(missing, math.ceil(missing * factor)))
        params = SamplingParams(**{**sampling.__dict__, "seed": round_seed(stats.rounds)})
        t0 = time.perf_counter()
        gen = engine.generate([encode(ex) for ex in examples], params)
        t1 = time.perf_counter()
        per_row = [ex for ex in examples for _ in range(G)]
        lengths = torch.tensor([len(r) for r in gen.response_ids])
        scored = scorer(gen.texts, [ex.ground_truth for ex in per_row], [ex.data_source for ex in per_row],
                        lengths, gen.truncated)
        stats.seconds_generate += t1 - t0
        stats.seconds_reward += time.perf_counter() - t1
        stats.rounds += 1
        stats.prompts_generated += len(examples)
        stats.samples_generated += len(per_row)
        stats.tokens_generated += int(lengths.sum())
        stats.acc_sum += float(scored.acc.sum())
        stats.timeouts += scored.timeouts

        group_acc = scored.acc.view(-1, G).mean(dim=1)  # (P,)
        stats.groups_all_correct += int((group_acc == 1).sum())
        stats.groups_all_wrong += int((group_acc == 0).sum())
        if a.dynamic_sampling:
            # filter on raw correctness, not the shaped reward: length shaping alone must not keep a group
            values = scored.acc if a.filter_metric == "acc" else scored.reward
            keep = algo.informative_groups(values, G)  # (P,)
        else:
            keep = torch.ones(len(examples), dtype=torch.bool)
        round_batch = RolloutBatch(
            group_size=G, prompt_ids=gen.prompt_ids, response_ids=gen.response_ids, truncated=gen.truncated,
            texts=gen.texts, example_uids=[ex.uid for ex in per_row], ground_truths=[ex.ground_truth for ex in per_row],
            acc=scored.acc, reward=scored.reward, overlong=scored.overlong, preds=scored.preds,
            rollout_logp=gen.logprobs or [],
        )
        dropped_tokens = int(lengths.view(-1, G)[~keep].sum())
        stats.tokens_in_dropped_groups += dropped_tokens
        stats.seconds_dropped += (t1 - t0) * dropped_tokens / max(int(lengths.sum()), 1)
        stats.keep_rates.append(float(keep.float().mean()))
        stats.groups_dropped += int((~keep).sum())
        kept.extend(round_batch.select_groups([i]) for i in torch.nonzero(keep).flatten().tolist())
    buffer.extend(kept[num_prompts:])
    del buffer[: max(0, len(buffer) - max_buffer_groups)]  # oldest (stalest) go first; 0 keeps none
    kept = kept[:num_prompts]
    stats.groups_kept = len(kept)
    return (RolloutBatch.concat(kept) if kept else None), stats


def record_behaviour_logp(buffer: list[RolloutBatch], logprobs: Callable[[RolloutBatch], tuple], *, source: str) -> None:
    """Give each newly buffered group the log-probs of the weights that sampled it, in place.

    Call it after ``collect_batch`` and before the update, while the trainer still holds those
    weights. ``source``: ``trainer`` computes them with ``logprobs`` (``Policy.compute_logprobs``),
    ``engine`` takes the rollout engine's own (vLLM reports them; they include its numerical
    difference from the trainer).
    """
    new = [b for b in buffer if not b.behaviour_logp]
    if not new:
        return
    if source == "engine":
        for b in new:
            if not b.rollout_logp:
                raise ValueError("algo.buffer_logp=engine: the rollout engine reported no log-probs (use rollout.backend=vllm)")
            b.behaviour_logp = [list(lp) for lp in b.rollout_logp]
        return
    joined = RolloutBatch.concat(new)
    logp, _ = logprobs(joined)  # (N, T), one pass for every new group
    start = 0
    for b in new:
        b.behaviour_logp = [logp[start + j, : len(r)].tolist() for j, r in enumerate(b.response_ids)]
        start += len(b)
