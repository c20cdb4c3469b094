"""The objectives: the clipped surrogates and their aggregation, as pure tensor functions (no I/O).

Checkable by hand against the DAPO paper (arXiv 2503.14476):
  eq. 10/11   dapo_surrogate       clip range [1 - eps_low, 1 + eps_high]   (Clip-Higher, sec. 3.1)
  eq. 12      aggregate            token-level mean over the whole batch    (sec. 3.3)
The objectives the field sets beside DAPO's (algo.objective), each checkable against its own paper:
  GSPO (arXiv 2507.18071)     eq. 5, 7     gspo_surrogate   sequence ratio s_i = exp(mean_t log r_t), clipped per
                                                            sequence
                              eq. 13-14    gspo_surrogate   its token form: value s_i, gradient s_i * grad log pi_t
  CISPO (arXiv 2506.13585)    eq. 4-5      cispo_surrogate  -sg(clip(r_t)) A log pi_t: clip the weight, not the update
Each surrogate gives the per-token loss of its own equation and the statistics only it has; ``actor_loss`` does
the rest for all of them, as ``Objective`` sets it: the importance weights, the aggregation, the statistics every
objective logs and the KL term. The GRPO and Dr. GRPO baselines are settings of the same record (``loss_agg``,
``kl_coef``), not separate code paths. Statistics are ``Stat``s: a value and how it combines over micro-batches and
ranks. Beyond the paper: the importance weights that correct for the weights and kernels that sampled a batch
(``rollout_correction``), off unless asked for.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import NamedTuple

import torch

from dapo.config.schema import KlKind, LossAgg
from dapo.config.schema import Objective as ObjectiveName

# the choices, as the config offers them (config.schema's Literals): the table and the branches below cover them
LOSS_AGG_MODES = typing.get_args(LossAgg)
KL_KINDS = typing.get_args(KlKind)
OBJECTIVES = typing.get_args(ObjectiveName)
LOG_RATIO_BOUND = 20.0  # |log ratio| above this is cut: its exp would overflow, as a stray -inf/+inf log-prob would


def log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """log(pi / pi_old), cut to +-LOG_RATIO_BOUND (the reference's clamp): any shape."""
    return (logp - old_logp).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)


@dataclass(frozen=True)
class Objective:
    """What the actor's loss is, as algo.* sets it: the surrogate (``name``), its clip range and dual clip, how the
    per-token losses are aggregated (``norm_length``: Dr. GRPO's constant length), and the KL term to the reference
    policy (``kl_coef`` 0: none, DAPO's)."""

    name: str = "dapo"
    eps_low: float = 0.2
    eps_high: float = 0.28
    loss_agg: str = "token-mean"
    norm_length: float | None = None
    dual_clip: float | None = None
    kl_coef: float = 0.0
    kl_kind: str = "k3"


class Stat(NamedTuple):
    """One micro-batch's loss statistic and how it combines over micro-batches and ranks."""

    value: torch.Tensor  # () detached
    # () for how="mean": what the value is a mean over in this micro-batch (its valid tokens, its sequences, its
    # clipped tokens); unused otherwise
    weight: torch.Tensor
    # "mean": weighted by weight; "sum": added (losses already normalised by the whole mini-batch); "max"; "min"
    # (over the micro-batches whose weight is not 0)
    how: str


def mean_stat(value: torch.Tensor, weight: torch.Tensor) -> Stat:
    return Stat(value.detach(), weight.detach().to(value.dtype), "mean")


def sum_stat(value: torch.Tensor) -> Stat:
    return Stat(value.detach(), value.new_ones(()), "sum")


def max_stat(value: torch.Tensor) -> Stat:
    return Stat(value.detach(), value.new_ones(()), "max")


def min_stat(value: torch.Tensor, weight: torch.Tensor) -> Stat:
    """The smallest value; ``weight`` 0 where this micro-batch has none to give (its value is ignored)."""
    return Stat(value.detach(), weight.detach().to(value.dtype), "min")


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "k3") -> torch.Tensor:
    """Per-token estimate of KL(pi || pi_ref) from samples of pi: (N, T) -> (N, T).

    k1 = log r, k2 = (log r)^2 / 2, k3 = exp(-log r) + log r - 1 (non-negative, low variance;
    GRPO's choice), with log r = logp - ref_logp. DAPO uses no KL term at all.
    """
    if kind == "k1":
        return logp - ref_logp
    if kind == "k2":
        return 0.5 * (logp - ref_logp).square()
    if kind == "k3":
        neg = log_ratio(ref_logp, logp)  # cut as the reference does: a stray -inf/+inf log-prob must not blow it up
        return (neg.exp() - neg - 1.0).clamp(-10.0, 10.0)
    raise ValueError(f"kl kind must be one of {KL_KINDS}, got {kind!r}")


