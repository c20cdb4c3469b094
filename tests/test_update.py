"""Policy.update on a tiny model: invariant to micro-batching, the ratio against the sampling policy, where the old
log-probs come from, the loss it minimises and the statistics it reports, importance weights, bf16 compute on
float32 masters, fused AdamW."""

import math

import pytest
import torch

from conftest import loss_fn_of, make_policy, sampled_batch, sgd, small_config
from dapo.algorithm import advantages, losses
from dapo.algorithm.batch import RolloutBatch
from dapo.algorithm.step import importance_weights, with_old_logp
from dapo.config import AlgoConfig
from dapo.model.logprobs import token_logprobs
from dapo.model.micro_batch import make_micro_batch


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_update_is_invariant_to_micro_batching(tiny_model_dir, tmp_path, loss_agg):
    """One pass over the whole mini-batch, token budgets that split it, one row per pass, packed rows,
    and activation checkpointing."""
    results = []
    for budget, packed, recompute in (
        (100_000, "false", "false"),
        (60, "false", "false"),
        (1, "false", "false"),
        (60, "true", "false"),
        (60, "false", "true"),
    ):
        cfg = small_config(
            tmp_path,
            tiny_model_dir,
            f"train.max_tokens_per_micro_batch={budget}",
            f"train.pack_sequences={packed}",
            f"model.gradient_checkpointing={recompute}",
            "train.mini_batch_prompts=3",
            "train.prompts_per_step=3",
            f"algo.loss_agg={loss_agg}",
        )
        torch.manual_seed(0)
        policy = make_policy(cfg)
        # plain SGD makes the weight change the (clipped) gradient itself; Adam's first step would
        # turn float noise in near-zero gradients into full-size sign flips
        policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
        policy.scheduler = torch.optim.lr_scheduler.LambdaLR(policy.optimizer, lambda step: 1.0)
        before = torch.cat([p.detach().flatten() for p in policy.model.parameters()])
        batch = sampled_batch(policy)
        passes = len(policy.micro_batches(batch, list(range(len(batch)))))
        stats = policy.update(batch, loss_fn_of(cfg))
        after = torch.cat([p.detach().flatten() for p in policy.model.parameters()])
        results.append((after - before, stats, passes))
    (w0, s0, n0), *rest = results
    assert n0 == 1 and results[2][2] == 12 and 1 < results[1][2] < 12
    for w, s, _ in rest:
        assert torch.allclose(w, w0, atol=1e-6)
        assert w0.abs().max() > 1e-3  # the update did something
        assert s["grad_norm"].item() == pytest.approx(s0["grad_norm"].item(), rel=1e-4)
        assert s["pg_loss"].item() == pytest.approx(s0["pg_loss"].item(), abs=1e-6)


def test_a_held_over_groups_first_update_ratio_is_against_the_policy_that_sampled_it(
    tiny_model_dir, tmp_path, monkeypatch
):
    cfg = small_config(tmp_path, tiny_model_dir, "train.prompts_per_step=2", "train.mini_batch_prompts=2")
    policy = make_policy(cfg)
    first = sampled_batch(policy)  # three groups sampled by pi_sampling
    held = with_old_logp([first.select_groups([2])], policy.compute_logprobs, source="recompute")  # held over
    logp_sampling, _ = policy.compute_logprobs(held[0])  # (G, T)
    policy.update(first.select_groups([0, 1]), loss_fn_of(cfg))  # this step's update: the weights move to pi_theta
    logp_theta, _ = policy.compute_logprobs(held[0])
    assert (logp_theta - logp_sampling).abs().max() > 1e-2

    fresh = sampled_batch(policy, prompts=("2+2=",))  # the next step samples one group, takes the held-over one
    nxt = RolloutBatch.concat([fresh, held[0]])
    nxt.adv = advantages.group_advantages(nxt.reward, 4)
    nxt.old_logp = nxt.old_logp_with_held_over(policy.compute_logprobs(nxt)[0])  # as train.py does
    seen = []
    real_surrogate = losses.SURROGATES["dapo"]

    def spy(logp, old_logp, *args):  # the ratio the first update's loss sees
        seen.append((logp - old_logp).detach().exp())
        return real_surrogate(logp, old_logp, *args)

    monkeypatch.setitem(losses.SURROGATES, "dapo", spy)
    [rows] = policy.micro_batches(nxt, list(range(len(nxt))))  # one pass, rows in the update's order
    policy.update(nxt, loss_fn_of(cfg))
    ratio = seen[0]  # (8, T) in the order of `rows`
    for k, i in enumerate(rows):
        n = len(nxt.response_ids[i])
        if i < 4:  # sampled by the current weights: on-policy, ratio 1
            assert torch.allclose(ratio[k, :n], torch.ones(n), atol=1e-5)
        else:  # held over: pi_theta / pi_sampling, not 1
            expected = (logp_theta[i - 4, :n] - logp_sampling[i - 4, :n]).exp()
            assert torch.allclose(ratio[k, :n], expected, atol=1e-5)
    assert max((ratio[k] - 1).abs().max().item() for k, i in enumerate(rows) if i >= 4) > 1e-2


