"""GSPO and CISPO (algo.objective) and the sequence-level engine correction, against hand-computed values."""

import dataclasses
import math
import typing
from pathlib import Path

import pytest
import torch

from conftest import objective_loss
from dapo import ablate
from dapo.algorithm import losses, rollout_correction
from dapo.config import ConfigError, load_config
from dapo.config import schema as config_module


def _logps(ratios, old_prob=0.5):
    """(N, T) log-probs whose ratio to old_logp is ``ratios`` (padding positions: ratio 1)."""
    ratios = torch.tensor(ratios)
    old = torch.log(torch.full_like(ratios, old_prob))
    return (old + torch.log(ratios)).requires_grad_(True), old


def value(stat):
    return stat.value.item()


def test_gspo_clips_the_sequence_ratio_hand_computed():
    # row 0: token ratios 2 and 0.5, so s_0 = exp((ln 2 + ln 0.5) / 2) = 1; row 1: one token, ratio 1.5 (+ padding)
    logp, old = _logps([[2.0, 0.5], [1.5, 1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, 1.0])
    loss, stats = objective_loss(
        "gspo", logp, old, adv, mask, eps_low=0.2, eps_high=0.28, loss_agg="seq-mean-token-mean"
    )
    # per sequence: -A * s_0 = -1 (inside the range); -A * clip(1.5) = -1.28 (clipped at the top)
    assert loss.item() == pytest.approx((-1.0 + -1.28) / 2, abs=1e-6)
    loss.backward()
    # d/dlogp_t of (1/G)(1/|y_i|) sum_t -A s_i: -A s_0 / (2 * 2) on both of row 0's tokens (the token-level
    # clip would have stopped the ratio-2 token); row 1 is clipped, so it passes none
    assert torch.allclose(logp.grad, torch.tensor([[-0.25, -0.25], [0.0, 0.0]]), atol=1e-6)
    assert value(stats["seq_clipfrac_high"]) == pytest.approx(0.5)
    assert value(stats["seq_clipfrac_low"]) == 0.0
    assert value(stats["seq_ratio_mean"]) == pytest.approx(1.25, abs=1e-6)
    assert value(stats["seq_ratio_max"]) == pytest.approx(1.5, abs=1e-6)
    assert value(stats["seq_ratio_min"]) == pytest.approx(1.0, abs=1e-6)
    # the same batch under DAPO's token clip: row 0's ratio-2 token is clipped and passes no gradient
    logp.grad = None
    dapo, _ = objective_loss("dapo", logp, old, adv, mask, eps_low=0.2, eps_high=0.28, loss_agg="seq-mean-token-mean")
    dapo.backward()
    assert logp.grad[0, 0].item() == 0.0


def test_gspo_negative_advantage_is_clipped_at_the_bottom_and_dual_clipped():
    # one sequence of two tokens with ratios 0.5 and 0.5 (s = 0.5), another of one token with ratio 50
    logp, old = _logps([[0.5, 0.5], [50.0, 1.0]], old_prob=0.01)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([-1.0, -2.0])
    loss, stats = objective_loss(
        "gspo", logp, old, adv, mask, eps_low=0.2, eps_high=0.28, loss_agg="seq-mean-token-mean", dual_clip=10.0
    )
    # row 0: max(0.5, 0.8) = 0.8 (clipped at the bottom); row 1: max(2 * 50, 2 * 1.28) = 100, dual clip -> 2 * 10
    assert loss.item() == pytest.approx((0.8 + 20.0) / 2, abs=1e-4)
    assert value(stats["seq_clipfrac_low"]) == pytest.approx(0.5)
    assert value(stats["seq_clipfrac_dual"]) == pytest.approx(0.5)


def test_gspo_statistics_read_a_per_token_advantage_by_its_mean_over_the_response():
    # a teacher's term makes the advantage per token: row 0's first token +0.5 but its mean (0.5 - 1.5) / 2 = -0.5,
    # so its sequence ratio 0.5 is clipped at the bottom, not the top; row 1 (+1 then its padding) at the top
    logp, old = _logps([[0.5, 0.5], [1.5, 1.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([[0.5, -1.5], [1.0, -9.0]])
    _, stats = objective_loss("gspo", logp, old, adv, mask, eps_low=0.2, eps_high=0.28, loss_agg="token-mean")
    assert value(stats["seq_clipfrac_low"]) == pytest.approx(0.5)
    assert value(stats["seq_clipfrac_high"]) == pytest.approx(0.5)
    # the dual clip counts a sequence with any token under it: row 1's ratio sqrt(50) > 3, its second token's
    # advantage -1 (its first token's is 0)
    logp, old = _logps([[1.0, 1.0], [50.0, 1.0]], old_prob=0.01)
    adv = torch.tensor([[1.0, 1.0], [0.0, -1.0]])
    _, stats = objective_loss("gspo", logp, old, adv, torch.tensor([[1.0, 1.0], [1.0, 1.0]]), eps_low=0.2,
                              eps_high=0.28, loss_agg="token-mean", dual_clip=3.0)  # fmt: skip
    assert value(stats["seq_clipfrac_dual"]) == pytest.approx(0.5)


@pytest.mark.parametrize("loss_agg", losses.LOSS_AGG_MODES)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_gspo_with_one_token_responses_is_the_token_level_clip(loss_agg, dual_clip):
    # with |y_i| = 1 the sequence ratio is the token ratio: GSPO and DAPO's surrogate coincide
    g = torch.Generator().manual_seed(0)
    old = -torch.rand(6, 1, generator=g) * 2
    base = old + 0.6 * torch.randn(6, 1, generator=g)
    adv = torch.randn(6, generator=g)
    mask = torch.ones(6, 1)
    kw = dict(eps_low=0.2, eps_high=0.28, loss_agg=loss_agg, norm_length=4, dual_clip=dual_clip)
    grads = []
    for name in ("gspo", "dapo"):
        logp = base.clone().requires_grad_(True)
        loss, _ = objective_loss(name, logp, old, adv, mask, **kw)
        loss.backward()
        grads.append((loss.detach(), logp.grad))
    assert torch.allclose(grads[0][0], grads[1][0], atol=1e-6)
    assert torch.allclose(grads[0][1], grads[1][1], atol=1e-6)


def test_cispo_clips_the_weight_not_the_update_hand_computed():
    logp, old = _logps([[1.5, 0.5, 1.0]])
    mask = torch.ones(1, 3)
    loss, stats = objective_loss("cispo", logp, old, torch.tensor([1.0]), mask, eps_low=0.2, eps_high=0.28)
    # weights clip(r) = [1.28, 0.8, 1.0]; the loss's value is -A * w per token, token-mean over 3
    assert loss.item() == pytest.approx(-(1.28 + 0.8 + 1.0) / 3, abs=1e-6)
    loss.backward()
    # gradient -A * sg(w) / 3 on every token: the one clipped at the top still learns (DAPO's clip gives it 0)
    assert torch.allclose(logp.grad, torch.tensor([[-1.28, -0.8, -1.0]]) / 3, atol=1e-6)
    assert value(stats["cispo_clipfrac_high"]) == pytest.approx(1 / 3)
    assert value(stats["cispo_clipfrac_low"]) == pytest.approx(1 / 3)
    assert value(stats["cispo_weight_mean"]) == pytest.approx((1.28 + 0.8 + 1.0) / 3, abs=1e-6)
    assert value(stats["approx_kl"]) == pytest.approx(-(math.log(1.5) + math.log(0.5)) / 3, abs=1e-6)


def test_cispo_gradient_on_unclipped_tokens_is_the_vanilla_policy_gradient():
    # inside the range the weight is the ratio itself: -A * r * grad log pi, the unclipped surrogate's gradient
    g = torch.Generator().manual_seed(1)
    old = -torch.rand(4, 5, generator=g) - 0.1
    base = old + 0.05 * torch.randn(4, 5, generator=g)  # ratios within [0.8, 1.28]
    adv = torch.randn(4, generator=g)
    mask = (torch.arange(5)[None, :] < torch.tensor([[5], [3], [1], [4]])).float()
    cispo = base.clone().requires_grad_(True)
    vanilla = base.clone().requires_grad_(True)
    c_loss, stats = objective_loss("cispo", cispo, old, adv, mask, eps_low=0.2, eps_high=0.28)
    v_loss = losses.aggregate(-adv[:, None] * (vanilla - old).exp(), mask)
    c_loss.backward()
    v_loss.backward()
    assert value(stats["cispo_clipfrac_high"]) == 0.0 and value(stats["cispo_clipfrac_low"]) == 0.0
    assert torch.allclose(c_loss, v_loss, atol=1e-6)
    assert torch.allclose(cispo.grad, vanilla.grad, atol=1e-7)
    # on-policy (ratio 1) it is REINFORCE: -A * grad log pi / num_tokens
    on = base.clone().requires_grad_(True)
    loss, _ = objective_loss("cispo", on, base, adv, mask)
    loss.backward()
    assert torch.allclose(on.grad, -adv[:, None] * mask / mask.sum(), atol=1e-7)


def test_cispo_dual_clip_caps_a_negative_advantage_weight():
    logp, old = _logps([[50.0]], old_prob=0.01)
    loss, _ = objective_loss("cispo", logp, old, torch.tensor([-2.0]), torch.ones(1, 1), eps_high=100.0, dual_clip=10.0)
    assert loss.item() == pytest.approx(20.0)  # -A * min(50, c)
    free, _ = objective_loss("cispo", logp, old, torch.tensor([-2.0]), torch.ones(1, 1), eps_high=100.0)
    assert free.item() == pytest.approx(100.0, rel=1e-5)


@pytest.mark.parametrize("objective", losses.OBJECTIVES)
@pytest.mark.parametrize("loss_agg", losses.LOSS_AGG_MODES)
def test_micro_batch_split_leaves_each_objective_unchanged(objective, loss_agg):
    """Splitting a mini-batch into micro-batches (each divided by the whole mini-batch's tokens and sequences) leaves
    the loss and its gradient as one pass gives them, for every objective and every aggregation (DAPO sec. 3.3:
    gradient accumulation never changes the objective)."""
    torch.manual_seed(0)
    N, T = 8, 7
    old = -torch.rand(N, T) * 2
    logp = (old + 0.3 * torch.randn(N, T)).requires_grad_(True)
    lengths = torch.randint(1, T + 1, (N,))
    mask = (torch.arange(T)[None, :] < lengths[:, None]).float()
    adv = torch.randn(N)
    kw = dict(eps_low=0.2, eps_high=0.28, loss_agg=loss_agg, norm_length=T)
    full, _ = objective_loss(objective, logp, old, adv, mask, **kw)
    full.backward()
    grad_full = logp.grad.clone()
    logp.grad = None
    num_tokens, num_seqs = mask.sum(), (mask.sum(-1) > 0).sum()
    total = 0.0
    for rows in (slice(0, 3), slice(3, 4), slice(4, 8)):
        part, _ = objective_loss(
            objective, logp[rows], old[rows], adv[rows], mask[rows], num_tokens=num_tokens, num_seqs=num_seqs, **kw
        )
        part.backward()
        total += part.item()
    assert total == pytest.approx(full.item(), abs=1e-6)
    assert torch.allclose(logp.grad, grad_full, atol=1e-7)


def test_actor_loss_runs_the_named_objective_and_aggregates_its_per_token_loss():
    logp, old = _logps([[1.5, 0.5, 1.0]])
    mask, adv = torch.ones(1, 3), torch.tensor([1.0])
    assert tuple(losses.SURROGATES) == typing.get_args(config_module.Objective)  # each choice the config offers
    per_token = {}
    for name, surrogate in losses.SURROGATES.items():
        loss, stats = losses.actor_loss(logp, old, adv, mask, losses.Objective(name))
        per_token[name], own = surrogate(logp, old, adv[:, None], mask, losses.Objective(name))
        assert torch.equal(loss, per_token[name].mean()), name  # token-mean over the 3 tokens
        assert set(own) < set(stats) and {"approx_kl", "token_prob_mean", "pg_loss"} < set(stats)
    # token ratios 1.5, 0.5, 1: DAPO clips both ends (1.28, 0.8), CISPO's value is the clipped weight too, GSPO's
    # sequence ratio is exp(mean log r) = 0.866 (inside the range) at every token
    assert per_token["dapo"].detach()[0].tolist() == pytest.approx([-1.28, -0.5, -1.0])
    assert per_token["cispo"].detach()[0].tolist() == pytest.approx([-1.28, -0.8, -1.0])
    assert per_token["gspo"].detach()[0].tolist() == pytest.approx([-(0.75 ** (1 / 3))] * 3)
    with pytest.raises(ValueError, match="objective must be one of"):
        losses.actor_loss(logp, old, adv, mask, losses.Objective("ppo"))


def test_sequence_is_weights_truncate_and_mask_hand_computed():
    # engine vs trainer: row 0's token ratios 2, 2 (rho 4); row 1's 0.5 (+ padding; rho 0.5); row 2's 1.5, 1 (rho 1.5)
    rollout = torch.log(torch.full((3, 2), 0.25))
    ratios = torch.tensor([[2.0, 2.0], [0.5, 7.0], [1.5, 1.0]])
    old = rollout + torch.log(ratios)
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 1.0]])
    w, stats = rollout_correction.sequence_is_weights(old, rollout, mask, cap=3.0, mask_outside=False)
    assert torch.allclose(w, torch.tensor([[3.0, 3.0], [0.5, 0.0], [1.5, 1.5]]), atol=1e-5)
    assert stats["is_truncated_frac"].item() == pytest.approx(1 / 3)
    assert stats["is_seq_ratio_mean"].item() == pytest.approx((4 + 0.5 + 1.5) / 3, abs=1e-5)
    assert stats["is_seq_ratio_max"].item() == pytest.approx(4.0, abs=1e-5)
    assert stats["is_seq_ratio_min"].item() == pytest.approx(0.5, abs=1e-5)
    assert stats["is_weight_mean"].item() == pytest.approx((3 + 3 + 0.5 + 1.5 + 1.5) / 5, abs=1e-5)
    # masking with the band [1/3, 3]: row 0 (rho 4) leaves it; 0.5 and 1.5 stay, with weight 1
    w, stats = rollout_correction.sequence_is_weights(old, rollout, mask, cap=3.0, mask_outside=True)
    assert torch.equal(w, torch.tensor([[0.0, 0.0], [1.0, 0.0], [1.0, 1.0]]))
    assert stats["is_masked_frac"].item() == pytest.approx(1 / 3)
    w, _ = rollout_correction.sequence_is_weights(old, rollout, mask, cap=1.9, mask_outside=True)
    assert torch.equal(w[1], torch.tensor([0.0, 0.0]))  # rho 0.5 < 1/1.9 leaves the band at the bottom


REPO = Path(__file__).resolve().parents[1]


def test_the_paper_s_surrogate_is_the_default():
    assert load_config("configs/demo.yaml").algo.objective == "dapo"  # the paper's surrogate stays the default


def test_objective_rows_change_only_the_surrogate_and_the_presets_are_the_rows_on_the_paper_scale():
    rows = ablate.find_rows(REPO / "configs" / "objectives")
    assert [r.stem for r in rows] == ["1_dapo", "2_gspo", "3_cispo"]
    base = REPO / "configs/ablation/base.yaml"
    dapo = load_config([base, rows[0]]).algo
    assert dapo == load_config([base, REPO / "configs/ablation/8_no_overlong_filtering.yaml"]).algo
    gspo, cispo = (load_config([base, r]).algo for r in rows[1:])
    changed = lambda a: {f.name for f in dataclasses.fields(a) if getattr(a, f.name) != getattr(dapo, f.name)}  # noqa: E731
    assert changed(gspo) == {"objective", "eps_low", "eps_high", "loss_agg"}
    assert (gspo.eps_low, gspo.eps_high, gspo.loss_agg) == (3e-4, 4e-4, "seq-mean-token-mean")
    assert changed(cispo) == {"objective", "eps_low", "eps_high"} and (cispo.eps_low, cispo.eps_high) == (1.0, 4.0)
    paper = REPO / "configs/dapo_qwen2.5_32b.yaml"
    for preset, row in (("gspo", rows[1]), ("cispo", rows[2])):
        cfg = load_config(REPO / "configs" / f"{preset}.yaml")
        assert cfg.algo == load_config([paper, row]).algo and cfg.train == load_config(paper).train


@pytest.mark.parametrize(
    "overrides, says",
    [
        (["algo.rollout_is_mode=sequence_mask"], "algo.rollout_is_mode=sequence_mask: corrects nothing without"),
        (
            ["rollout.backend=vllm", "algo.rollout_is_cap=1", "algo.rollout_is_mode=sequence_mask"],
            "a cap of 1 masks every one",
        ),
        (["algo.objective=ppo"], "algo.objective"),
        (["algo.eps_low=1.5"], "algo.eps_low"),
    ],
)
def test_combinations_that_make_no_sense_are_refused_in_one_line(overrides, says):
    with pytest.raises(ConfigError) as err:
        load_config("configs/demo.yaml", overrides)
    assert says in str(err.value) and "\n" not in str(err.value)


def test_cispo_without_a_lower_bound_is_accepted():
    assert load_config("configs/demo.yaml", ["algo.objective=cispo", "algo.eps_low=1", "algo.eps_high=4"])
