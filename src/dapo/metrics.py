"""What a training step logs, computed from the step's batch and its dynamic-sampling statistics.
The names and their verl counterparts are listed in docs/metrics.md."""

from __future__ import annotations

from collections import deque

import torch

from dapo.batch import RolloutBatch
from dapo.dynamic_sampling import CollectStats


def sampling_metrics(cstats: CollectStats, *, buffer_groups: int, gen_rounds_total: int) -> dict:
    """What generation produced this step, trained on or not."""
    return {
        "reward/timeouts": cstats.timeouts,
        "reward/worker_crashes": cstats.worker_crashes,
        "rollout/acc_mean": cstats.acc_sum / max(cstats.samples_generated, 1),
        "sampling/gen_rounds": cstats.rounds,
        "sampling/prompts_generated": cstats.prompts_generated,
        "sampling/groups_kept": cstats.groups_kept,
        "sampling/groups_dropped": cstats.groups_dropped,
        "sampling/groups_from_buffer": cstats.groups_from_buffer,
        "sampling/all_correct_frac": cstats.groups_all_correct / max(cstats.prompts_generated, 1),
        "sampling/all_wrong_frac": cstats.groups_all_wrong / max(cstats.prompts_generated, 1),
        "sampling/samples_generated": cstats.samples_generated,
        "sampling/dropped_gen_time_frac": cstats.seconds_dropped / max(cstats.seconds_generate, 1e-9),
        "sampling/dropped_gen_s": cstats.seconds_dropped,
        "sampling/tokens_generated": cstats.tokens_generated,
        "sampling/informative_frac": (cstats.prompts_generated - cstats.groups_dropped)
        / max(cstats.prompts_generated, 1),
        "sampling/buffer_groups": buffer_groups,
        "sampling/gen_rounds_total": gen_rounds_total,
        "sampling/cap_hit": float(cstats.cap_hit),
        "perf/time_generate_s": cstats.seconds_generate,
        "perf/time_reward_s": cstats.seconds_reward,
        "perf/gen_tokens_per_s": cstats.tokens_generated / max(cstats.seconds_generate, 1e-9),
        "perf/reward_samples_per_s": cstats.samples_generated / max(cstats.seconds_reward, 1e-9),
    }