def traced_update(cfg, *, old_logp: str, engine_logp_from=None, from_update: bool = False):
    """One step's old-log-prob pass and update (dapo.algorithm.step.old_logprobs, Policy.update) with
    ``algo.old_logp_source`` on three groups, one per mini-batch, under SGD: returns the batch as the update left it,
    the phase's result, each loss call's (old_logp, logp, loss) and each optimizer step's gradients and
    the weights after the update."""
    from types import SimpleNamespace

    from dapo.algorithm.step import old_logprobs, takes_old_logp_from_update
    from dapo.config import load_config

    torch.manual_seed(0)
    policy = make_policy(cfg)
    sgd(policy)
    batch = sampled_batch(policy)  # recomputed old_logp and entropy: the reference's, kept to compare
    reference_old, reference_entropy = batch.old_logp.clone(), batch.entropy.clone()
    batch.old_logp = batch.entropy = None
    if engine_logp_from is not None:  # what vLLM in float32 reports: the trainer's own numbers
        batch.rollout_logp = [engine_logp_from[i, : len(r)].tolist() for i, r in enumerate(batch.response_ids)]
    run_cfg = load_config(
        None, [f"algo.old_logp_source={old_logp}", "rollout.backend=vllm", f"algo.old_logp_from_update={from_update}"]
    )
    phase = old_logprobs(batch, policy, run_cfg.algo, from_update=takes_old_logp_from_update(run_cfg))
    before_update = batch.old_logp.clone()
    real_loss, calls, grads = loss_fn_of(cfg), [], []

    def spy(logp, old, *args, **kwargs):
        loss, stats = real_loss(logp, old, *args, **kwargs)
        calls.append((old.clone(), logp.detach().clone(), loss.detach()))
        return loss, stats

    policy.optimizer.register_step_pre_hook(
        lambda *_: grads.append([p.grad.clone() for p in policy.model.parameters()])
    )
    policy.update(batch, spy, with_entropy=phase.entropy_from_update, old_logp_rows=phase.from_update)
    weights = torch.cat([p.detach().flatten() for p in policy.model.parameters()])
    return SimpleNamespace(
        batch=batch,
        phase=phase,
        before_update=before_update,
        calls=calls,
        grads=grads,
        weights=weights,
        reference_old=reference_old,
        reference_entropy=reference_entropy,
    )


