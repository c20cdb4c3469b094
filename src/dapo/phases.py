"""What the phases of a training step compute, beside the loop in training.py that runs them in order: the loss
the update minimises, the advantages, and the old log-probs with the rollout correction's importance weights."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from dapo import algo, is_weights
from dapo.batch import RolloutBatch
from dapo.config import AlgoConfig
from dapo.dynamic_sampling import record_behaviour_logp
from dapo.policy import LossFn


def make_loss_fn(algo_cfg: AlgoConfig, max_response_tokens: int) -> LossFn:
    """The loss ``Policy.update`` minimises: the clipped surrogate as ``algo_cfg`` sets it, with the KL
    term to the reference model when ``algo_cfg.kl_coef`` > 0 (``max_response_tokens``: Dr. GRPO's
    constant length)."""
    a = algo_cfg
    return functools.partial(
        algo.actor_loss,
        eps_low=a.eps_low,
        eps_high=a.eps_high,
        loss_agg=a.loss_agg,
        norm_length=max_response_tokens,
        dual_clip=a.dual_clip,
        kl_coef=a.kl_coef,
        kl_kind=a.kl_kind,
        objective=a.objective,
    )


def assign_advantages(batch: RolloutBatch, a, group_size: int, *, filter_void_turns: bool = False) -> None:
    """Overlong filtering (sec. 3.4: truncated answers carry no learning signal) and the void-turn filter
    (tools.filter_void_turns), then eq. 9's group-normalised advantage, one value per response."""
    if a.overlong_filtering:
        batch.trainable = ~batch.truncated
    if filter_void_turns and batch.void_turn:
        keep = ~torch.tensor(batch.void_turn, dtype=torch.bool)
        batch.trainable = keep if batch.trainable is None else batch.trainable & keep
    in_baseline = None if a.truncated_in_group_stats else ~batch.truncated  # the paper masks only the loss
    batch.adv = algo.group_advantages(
        batch.reward, group_size, scale_by_std=a.scale_adv_by_std, in_baseline=in_baseline
    )  # (N,)


@dataclass
class OldLogprobs:
    """What the old-log-prob phase did: the importance weights' statistics, the response tokens it
    computed, and whether the update must give the entropy (no pass ran to give it)."""

    metrics: dict
    tokens_computed: int
    entropy_from_update: bool = False


def old_logprobs(batch: RolloutBatch, run) -> OldLogprobs:
    """old_logp (and entropy) under the weights that sampled, the reference's log-probs for a KL
    term, and the importance weights when they are on (``run``: the training.Run).

    algo.old_logp: ``recompute`` runs the log-prob pass over every row; ``engine`` takes vLLM's
    log-probs and runs no pass (entropy from the update's forwards).
    """
    a = run.cfg.algo
    if run.state.buffer:  # held-over groups keep the log-probs of the weights that sampled them (still loaded)
        record_behaviour_logp(run.state.buffer, run.policy.compute_logprobs, source=a.buffer_logp)
    if a.old_logp == "engine":
        if not batch.rollout_logp:
            raise ValueError("algo.old_logp=engine: the rollout engine reported no log-probs; use rollout.backend=vllm")
        T = batch.max_response_len
        batch.old_logp = batch.behaviour_old_logp(batch.padded_logp(batch.rollout_logp, T))  # (N, T)
        tokens = 0
    else:
        old_logp, batch.entropy = run.policy.compute_logprobs(batch, with_entropy=True)  # (N, T)
        batch.old_logp = batch.behaviour_old_logp(old_logp)  # held-over groups: the weights that sampled them
        tokens = int(batch.response_lengths.sum())
    if run.reference is not None:
        batch.ref_logp = run.reference.logprobs(batch)  # (N, T)
    metrics = importance_weights(batch, a)  # engine vs trainer; off without a cap
    return OldLogprobs(metrics, tokens, entropy_from_update=a.old_logp == "engine")


def importance_weights(batch: RolloutBatch, a) -> dict:
    """Importance weights on the engine's log-probs (is_weights.py, ``a``: the AlgoConfig's rollout_is_cap,
    _mode and _m2): sets ``batch.is_weights`` and returns their statistics; nothing without a cap (the reference)."""
    if a.rollout_is_cap is None:
        return {}
    if not batch.rollout_logp:
        raise ValueError("algo.rollout_is_cap needs the rollout engine's log-probs; this batch has none")
    T = batch.old_logp.shape[1]
    rollout_logp, mask = batch.padded_logp(batch.rollout_logp, T), batch.response_mask(width=T)  # (N, T) each
    batch.is_weights, stats = is_weights.rollout_is_weights(
        batch.old_logp, rollout_logp, mask, mode=a.rollout_is_mode, cap=a.rollout_is_cap, m2_threshold=a.rollout_is_m2
    )
    return {f"rollout/{k}": v for k, v in stats.items()}
