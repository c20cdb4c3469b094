"""What each response is worth: the group-normalised advantage, the dynamic-sampling filter and the soft overlong
penalty, as pure tensor functions (no I/O, no config). Checkable by hand against the DAPO paper (arXiv 2503.14476):
  eq. 9       group_advantages     (R - mean) / std within a group
  eq. 11      informative_groups   keep 0 < #correct < G                    (Dynamic Sampling, sec. 3.2)
  eq. 13      overlong_penalty     soft overlong punishment                 (sec. 3.4)
Dr. GRPO is ``group_advantages(..., scale_by_std=False)``.
Beyond the paper, on-policy distillation (Agarwal et al. 2024, arXiv 2306.13649; Thinking Machines, "On-Policy
Distillation", 2025): ``teacher_advantages`` gives each sampled token coef x (log p_teacher - log p_student), the
negative per-token reverse KL, as a reward with discount 0.
"""

from __future__ import annotations

import torch


def group_advantages(
    rewards: torch.Tensor,
    group_size: int,
    *,
    scale_by_std: bool = True,
    eps: float = 1e-6,
    in_baseline: torch.Tensor | None = None,
) -> torch.Tensor:
    """Group-normalised outcome advantage, one value per response: (N,) -> (N,).

    GRPO/DAPO: (r - mean_G) / (std_G + eps) with the unbiased std, as the reference does.
    Dr. GRPO (``scale_by_std=False``): r - mean_G, which removes the question-difficulty bias.
    ``in_baseline`` (N,) bool: only these rows set their group's mean and std, and the others get
    advantage 0 (overlong filtering that keeps masked truncated responses out of the baseline too).
    A group with fewer than two such rows has no baseline: its advantages are 0.
    """
    if rewards.dim() != 1 or rewards.numel() % group_size != 0:
        raise ValueError(f"rewards must be (P*G,) with G={group_size}, got {tuple(rewards.shape)}")
    grouped = rewards.float().view(-1, group_size)  # (P, G)
    if in_baseline is None:
        in_baseline = torch.ones_like(rewards, dtype=torch.bool)
    w = in_baseline.view(-1, group_size).float()  # (P, G)
    n = w.sum(dim=1, keepdim=True)  # (P, 1)
    mean = (grouped * w).sum(dim=1, keepdim=True) / n.clamp(min=1.0)  # (P, 1)
    centered = (grouped - mean) * w  # (P, G)
    if scale_by_std:
        std = (centered.square().sum(dim=1, keepdim=True) / (n - 1.0).clamp(min=1.0)).sqrt()  # (P, 1) unbiased
        centered = centered / (std + eps)
    centered = torch.where(n >= 2, centered, torch.zeros_like(centered))  # (P, G)
    return centered.view(-1)  # (N,)


def informative_groups(values: torch.Tensor, group_size: int, counted: torch.Tensor | None = None) -> torch.Tensor:
    """(N,) -> (P,) bool: True where a group's values are not all equal.

    With accuracies this is the dynamic-sampling condition 0 < #correct < G (eq. 11): a group
    whose G answers are all right or all wrong has zero advantage and so no gradient.
    ``counted`` (N,) bool: only these rows' values are compared (the others, ungraded, have none).
    """
    grouped = values.float().view(-1, group_size)  # (P, G)
    if counted is None:
        return (grouped != grouped[:, :1]).any(dim=1)  # (P,)
    counted = counted.view(-1, group_size)  # (P, G)
    highest = torch.where(counted, grouped, -torch.inf).max(dim=1).values  # (P,)
    lowest = torch.where(counted, grouped, torch.inf).min(dim=1).values  # (P,)
    return highest > lowest  # (P,): False for a group with fewer than two counted rows


def overlong_penalty(
    lengths: torch.Tensor,
    *,
    max_response_tokens: int,
    overlong_buffer_tokens: int,
    penalty_factor: float = 1.0,
) -> torch.Tensor:
    """Soft overlong punishment (eq. 13): (N,) lengths -> (N,) reward added to the correctness reward.

    0 while |y| <= L_max - L_cache, then linear down to -penalty_factor at |y| = L_max, and
    -penalty_factor beyond it. (L_max here is the generation limit, L_cache the buffer.)
    """
    if not 0 < overlong_buffer_tokens <= max_response_tokens:
        raise ValueError("need 0 < overlong_buffer_tokens <= max_response_tokens")
    expected = max_response_tokens - overlong_buffer_tokens
    exceed = lengths.float() - expected  # (N,)
    penalty = -exceed / overlong_buffer_tokens * penalty_factor
    return penalty.clamp(min=-penalty_factor, max=0.0)


def teacher_advantages(
    reward_adv: torch.Tensor | None,
    teacher_logp: torch.Tensor,
    student_logp: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    coef: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token advantages with the teacher's term: (N,) or None, (N, T) x 3 -> (N, T) advantages, (N, T) term.

    term_t = coef * (log p_teacher(y_t | s_t) - log p_student(y_t | s_t)): the negative reverse-KL estimate at the
    sampled token, a per-token reward with discount 0 (each token is credited with its own term only). The student's
    log-prob is that of the weights that sampled (old_logp), so the term is fixed for the step like the reward.
    ``reward_adv``: eq. 9's advantage, added to every token of its response (DAPO + teacher); None: the term alone
    (pure distillation). Tokens outside ``response_mask`` (padding, a tool's output) get no term.
    """
    term = coef * (teacher_logp - student_logp) * response_mask  # (N, T)
    if reward_adv is None:
        return term, term
    return reward_adv[:, None] + term, term  # (N, T)