def test_engine_old_logp_is_the_engines_and_runs_no_pass(tiny_model_dir, tmp_path):
    from dapo.collect.stats import CollectStats
    from dapo.reporting.metrics import step_metrics

    cfg = small_config(tmp_path, tiny_model_dir, "train.prompts_per_step=3", "train.mini_batch_prompts=1")
    rec = traced_update(cfg, old_logp="recompute")
    engine = traced_update(cfg, old_logp="engine", engine_logp_from=rec.reference_old)
    assert engine.phase.tokens_computed == 0 and engine.phase.entropy_from_update
    assert rec.phase.tokens_computed == int(rec.batch.response_lengths.sum()) and not rec.phase.entropy_from_update
    assert torch.equal(engine.before_update, rec.reference_old)  # the engine's numbers, as they came
    assert (engine.weights - rec.weights).abs().max() < 1e-6 and rec.grads[0][0].abs().max() > 1e-3
    # entropy from the update's forwards: group 1's before any step (the pass's); later groups' after the
    # first steps, under the weights that trained them
    assert torch.allclose(engine.batch.entropy[:4], rec.reference_entropy[:4], atol=1e-5)
    assert engine.batch.entropy[4:].abs().max() > 0.1
    assert (engine.batch.entropy[4:] - rec.reference_entropy[4:]).abs().max() > 1e-4
    times = {"update": 1.0, "old_logprob": 0.0}
    m = step_metrics(engine.batch, CollectStats(), {}, times, old_logprob_tokens=0, engine_vs_trainer=False)
    assert not any(k.startswith("rollout/logprob_abs_diff") for k in m) and "perf/old_logprob_tokens_per_s" not in m
    assert m["actor/entropy"] > 0.1


@pytest.mark.parametrize("epochs", [1, 2])
def test_old_logp_from_update_skips_the_first_updates_rows_and_trains_as_the_pass(tiny_model_dir, tmp_path, epochs):
    """algo.old_logp_from_update: the pass leaves out the first update's rows, whose forward gives their old
    log-probs (ratio exactly 1) and entropy before its optimizer step; the later updates (and a second epoch's
    first) take the pass's, and the weights, old log-probs and entropy end as with the pass over every row."""
    cfg = small_config(
        tmp_path, tiny_model_dir, "train.prompts_per_step=3", "train.mini_batch_prompts=1", f"train.ppo_epochs={epochs}"
    )
    rec = traced_update(cfg, old_logp="recompute")
    ours = traced_update(cfg, old_logp="recompute", from_update=True)
    lengths = rec.batch.response_lengths
    assert ours.phase.from_update == [0, 1, 2, 3]  # group 1, one update
    assert ours.phase.tokens_computed == int(lengths[4:].sum()) and rec.phase.tokens_computed == int(lengths.sum())
    assert not ours.before_update[:4].any()  # the pass skipped them
    assert torch.equal(ours.before_update[4:], rec.reference_old[4:])
    old, logp, _ = ours.calls[0]
    assert torch.equal(old, logp)  # the first update's own forward: ratio exactly 1
    assert torch.allclose(rec.calls[0][0], logp, atol=1e-5)  # where the pass's differs by float rounding
    assert torch.allclose(ours.batch.old_logp, rec.reference_old, atol=1e-5)
    assert torch.allclose(ours.batch.entropy, rec.reference_entropy, atol=1e-5)
    assert ours.batch.entropy[:4].abs().max() > 0.1
    assert (ours.weights - rec.weights).abs().max() < 1e-6 and rec.grads[0][0].abs().max() > 1e-3
    assert len(ours.calls) == 3 * epochs
    for (old, _, loss), (old_rec, _, loss_rec) in zip(ours.calls[1:], rec.calls[1:]):
        assert torch.allclose(old, old_rec, atol=1e-5) and loss.item() == pytest.approx(loss_rec.item(), abs=1e-6)
    if epochs == 2:  # the second epoch's first update: the old log-probs the first one wrote, not its own forward
        old, logp, _ = ours.calls[3]
        assert torch.equal(old, ours.batch.old_logp[:4, : old.shape[1]]) and (old - logp).abs().max() > 1e-3


def test_old_logp_from_update_leaves_held_over_rows_and_rows_with_nothing_trained_to_the_pass(tiny_model_dir, tmp_path):
    from dapo.algorithm.step import first_update_rows

    cfg = small_config(tmp_path, tiny_model_dir, "train.prompts_per_step=4", "train.mini_batch_prompts=2")
    policy = make_policy(cfg)
    batch = sampled_batch(policy)
    assert first_update_rows(batch, policy) == list(range(8))
    batch.held_over_old_logp = [[-1.0] * len(r) if i == 2 else None for i, r in enumerate(batch.response_ids)]
    batch.trainable = torch.tensor([i != 5 for i in range(len(batch))])  # e.g. a response overlong filtering drops
    assert first_update_rows(batch, policy) == [0, 1, 3, 4, 6, 7]


