"""What a training step logs, computed from the step's batch and its dynamic-sampling statistics.
The names and their verl counterparts are listed in docs/metrics.md."""

from __future__ import annotations

import torch

from dapo.algorithm.batch import RolloutBatch
from dapo.algorithm.losses import log_ratio
from dapo.collect.stats import CollectStats


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
    if batch.adv.dim() == 1:
        adv_tokens = batch.adv.repeat_interleave(batch.response_lengths)  # every response token, as verl's data metrics
    else:  # per token (a teacher's term): each response's own tokens
        adv_tokens = batch.adv[torch.arange(batch.adv.shape[1])[None, :] < batch.response_lengths[:, None]]
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
        "actor/adv_abs_mean": (batch.adv if batch.adv.dim() == 1 else adv_tokens).abs().mean(),
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
    m.update({k if "/" in k else f"actor/{k}": v for k, v in update.items()})  # a teacher's KL keeps its own name
    return m


def behaviour_drift(old_logp: torch.Tensor, behaviour_logp: torch.Tensor) -> dict[str, torch.Tensor]:
    """How far the weights a step trains from moved from those that sampled its tokens (generating ahead,
    held-over groups, the engine's numerics), over the sampled tokens' log-probs under each (n,):
    ``async/policy_kl``, KL(behaviour || current) per token by the k3 estimate (r - 1) - log r, r = pi_old /
    pi_behaviour (unbiased on the behaviour's samples, never negative); ``rollout/is_ess``, the effective
    sample size of the importance weights r as a share of the tokens, (sum r)^2 / (n sum r^2): 1 when nothing
    moved, small when a few tokens carry the weight."""
    log_r = log_ratio(old_logp, behaviour_logp)
    ratio = log_r.exp()
    return {
        "async/policy_kl": (ratio - 1.0 - log_r).mean(),
        "rollout/is_ess": ratio.sum() ** 2 / (ratio.numel() * (ratio**2).sum()).clamp(min=1e-30),
    }


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
