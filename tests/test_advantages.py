"""The advantages (dapo.algorithm.advantages) against hand-computed numbers and the paper's eq. 9, 11 and 13."""

import math

import pytest
import torch

from dapo.algorithm import advantages


def test_group_advantages_hand_computed():
    rewards = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0, -1.0, -1.0])
    adv = advantages.group_advantages(rewards, group_size=4)
    # group 1: mean 0, unbiased std sqrt(4/3); group 2: mean -0.5, unbiased std 1
    s = math.sqrt(4 / 3)
    expected = torch.tensor([1 / s, 1 / s, -1 / s, -1 / s, 1.5, -0.5, -0.5, -0.5])
    assert torch.allclose(adv, expected, atol=1e-5)
    assert torch.allclose(adv.view(2, 4).sum(dim=1), torch.zeros(2), atol=1e-5)


def test_dr_grpo_advantage_is_centered_reward():
    rewards = torch.tensor([1.0, -1.0, -1.0, -1.0])
    adv = advantages.group_advantages(rewards, 4, scale_by_std=False)
    assert torch.allclose(adv, torch.tensor([1.5, -0.5, -0.5, -0.5]))


def test_truncated_rows_out_of_the_baseline_hand_computed():
    # one group: right, wrong, wrong, and a truncated wrong answer at -2 (-1 and the full soft penalty)
    rewards = torch.tensor([1.0, -1.0, -1.0, -2.0])
    truncated = torch.tensor([False, False, False, True])
    # in the baseline (the paper masks only the loss): mean -0.75, unbiased std sqrt(4.75 / 3)
    s_all = math.sqrt(4.75 / 3)
    inside = advantages.group_advantages(rewards, 4)
    assert torch.allclose(inside, torch.tensor([1.75, -0.25, -0.25, -1.25]) / s_all, atol=1e-5)
    # out of it: the baseline of [1, -1, -1] is mean -1/3, unbiased std sqrt(4/3); the masked row gets 0
    s_in = math.sqrt(4 / 3)
    outside = advantages.group_advantages(rewards, 4, in_baseline=~truncated)
    assert torch.allclose(outside, torch.tensor([(4 / 3) / s_in, (-2 / 3) / s_in, (-2 / 3) / s_in, 0.0]), atol=1e-5)
    assert outside[0].item() == pytest.approx(1.1547, abs=1e-4) and inside[0].item() == pytest.approx(1.3908, abs=1e-4)
    # Dr. GRPO form: only the centring changes
    plain = advantages.group_advantages(rewards, 4, scale_by_std=False, in_baseline=~truncated)
    assert torch.allclose(plain, torch.tensor([4 / 3, -2 / 3, -2 / 3, 0.0]), atol=1e-6)
    # a group left with one untruncated answer has no baseline, so no advantage
    lone = advantages.group_advantages(
        torch.tensor([1.0, -2.0, -2.0, -2.0]), 4, in_baseline=torch.tensor([1, 0, 0, 0]).bool()
    )
    assert torch.equal(lone, torch.zeros(4))


def test_constant_group_has_zero_advantage_and_is_filtered():
    rewards = torch.tensor([1.0, 1.0, 1.0, -1.0, 1.0, -1.0, -1.0, -1.0, -1.0])
    adv = advantages.group_advantages(rewards, 3)
    assert torch.equal(adv[:3], torch.zeros(3))  # all correct
    assert torch.equal(adv[6:], torch.zeros(3))  # all wrong
    keep = advantages.informative_groups(rewards, 3)
    assert keep.tolist() == [False, True, False]


def test_informative_groups_on_accuracy():
    acc = torch.tensor([1, 1, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 1])
    assert advantages.informative_groups(acc, 4).tolist() == [True, False, False, True]


def test_group_advantages_rejects_ragged_batch():
    with pytest.raises(ValueError, match="G=4"):
        advantages.group_advantages(torch.ones(6), 4)


def test_overlong_penalty_eq13():
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    pen = advantages.overlong_penalty(lengths, max_response_tokens=20, overlong_buffer_tokens=4)
    assert torch.allclose(pen, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))
    half = advantages.overlong_penalty(lengths, max_response_tokens=20, overlong_buffer_tokens=4, penalty_factor=0.5)
    assert torch.allclose(half, pen * 0.5)
    # the paper's numbers: 16384 expected + 4096 buffer
    paper = advantages.overlong_penalty(
        torch.tensor([16384, 18432, 20480]), max_response_tokens=20480, overlong_buffer_tokens=4096
    )
    assert torch.allclose(paper, torch.tensor([0.0, -0.5, -1.0]))
    with pytest.raises(ValueError):
        advantages.overlong_penalty(lengths, max_response_tokens=4, overlong_buffer_tokens=8)