def test_old_logp_from_update_applies_only_where_the_pass_can_leave_rows_out():
    from dapo.algorithm.step import takes_old_logp_from_update
    from dapo.config import load_config

    on, teacher = ["algo.old_logp_from_update=true"], ["teacher.path=assets/arith-base", "teacher.coef=0.5"]
    assert takes_old_logp_from_update(load_config(None, on)) and not takes_old_logp_from_update(load_config(None, []))
    assert takes_old_logp_from_update(load_config(None, [*on, *teacher, "teacher.signal=full"]))
    for needs_the_pass in (["rollout.backend=vllm", "algo.rollout_is_cap=2"], teacher, ["model.keep_dropout=true"]):
        assert not takes_old_logp_from_update(load_config(None, [*on, *needs_the_pass]))


def test_old_logp_sources_fail_in_one_line_where_they_cannot_be_exact(tiny_model_dir, tmp_path):
    cfg = small_config(tmp_path, tiny_model_dir, "train.prompts_per_step=3", "train.mini_batch_prompts=1")
    with pytest.raises(
        ValueError,
        match="^algo.old_logp_source=engine: the rollout engine reported no log-probs; use rollout.backend=vllm$",
    ):
        traced_update(cfg, old_logp="engine")  # the hf engine's batch has none


def test_update_minimises_the_loss_fn_it_is_given_with_the_documented_arguments(tiny_model_dir, tmp_path):
    cfg = small_config(
        tmp_path,
        tiny_model_dir,
        "train.prompts_per_step=3",
        "train.mini_batch_prompts=3",
        "train.max_tokens_per_micro_batch=60",
        "train.grad_clip=1e9",
    )
    torch.manual_seed(0)
    policy = make_policy(cfg)
    sgd(policy)
    batch = sampled_batch(policy)
    calls = []

    def loss_fn(logp, old_logp, adv, mask, *, num_tokens, num_seqs, is_weights, ref_logp):
        calls.append(
            (
                logp.shape,
                old_logp.shape,
                adv.shape,
                mask.shape,
                float(num_tokens),
                float(num_seqs),
                is_weights,
                ref_logp,
                logp._base,
            )
        )
        zero = torch.zeros(())
        stats = {
            k: losses.mean_stat(zero, zero)
            for k in (
                "clipfrac_high",
                "clipfrac_low",
                "clipfrac_dual",
                "approx_kl",
                "token_prob_mean",
                "up_clipped_prob_mean",
            )
        }
        loss = -3.0 * (logp * mask).sum()  # a hand-made objective: 3 x the summed log-likelihood
        return loss, {**stats, "up_clipped_prob_max": losses.max_stat(zero), "pg_loss": losses.sum_stat(loss)}

    # the expected step: 3 x the gradient of the batch's log-likelihood in one pass, however update splits the rows
    mb = make_micro_batch(batch, list(range(len(batch))), policy.pad_id, "cpu")
    logp, _ = token_logprobs(policy.model.train(), mb, temperature=cfg.rollout.temperature)
    (3.0 * (logp * batch.response_mask()).sum()).backward()
    expected = [p.grad.clone() for p in policy.model.parameters()]
    policy.model.zero_grad(set_to_none=True)
    before = [p.detach().clone() for p in policy.model.parameters()]
    stats = policy.update(batch, loss_fn)
    tokens = float(batch.response_mask().sum())
    assert len(calls) > 1  # several micro-batches
    for logp_shape, old_shape, adv_shape, mask_shape, num_tokens, num_seqs, is_weights, ref_logp, base in calls:
        assert logp_shape == old_shape == mask_shape and adv_shape == logp_shape[:1]
        assert (num_tokens, num_seqs) == (tokens, len(batch))  # the whole mini-batch's counts
        assert is_weights is None and ref_logp is None  # the batch carries neither
        assert base is None  # a tensor of its own, not a view (FSDP's pre-backward hook sits on it)
    for p, b, g in zip(policy.model.parameters(), before, expected):
        assert torch.allclose(p.detach() - b, g, atol=1e-5)
    assert max(g.abs().max() for g in expected) > 1e-2
    assert stats["pg_loss"].item() == pytest.approx(-3.0 * (logp * batch.response_mask()).sum().item(), rel=1e-5)