def aggregate(
    values: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg: str = "token-mean",
    *,
    num_tokens: torch.Tensor | float | None = None,
    num_seqs: torch.Tensor | float | None = None,
    norm_length: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token (N, T) quantity to a scalar the way the loss does.

    token-mean               sum(v * mask) / num_tokens            (DAPO eq. 12)
    seq-mean-token-mean      sum_i mean_t(v_i) / num_seqs          (GRPO eq. 9, sample-level)
    seq-mean-token-sum-norm  sum(v * mask) / (num_seqs * norm_length)   (Dr. GRPO: constant length)

    ``num_tokens`` / ``num_seqs`` default to this batch's own counts. Passing the counts of the
    whole optimizer step (summed over micro-batches and ranks) makes micro-batch losses add up
    exactly to the step's loss, so accumulation and data parallelism never change the objective.
    """
    mask = response_mask.to(values.dtype)
    if loss_agg == "token-mean":
        denom = mask.sum() if num_tokens is None else num_tokens
        return (values * mask).sum() / torch.as_tensor(denom, dtype=values.dtype).clamp(min=1.0)
    if num_seqs is None:
        # sequences fully masked out (overlong filtering) are not counted as samples
        num_seqs = (mask.sum(dim=-1) > 0).sum()
    seqs = torch.as_tensor(num_seqs, dtype=values.dtype).clamp(min=1.0)
    if loss_agg == "seq-mean-token-mean":
        per_seq = (values * mask).sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)  # (N,)
        return per_seq.sum() / seqs
    if loss_agg == "seq-mean-token-sum-norm":
        length = float(mask.shape[-1] if norm_length is None else norm_length)
        return (values * mask).sum() / (seqs * length)
    raise ValueError(f"loss_agg must be one of {LOSS_AGG_MODES}, got {loss_agg!r}")


def _clipped_surrogate(
    ratio: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float, dual_clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """max(-adv * r, -adv * clip(r)), then the dual clip: (N, T) per-token losses and where the dual clip bound."""
    # pessimistic bound: the min of the objectives (the loss is the objective negated)
    per_token = torch.maximum(-adv * ratio, -adv * ratio.clamp(1.0 - eps_low, 1.0 + eps_high))
    dual_clipped = torch.zeros_like(per_token, dtype=torch.bool)  # (N, T)
    if dual_clip is not None:
        bound = -adv * dual_clip
        dual_clipped = (adv < 0) & (per_token > bound)
        per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
    return per_token, dual_clipped


def dapo_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, o: Objective
) -> tuple[torch.Tensor, dict[str, Stat]]:
    """PPO's clipped surrogate with the decoupled clip range [1 - eps_low, 1 + eps_high] (eq. 10), per token (N, T).

    ``o.dual_clip`` (> 1) also bounds the loss of negative-advantage tokens at -adv * c, as the reference recipe
    does with c = 10 (None: off). Its statistics, means over the valid tokens:
      clipfrac_high  share of tokens whose ratio was clipped at 1 + eps_high (only where adv > 0)
      clipfrac_low   share clipped at 1 - eps_low (only where adv < 0)
      clipfrac_dual  share of tokens whose loss the dual clip bounded (adv < 0 and ratio > dual_clip)
      up_clipped_prob_mean / _max  probability pi(o_t) of the tokens clipped at the top (DAPO fig. 3a)
    """
    ratio = log_ratio(logp, old_logp).exp()  # (N, T)
    per_token, dual_clipped = _clipped_surrogate(ratio, adv, o.eps_low, o.eps_high, o.dual_clip)  # (N, T)
    with torch.no_grad():
        valid = mask > 0
        n_tokens = mask.sum()
        token_mean = lambda x: mean_stat((x * mask).sum() / n_tokens.clamp(min=1.0), n_tokens)  # noqa: E731
        clipped_high = valid & (adv > 0) & (ratio > 1.0 + o.eps_high)
        prob = logp.detach().exp()
        up_probs = torch.where(clipped_high, prob, torch.zeros_like(prob))
        n_up = clipped_high.sum()
        stats = {
            "clipfrac_high": token_mean(clipped_high),
            "clipfrac_low": token_mean(valid & (adv < 0) & (ratio < 1.0 - o.eps_low)),
            "clipfrac_dual": token_mean(dual_clipped),
            "up_clipped_prob_max": max_stat(up_probs.max()),  # 0 when nothing was clipped
            "up_clipped_prob_mean": mean_stat(up_probs.sum() / n_up.clamp(min=1), n_up),
        }
    return per_token, stats


def gspo_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, o: Objective
) -> tuple[torch.Tensor, dict[str, Stat]]:
    """GSPO (Zheng et al. 2025, arXiv 2507.18071): the clipped surrogate on the sequence-level ratio, per token.

    s_i = exp(mean_t log(pi / pi_old)) over response i's valid tokens (eq. 7), clipped per sequence to
    [1 - eps_low, 1 + eps_high] (eq. 5; the paper uses 3e-4 / 4e-4), in its token form (GSPO-token,
    eq. 13-14): s_it = sg[s_i] * pi_t / sg[pi_t] has the value s_i at every token and the gradient
    s_i * grad log pi_t, so with ``loss_agg="seq-mean-token-mean"`` (the paper's 1/G sum_i 1/|y_i| sum_t)
    the loss and gradient are GSPO's exactly, and the other aggregations weigh sequences as they do for
    DAPO. ``dual_clip`` bounds a negative-advantage sequence's loss at -adv * c, as for the token ratio.
    Statistics: the shares of sequences clipped at the top (adv > 0) and the bottom (adv < 0), and the sequence
    ratios' mean, max and min over valid sequences.
    """
    lengths = mask.sum(dim=-1)  # (N,)
    seq_log_ratio = ((logp - old_logp) * mask).sum(dim=-1) / lengths.clamp(min=1.0)  # (N,) log s_i
    log_s = logp - logp.detach() + seq_log_ratio.detach()[:, None]  # (N, T): value log s_i, gradient of log pi_t
    ratio = log_s.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()  # (N, T)
    per_token, dual_clipped = _clipped_surrogate(ratio, adv, o.eps_low, o.eps_high, o.dual_clip)
    with torch.no_grad():
        valid = lengths > 0  # (N,) sequences trained on
        s = seq_log_ratio.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()  # (N,)
        # (N,) a response's advantage: its outcome advantage, or with a teacher's per-token term its tokens' mean
        seq_adv = (adv * mask).sum(dim=-1) / lengths.clamp(min=1.0)
        n_seqs = valid.sum().to(logp.dtype)
        seq_mean = lambda x: mean_stat((x * valid).sum() / n_seqs.clamp(min=1), n_seqs)  # noqa: E731
        stats = {
            "seq_clipfrac_high": seq_mean((seq_adv > 0) & (s > 1.0 + o.eps_high)),
            "seq_clipfrac_low": seq_mean((seq_adv < 0) & (s < 1.0 - o.eps_low)),
            "seq_clipfrac_dual": seq_mean((dual_clipped & (mask > 0)).any(dim=-1)),  # any of its tokens
            "seq_ratio_mean": seq_mean(s),
            "seq_ratio_max": max_stat(torch.where(valid, s, torch.zeros_like(s)).max()),
            "seq_ratio_min": min_stat(torch.where(valid, s, torch.full_like(s, float("inf"))).min(), n_seqs),
        }
    return per_token, stats


def cispo_surrogate(
    logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor, o: Objective
) -> tuple[torch.Tensor, dict[str, Stat]]:
    """CISPO (MiniMax-M1, arXiv 2506.13585): clip the importance weight, not the update; per token.

    -sg(w) * adv * log pi with w = clip(pi / pi_old, 1 - eps_low, 1 + eps_high) (eq. 4-5): the weight is
    detached, so a token whose ratio left the range still passes gradient, scaled by the bound. MiniMax-M1 sets
    no lower bound (``eps_low=1``) and tunes only the upper one; the cap 1 + 4 = 5 is the absolute cap peers ship
    for it. Written as sg(w) * exp(log pi - sg(log pi)), whose value is -adv * w (comparable with the other
    objectives' pg_loss) and whose gradient is eq. 4's. ``dual_clip`` caps a negative-advantage token's weight at
    c (its loss at -adv * c, as for the clipped surrogate). Eq. 4 divides by the step's tokens: token-mean.
    Statistics: the shares of tokens whose weight was clipped at the top and the bottom, and the mean weight.
    """
    with torch.no_grad():
        ratio = log_ratio(logp, old_logp).exp()  # (N, T)
        weight = ratio.clamp(1.0 - o.eps_low, 1.0 + o.eps_high)  # (N, T) eq. 5
        if o.dual_clip is not None:
            weight = torch.where(adv < 0, weight.clamp(max=o.dual_clip), weight)
    per_token = -adv * weight * (logp - logp.detach()).exp()  # (N, T): value -adv * w, gradient -adv * w * grad log pi
    with torch.no_grad():
        n = mask.sum()
        valid = mask > 0
        stats = {
            "cispo_clipfrac_high": mean_stat((valid & (ratio > 1.0 + o.eps_high)).sum() / n.clamp(min=1), n),
            "cispo_clipfrac_low": mean_stat((valid & (ratio < 1.0 - o.eps_low)).sum() / n.clamp(min=1), n),
            "cispo_weight_mean": mean_stat((weight * mask).sum() / n.clamp(min=1), n),
        }
    return per_token, stats


SURROGATES = {"dapo": dapo_surrogate, "gspo": gspo_surrogate, "cispo": cispo_surrogate}  # algo.objective
assert tuple(SURROGATES) == OBJECTIVES, "every objective the config offers has its surrogate"


def actor_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    adv: torch.Tensor,
    response_mask: torch.Tensor,
    objective: Objective = Objective(),
    *,
    num_tokens: torch.Tensor | float | None = None,
    num_seqs: torch.Tensor | float | None = None,
    is_weights: torch.Tensor | None = None,
    ref_logp: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Stat]]:
    """The actor's whole loss as ``objective`` sets it: its surrogate's per-token losses, each times ``is_weights``
    (N, T, no gradient: the rollout correction) where given, aggregated (``aggregate``), plus with ``kl_coef`` > 0
    the KL penalty to the reference policy (on ``ref_logp`` (N, T)) aggregated alike and weighted by ``kl_coef``
    (GRPO's KL loss; DAPO has none).

    logp, old_logp, response_mask: (N, T); adv: (N,) or (N, T). Returns the loss to minimise (the negated
    objective) and its statistics: the surrogate's own; approx_kl (mean of old_logp - logp, the k1 estimate of
    KL(old || new)) and token_prob_mean (mean pi(o_t)) over the valid tokens; the sum ``pg_loss`` (the surrogate
    alone) and, with the KL term, ``kl_loss`` (the aggregated penalty before weighting).
    """
    o = objective
    if o.name not in SURROGATES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {o.name!r}")
    if adv.dim() == 1:
        adv = adv.unsqueeze(-1)  # (N, 1), broadcast over tokens
    mask = response_mask.to(logp.dtype)  # (N, T)
    per_token, stats = SURROGATES[o.name](logp, old_logp, adv, mask, o)  # (N, T)
    if is_weights is not None:
        per_token = per_token * is_weights.detach()  # (N, T)
    counts = {"num_tokens": num_tokens, "num_seqs": num_seqs, "norm_length": o.norm_length}
    loss = aggregate(per_token, response_mask, o.loss_agg, **counts)
    with torch.no_grad():
        n = mask.sum()
        stats["approx_kl"] = mean_stat(((old_logp - logp.detach()) * mask).sum() / n.clamp(min=1), n)
        stats["token_prob_mean"] = mean_stat((logp.detach().exp() * mask).sum() / n.clamp(min=1), n)
    stats["pg_loss"] = sum_stat(loss)
    if o.kl_coef > 0:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp, the reference policy's log-probs of the same tokens")
        kl_loss = aggregate(kl_penalty(logp, ref_logp, o.kl_kind), response_mask, o.loss_agg, **counts)
        stats["kl_loss"] = sum_stat(kl_loss)
        loss = loss + o.kl_coef * kl_loss
    return loss, stats
