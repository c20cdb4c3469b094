"""Importance weights between the weights that sampled a batch and the trainer's: the rollout correction.

A token was sampled by pi_behaviour (the rollout engine's kernels, and with ``rollout.max_staleness`` > 0 weights
one or more updates older); the loss is anchored at pi_old, the trainer's log-probs under the current weights.
Each function below turns r_t = pi_old(o_t) / pi_behaviour(o_t) into a weight per token, by which the token's
clipped surrogate is multiplied (``losses.actor_loss``'s ``is_weights``). Pure tensor functions, no I/O.

  token_truncate      min(r_t, C)                                         (Yao et al. 2025; verl's rollout_is=token)
  token_mask          r_t where r_t <= C, 0 above                          (AReaL's decoupled PPO, arXiv 2505.24298)
  token_m2            min(r_t, C) on the tokens kept by the second-moment rule, 0 on the rest
                      (M2PO, arXiv 2510.01161: drop the largest (log r_t)^2 until their mean is <= tau)
  sequence_truncate   every token of response i x min(rho_i, C), rho_i = prod_t r_t
  sequence_mask       1 where 1/C <= rho_i <= C, 0 elsewhere

Every function returns the weights (N, T), 0 on padding, and detached statistics over valid tokens or sequences.
A token weighted 0 still counts in the loss's divisor, so masking lowers the step's gradient rather than
re-weighting the tokens kept.
"""

from __future__ import annotations

import typing

import torch

from dapo.algorithm.losses import LOG_RATIO_BOUND, log_ratio
from dapo.config.schema import RolloutIsMode

MODES = typing.get_args(RolloutIsMode)  # the modes the config offers: rollout_is_weights covers each


def truncated_is_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor, *, cap: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """w = min(pi_old / pi_rollout, cap) per token (token_truncate): the cap bounds the variance and keeps
    every token. Statistics: is_weight_mean and is_truncated_frac (the share of tokens above the cap)."""
    mask = response_mask.to(old_logp.dtype)  # (N, T)
    ratio = log_ratio(old_logp, rollout_logp).exp()  # (N, T)
    weights = ratio.clamp(max=cap) * mask  # (N, T)
    n_valid = mask.sum().clamp(min=1.0)
    stats = {
        "is_weight_mean": weights.sum() / n_valid,
        "is_truncated_frac": ((ratio > cap).to(mask.dtype) * mask).sum() / n_valid,
    }
    return weights.detach(), stats


def masked_is_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor, *, cap: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """w = r_t where r_t <= cap, 0 above (token_mask): a token the current weights favour far more than its
    sampling engine did does not train at all, where truncation would still train it at weight cap. Statistics:
    is_weight_mean and is_masked_frac (the share of tokens above the cap)."""
    mask = response_mask.to(old_logp.dtype)  # (N, T)
    ratio = log_ratio(old_logp, rollout_logp).exp()  # (N, T)
    above = ratio > cap  # (N, T)
    weights = torch.where(above, torch.zeros_like(ratio), ratio) * mask  # (N, T)
    n_valid = mask.sum().clamp(min=1.0)
    stats = {
        "is_weight_mean": weights.sum() / n_valid,
        "is_masked_frac": (above.to(mask.dtype) * mask).sum() / n_valid,
    }
    return weights.detach(), stats


def second_moment_mask(log_ratio: torch.Tensor, response_mask: torch.Tensor, *, threshold: float) -> torch.Tensor:
    """M2PO's token mask (N, T): 1 on the valid tokens kept, 0 elsewhere. The batch's second moment
    M2 = mean_t (log r_t)^2 over the valid tokens; while M2 > ``threshold`` the token with the largest
    (log r_t)^2 is dropped. Equivalently: sort the valid tokens' (log r_t)^2 in ascending order and keep
    the longest prefix whose mean is <= threshold (prefix means of a sorted list only grow)."""
    valid = response_mask > 0  # (N, T)
    m2 = log_ratio.pow(2)[valid]  # (n,)
    order = torch.argsort(m2, stable=True)  # ascending
    prefix_mean = m2[order].cumsum(0) / torch.arange(1, m2.numel() + 1, dtype=m2.dtype)  # (n,)
    keep_n = int((prefix_mean <= threshold).sum())
    kept = torch.zeros_like(m2, dtype=torch.bool)
    kept[order[:keep_n]] = True
    out = torch.zeros_like(valid)
    out[valid] = kept
    return out