def test_update_statistics_are_the_token_weighted_micro_batch_ones_synced_once(tiny_model_dir, tmp_path, monkeypatch):
    from dapo.runtime import parallel

    cfg = small_config(
        tmp_path,
        tiny_model_dir,
        "train.prompts_per_step=3",
        "train.mini_batch_prompts=1",
        "train.max_tokens_per_micro_batch=40",
        "algo.kl_coef=0.1",
        "algo.eps_high=0.01",
    )
    torch.manual_seed(0)
    policy = make_policy(cfg)
    batch = sampled_batch(policy)
    batch.ref_logp = batch.old_logp - 0.1
    batch.old_logp = batch.old_logp + 0.05 * torch.randn(
        batch.old_logp.shape, generator=torch.Generator().manual_seed(0)
    )
    real_loss, seen = loss_fn_of(cfg), []

    def spy(logp, old_logp, adv, mask, **kwargs):
        loss, stats = real_loss(logp, old_logp, adv, mask, **kwargs)
        seen.append((len(gathers), mask.sum() / kwargs["num_tokens"], stats))  # which update, its token share, stats
        return loss, stats

    real_gather, gathers = parallel.all_gather, []
    monkeypatch.setattr(parallel, "all_gather", lambda t, d: gathers.append(t) or real_gather(t, d))
    real_cpu, transfers = torch.Tensor.cpu, []
    monkeypatch.setattr(torch.Tensor, "cpu", lambda t, *a, **k: transfers.append(t.shape) or real_cpu(t, *a, **k))
    out = policy.update(batch, spy)
    monkeypatch.undo()

    assert len(gathers) == 3 and len(seen) > 3  # one collective per optimizer update, not one per micro-batch
    assert len(transfers) == 2 * 3  # per update: the statistics once, the gradient norm once
    per_update = []
    for u in range(3):
        micro = [(w, s) for k, w, s in seen if k == u]
        up_n = sum(s["up_clipped_prob_mean"].weight for _, s in micro)  # the top-clipped tokens
        per_update.append(
            {
                "pg_loss": sum(s["pg_loss"].value for _, s in micro),
                "kl_loss": sum(s["kl_loss"].value for _, s in micro),
                **{
                    k: sum(w * s[k].value for w, s in micro)
                    for k in ("clipfrac_high", "clipfrac_low", "clipfrac_dual", "approx_kl", "token_prob_mean")
                },
                "up_clipped_prob_mean": sum(
                    s["up_clipped_prob_mean"].value * s["up_clipped_prob_mean"].weight for _, s in micro
                )
                / max(up_n, 1),
                "up_clipped_prob_max": max(s["up_clipped_prob_max"].value for _, s in micro),
            }
        )
    assert set(out) == {*per_update[0], "grad_norm", "lr", "skipped_updates", "nonfinite_updates"}
    assert out["clipfrac_high"] > 0 and out["up_clipped_prob_max"] > 0 and out["kl_loss"] > 0
    for k in per_update[0]:
        expected = (max if k.endswith("_max") else lambda v: sum(v) / 3)([u[k] for u in per_update])
        assert out[k].item() == pytest.approx(float(expected), abs=1e-7), k


