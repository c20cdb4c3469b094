"""The algorithm functions against hand-computed numbers and the paper's invariants."""

import math

import pytest
import torch

from dapo.algorithm import advantages, losses, rollout_correction


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


def _ratio_logps(ratios):
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    logp = old + torch.log(torch.tensor([ratios]))
    return logp.requires_grad_(True), old


def test_policy_loss_clip_higher_hand_computed():
    mask = torch.ones(1, 3)
    logp, old = _ratio_logps([1.5, 0.5, 1.0])
    loss, stats = losses.dapo_loss(logp, old, torch.tensor([1.0]), mask, eps_low=0.2, eps_high=0.28)
    # adv > 0: per-token max(-r, -clip(r, .8, 1.28)) = [-1.28, -0.5, -1.0]
    assert loss.item() == pytest.approx((-1.28 - 0.5 - 1.0) / 3, abs=1e-6)
    assert stats["clipfrac_high"].value.item() == pytest.approx(1 / 3)
    assert stats["clipfrac_low"].value.item() == 0.0
    loss.backward()
    # the clipped token gets no gradient; the others get -r/3
    assert torch.allclose(logp.grad, torch.tensor([[0.0, -0.5 / 3, -1.0 / 3]]), atol=1e-6)
    # the up-clipped token's probability under the new policy: 0.5 * 1.5
    assert stats["up_clipped_prob_max"].value.item() == pytest.approx(0.75, abs=1e-6)
    # how each combines over micro-batches: token means weigh by the valid tokens, the top-clipped
    # probability's mean by the clipped tokens
    assert {k: (s.how, s.weight.item()) for k, s in stats.items()} == {
        "clipfrac_high": ("mean", 3.0),
        "clipfrac_low": ("mean", 3.0),
        "clipfrac_dual": ("mean", 3.0),
        "approx_kl": ("mean", 3.0),
        "token_prob_mean": ("mean", 3.0),
        "up_clipped_prob_mean": ("mean", 1.0),
        "up_clipped_prob_max": ("max", 1.0),
    }


def test_eps_high_binds_only_where_advantage_positive():
    mask = torch.ones(1, 3)
    logp, old = _ratio_logps([1.5, 0.5, 1.0])
    loss, stats = losses.dapo_loss(logp, old, torch.tensor([-1.0]), mask, eps_low=0.2, eps_high=0.28)
    # adv < 0: max(r, clip(r)) = [1.5 (not clipped at the top), 0.8 (clipped at the bottom), 1.0]
    assert loss.item() == pytest.approx((1.5 + 0.8 + 1.0) / 3, abs=1e-6)
    assert stats["clipfrac_high"].value.item() == 0.0
    assert stats["clipfrac_low"].value.item() == pytest.approx(1 / 3)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[1.5 / 3, 0.0, 1.0 / 3]]), atol=1e-6)


def test_symmetric_clip_is_grpo():
    mask = torch.ones(1, 3)
    logp, old = _ratio_logps([1.5, 0.5, 1.0])
    loss, _ = losses.dapo_loss(logp, old, torch.tensor([1.0]), mask, eps_low=0.2, eps_high=0.2)
    assert loss.item() == pytest.approx((-1.2 - 0.5 - 1.0) / 3, abs=1e-6)


def test_dual_clip_bounds_negative_advantage_loss():
    mask = torch.ones(1, 1)
    old = torch.log(torch.tensor([[0.01]]))
    logp = torch.log(torch.tensor([[0.5]]))  # ratio 50
    loss, _ = losses.dapo_loss(logp, old, torch.tensor([-2.0]), mask, dual_clip=10.0)
    assert loss.item() == pytest.approx(20.0)  # -adv * c
    loss_free, _ = losses.dapo_loss(logp, old, torch.tensor([-2.0]), mask, dual_clip=None)
    assert loss_free.item() == pytest.approx(100.0, rel=1e-5)


def test_clip_fractions_as_the_reference_counts_them():
    # ratios 1.5, 0.5, 12, 1.0 with advantages +1, -1, -1, -1; dual clip c = 10
    old = torch.log(torch.full((4, 1), 0.05))
    logp = old + torch.log(torch.tensor([[1.5], [0.5], [12.0], [1.0]]))
    adv = torch.tensor([1.0, -1.0, -1.0, -1.0])
    loss, stats = losses.dapo_loss(logp, old, adv, torch.ones(4, 1), eps_low=0.2, eps_high=0.28, dual_clip=10.0)
    # per token: -1.28 (clipped at the top), 0.8 (at the bottom), min(12, 10) = 10 (dual clip), 1.0
    assert loss.item() == pytest.approx((-1.28 + 0.8 + 10.0 + 1.0) / 4, abs=1e-5)
    assert stats["clipfrac_high"].value.item() == pytest.approx(0.25)
    assert stats["clipfrac_low"].value.item() == pytest.approx(0.25)
    assert stats["clipfrac_dual"].value.item() == pytest.approx(0.25)  # verl's actor/pg_clipfrac_lower
    _, no_dual = losses.dapo_loss(logp, old, adv, torch.ones(4, 1), eps_low=0.2, eps_high=0.28, dual_clip=None)
    assert no_dual["clipfrac_dual"].value.item() == 0.0


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
    loss, _ = losses.dapo_loss(logp, logp.detach(), torch.tensor([1.0, -1.0]), mask, is_weights=w)
    assert loss.item() == pytest.approx((-(1 + 2 + 3) + (0.5 + 3)) / 5, abs=1e-5)
    loss.backward()
    # d(-adv * w * ratio)/d logp = -adv * w / num_tokens
    assert torch.allclose(logp.grad, torch.tensor([[-1.0, -2.0, -3.0], [0.5, 3.0, 0.0]]) / 5, atol=1e-6)