def m2_is_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor, *, cap: float, threshold: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """w = min(r_t, cap) on the tokens second_moment_mask keeps, 0 on the rest (token_m2). Statistics:
    is_weight_mean, is_masked_frac (share of tokens dropped) and is_m2 (the second moment before dropping)."""
    mask = response_mask.to(old_logp.dtype)  # (N, T)
    log_r = log_ratio(old_logp, rollout_logp)  # (N, T)
    kept = second_moment_mask(log_r, response_mask, threshold=threshold)  # (N, T)
    weights = log_r.exp().clamp(max=cap) * kept.to(mask.dtype)  # (N, T)
    n_valid = mask.sum().clamp(min=1.0)
    stats = {
        "is_weight_mean": weights.sum() / n_valid,
        "is_masked_frac": 1.0 - kept.to(mask.dtype).sum() / n_valid,
        "is_m2": (log_r.pow(2) * mask).sum() / n_valid,
    }
    return weights.detach(), stats


def sequence_is_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, response_mask: torch.Tensor, *, cap: float, mask_outside: bool
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Per response: rho_i = prod_t pi_old / pi_rollout over its valid tokens (the sequence is what the engine
    sampled). ``mask_outside=False`` (sequence_truncate): every token of response i weighs min(rho_i, cap).
    ``mask_outside=True`` (sequence_mask): weight 1 where 1/cap <= rho_i <= cap, 0 elsewhere, so a response
    the engine sampled from a visibly other distribution does not train. Statistics over valid sequences:
    is_weight_mean (over tokens), is_seq_ratio_mean / _max / _min, and is_truncated_frac or is_masked_frac."""
    mask = response_mask.to(old_logp.dtype)  # (N, T)
    rho = (log_ratio(old_logp, rollout_logp) * mask).sum(dim=-1).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()  # (N,)
    if mask_outside:
        outside = (rho > cap) | (rho < 1.0 / cap)  # (N,)
        seq_w = (~outside).to(mask.dtype)
    else:
        outside = rho > cap
        seq_w = rho.clamp(max=cap)
    weights = seq_w[:, None] * mask  # (N, T)
    valid = mask.sum(dim=-1) > 0  # (N,)
    n_seqs = valid.sum().clamp(min=1)
    stats = {
        "is_weight_mean": weights.sum() / mask.sum().clamp(min=1.0),
        "is_seq_ratio_mean": (rho * valid).sum() / n_seqs,
        "is_seq_ratio_max": torch.where(valid, rho, torch.zeros_like(rho)).max(),
        "is_seq_ratio_min": torch.where(valid, rho, torch.full_like(rho, float("inf"))).min(),
        ("is_masked_frac" if mask_outside else "is_truncated_frac"): (outside & valid).sum() / n_seqs,
    }
    return weights.detach(), stats


def rollout_is_weights(
    old_logp: torch.Tensor,
    rollout_logp: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    mode: str,
    cap: float,
    m2_threshold: float = 0.04,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weights of ``mode`` (one of MODES; algo.rollout_is_mode) with cap C (algo.rollout_is_cap)."""
    if mode == "token_truncate":
        return truncated_is_weights(old_logp, rollout_logp, response_mask, cap=cap)
    if mode == "token_mask":
        return masked_is_weights(old_logp, rollout_logp, response_mask, cap=cap)
    if mode == "token_m2":
        return m2_is_weights(old_logp, rollout_logp, response_mask, cap=cap, threshold=m2_threshold)
    if mode in ("sequence_truncate", "sequence_mask"):
        return sequence_is_weights(old_logp, rollout_logp, response_mask, cap=cap, mask_outside=mode == "sequence_mask")
    raise ValueError(f"rollout_is_mode must be one of {MODES}, got {mode!r}")