def test_a_statistic_the_loss_adds_reaches_the_steps_metrics_combined_as_it_says(tiny_model_dir, tmp_path):
    """A new name with each ``how``, and nothing else changed: per update a weighted mean over the
    micro-batches (0 where the weights add up to 0), a sum, a max or a min (of the micro-batches with a weight);
    over the updates their mean, max or min."""
    from dapo.collect.stats import CollectStats
    from dapo.reporting.metrics import step_metrics

    cfg = small_config(
        tmp_path,
        tiny_model_dir,
        "train.prompts_per_step=3",
        "train.mini_batch_prompts=1",
        "train.max_tokens_per_micro_batch=40",
    )
    torch.manual_seed(0)
    policy = make_policy(cfg)
    batch = sampled_batch(policy)
    real_loss, calls, steps = loss_fn_of(cfg), [], []
    policy.optimizer.register_step_pre_hook(lambda *_: steps.append(None))

    def loss_fn(logp, old_logp, adv, mask, **kwargs):
        loss, stats = real_loss(logp, old_logp, adv, mask, **kwargs)
        k = torch.tensor(float(len(calls)))  # this call's number: a value known by hand
        calls.append((len(steps), float(mask.sum())))  # which update, its valid tokens
        new = {
            "my_mean": losses.mean_stat(k, mask.sum()),
            "my_unweighted": losses.mean_stat(k, torch.zeros(())),
            "my_sum": losses.sum_stat(k + 1),
            "my_max": losses.max_stat(-k),
            # odd-numbered calls give 10 - k; even-numbered ones give -100 with weight 0, which must be ignored
            "my_min": losses.min_stat(10 - k if k % 2 else torch.tensor(-100.0), torch.tensor(float(k % 2))),
        }
        return loss, {**stats, **new}

    out = policy.update(batch, loss_fn)
    updates = [[k for k, (u, _) in enumerate(calls) if u == update] for update in range(3)]
    assert len(steps) == 3 and sum(map(len, updates)) == len(calls)
    assert all(len(u) > 1 for u in updates)  # micro-batches in each update
    per_update = [
        {
            "my_mean": sum(k * calls[k][1] for k in u) / sum(calls[k][1] for k in u),
            "my_unweighted": 0.0,
            "my_sum": sum(k + 1 for k in u),
            "my_max": max(-k for k in u),
            "my_min": min((10 - k for k in u if k % 2), default=0.0),
        }
        for u in updates
    ]
    for name in per_update[0]:
        over = {"my_max": max, "my_min": min}.get(name, lambda v: sum(v) / 3)
        expected = over([u[name] for u in per_update])
        assert out[name].item() == pytest.approx(expected, abs=1e-6), name
    m = step_metrics(batch, CollectStats(), out, {"update": 1.0, "old_logprob": 1.0})
    assert {"actor/my_mean", "actor/my_unweighted", "actor/my_sum", "actor/my_max", "actor/my_min"} <= set(m)


def test_truncated_importance_sampling_weights_each_tokens_loss(tiny_model_dir, tmp_path):
    # the engine's log-probs of a hand-made batch: ratios pi_old / pi_rollout of 1, 2 | 4, 0.5, 3 with C = 2.5
    batch = RolloutBatch.of_responses(
        [[1], [1]], [[5, 6], [5, 6, 7]], group_size=2, rollout_logp=[[-1.0, -2.0], [-3.0, -1.0, -2.0]]
    )
    batch.old_logp = torch.tensor(
        [[-1.0, -2.0 + math.log(2), 0.0], [-3.0 + math.log(4), -1.0 - math.log(2), -2.0 + math.log(3)]]
    )
    assert importance_weights(batch, AlgoConfig()) == {} and batch.is_weights is None  # off: the reference
    stats = importance_weights(batch, AlgoConfig(rollout_is_cap=2.5))
    assert torch.allclose(batch.is_weights, torch.tensor([[1.0, 2.0, 0.0], [2.5, 0.5, 2.5]]), atol=1e-5)
    assert stats["rollout/is_weight_mean"].item() == pytest.approx((1 + 2 + 2.5 + 0.5 + 2.5) / 5, abs=1e-5)
    assert stats["rollout/is_truncated_frac"].item() == pytest.approx(2 / 5)

    # in the update, weights of 2 on every token double the (SGD) step
    deltas = []
    for weight in (None, 2.0):
        cfg = small_config(
            tmp_path, tiny_model_dir, "train.prompts_per_step=3", "train.mini_batch_prompts=3", "train.grad_clip=1e9"
        )
        torch.manual_seed(0)
        policy = make_policy(cfg)
        policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
        policy.scheduler = torch.optim.lr_scheduler.LambdaLR(policy.optimizer, lambda step: 1.0)
        sampled = sampled_batch(policy)
        if weight is not None:
            sampled.is_weights = torch.full_like(sampled.old_logp, weight)
        before = torch.cat([p.detach().flatten() for p in policy.model.parameters()])
        policy.update(sampled, loss_fn_of(cfg))
        deltas.append(torch.cat([p.detach().flatten() for p in policy.model.parameters()]) - before)
    assert deltas[0].abs().max() > 1e-3
    assert torch.allclose(deltas[1], 2 * deltas[0], atol=1e-6)