def test_token_mean_vs_sample_mean_vs_dr_grpo():
    # two responses, lengths 1 and 3, per-token loss values v (ratio 1 so loss = -adv)
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([2.0, -1.0])
    tok, _ = losses.dapo_loss(logp, logp, adv, mask, loss_agg="token-mean")
    seq, _ = losses.dapo_loss(logp, logp, adv, mask, loss_agg="seq-mean-token-mean")
    drg, _ = losses.dapo_loss(logp, logp, adv, mask, loss_agg="seq-mean-token-sum-norm", norm_length=4)
    # per-token losses: [-2] and [1, 1, 1]
    assert tok.item() == pytest.approx((-2 + 3) / 4)  # every token weighs the same (DAPO eq. 12)
    assert seq.item() == pytest.approx((-2 + 1) / 2)  # every sample weighs the same (GRPO)
    assert drg.item() == pytest.approx((-2 + 3) / (2 * 4))  # constant normaliser (Dr. GRPO)


def test_fully_masked_rows_do_not_count_as_samples():
    logp = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    loss, _ = losses.dapo_loss(logp, logp, torch.tensor([1.0, 5.0]), mask, loss_agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-1.0)


def test_without_num_tokens_micro_batches_would_differ():
    # the trap the global divisor avoids: averaging per-micro-batch token means
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([2.0, -1.0])
    a, _ = losses.dapo_loss(logp[:1], logp[:1], adv[:1], mask[:1])
    b, _ = losses.dapo_loss(logp[1:], logp[1:], adv[1:], mask[1:])
    assert (a.item() + b.item()) / 2 != pytest.approx(0.25)


def test_approx_kl_and_token_prob():
    old = torch.log(torch.tensor([[0.5, 0.25]]))
    logp = torch.log(torch.tensor([[0.25, 0.25]]))
    _, stats = losses.dapo_loss(logp, old, torch.tensor([1.0]), torch.ones(1, 2))
    assert stats["approx_kl"].value.item() == pytest.approx(math.log(2) / 2, abs=1e-6)
    assert stats["token_prob_mean"].value.item() == pytest.approx(0.25)


def test_kl_estimators_hand_computed():
    logp = torch.log(torch.tensor([0.5]))
    ref = torch.log(torch.tensor([0.25]))
    ln2 = math.log(2)
    assert losses.kl_penalty(logp, ref, "k1").item() == pytest.approx(ln2)
    assert losses.kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * ln2**2)
    assert losses.kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 + ln2 - 1)
    assert losses.kl_penalty(ref, ref, "k3").item() == 0.0
    with pytest.raises(ValueError, match="k1, k2, k3|k1', 'k2', 'k3"):
        losses.kl_penalty(logp, ref, "k4")


def test_unknown_loss_agg_is_rejected():
    with pytest.raises(ValueError, match="loss_agg"):
        losses.dapo_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), loss_agg="mean")


def test_actor_loss_is_policy_loss_plus_the_weighted_kl_term():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 4, generator=g) - 0.1
    old, ref = logp + 0.1 * torch.randn(3, 4, generator=g), logp - 0.2 * torch.rand(3, 4, generator=g)
    adv, mask = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    common = dict(num_tokens=12.0, num_seqs=3.0, loss_agg="seq-mean-token-mean", dual_clip=10.0)
    pg, pg_stats = losses.dapo_loss(logp, old, adv, mask, **common)
    loss, stats = losses.actor_loss(logp, old, adv, mask, **common)  # kl_coef 0: DAPO's loss, no reference needed
    assert torch.equal(loss, pg) and torch.equal(stats["pg_loss"].value, pg) and "kl_loss" not in stats
    assert stats["pg_loss"].how == "sum"
    for k, v in pg_stats.items():
        assert torch.equal(stats[k].value, v.value) and torch.equal(stats[k].weight, v.weight) and stats[k].how == v.how
    loss, stats = losses.actor_loss(logp, old, adv, mask, ref_logp=ref, kl_coef=0.5, kl_kind="k2", **common)
    kl = (0.5 * (logp - ref).square() * mask).sum(-1) / mask.sum(-1)  # k2, each sequence's token mean
    assert stats["kl_loss"].value.item() == pytest.approx(kl.sum().item() / 3, rel=1e-6)
    assert loss.item() == pytest.approx(pg.item() + 0.5 * stats["kl_loss"].value.item(), rel=1e-6)
    with pytest.raises(ValueError, match="ref_logp"):
        losses.actor_loss(logp, old, adv, mask, kl_coef=0.5)


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
            loss, _ = losses.dapo_loss(logp[a].view(1, 1), prox[a].view(1, 1), adv[a].view(1), one, is_weights=w)
            (g,) = torch.autograd.grad(loss, theta, retain_graph=True)
            total += mu[a] * g
        return total

    # the on-policy gradient of -E_pi[A]: -sum_a pi(a) A(a) grad log pi(a)
    (on_policy,) = torch.autograd.grad(-(logp.exp().detach() * adv * logp).sum(), theta, retain_graph=True)
    assert torch.allclose(expected_grad(corrected=True), on_policy, atol=1e-6)
    stale_bias = (expected_grad(corrected=False) - on_policy).norm()
    assert stale_bias > on_policy.norm()  # ignoring the staleness trains towards mu's gradient
