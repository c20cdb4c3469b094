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
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from dapo import algo
from dapo.batch import RolloutBatch
from dapo.rewards.graders import TIMEOUT_PRED, graders_for
from dapo.rewards.pool import CRASH_PRED
from dapo.rollout.base import SamplingParams, ToolLog
from dapo.screening import ScreenCounts, collect_screened
from dapo.watchdog import phase


class GenerationCapError(RuntimeError):
    pass


@dataclass
class Scored:
    acc: torch.Tensor  # (N,) float 0/1
    reward: torch.Tensor  # (N,) correctness reward + overlong shaping
    overlong_penalty: torch.Tensor  # (N,) <= 0: the shaping part alone
    preds: list[str]
    timeouts: int = 0  # responses whose grading ran past the time limit (scored wrong)
    worker_crashes: int = 0  # responses whose grading worker died (scored wrong)


class Scorer:
    """Turns response texts into rewards: rule reward from the grading pool, then eq. 13 shaping.

    With ``reward_from_score`` (a caller's reward function) the grader's own score is the reward
    instead of algo.correct_reward / wrong_reward; a response whose grading timed out or crashed
    gets algo.wrong_reward, as under the built-in graders."""

    def __init__(self, pool, *, grader: str, algo_cfg, max_response_tokens: int, reward_from_score: bool = False):
        self.pool = pool
        self.grader = grader
        self.a = algo_cfg
        self.max_response_tokens = max_response_tokens
        self.reward_from_score = reward_from_score

    def __call__(
        self, texts: list[str], ground_truths: list[str], data_sources: list[str], lengths, truncated
    ) -> Scored:
        result = self.pool.score(texts, ground_truths, graders_for(data_sources, self.grader))
        acc = torch.tensor([float(g.acc) for g in result.grades])  # (N,)
        if self.reward_from_score:
            reward = torch.tensor(
                [self.a.wrong_reward if g.pred in (TIMEOUT_PRED, CRASH_PRED) else g.score for g in result.grades],
                dtype=torch.float32,
            )  # (N,)
        else:
            reward = torch.where(acc > 0, self.a.correct_reward, self.a.wrong_reward)  # (N,)
        penalty = torch.zeros_like(reward)
        if self.a.soft_overlong_punishment:
            penalty = algo.overlong_penalty(
                lengths,
                max_response_tokens=self.max_response_tokens,
                overlong_buffer_tokens=self.a.overlong_buffer_tokens,
                penalty_factor=self.a.overlong_penalty_factor,
            )
        return Scored(
            acc, reward + penalty, penalty, [g.pred for g in result.grades], result.num_timeouts, result.num_crashes
        )


NO_ANSWER = ("[INVALID]", "")  # what every grader predicts for a response without an answer
# The keep-rate estimate that sizes each round's over-sampling (algo.adaptive_oversample) follows the
# measured rate with this momentum: one unlucky round does not double the next step's generation, and
# a run whose problems get easier is followed within a few steps.
KEEP_RATE_MOMENTUM = 0.7


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
    worker_crashes: int = 0
    cap_hit: bool = False
    seconds_generate: float = 0.0
    seconds_reward: float = 0.0
    seconds_dropped: float = 0.0  # generation time attributed to dropped groups (by token share)
    screen: ScreenCounts = field(default_factory=ScreenCounts)  # algo.screen_samples: what screening dropped
    tools: ToolLog = field(default_factory=lambda: ToolLog(turns=0))  # summed over the generated responses
    keep_rates: list[float] = field(default_factory=list)

    def count_groups(self, group_acc: torch.Tensor, keep: torch.Tensor) -> None:
        """A round's drawn prompts (P,): their groups' accuracy, and whether dynamic sampling or screening kept them."""
        self.prompts_generated += len(keep)
        self.groups_all_correct += int((group_acc == 1).sum())
        self.groups_all_wrong += int((group_acc == 0).sum())
        self.groups_dropped += int((~keep).sum())
        self.keep_rates.append(float(keep.float().mean()))


def round_seeds(base_seed: int, rounds_done: int):
    """The sampling seed of a step's k-th generation round, after ``rounds_done`` rounds: distinct across the run."""
    return lambda k: base_seed * 1_000_003 + rounds_done + k