def test_bf16_compute_updates_float32_master_weights_like_a_float32_update(tiny_model_dir, tmp_path):
    """At lr 1e-6 AdamW moves every weight by about 1e-6, far below bf16's resolution; with float32
    masters the bf16-compute update equals the float32 one up to bf16 noise in the gradient."""
    batch, deltas = None, {}
    for dtype in ("float32", "bfloat16"):
        cfg = small_config(
            tmp_path,
            tiny_model_dir,
            f"model.dtype={dtype}",
            "train.lr=1e-6",
            "train.prompts_per_step=3",
            "train.mini_batch_prompts=3",
        )
        policy = make_policy(cfg)
        batch = batch or sampled_batch(policy)  # the same samples for both
        batch.old_logp, _ = policy.compute_logprobs(batch)  # each under its own compute dtype: ratio 1
        trained = policy.master if dtype == "bfloat16" else list(policy.model.parameters())
        assert all(p.dtype == torch.float32 for p in trained) and len(trained) == len(list(policy.model.parameters()))
        before = torch.cat([p.detach().flatten() for p in trained])
        policy.update(batch, loss_fn_of(cfg))
        after = torch.cat([p.detach().flatten() for p in trained])
        deltas[dtype] = after - before
        if dtype == "bfloat16":
            assert all(p.dtype == torch.bfloat16 for p in policy.model.parameters())
            # the model computes with the masters rounded to bf16 ...
            assert all(torch.equal(p, m.bfloat16()) for p, m in zip(policy.model.parameters(), policy.master))
            # ... which would have swallowed nearly every update had AdamW stepped the bf16 weights
            assert (before.bfloat16() == after.bfloat16()).float().mean() > 0.9
    d32, d16 = deltas["float32"], deltas["bfloat16"]
    assert d32.abs().mean().item() == pytest.approx(1e-6, rel=0.01)  # Adam's first step: lr per weight
    assert d16.abs().mean().item() == pytest.approx(d32.abs().mean().item(), rel=0.01)
    assert (torch.sign(d16) == torch.sign(d32)).float().mean() > 0.98  # a few near-zero gradients flip sign
    assert (d16 - d32).abs().sum() / d32.abs().sum() < 0.03
    # a checkpoint's trainer state carries the masters, so a resumed run continues from them, not from bf16
    restored = make_policy(cfg)
    restored.load_trainer_state(policy.trainer_state())
    assert all(torch.equal(a, b) for a, b in zip(restored.master, policy.master))
    assert all(torch.equal(a, b) for a, b in zip(restored.model.parameters(), policy.model.parameters()))


def test_fused_adamw_takes_the_steps_of_the_reference_adamw(tiny_model_dir, tmp_path):
    """The trainer's AdamW runs torch's fused kernel on CPU; three updates leave
    the weights and moments where torch's default (foreach) AdamW leaves them, to float32 rounding."""
    cfg = small_config(tmp_path, tiny_model_dir, "train.lr=1e-3", "train.weight_decay=0.1")
    policy = make_policy(cfg)
    assert policy.optimizer.param_groups[0]["fused"]
    params = [p for p in policy.model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    twins = [torch.nn.Parameter(p.clone()) for p in start]
    reference = torch.optim.AdamW(twins, lr=1e-3, betas=tuple(cfg.train.betas), weight_decay=0.1, foreach=True)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    for _ in range(3):
        for p, q, g in zip(params, twins, grads):
            p.grad, q.grad = g.clone(), g.clone()
        policy.optimizer.step()
        reference.step()
    # a constant gradient makes each bias-corrected Adam step exactly lr per weight (decay adds ~1e-4 of it)
    moved = sum((p.detach() - s).abs().sum().item() for p, s in zip(params, start))
    assert moved / sum(p.numel() for p in params) == pytest.approx(3e-3, rel=0.01)
    for p, q in zip(params, twins):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(policy.optimizer.state[p]["exp_avg_sq"], reference.state[q]["exp_avg_sq"])
