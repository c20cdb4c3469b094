"""The objectives (dapo.algorithm.losses) against hand-computed numbers and the paper's invariants: the decoupled clip,
the dual clip, the aggregations, the KL term."""

import dataclasses
import math

import pytest
import torch

from conftest import objective_loss
from dapo.algorithm import losses


def _ratio_logps(ratios):
    old = torch.log(torch.tensor([[0.5, 0.5, 0.5]]))
    logp = old + torch.log(torch.tensor([ratios]))
    return logp.requires_grad_(True), old


def test_policy_loss_clip_higher_hand_computed():
    mask = torch.ones(1, 3)
    logp, old = _ratio_logps([1.5, 0.5, 1.0])
    loss, stats = objective_loss("dapo", logp, old, torch.tensor([1.0]), mask, eps_low=0.2, eps_high=0.28)
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
        "pg_loss": ("sum", 1.0),
    }


def test_eps_high_binds_only_where_advantage_positive():
    mask = torch.ones(1, 3)
    logp, old = _ratio_logps([1.5, 0.5, 1.0])
    loss, stats = objective_loss("dapo", logp, old, torch.tensor([-1.0]), mask, eps_low=0.2, eps_high=0.28)
    # adv < 0: max(r, clip(r)) = [1.5 (not clipped at the top), 0.8 (clipped at the bottom), 1.0]
    assert loss.item() == pytest.approx((1.5 + 0.8 + 1.0) / 3, abs=1e-6)
    assert stats["clipfrac_high"].value.item() == 0.0
    assert stats["clipfrac_low"].value.item() == pytest.approx(1 / 3)
    loss.backward()
    assert torch.allclose(logp.grad, torch.tensor([[1.5 / 3, 0.0, 1.0 / 3]]), atol=1e-6)


def test_symmetric_clip_is_grpo():
    mask = torch.ones(1, 3)
    logp, old = _ratio_logps([1.5, 0.5, 1.0])
    loss, _ = objective_loss("dapo", logp, old, torch.tensor([1.0]), mask, eps_low=0.2, eps_high=0.2)
    assert loss.item() == pytest.approx((-1.2 - 0.5 - 1.0) / 3, abs=1e-6)


def test_dual_clip_bounds_negative_advantage_loss():
    mask = torch.ones(1, 1)
    old = torch.log(torch.tensor([[0.01]]))
    logp = torch.log(torch.tensor([[0.5]]))  # ratio 50
    loss, _ = objective_loss("dapo", logp, old, torch.tensor([-2.0]), mask, dual_clip=10.0)
    assert loss.item() == pytest.approx(20.0)  # -adv * c
    loss_free, _ = objective_loss("dapo", logp, old, torch.tensor([-2.0]), mask, dual_clip=None)
    assert loss_free.item() == pytest.approx(100.0, rel=1e-5)


def test_clip_fractions_as_the_reference_counts_them():
    # ratios 1.5, 0.5, 12, 1.0 with advantages +1, -1, -1, -1; dual clip c = 10
    old = torch.log(torch.full((4, 1), 0.05))
    logp = old + torch.log(torch.tensor([[1.5], [0.5], [12.0], [1.0]]))
    adv = torch.tensor([1.0, -1.0, -1.0, -1.0])
    loss, stats = objective_loss("dapo", logp, old, adv, torch.ones(4, 1), eps_low=0.2, eps_high=0.28, dual_clip=10.0)
    # per token: -1.28 (clipped at the top), 0.8 (at the bottom), min(12, 10) = 10 (dual clip), 1.0
    assert loss.item() == pytest.approx((-1.28 + 0.8 + 10.0 + 1.0) / 4, abs=1e-5)
    assert stats["clipfrac_high"].value.item() == pytest.approx(0.25)
    assert stats["clipfrac_low"].value.item() == pytest.approx(0.25)
    assert stats["clipfrac_dual"].value.item() == pytest.approx(0.25)  # verl's actor/pg_clipfrac_lower
    _, no_dual = objective_loss("dapo", logp, old, adv, torch.ones(4, 1), eps_low=0.2, eps_high=0.28, dual_clip=None)
    assert no_dual["clipfrac_dual"].value.item() == 0.0