def step_metrics(
    batch: RolloutBatch,
    cstats: CollectStats,
    update: dict,
    times: dict,
    *,
    max_prompt_tokens: int = 0,
    max_response_tokens: int = 0,
    old_logprob_tokens: int | None = None,
    engine_vs_trainer: bool = True,
) -> dict:
    """What the update trained on and how it went. ``old_logprob_tokens``: the response tokens the
    old-log-prob pass computed (None: every row's; 0: no pass, no throughput); ``engine_vs_trainer``:
    whether ``batch.old_logp`` is the trainer's, so comparing the engine's log-probs with it means something."""
    lengths = batch.response_lengths.float()  # (N,)
    prompt_lengths = torch.tensor([len(p) for p in batch.prompt_ids], dtype=torch.float32)  # (N,)
    mask = batch.response_mask()
    samples_trained = len(batch)
    adv_tokens = batch.adv.repeat_interleave(batch.response_lengths)  # every response token, as verl's data metrics
    m = {
        "reward/score_mean": batch.reward.mean(),
        "reward/score_max": batch.reward.max(),
        "reward/score_min": batch.reward.min(),
        "reward/acc_mean": batch.acc.mean(),
        "reward/overlong_penalty_mean": batch.overlong_penalty.mean(),
        "rollout/response_length_mean": lengths.mean(),
        "rollout/response_length_max": lengths.max(),
        "rollout/response_length_min": lengths.min(),
        "rollout/response_length_clip_frac": (lengths == max_response_tokens)
        .float()
        .mean(),  # at the limit, EOS or not
        "rollout/prompt_length_mean": prompt_lengths.mean(),
        "rollout/prompt_length_max": prompt_lengths.max(),
        "rollout/prompt_length_min": prompt_lengths.min(),
        "rollout/prompt_length_clip_frac": (prompt_lengths == max_prompt_tokens).float().mean(),  # cut from the left
        "rollout/truncated_frac": batch.truncated.float().mean(),
        "actor/entropy": (batch.entropy[:, : mask.shape[1]] * mask).sum() / mask.sum().clamp(min=1),
        "actor/adv_abs_mean": batch.adv.abs().mean(),
        "actor/adv_token_mean": adv_tokens.mean(),
        "actor/adv_token_max": adv_tokens.max(),
        "actor/adv_token_min": adv_tokens.min(),
        "sampling/samples_per_trained_sample": cstats.samples_generated / max(samples_trained, 1),
        "sampling/tokens_per_trained_token": cstats.tokens_generated / max(float(mask.sum()), 1.0),
        "sampling/tokens_trained": float(mask.sum()),
        "perf/train_tokens_per_s": float(mask.sum()) / max(times["update"], 1e-9),
    }
    if cstats.tools.turns:  # multi-turn rollouts (tools.python): per generated response, and the step's totals
        per = 1.0 / max(cstats.samples_generated, 1)
        t = cstats.tools
        m["tools/calls_per_response"], m["tools/errors_per_response"] = t.calls * per, t.errors * per
        m["tools/timeouts_per_response"], m["tools/turns_per_response"] = t.timeouts * per, t.turns * per
        m["tools/seconds"], m["tools/tokens_masked"] = t.seconds, float(t.tool_tokens)
    if batch.void_turn:  # the trained batch's responses with a void turn (tools.filter_void_turns masks them)
        m["tools/void_turn_frac"] = sum(batch.void_turn) / len(batch)
    old_tokens = float(lengths.sum()) if old_logprob_tokens is None else old_logprob_tokens
    if old_tokens:
        m["perf/old_logprob_tokens_per_s"] = old_tokens / max(times["old_logprob"], 1e-9)
    # the engine's log-probs of its own samples vs the trainer's: numerics (and buffer staleness)
    if batch.rollout_logp and engine_vs_trainer:
        T = batch.old_logp.shape[1]
        rollout_logp = batch.padded_logp(batch.rollout_logp, T)  # (N, T)
        written = batch.written_mask(width=T) > 0  # the model's tokens only
        diff = (rollout_logp - batch.old_logp).abs()[written]
        m["rollout/logprob_abs_diff_mean"], m["rollout/logprob_abs_diff_max"] = diff.mean(), diff.max()
        m.update(behaviour_drift(batch.old_logp[written], rollout_logp[written]))
    m.update({f"actor/{k}": v for k, v in update.items()})
    return m


