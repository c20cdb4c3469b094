"""The rollout correction (dapo.algorithm.rollout_correction) by hand: truncated and masked token weights, M2PO's
second-moment rule, the weights in the loss, and the stale-policy bias they remove."""

import math
import typing

import pytest
import torch

from conftest import objective_loss
from dapo.algorithm import rollout_correction
from dapo.config import schema as config_module


def _logps(ratios: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rollout = torch.log(torch.full_like(ratios, 0.25))
    return rollout + torch.log(ratios), rollout  # old, rollout: pi_old / pi_rollout = ratios


def test_every_mode_the_config_offers_gives_weights():
    old, rollout = _logps(torch.tensor([[1.0, 2.0]]))
    for mode in typing.get_args(config_module.RolloutIsMode):
        weights, _ = rollout_correction.rollout_is_weights(old, rollout, torch.ones(1, 2), mode=mode, cap=3.0,
                                                           m2_threshold=1.0)  # fmt: skip
        assert weights.shape == (1, 2) and (weights > 0).all(), mode


def test_token_mask_zeroes_tokens_above_the_cap_and_keeps_the_ratio_below():
    old, rollout = _logps(torch.tensor([[1.0, 2.5, 4.0], [0.5, 3.5, 9.0]]))
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])  # 9.0 is padding
    w, stats = rollout_correction.masked_is_weights(old, rollout, mask, cap=3.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.5, 0.0], [0.5, 0.0, 0.0]]), atol=1e-5)
    assert stats["is_masked_frac"].item() == pytest.approx(2 / 5)  # 4.0 and 3.5; padding does not count
    assert stats["is_weight_mean"].item() == pytest.approx((1 + 2.5 + 0.5) / 5, abs=1e-5)
    # against truncation: the same tokens, weight C instead of 0
    t, _ = rollout_correction.truncated_is_weights(old, rollout, mask, cap=3.0)
    assert torch.allclose(t - w, torch.tensor([[0.0, 0.0, 3.0], [0.0, 3.0, 0.0]]), atol=1e-5)


def test_second_moment_mask_drops_the_largest_log_ratios_until_their_mean_is_under_tau():
    # (log r)^2 of the valid tokens: 0, 0.01, 0.04, 0.25, 1.0 (mean 0.26); padding holds a huge ratio
    log_r = torch.tensor([[0.0, 0.1, -0.2, 0.0], [0.5, -1.0, 0.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0]])
    # tau 0.1: dropping 1.0 leaves mean (0 + .01 + .04 + .25) / 4 = 0.075 <= 0.1
    kept = rollout_correction.second_moment_mask(log_r, mask, threshold=0.1)
    assert kept.tolist() == [[True, True, True, False], [True, False, False, False]]
    # tau 0.02: 0.25 goes as well, and 0.04 stays: (0 + .01 + .04) / 3 = 0.0167
    assert rollout_correction.second_moment_mask(log_r, mask, threshold=0.02).tolist() == [
        [True, True, True, False],
        [False, False, False, False],
    ]
    # tau 0.01: (0 + 0.01) / 2 = 0.005 keeps two; tau above the whole mean keeps every valid token
    assert rollout_correction.second_moment_mask(log_r, mask, threshold=0.01).sum().item() == 2
    assert torch.equal(rollout_correction.second_moment_mask(log_r, mask, threshold=0.3), mask > 0)


def test_m2_weights_are_the_truncated_ratio_on_the_tokens_kept():
    log_r = torch.tensor([[0.0, 0.1, -0.2], [0.5, -1.0, 0.0]])
    old, rollout = _logps(log_r.exp())
    mask = torch.ones(2, 3)
    w, stats = rollout_correction.m2_is_weights(old, rollout, mask, cap=1.5, threshold=0.1)
    # kept: log r 0, 0.1, -0.2, 0.5, 0 ((0 + .01 + .04 + .25 + 0) / 5 = 0.06); dropped: -1.0
    expected = torch.tensor([[1.0, math.exp(0.1), math.exp(-0.2)], [1.5, 0.0, 1.0]])  # e^0.5 = 1.65 -> the cap
    assert torch.allclose(w, expected, atol=1e-5)
    assert stats["is_masked_frac"].item() == pytest.approx(1 / 6, abs=1e-6)
    assert stats["is_m2"].item() == pytest.approx((0.01 + 0.04 + 0.25 + 1.0) / 6, abs=1e-5)