def test_token_mean_vs_sample_mean_vs_dr_grpo():
    # two responses, lengths 1 and 3, per-token loss values v (ratio 1 so loss = -adv)
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([2.0, -1.0])
    tok, _ = objective_loss("dapo", logp, logp, adv, mask, loss_agg="token-mean")
    seq, _ = objective_loss("dapo", logp, logp, adv, mask, loss_agg="seq-mean-token-mean")
    drg, _ = objective_loss("dapo", logp, logp, adv, mask, loss_agg="seq-mean-token-sum-norm", norm_length=4)
    # per-token losses: [-2] and [1, 1, 1]
    assert tok.item() == pytest.approx((-2 + 3) / 4)  # every token weighs the same (DAPO eq. 12)
    assert seq.item() == pytest.approx((-2 + 1) / 2)  # every sample weighs the same (GRPO)
    assert drg.item() == pytest.approx((-2 + 3) / (2 * 4))  # constant normaliser (Dr. GRPO)


def test_fully_masked_rows_do_not_count_as_samples():
    logp = torch.zeros(2, 2)
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    loss, _ = objective_loss("dapo", logp, logp, torch.tensor([1.0, 5.0]), mask, loss_agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-1.0)


def test_without_num_tokens_micro_batches_would_differ():
    # the trap the global divisor avoids: averaging per-micro-batch token means
    logp = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 0.0, 0.0], [1.0, 1.0, 1.0]])
    adv = torch.tensor([2.0, -1.0])
    a, _ = objective_loss("dapo", logp[:1], logp[:1], adv[:1], mask[:1])
    b, _ = objective_loss("dapo", logp[1:], logp[1:], adv[1:], mask[1:])
    assert (a.item() + b.item()) / 2 != pytest.approx(0.25)


def test_approx_kl_and_token_prob():
    old = torch.log(torch.tensor([[0.5, 0.25]]))
    logp = torch.log(torch.tensor([[0.25, 0.25]]))
    _, stats = objective_loss("dapo", logp, old, torch.tensor([1.0]), torch.ones(1, 2))
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
        objective_loss("dapo", torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1), torch.ones(1, 1), loss_agg="mean")


def test_actor_loss_is_policy_loss_plus_the_weighted_kl_term():
    g = torch.Generator().manual_seed(0)
    logp = -torch.rand(3, 4, generator=g) - 0.1
    old, ref = logp + 0.1 * torch.randn(3, 4, generator=g), logp - 0.2 * torch.rand(3, 4, generator=g)
    adv, mask = torch.tensor([1.0, -0.5, 2.0]), torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]])
    counts = dict(num_tokens=12.0, num_seqs=3.0)
    objective = losses.Objective(loss_agg="seq-mean-token-mean", dual_clip=10.0)
    pg, pg_stats = losses.actor_loss(logp, old, adv, mask, objective, **counts)  # kl_coef 0: DAPO's, no reference
    assert torch.equal(stats_value := pg_stats["pg_loss"].value, pg) and "kl_loss" not in pg_stats
    assert pg_stats["pg_loss"].how == "sum" and stats_value.requires_grad is False
    with_kl = dataclasses.replace(objective, kl_coef=0.5, kl_kind="k2")
    loss, stats = losses.actor_loss(logp, old, adv, mask, with_kl, ref_logp=ref, **counts)
    for k, v in pg_stats.items():  # the surrogate's statistics are those without the KL term
        assert torch.equal(stats[k].value, v.value) and torch.equal(stats[k].weight, v.weight) and stats[k].how == v.how
    kl = (0.5 * (logp - ref).square() * mask).sum(-1) / mask.sum(-1)  # k2, each sequence's token mean
    assert stats["kl_loss"].value.item() == pytest.approx(kl.sum().item() / 3, rel=1e-6)
    assert loss.item() == pytest.approx(pg.item() + 0.5 * stats["kl_loss"].value.item(), rel=1e-6)
    with pytest.raises(ValueError, match="ref_logp"):
        losses.actor_loss(logp, old, adv, mask, with_kl)
