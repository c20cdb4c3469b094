"""What a step's collection counted, the sampling seeds of its rounds and the keep-rate estimate that sizes them,
and the sampling/* metrics a step logs from them (docs/metrics.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dapo.rollout.base import ToolLog

# The keep-rate estimate that sizes each round's over-sampling (algo.adaptive_oversample) follows the
# measured rate with this momentum: one unlucky round does not double the next step's generation, and
# a run whose problems get easier is followed within a few steps.
KEEP_RATE_MOMENTUM = 0.7


@dataclass
class ScreenCounts:
    """A step's screening, summed over its engine calls (sampling/screen_* metrics)."""

    screened: int = 0  # prompts given their first n responses
    out_all_correct: int = 0  # screened out: the n were all right
    out_all_wrong: int = 0  # screened out: the n were all wrong (or, by reward, all equal otherwise)
    out_tokens: int = 0  # tokens of the screened-out prompts' n responses
    surplus: int = 0  # screened in beyond what the step needed: not completed
    surplus_tokens: int = 0
    completed: int = 0  # screened in and completed to G, for training
    audited: int = 0  # screened out, completed anyway (algo.screen_audit), never trained
    audit_informative: int = 0  # of those, groups of G that would have been informative
    audit_tokens: int = 0  # tokens of the audit's completions


@dataclass
class CollectStats:
    """A step's collection, summed over its generation rounds (engine calls)."""

    rounds: int = 0
    prompts_generated: int = 0
    samples_generated: int = 0
    tokens_generated: int = 0
    tokens_in_dropped_groups: int = 0
    groups_kept: int = 0
    groups_dropped: int = 0
    groups_all_correct: int = 0
    groups_all_wrong: int = 0
    groups_from_held_over: int = 0  # groups held over from an earlier step that this step trains
    acc_sum: float = 0.0  # over every generated sample (the honest training accuracy)
    timeouts: int = 0
    worker_crashes: int = 0
    grading_retries: int = 0
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


@dataclass
class RoundCounters:
    """What a collection carries from step to step: the generation rounds done (each round's sampling seed follows
    from their number, so it is distinct across the run) and the running keep-rate estimate."""

    gen_rounds: int = 0
    keep_rate: float = 1.0

    def observe(self, stats: CollectStats) -> None:
        """A step's collection is done."""
        self.gen_rounds += stats.rounds
        self.keep_rate = next_keep_rate(self.keep_rate, stats)

    def round_seed(self, base_seed: int):
        """The sampling seed of this step's k-th generation round."""
        return round_seeds(base_seed, self.gen_rounds)


def round_seeds(base_seed: int, rounds_done: int):
    """The sampling seed of a step's k-th generation round, after ``rounds_done`` rounds: distinct across the run."""
    return lambda k: base_seed * 1_000_003 + rounds_done + k


def next_keep_rate(estimate: float, stats: CollectStats) -> float:
    """The running estimate of the share of groups dynamic sampling keeps, after a step's collection."""
    if not stats.keep_rates:
        return estimate
    measured = sum(stats.keep_rates) / len(stats.keep_rates)
    return KEEP_RATE_MOMENTUM * estimate + (1 - KEEP_RATE_MOMENTUM) * measured


def sampling_metrics(cstats: CollectStats, *, held_over: int, gen_rounds_total: int) -> dict:
    """What generation produced this step, trained on or not."""
    return {
        "reward/timeouts": cstats.timeouts,
        "reward/worker_crashes": cstats.worker_crashes,
        "reward/grading_retries": cstats.grading_retries,
        "rollout/acc_mean": cstats.acc_sum / max(cstats.samples_generated, 1),
        "sampling/gen_rounds": cstats.rounds,
        "sampling/prompts_generated": cstats.prompts_generated,
        "sampling/groups_kept": cstats.groups_kept,
        "sampling/groups_dropped": cstats.groups_dropped,
        "sampling/groups_from_held_over": cstats.groups_from_held_over,
        "sampling/all_correct_frac": cstats.groups_all_correct / max(cstats.prompts_generated, 1),
        "sampling/all_wrong_frac": cstats.groups_all_wrong / max(cstats.prompts_generated, 1),
        "sampling/samples_generated": cstats.samples_generated,
        "sampling/dropped_gen_time_frac": cstats.seconds_dropped / max(cstats.seconds_generate, 1e-9),
        "sampling/dropped_gen_s": cstats.seconds_dropped,
        "sampling/tokens_generated": cstats.tokens_generated,
        "sampling/informative_frac": (cstats.prompts_generated - cstats.groups_dropped)
        / max(cstats.prompts_generated, 1),
        "sampling/held_over_groups": held_over,
        "sampling/gen_rounds_total": gen_rounds_total,
        "sampling/cap_hit": float(cstats.cap_hit),
        "perf/time_generate_s": cstats.seconds_generate,
        "perf/time_reward_s": cstats.seconds_reward,
        "perf/gen_tokens_per_s": cstats.tokens_generated / max(cstats.seconds_generate, 1e-9),
        "perf/reward_samples_per_s": cstats.samples_generated / max(cstats.seconds_reward, 1e-9),
    }


def screen_metrics(s: ScreenCounts, *, group_size: int, screen_samples: int) -> dict:
    """A step's screening as metrics (docs/metrics.md). ``sampling/screen_saved_tokens`` estimates the responses
    not generated, G - n for each prompt dropped after its first n, at the mean length of those n."""
    dropped_tokens = s.out_tokens + s.surplus_tokens
    out = {
        "sampling/screened": s.screened,
        "sampling/screened_out_all_correct": s.out_all_correct,
        "sampling/screened_out_all_wrong": s.out_all_wrong,
        "sampling/screened_out_tokens": s.out_tokens,
        "sampling/screen_surplus": s.surplus,
        "sampling/screen_saved_tokens": dropped_tokens * (group_size - screen_samples) / screen_samples,
        "sampling/screen_audited": s.audited,
        "sampling/screen_audit_tokens": s.audit_tokens,
    }
    if s.audited:
        out["sampling/screen_audit_informative"] = s.audit_informative
    return out


def collection_metrics(stats: CollectStats, *, held_over: int, gen_rounds_total: int, group_size: int,
                       screen_samples: int) -> dict:  # fmt: skip
    """A step's sampling/* metrics, screening's with them when it is on (``screen_samples`` > 0)."""
    out = sampling_metrics(stats, held_over=held_over, gen_rounds_total=gen_rounds_total)
    if screen_samples:
        out |= screen_metrics(stats.screen, group_size=group_size, screen_samples=screen_samples)
    return out