def test_the_dispatch_names_an_unknown_mode():
    old, rollout = _logps(torch.ones(1, 2))
    for mode in rollout_correction.MODES:
        w, _ = rollout_correction.rollout_is_weights(old, rollout, torch.ones(1, 2), mode=mode, cap=2.0)
        assert torch.allclose(w, torch.ones(1, 2)), mode  # the engine agrees: every weight is 1
    with pytest.raises(ValueError, match="rollout_is_mode must be one of"):
        rollout_correction.rollout_is_weights(old, rollout, torch.ones(1, 2), mode="token", cap=2.0)


def test_truncated_is_weights_hand_computed():
    # trainer vs engine log-probs of 5 tokens of 2 responses; the last position of row 1 is padding
    ratios = torch.tensor([[1.0, 2.0, 4.0], [0.5, 3.5, 9.0]])
    rollout_logp = torch.log(torch.tensor([[0.4, 0.2, 0.1], [0.6, 0.2, 0.1]]))
    old_logp = rollout_logp + torch.log(ratios)
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    w, stats = rollout_correction.truncated_is_weights(old_logp, rollout_logp, mask, cap=3.0)
    assert torch.allclose(w, torch.tensor([[1.0, 2.0, 3.0], [0.5, 3.0, 0.0]]), atol=1e-5)
    assert stats["is_weight_mean"].item() == pytest.approx((1 + 2 + 3 + 0.5 + 3) / 5, abs=1e-5)
    assert stats["is_truncated_frac"].item() == pytest.approx(
        2 / 5
    )  # 4.0 and 3.5 exceed the cap; padding does not count
    # each token's clipped loss is scaled by its weight: ratio 1 everywhere, adv +1 and -1
    logp = torch.zeros(2, 3, requires_grad=True)
    loss, _ = objective_loss("dapo", logp, logp.detach(), torch.tensor([1.0, -1.0]), mask, is_weights=w)
    assert loss.item() == pytest.approx((-(1 + 2 + 3) + (0.5 + 3)) / 5, abs=1e-5)
    loss.backward()
    # d(-adv * w * ratio)/d logp = -adv * w / num_tokens
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -2.0, -3.0], [0.5, 3.0, 0.0]]) / 5, atol=1e-6)


def test_a_stale_behaviour_policy_biases_the_gradient_and_the_truncated_weight_removes_the_bias():
    """Asynchronous rollout's correction (decoupled PPO): responses sampled by weights k versions old (mu), the
    clip anchored at the proximal policy (the trainer's weights at the start of the step, whose log-probs the
    loop recomputes as old_logp), and w = min(pi_prox / mu, cap) on each token. Exact expectations over a
    4-action policy: without w the expected gradient is mu's, not the policy's; with it, the on-policy one."""
    theta = torch.tensor([0.5, -0.3, 1.2, 0.1], requires_grad=True)  # the trainer's logits at the step's start
    stale = torch.tensor([1.5, 0.4, -0.8, 0.0])  # the behaviour policy's: the engine's weights, k versions old
    adv = torch.tensor([1.0, -0.5, 0.8, -1.2])
    logp, mu = torch.log_softmax(theta, -1), torch.softmax(stale, -1)
    prox = logp.detach()  # the proximal policy: the trainer's own log-probs, before any update

    def expected_grad(corrected: bool) -> torch.Tensor:
        total = torch.zeros(4)
        for a in range(4):  # E over a ~ mu of one sampled token's loss gradient
            one = torch.ones(1, 1)
            w = None
            if corrected:
                w, _ = rollout_correction.truncated_is_weights(
                    prox[a].view(1, 1), mu[a].log().view(1, 1), one, cap=10.0
                )
            loss, _ = objective_loss("dapo", logp[a].view(1, 1), prox[a].view(1, 1), adv[a].view(1), one, is_weights=w)
            (g,) = torch.autograd.grad(loss, theta, retain_graph=True)
            total += mu[a] * g
        return total

    # the on-policy gradient of -E_pi[A]: -sum_a pi(a) A(a) grad log pi(a)
    (on_policy,) = torch.autograd.grad(-(logp.exp().detach() * adv * logp).sum(), theta, retain_graph=True)
    assert torch.allclose(expected_grad(corrected=True), on_policy, atol=1e-6)
    stale_bias = (expected_grad(corrected=False) - on_policy).norm()
    assert stale_bias > on_policy.norm()  # ignoring the staleness trains towards mu's gradient