def behaviour_drift(old_logp: torch.Tensor, behaviour_logp: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the weights a step trains from moved from those that sampled its tokens (generating ahead,
    held-over groups, the engine's numerics), over the sampled tokens' log-probs under each (n,):
    ``async/policy_kl``, KL(behaviour || current) per token by the k3 estimate (r - 1) - log r, r = pi_old /
    pi_behaviour (unbiased on the behaviour's samples, never negative); ``rollout/is_ess``, the effective
    sample size of the importance weights r as a share of the tokens, (sum r)^2 / (n sum r^2): 1 when nothing
    moved, small when a few tokens carry the weight."""
    log_ratio = (old_logp - behaviour_logp).clamp(-20.0, 20.0)  # exp of a huge value is inf
    ratio = log_ratio.exp()
    return {
        "async/policy_kl": (ratio - 1.0 - log_ratio).mean(),
        "rollout/is_ess": ratio.sum() ** 2 / (ratio.numel() * (ratio**2).sum()).clamp(min=1e-30),
    }


def no_signal_advice(streak: int, cstats: CollectStats, *, group_size: int, max_response_tokens: int) -> str:
    """One line for a run whose groups keep coming back all right or all wrong."""
    wrong = cstats.groups_all_wrong / max(cstats.prompts_generated, 1)
    right = cstats.groups_all_correct / max(cstats.prompts_generated, 1)
    if wrong >= right:
        fix = (
            f"the data is too hard for this model: use easier problems, a larger group (rollout.group_size="
            f"{group_size}) or longer responses (rollout.max_response_tokens={max_response_tokens})"
        )
    else:
        fix = "the data is too easy for this model: use harder problems"
    return (
        f"no informative group for {streak} steps in a row: {100 * wrong:.0f}% of groups all wrong, "
        f"{100 * right:.0f}% all right; {fix}"
    )


def sample_records(batch: RolloutBatch, tokenizer, k: int) -> list[dict]:
    rows = list(range(0, len(batch), max(1, len(batch) // max(k, 1))))[:k]
    return [
        {
            "prompt": tokenizer.decode(batch.prompt_ids[i], skip_special_tokens=True),
            "response": batch.texts[i],
            "reward": float(batch.reward[i]),
            "acc": float(batch.acc[i]),
            "pred": batch.preds[i] if batch.preds else "",
            "ground_truth": batch.ground_truths[i],
            "length": len(batch.response_ids[i]),
            "truncated": bool(batch.truncated[i]),
            **({"policy_version": batch.policy_version[i]} if batch.policy_version else {}),
        }
        for i in rows
    ]


# The mean |engine log-prob - trainer log-prob| per response token above which the engine is taken not to be
# sampling from the trained weights, by the dtype both compute in. In float32 the two agree to float noise
# (6e-7 on the demo model, 4e-6 on SmolLM2-135M with vLLM on CPU: README, vLLM section), so 1e-3 is far above
# rounding and below what one optimizer step at the demo's learning rate moves. bfloat16 keeps 8 significant
# bits: a logit near 10 is rounded by up to 0.04, and two implementations of one model round differently,
# so the bar sits at 0.1, above rounding alone; a stale engine after many steps lies far beyond it.
ENGINE_GAP_LIMIT = {"float32": 1e-3, "bfloat16": 0.1}


def engine_gap_warning(metrics: dict, *, dtype: str, step: int) -> str | None:
    """One line when the rollout engine's log-probs are further from the trainer's than ``dtype`` explains
    (``ENGINE_GAP_LIMIT``): the sign of weights that did not reach the engine. None otherwise."""
    gap = metrics.get("rollout/logprob_abs_diff_mean")
    limit = ENGINE_GAP_LIMIT.get(dtype)
    if gap is None or limit is None or float(gap) <= limit:
        return None
    return (
        f"step {step}: the rollout engine's log-probs are {float(gap):.3g} nats per token from the trainer's "
        f"(a {dtype} run stays under {limit:g}): the engine is probably not sampling from the trained weights; "
        "check train.log for a weight push that failed or was skipped, or weights lost across the engine's "
        "sleep and wake (rollout/logprob_abs_diff_mean follows the gap)"
    )


# where staleness started to cost accuracy on the demo (docs/async.md, benchmarks/async_rollout.py --lrs, 5 paired
# seeds): the settings of lr and k past either level lost 4 to 20 points of held-out accuracy at equal steps (5 to
# 20 of train accuracy), those within both 2 or fewer
DRIFT_KL_LEVEL = 0.005  # async/policy_kl, nats a token
DRIFT_ESS_LEVEL = 0.985  # rollout/is_ess
DRIFT_WINDOW = 5  # steps averaged, so one step's noise does not warn


class DriftGuard:
    """Says once when training on stale samples moves the policy past the level that cost accuracy: the mean of
    ``async/policy_kl`` or ``rollout/is_ess`` over the last DRIFT_WINDOW steps that trained on stale samples."""

    def __init__(self) -> None:
        self.recent: deque[tuple[float, float]] = deque(maxlen=DRIFT_WINDOW)
        self.said = False

    def observe(self, metrics: dict, *, step: int, lr: float, max_staleness: int) -> str | None:
        if self.said or not metrics.get("async/staleness_max") or "async/policy_kl" not in metrics:
            return None
        self.recent.append((float(metrics["async/policy_kl"]), float(metrics["rollout/is_ess"])))
        if len(self.recent) < DRIFT_WINDOW:
            return None
        kl = sum(k for k, _ in self.recent) / DRIFT_WINDOW
        ess = sum(e for _, e in self.recent) / DRIFT_WINDOW
        if kl <= DRIFT_KL_LEVEL and ess >= DRIFT_ESS_LEVEL:
            return None
        self.said = True
        return (
            f"step {step}: the policy moves far between sampling and training: async/policy_kl {kl:.3g} nats a token "
            f"and rollout/is_ess {ess:.3f} over the last {DRIFT_WINDOW} steps (past {DRIFT_KL_LEVEL:g} or under "
            f"{DRIFT_ESS_LEVEL:g}, the demo lost 4 to 20 points of accuracy at equal steps: docs/async.md); lower "
            f"train.lr (now {lr:g}) or rollout.max_staleness (now {max_staleness})"
        )
