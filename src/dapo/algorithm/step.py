"""What a training step computes on its batch between collecting it and updating on it, beside the loop in
training.py that runs these in order: the advantages (overlong filtering, then eq. 9), the old log-probs (the
held-over groups' own, the reference model's for a KL term), the rollout correction's importance weights, and the
loss the update minimises. Each takes what it needs (the policy, the algorithm's settings, the held-over groups)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from dapo.algorithm import advantages, losses, rollout_correction
from dapo.algorithm.batch import RolloutBatch
from dapo.config import AlgoConfig, TeacherConfig


def objective_of(algo_cfg: AlgoConfig, max_response_tokens: int) -> losses.Objective:
    """The objective algo.* sets (``max_response_tokens``: Dr. GRPO's constant length)."""
    a = algo_cfg
    return losses.Objective(
        a.objective, a.eps_low, a.eps_high, a.loss_agg, max_response_tokens, a.dual_clip, a.kl_coef, a.kl_kind
    )


def make_loss_fn(algo_cfg: AlgoConfig, max_response_tokens: int) -> Callable:
    """The loss ``Policy.update`` minimises (its ``LossFn``): ``losses.actor_loss`` with the objective algo.* sets,
    the KL term to the reference model included when ``algo_cfg.kl_coef`` > 0."""
    return functools.partial(losses.actor_loss, objective=objective_of(algo_cfg, max_response_tokens))


def assign_advantages(batch: RolloutBatch, algo_cfg: AlgoConfig, group_size: int, *, filter_void_turns=False) -> None:
    """Overlong filtering (sec. 3.4: truncated answers carry no learning signal) and the void-turn filter
    (tools.filter_void_turns), then eq. 9's group-normalised advantage, one value per response. A response whose
    grading was given up on (``batch.ungraded``) is neither trained on nor part of its group's baseline."""
    a = algo_cfg
    if a.overlong_filtering:
        batch.trainable = ~batch.truncated
    if filter_void_turns and batch.void_turn:
        keep = ~torch.tensor(batch.void_turn, dtype=torch.bool)
        batch.trainable = keep if batch.trainable is None else batch.trainable & keep
    in_baseline = None if a.truncated_in_group_stats else ~batch.truncated  # the paper masks only the loss
    if any(batch.ungraded):
        graded = ~torch.tensor(batch.ungraded, dtype=torch.bool)
        batch.trainable = graded if batch.trainable is None else batch.trainable & graded
        in_baseline = graded if in_baseline is None else in_baseline & graded
    batch.adv = advantages.group_advantages(
        batch.reward, group_size, scale_by_std=a.scale_adv_by_std, in_baseline=in_baseline
    )  # (N,)


@dataclass
class OldLogprobs:
    """What the old-log-prob pass did: the importance weights' statistics, the response tokens it
    computed, and whether the update must give the entropy (no pass ran to give it)."""

    metrics: dict
    tokens_computed: int
    entropy_from_update: bool = False
    held_over: list[RolloutBatch] = dataclasses.field(default_factory=list)  # with their old log-probs
    from_update: list[int] = dataclasses.field(default_factory=list)  # rows whose old log-probs the update gives


def old_logprobs(
    batch: RolloutBatch,
    policy,
    algo_cfg: AlgoConfig,
    *,
    reference=None,
    held_over: Sequence[RolloutBatch] = (),
    from_update: bool = False,
) -> OldLogprobs:
    """old_logp (and entropy) under the weights that sampled, the reference's log-probs for a KL term, and the
    importance weights when they are on. ``policy`` and ``reference`` give ``compute_logprobs`` / ``logprobs``;
    ``held_over``: the groups the collection keeps for a later step; the new ones get their old log-probs now,
    while the policy still holds the weights that sampled them, and all come back in ``OldLogprobs.held_over``.

    algo.old_logp_source: ``recompute`` runs the log-prob pass over every row; ``engine`` takes vLLM's
    log-probs and runs no pass (entropy from the update's forwards). ``from_update`` (``takes_old_logp_from_update``):
    the pass leaves out the first update's rows (``OldLogprobs.from_update``), whose old log-probs its forward gives.
    """
    a = algo_cfg
    held_over = with_old_logp(held_over, policy.compute_logprobs, source=a.held_over_logp_source)
    if a.old_logp_source == "engine":
        if not batch.rollout_logp:
            raise ValueError(
                "algo.old_logp_source=engine: the rollout engine reported no log-probs; use rollout.backend=vllm"
            )
        T = batch.max_response_len
        batch.old_logp = batch.old_logp_with_held_over(batch.padded_logp(batch.rollout_logp, T))  # (N, T)
        tokens = 0
        skipped = []
    else:
        skipped = first_update_rows(batch, policy) if from_update else []
        old_logp, batch.entropy = policy.compute_logprobs(batch, with_entropy=True, skip=skipped)  # (N, T)
        batch.old_logp = batch.old_logp_with_held_over(old_logp)  # held-over groups: the weights that sampled them
        tokens = int(batch.response_lengths.sum() - batch.response_lengths[skipped].sum())
    if reference is not None:
        batch.ref_logp = reference.logprobs(batch)  # (N, T)
    metrics = importance_weights(batch, a)  # engine vs trainer; off without a cap
    return OldLogprobs(
        metrics, tokens, entropy_from_update=a.old_logp_source == "engine", held_over=held_over, from_update=skipped
    )


def takes_old_logp_from_update(cfg) -> bool:
    """Whether algo.old_logp_from_update applies to a run with the config ``cfg``: not where every old log-prob is
    needed before the update starts (importance weights on the engine's log-probs, a sampled teacher term in the
    advantage) or where the update's forward would differ from the pass's (dropout kept in training passes)."""
    sampled_teacher = cfg.teacher.coef > 0 and cfg.teacher.signal == "sampled"
    a = cfg.algo
    return a.old_logp_from_update and a.rollout_is_cap is None and not sampled_teacher and not cfg.model.keep_dropout


def first_update_rows(batch: RolloutBatch, policy) -> list[int]:
    """The rows of the first optimizer update whose old log-probs its own forward can give: not held over from an
    earlier step (their old policy is the weights that sampled them) and with a token trained on (a micro-batch with
    none runs no forward)."""
    first = policy.mini_batch_rows(batch)[0]
    trained = batch.response_mask(torch.tensor(first)).sum(-1) > 0  # (n,)
    held = batch.held_over_old_logp  # one entry per row, or none when no row is held over
    return [i for i, t in zip(first, trained.tolist()) if t and not (held and held[i] is not None)]


def teacher_term(batch: RolloutBatch, teacher, teacher_cfg: TeacherConfig) -> dict:
    """On-policy distillation, after the old log-probs: the teacher's log-probs of every sampled token (``teacher``
    gives ``logprobs``, over the same micro-batches as the student's pass), and ``batch.adv`` made per token (N, T):
    the reward's advantage plus teacher.coef x (log p_teacher - old_logp), or the teacher's term alone
    (teacher.reward_advantage=false). Only the tokens trained on (``response_mask``: the model's own, not a tool's)
    get a term and count in the statistics it returns:
      teacher/reverse_kl_mean           mean of old_logp - teacher_logp over those tokens (the k1 estimate of
                                        KL(student || teacher), per token)
      teacher/reverse_kl_response_mean  the same per response (its tokens' mean), averaged over responses
      teacher/adv_share                 the teacher term's share of the advantage: sum |term| / (sum |term| +
                                        sum |reward advantage|) over those tokens (1 in pure distillation)
    """
    teacher_logp = teacher.logprobs(batch)  # (N, T)
    T = teacher_logp.shape[1]
    mask = batch.response_mask(width=T)  # (N, T)
    student_logp = batch.old_logp[:, :T]  # (N, T): the weights that sampled (held-over rows: theirs)
    reward_adv = batch.adv if teacher_cfg.reward_advantage else None  # (N,)
    batch.adv, term = advantages.teacher_advantages(
        reward_adv, teacher_logp, student_logp, mask, coef=teacher_cfg.coef
    )  # (N, T) each
    reverse_kl = (student_logp - teacher_logp) * mask  # (N, T)
    tokens = mask.sum(dim=1)  # (N,)
    scored = tokens > 0  # (N,) responses with a token trained on
    reward_part = (reward_adv[:, None].abs() * mask).sum() if reward_adv is not None else torch.zeros(())
    term_part = term.abs().sum()
    return {
        "teacher/reverse_kl_mean": reverse_kl.sum() / tokens.sum().clamp(min=1),
        "teacher/reverse_kl_response_mean": (reverse_kl.sum(dim=1)[scored] / tokens[scored]).mean()
        if scored.any()
        else torch.zeros(()),
        "teacher/adv_share": term_part / (term_part + reward_part).clamp(min=1e-12),
    }


def teacher_in_loss(batch: RolloutBatch, teacher_cfg: TeacherConfig) -> None:
    """teacher.signal=full: the teacher's exact KL goes into the loss (``Policy.update``), not into the advantage,
    which stays the reward's (DAPO + teacher) or is 0 on every row (pure distillation: the KL is all there is)."""
    if not teacher_cfg.reward_advantage:
        batch.adv = torch.zeros_like(batch.adv)


def importance_weights(batch: RolloutBatch, algo_cfg: AlgoConfig) -> dict:
    """Importance weights on the engine's log-probs (``rollout_correction``; the AlgoConfig's rollout_is_cap,
    _mode and _m2): sets ``batch.is_weights`` and returns their statistics; nothing without a cap (the reference)."""
    a = algo_cfg
    if a.rollout_is_cap is None:
        return {}
    if not batch.rollout_logp:
        raise ValueError("algo.rollout_is_cap needs the rollout engine's log-probs; this batch has none")
    T = batch.old_logp.shape[1]
    rollout_logp, mask = batch.padded_logp(batch.rollout_logp, T), batch.response_mask(width=T)  # (N, T) each
    batch.is_weights, stats = rollout_correction.rollout_is_weights(
        batch.old_logp, rollout_logp, mask, mode=a.rollout_is_mode, cap=a.rollout_is_cap, m2_threshold=a.rollout_is_m2
    )
    return {f"rollout/{k}": v for k, v in stats.items()}


def with_old_logp(
    held_over: Sequence[RolloutBatch], logprobs: Callable[[RolloutBatch], tuple], *, source: str
) -> list[RolloutBatch]:
    """The held-over groups, each newly held over given the log-probs of the weights that sampled it (its old_logp
    when a later step trains it); the others as they are.

    Call it after the collection and before the update, while the trainer still holds those weights.
    ``source`` (algo.held_over_logp_source): ``recompute`` computes them with ``logprobs``
    (``Policy.compute_logprobs``), ``engine`` takes the rollout engine's own (vLLM reports them; they include its
    numerical difference from the trainer).
    """
    new = [b for b in held_over if not b.held_over_old_logp]
    if not new:
        return list(held_over)
    if source == "engine":
        for b in new:
            if not b.rollout_logp:
                raise ValueError(
                    "algo.held_over_logp_source=engine: the rollout engine reported no log-probs (use "
                    "rollout.backend=vllm)"
                )
        given = {id(b): [list(lp) for lp in b.rollout_logp] for b in new}
    else:
        logp, _ = logprobs(RolloutBatch.concat(new))  # (N, T), one pass for every new group
        given, start = {}, 0
        for b in new:
            given[id(b)] = [logp[start + j, : len(r)].tolist() for j, r in enumerate(b.response_ids)]
            start += len(b)
    return [dataclasses.replace(b, held_over_old_logp=given[id(b)]) if id(b) in given else b for b in held_over]
