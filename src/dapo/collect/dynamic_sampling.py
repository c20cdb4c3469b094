"""Dynamic sampling (DAPO sec. 3.2): generate, grade, shape and filter until the step's batch holds its P prompts.

A group whose G responses are all right (or all wrong) has zero advantage and contributes no gradient, so it is
dropped and more prompts are sampled. Informative groups beyond the batch are discarded, as the reference does
(``batch[:train_batch_size]``); with ``algo.held_over_max_groups`` > 0 they are held over for the next step, each
given the log-probs of the weights that sampled it before the update (``dapo.algorithm.step``), which its loss then
uses as old_logp: a held-over group is off-policy, and the clip must bound the step from the policy that sampled
it. Unlike the reference, hitting the cap on generation rounds trains on what was kept
(``algo.on_max_gen_rounds=train``) instead of stopping the run.

How a step's engine calls spend their responses is chosen once, when ``DynamicSampling`` is made: ``fill_rounds``
gives every drawn prompt its whole group (the paper's), ``dapo.collect.screening.fill_screened`` screens each with a
few responses first (``algo.screen_samples``). Both fill the batch through ``DynamicSampling``'s public methods.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable
from dataclasses import replace

import torch

from dapo.algorithm import advantages
from dapo.algorithm.batch import RolloutBatch
from dapo.collect.scoring import NO_ANSWER, Scored
from dapo.collect.screening import fill_screened
from dapo.collect.stats import CollectStats
from dapo.rollout.base import SamplingParams
from dapo.runtime.watchdog import phase


class GenerationCapError(RuntimeError):
    pass


class DynamicSampling:
    """Fills a training batch with informative groups (DAPO sec. 3.2): generate G responses for
    each of a round's prompts, grade and shape them, drop the groups whose G values are all equal,
    and go again until ``num_prompts`` groups are kept.

    ``prompts.next(k)`` gives the next k examples (a ``PromptOrder``), ``encode(example)`` their prompt ids;
    ``sampling`` holds G (``n``) and how tokens are sampled, each round getting its own seed; ``algo`` the
    algorithm's settings (AlgoConfig).
    """

    def __init__(
        self,
        *,
        engine,
        prompts,
        scorer: Callable[..., Scored],
        encode: Callable[[object], list[int]],
        sampling: SamplingParams,
        algo,
    ):
        self.engine, self.prompts, self.scorer, self.encode = engine, prompts, scorer, encode
        self.sampling, self.algo = sampling, algo
        # how the step's engine calls spend their responses: whole groups, or n first (screening)
        self.fill = fill_screened if algo.screen_samples else fill_rounds

    def fill_batch(
        self,
        num_prompts: int,
        held_over: list[RolloutBatch],
        *,
        round_seed: Callable[[int], int],
        keep_rate_estimate: float = 1.0,
    ) -> tuple[RolloutBatch | None, CollectStats, list[RolloutBatch]]:
        """A batch of ``num_prompts`` informative groups (None if none came), what it took, and the groups held
        over after it.

        ``held_over`` (single-group batches kept from earlier steps) is used first; the groups held over after the
        step are those not used and the step's surplus groups, at most ``algo.held_over_max_groups`` of them, the
        oldest dropped first (none: the reference's behaviour). ``round_seed(k)`` is the sampling seed of this
        step's k-th round; ``keep_rate_estimate`` the share of groups expected to survive, by which each round
        over-samples (with adaptive_oversample).
        """
        stats = CollectStats()
        kept = list(held_over[:num_prompts])
        stats.groups_from_held_over = len(kept)
        self.fill(self, num_prompts, kept, round_seed=round_seed, keep_rate_estimate=keep_rate_estimate, stats=stats)
        after = held_over[num_prompts:] + kept[num_prompts:]
        after = after[max(0, len(after) - self.algo.held_over_max_groups) :]  # the oldest (stalest) go first
        kept = kept[:num_prompts]
        stats.groups_kept = len(kept)
        return (RolloutBatch.concat(kept) if kept else None), stats, after

    def at_round_cap(self, stats: CollectStats, num_kept: int, num_prompts: int) -> bool:
        """Whether the step has had its ``algo.max_gen_rounds`` engine calls: then it trains on what it kept, with a
        warning (``algo.on_max_gen_rounds=fail``: GenerationCapError)."""
        a = self.algo
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

    def draw(self, missing: int, keep_rate_estimate: float) -> list:
        """The next prompts for ``missing`` kept groups (``to_draw`` of them)."""
        return self.prompts.next(self.to_draw(missing, keep_rate_estimate))

    def to_draw(self, missing: int, keep_rate_estimate: float) -> int:
        """Prompts a round draws for ``missing`` kept groups: over-sampled in proportion to the measured keep rate,
        so most steps need one round."""
        factor = self.algo.oversample / max(keep_rate_estimate, 0.05) if self.algo.dynamic_sampling else 1.0
        return max(missing, math.ceil(missing * factor))

    def informative(self, part: RolloutBatch, n: int) -> torch.Tensor:
        """(P,) bool: groups of ``n`` consecutive rows whose values are not all equal (eq. 11), on raw correctness
        unless algo.filter_metric says reward: length shaping alone must not keep a group. Ungraded rows do not
        count: their value is no grade."""
        values = part.acc if self.algo.filter_metric == "acc" else part.reward
        graded = ~torch.tensor(part.ungraded, dtype=torch.bool) if part.ungraded else None
        return advantages.informative_groups(values, n, counted=graded)

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
        with phase("generate"):  # the step watchdog's phases: one round's generation, then its grading
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
        stats.grading_retries += scored.retried
        # a void turn: one that ended at a block that was not code, or a last turn that ended without an answer
        void_turn = [
            log.void_turns > 0 or (not bool(cut) and pred in NO_ANSWER)
            for log, cut, pred in zip(gen.tool_logs or [], gen.truncated, scored.preds)
        ]
        part = RolloutBatch.from_generation(
            gen,
            group_size=counts[0] if uniform else 1,
            example_uids=[ex.uid for ex in per_row],
            ground_truths=[ex.ground_truth for ex in per_row],
            acc=scored.acc,
            reward=scored.reward,
            overlong_penalty=scored.overlong_penalty,
            preds=scored.preds,
            void_turn=void_turn,
            ungraded=scored.ungraded if any(scored.ungraded) else [],
        )
        return part, t1 - t0


def fill_rounds(
    sampling: DynamicSampling, num_prompts: int, kept: list[RolloutBatch], *, round_seed, keep_rate_estimate, stats
) -> None:
    """Append informative groups of G to ``kept`` round by round until it holds ``num_prompts`` or the round cap
    stops it: every drawn prompt gets its whole group, and the uninformative groups are dropped (the paper's)."""
    while len(kept) < num_prompts and not sampling.at_round_cap(stats, len(kept), num_prompts):
        missing = num_prompts - len(kept)
        kept += _round(sampling, missing, round_seed(stats.rounds), keep_rate_estimate, stats)


def _round(sampling: DynamicSampling, missing: int, seed: int, keep_rate_estimate: float, stats) -> list:
    """One generation round for ``missing`` prompts (more when over-sampling): its informative groups."""
    a, G = sampling.algo, sampling.sampling.n
    examples = sampling.draw(missing, keep_rate_estimate)
    part, gen_s = sampling.sample(examples, [G] * len(examples), seed, stats)
    keep = sampling.informative(part, G) if a.dynamic_sampling else torch.ones(len(examples), dtype=torch.bool)
    group_acc = part.acc.view(-1, G).mean(dim=1)  # (P,)
    lengths = part.response_lengths
    dropped_tokens = int(lengths.view(-1, G)[~keep].sum())
    stats.seconds_dropped += gen_s * dropped_tokens / max(int(lengths.sum()), 1)
    stats.tokens_in_dropped_groups += dropped_tokens
    stats.count_groups(group_acc, keep)
    return [part.select_groups([i]) for i in torch.nonzero(keep).flatten().tolist()]