def next_keep_rate(estimate: float, stats: CollectStats) -> float:
    """The running estimate of the share of groups dynamic sampling keeps, after a step's collection."""
    if not stats.keep_rates:
        return estimate
    measured = sum(stats.keep_rates) / len(stats.keep_rates)
    return KEEP_RATE_MOMENTUM * estimate + (1 - KEEP_RATE_MOMENTUM) * measured


class BatchCollector:
    """Fills a training batch with informative groups (DAPO sec. 3.2): generate G responses for
    each of a round's prompts, grade and shape them, drop the groups whose G values are all equal,
    and go again until ``num_prompts`` groups are kept.

    ``sampler.next(k)`` gives k examples, ``encode(example)`` their prompt ids; ``sampling`` holds G (``n``) and the
    sampling settings, each round getting its own seed.
    """

    def __init__(
        self,
        *,
        engine,
        sampler,
        scorer: Callable[..., Scored],
        encode: Callable[[object], list[int]],
        sampling: SamplingParams,
        algo_cfg,
    ):
        self.engine, self.sampler, self.scorer, self.encode = engine, sampler, scorer, encode
        self.sampling, self.a = sampling, algo_cfg

    def collect(
        self,
        num_prompts: int,
        buffer: list[RolloutBatch],
        *,
        round_seed: Callable[[int], int],
        keep_rate_estimate: float = 1.0,
    ) -> tuple[RolloutBatch | None, CollectStats]:
        """A batch of ``num_prompts`` informative groups (None if none came), and what it took.

        ``buffer`` (single-group batches held over from earlier steps) is consumed first and refilled
        in place with up to ``algo.buffer_max_groups`` surplus groups (none: the reference's behaviour).
        ``round_seed(k)`` is the sampling seed of this step's k-th round; ``keep_rate_estimate`` the
        share of groups expected to survive, by which each round over-samples (with adaptive_oversample).
        """
        stats = CollectStats()
        kept: list[RolloutBatch] = []
        while buffer and len(kept) < num_prompts:
            kept.append(buffer.pop(0))
            stats.groups_from_buffer += 1
        if self.a.screen_samples:  # n responses first, the rest only where they disagree (screening.py)
            collect_screened(
                self, num_prompts, kept, round_seed=round_seed, keep_rate_estimate=keep_rate_estimate, stats=stats
            )
        else:
            while len(kept) < num_prompts and not self._at_round_cap(stats, len(kept), num_prompts):
                kept += self._round(num_prompts - len(kept), round_seed(stats.rounds), keep_rate_estimate, stats)
        buffer.extend(kept[num_prompts:])
        del buffer[: max(0, len(buffer) - self.a.buffer_max_groups)]  # the oldest (stalest) go first
        kept = kept[:num_prompts]
        stats.groups_kept = len(kept)
        return (RolloutBatch.concat(kept) if kept else None), stats

    def _at_round_cap(self, stats: CollectStats, num_kept: int, num_prompts: int) -> bool:
        a = self.a
        if not a.max_gen_rounds or stats.rounds < a.max_gen_rounds:
            return False
        stats.cap_hit = True
        msg = (
            f"dynamic sampling hit algo.max_gen_rounds={a.max_gen_rounds} with {num_kept}/{num_prompts} "
            "prompts kept; training on those (set algo.on_max_gen_rounds=fail to stop instead)"
        )
        if a.on_max_gen_rounds == "fail":
            raise GenerationCapError(msg.split(";")[0] + "; raise algo.max_gen_rounds or use an easier dataset")
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return True

    def _round(self, missing: int, seed: int, keep_rate_estimate: float, stats: CollectStats) -> list[RolloutBatch]:
        """One generation round for ``missing`` prompts (more when over-sampling): its informative groups."""
        a, G = self.a, self.sampling.n
        examples = self.sampler.next(self.to_draw(missing, keep_rate_estimate))
        part, gen_s = self.sample(examples, [G] * len(examples), seed, stats)
        keep = self.informative(part, G) if a.dynamic_sampling else torch.ones(len(examples), dtype=torch.bool)
        group_acc = part.acc.view(-1, G).mean(dim=1)  # (P,)
        lengths = part.response_lengths
        dropped_tokens = int(lengths.view(-1, G)[~keep].sum())
        stats.seconds_dropped += gen_s * dropped_tokens / max(int(lengths.sum()), 1)
        stats.tokens_in_dropped_groups += dropped_tokens
        stats.count_groups(group_acc, keep)
        return [part.select_groups([i]) for i in torch.nonzero(keep).flatten().tolist()]

    def to_draw(self, missing: int, keep_rate_estimate: float) -> int:
        """Prompts a round draws for ``missing`` kept groups: over-sampled in proportion to the measured keep rate,
        so most steps need one round."""
        factor = self.a.oversample / max(keep_rate_estimate, 0.05) if self.a.dynamic_sampling else 1.0
        return max(missing, math.ceil(missing * factor))

    def informative(self, part: RolloutBatch, n: int) -> torch.Tensor:
        """(P,) bool: groups of ``n`` consecutive rows whose values are not all equal (eq. 11), on raw correctness
        unless algo.filter_metric says reward: length shaping alone must not keep a group."""
        return algo.informative_groups(part.acc if self.a.filter_metric == "acc" else part.reward, n)

    def sample(self, examples: list, counts: list[int], seed: int, stats: CollectStats) -> tuple[RolloutBatch, float]:
        """``counts[i]`` responses to ``examples[i]`` in one engine call, graded and shaped, in prompt-major order
        (group_size: the count where all are equal, else 1), and the call's generation seconds. ``stats`` gets
        the call's own figures (rounds, samples, tokens, tool calls, grading); the groups' are the caller's."""
        uniform = len(set(counts)) == 1
        prompts = [self.encode(ex) for ex in examples]
        if uniform:  # n per prompt: the engine's own n (vLLM samples a prompt's n together)
            sampling = replace(self.sampling, n=counts[0], seed=seed)
        else:  # one request per response (vLLM's prefix cache shares the prompt; hf pads the same rows)
            prompts = [p for p, c in zip(prompts, counts) for _ in range(c)]
            sampling = replace(self.sampling, n=1, seed=seed)
        t0 = time.perf_counter()
        with phase("generate"):  # the step watchdog's phases (watchdog.py): one round's generation, then its grading
            gen = self.engine.generate(prompts, sampling)
        t1 = time.perf_counter()
        per_row = [ex for ex, c in zip(examples, counts) for _ in range(c)]
        lengths = torch.tensor([len(r) for r in gen.response_ids])  # (N,)
        with phase("reward"):
            scored = self.scorer(
                gen.texts,
                [ex.ground_truth for ex in per_row],
                [ex.data_source for ex in per_row],
                lengths,
                gen.truncated,
            )
        stats.seconds_generate += t1 - t0
        stats.seconds_reward += time.perf_counter() - t1
        stats.rounds += 1
        stats.samples_generated += len(per_row)
        stats.tokens_generated += int(lengths.sum())
        for log in gen.tool_logs or []:
            stats.tools.add(log)
        stats.acc_sum += float(scored.acc.sum())
        stats.timeouts += scored.timeouts
        stats.worker_crashes += scored.worker_crashes
        # a void turn: one that ended at a block that was not code, or a last turn that ended without an answer
        void_turn = [
            log.void_turns > 0 or (not bool(cut) and pred in NO_ANSWER)
            for log, cut, pred in zip(gen.tool_logs or [], gen.truncated, scored.preds)
        ]
        part = RolloutBatch(
            group_size=counts[0] if uniform else 1,
            prompt_ids=gen.prompt_ids,
            response_ids=gen.response_ids,
            truncated=gen.truncated,
            texts=gen.texts,
            example_uids=[ex.uid for ex in per_row],
            ground_truths=[ex.ground_truth for ex in per_row],
            acc=scored.acc,
            reward=scored.reward,
            overlong_penalty=scored.overlong_penalty,
            preds=scored.preds,
            rollout_logp=gen.logprobs or [],
            tool_mask=gen.tool_mask or [],
            void_turn=void_turn,
        )
        return part, t1 - t0


def record_behaviour_logp(
    buffer: list[RolloutBatch], logprobs: Callable[[RolloutBatch], tuple], *, source: str
) -> None:
    """Give each newly buffered group the log-probs of the weights that sampled it, in place.

    Call it after ``BatchCollector.collect`` and before the update, while the trainer still holds those
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
                raise ValueError(
                    "algo.buffer_logp=engine: the rollout engine reported no log-probs (use rollout.backend=vllm)"
                )
            b.behaviour_logp = [list(lp) for lp in b.rollout_logp]
        return
    joined = RolloutBatch.concat(new)
    logp, _ = logprobs(joined)  # (N, T), one pass for every new group
    start = 0
    for b in new:
        b.behaviour_logp = [logp[start + j, : len(r)].tolist() for j, r in enumerate(b.response_ids)]
        start += len(b)
